"""The links of ``bench.multihost`` measured as its ranks use them: a ring transfer with
every probe held to its host's share of a core.

As :func:`netbed.links.measure_ring` (host ``i`` sends to ``i+1`` while receiving
from ``i-1``; the goodput is the slowest host's payload rate), with two
differences: each probe starts in its host's cpu group, so a host that cannot
drive its link at its share says so here as in the runs; and the round trip is
timed by the last host, whose ring peer is host 0 (the echo), so that it works
for any number of hosts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from bench.harness.slow_host import SlowGroup
from tests.netbed import Testbed, TestbedError, rate_bits
from tests.netbed.links import LINK_PROBE, LinkMeasurement


def in_group(group: SlowGroup, command: list[str]) -> list[str]:
    """``command`` started in ``group``: a shell moves itself in, then becomes the command."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group.path / "cgroup.procs"),
            *command]


def measure_held_ring(bed: Testbed, groups: list[SlowGroup], seconds: float = 3.0,
                      timeout: float = 120) -> LinkMeasurement:
    """The ring transfer at the bed's current rate, every probe in its host's group."""
    if bed.rate is None:
        raise TestbedError("shape the links (Testbed.shape) before measuring them")
    hosts = bed.hosts
    nbytes = max(1 << 20, int(rate_bits(bed.rate) / 8 * seconds))
    start_at = time.time() + 1.5
    procs = []
    before = bed.counters()
    try:
        for host in hosts:
            peer = hosts[(host.index + 1) % len(hosts)]
            args = [sys.executable, str(LINK_PROBE), "--listen", host.address, "--peer",
                    peer.address, "--bytes", str(nbytes), "--start-at", f"{start_at:.3f}"]
            if host.index == 0:
                args.append("--echo")
            if host.index == len(hosts) - 1:
                args += ["--ping", "200"]
            procs.append(subprocess.Popen(in_group(groups[host.index],
                                                   bed.in_host(host, *args)),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        results = []
        for host, proc in zip(hosts, procs):
            out, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise TestbedError(f"link probe on host {host.index} failed "
                                   f"({proc.returncode}): {err.strip()[-1500:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wire = before.between_hosts(bed.counters())
    slowest = max(r["receive_s"] for r in results)
    rtt = next(r["rtt_s"] for r in results if r.get("rtt_s") is not None)
    return LinkMeasurement(bed.rate, nbytes / slowest, rtt, slowest,
                           wire / (nbytes * len(hosts)) - 1)
