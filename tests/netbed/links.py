"""The bed's links: tc rates, interface byte counters, and a ring probe of what a link delivers.

The probe (:func:`measure_ring`) has every host send to its ring neighbour while
receiving from the other, as a ring all-reduce does, with ``tests/netbed/linkprobe.py``
(standard library only) started inside each host's namespace.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .system import TestbedError

if TYPE_CHECKING:
    from .bed import Testbed

LINK_PROBE = Path(__file__).resolve().parent / "linkprobe.py"


def rate_bits(rate: str) -> float:
    """``'100mbit'`` -> 1e8: a tc rate in bits per second (bit, kbit, mbit, gbit; k/m/g = 1000)."""
    text = rate.strip().lower()
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(unit):
            number = text[: -len(unit)]
            try:
                value = float(number)
            except ValueError:
                break
            if value > 0:
                return value * factor
            break
    raise ValueError(f"rate {rate!r} is not a tc rate: write it like 1gbit, 100mbit, 20mbit "
                     "or 512kbit")


def tbf_burst(rate: str) -> int:
    """The bucket of a tbf shaper at ``rate``, in bytes.

    It must hold what the rate sends in a few timer ticks, or tbf falls short of
    its rate on fast links: 4 ms worth, and never under 32 KiB.
    """
    return max(32 * 1024, int(rate_bits(rate) / 8 * 0.004))


@dataclass
class Counters:
    """Interface byte counters at one moment.

    Args:
        host_tx: bytes each host's veth has sent (everything that host put on its link).
        to_launcher: bytes the root namespace has received through the uplink
            (what the hosts sent to the launcher: SSH output, acknowledgements).
        at: ``time.monotonic()`` when read.
    """

    host_tx: list[int]
    to_launcher: int
    at: float = field(default_factory=time.monotonic)

    def between_hosts(self, later: Counters) -> int:
        """Bytes the hosts sent each other between ``self`` and ``later``."""
        sent = sum(b - a for a, b in zip(self.host_tx, later.host_tx))
        return sent - (later.to_launcher - self.to_launcher)

    def launcher_bytes(self, later: Counters) -> int:
        """Bytes the hosts sent the launcher between ``self`` and ``later``."""
        return later.to_launcher - self.to_launcher


@dataclass(frozen=True)
class LinkMeasurement:
    """What a link probe found at one shaping rate.

    Args:
        rate: the tc rate (``100mbit``).
        goodput_bytes_per_s: payload bytes per second each host achieved while
            sending to its ring neighbour and receiving from the other at once
            (the slowest host's figure).
        rtt_s: median TCP round trip of a 1-byte message between hosts 1 and 0.
        seconds: how long the transfer took.
        overhead: wire bytes over payload bytes, minus 1: TCP/IP headers and
            acknowledgements, as the veth counters saw them.
    """

    rate: str
    goodput_bytes_per_s: float
    rtt_s: float
    seconds: float
    overhead: float


def measure_ring(bed: Testbed, seconds: float = 3.0, timeout: float = 120,
                 wrap: Callable[[int, list[str]], list[str]] | None = None) -> LinkMeasurement:
    """Ring transfer at the bed's current rate: host ``i`` sends to ``i+1`` while receiving.

    Every host sends ``seconds`` worth of the nominal rate; the goodput is the
    slowest host's payload rate. The last host then measures the round trip of a
    1-byte message to its ring peer, host 0, which echoes it. ``wrap(index,
    command)``, when given, returns the command that starts host ``index``'s probe
    (to run it under the host's CPU share, say).
    """
    if bed.rate is None:
        raise TestbedError("shape the links (Testbed.shape) before measuring them")
    if len(bed.hosts) < 2:
        raise TestbedError("a link probe needs two hosts or more")
    nbytes = max(1 << 20, int(rate_bits(bed.rate) / 8 * seconds))
    start_at = time.time() + 1.5
    procs = []
    before = bed.counters()
    try:
        for host in bed.hosts:
            peer = bed.hosts[(host.index + 1) % len(bed.hosts)]
            args = [sys.executable, str(LINK_PROBE), "--listen", host.address, "--peer",
                    peer.address, "--bytes", str(nbytes), "--start-at", f"{start_at:.3f}"]
            if host.index == 0:
                args.append("--echo")
            if host.index == len(bed.hosts) - 1:  # its peer is host 0, the echo
                args += ["--ping", "200"]
            command = bed.in_host(host, *args)
            procs.append(subprocess.Popen(command if wrap is None else wrap(host.index, command),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        results = []
        for host, proc in zip(bed.hosts, procs):
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
                           wire / (nbytes * len(bed.hosts)) - 1)
