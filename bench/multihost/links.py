"""The links of ``bench.multihost`` measured as its ranks use them: the ring transfer of
:func:`netbed.links.measure_ring` with every probe started in its host's cpu group, so
that a host that cannot drive its link at its share says so here as in the runs."""

from __future__ import annotations

from bench.harness.slow_host import SlowGroup
from tests.netbed import Testbed
from tests.netbed.links import LinkMeasurement, measure_ring


def in_group(group: SlowGroup, command: list[str]) -> list[str]:
    """``command`` started in ``group``: a shell moves itself in, then becomes the command."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group.path / "cgroup.procs"),
            *command]


def measure_held_ring(bed: Testbed, groups: list[SlowGroup], seconds: float = 3.0,
                      timeout: float = 120) -> LinkMeasurement:
    """The ring transfer at the bed's current rate, every probe in its host's group."""
    return measure_ring(bed, seconds, timeout,
                        wrap=lambda index, command: in_group(groups[index], command))
