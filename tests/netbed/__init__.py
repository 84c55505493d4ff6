"""Hosts on one machine, for the tests and the benchmarks: network namespaces on a bridge,
shaped links and an sshd each (:class:`Testbed`), and what a job on them is watched with.

A helper of the tests that the benchmarks use too: the tests import it as ``netbed``
(their folder is on the path), the benches as ``tests.netbed`` from the project root.
Nothing of it is copied in ``bench/``.

- :mod:`netbed.bed`: the bed (:class:`Testbed`, its hosts, shaping, counters, clean-up);
- :mod:`netbed.lan`: namespaces joined by a bridge (the tests' ``netns`` uses it too);
- :mod:`netbed.links`: tc rates, interface counters, the ring probe of a link;
- :mod:`netbed.sshd`: a private sshd's config and greeting (the tests' sshd uses it too);
- :mod:`netbed.stale`: beds a killed process left behind, removed;
- :mod:`netbed.events`: a launcher's events stamped with their time of arrival;
- :mod:`netbed.system`: commands, tools, processes of this machine.
"""

from .bed import Host, Testbed
from .events import Events
from .links import Counters, LinkMeasurement, rate_bits
from .stale import OWNER_FILE, PREFIX, reap_stale_beds
from .system import TestbedError, check_requirements, free_port, worker_pid

__all__ = ["OWNER_FILE", "PREFIX", "Counters", "Events", "Host", "LinkMeasurement", "Testbed",
           "TestbedError", "check_requirements", "free_port", "rate_bits", "reap_stale_beds",
           "worker_pid"]
