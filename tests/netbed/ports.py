"""Ports for the tests: free when taken, and held for the process that took them.

A port found free by binding to port 0 and closing again can be taken by anyone before
the test's server binds it: another test process of this suite (it runs in several,
pytest-xdist), another checkout's suite on the same machine, or the kernel itself,
which gives the same range to every outgoing connection (SSH, gloo, the store's clients).

So the ports the tests take come from outside the kernel's ephemeral range (read from
``/proc/sys/net/ipv4/ip_local_port_range``) and away from torch's default master port,
and each is claimed, for as long as the process that took it lives, by binding an
abstract Unix socket named after it (``\\0exogym-test-port-N``): one name per port on the
machine, freed by the kernel when the process ends, however it ends, so nothing is left
behind. A port is given out once per machine until its holder exits, then only if
nothing listens on it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: torch's default master port and its neighbours: other runs on this machine use them.
AVOID = range(29_400, 29_601)
#: The lowest port handed out (below it: well-known and registered services' habits).
LOWEST = 10_240

_held: dict[int, socket.socket] = {}
_random = random.Random()  # seeded from the OS: two test processes start apart


def ephemeral_range() -> range:
    """The ports the kernel gives outgoing connections and ``bind(port 0)``."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32_768, 61_000)  # Linux's default where the file cannot be read


def _candidates() -> list[range]:
    ephemeral = ephemeral_range()
    spans = [range(LOWEST, min(ephemeral.start, AVOID.start)),
             range(max(LOWEST, AVOID.stop), ephemeral.start),
             range(max(LOWEST, ephemeral.stop), 65_536)]
    return [span for span in spans if len(span) > 0]


def _bindable(port: int, addresses: tuple[str, ...]) -> bool:
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, port))
            except OSError:
                return False
    return True


def _claim(port: int) -> bool:
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0exogym-test-port-{port}")
    except OSError:
        claim.close()
        return False
    _held[port] = claim
    return True


def free_port(*addresses: str) -> int:
    """A TCP port free on every one of ``addresses`` (default ``""``: every address of this
    machine, so that a port free on 127.0.0.1 but listened on at 127.0.0.2 by a process a
    test left, or by another suite, is not given out), claimed for this process: no other
    test process on this machine gets it while this one lives, and no outgoing connection
    is given it."""
    addresses = addresses or ("",)
    spans = _candidates()
    weights = [len(span) for span in spans]
    for _ in range(4000):
        span = _random.choices(spans, weights)[0]
        port = _random.randrange(span.start, span.stop)
        if port in _held or not _bindable(port, addresses) or not _claim(port):
            continue
        if _bindable(port, addresses):  # nothing took it between the look and the claim
            return port
    raise RuntimeError(f"no free port on {', '.join(addresses)} after 4000 tries: "
                       f"{len(_held)} held by this process")
