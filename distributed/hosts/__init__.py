"""hosts: the machines of a run.

The hosts file, SSH connections and sessions, commands run on a host, code
sync, interface choice, pre-flight checks and link speed. ``hosts/onhost``
holds the standard-library-only scripts shipped to hosts as source. May import
exogym's light modules only; never tasks, profiles, planning, launch, worker or app.
"""
