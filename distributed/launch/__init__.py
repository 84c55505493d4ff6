"""launch: a job across hosts over SSH.

The rank program and its per-host plan, one rank's run (start, stream, stop),
the launcher that starts and watches every rank, and script mode. Built on
hosts (sessions, shells, pre-flight) and on what the worker agrees with it
(its command line, the rank variables); may import worker, profiles, hosts and
exogym, never app.
"""
