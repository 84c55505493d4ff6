"""The cost model of links and collectives: how long a collective takes on a network.

This is the one model of the network in the project. The simulator's clock
(``fit(network=...)``, :mod:`exogym.comm`) charges every training collective
with it, and the planner behind the wizard and ``recommend``
(``distributed/planning/projection.py``) predicts step times with it. It needs
no torch, so the command line can use it freely.

The model. Hosts hang off one switch (the default topology), each on a link
of ``bandwidth`` (per host, when ``rank_bandwidth`` is given) that sends and
receives at once. A collective among ``N`` hosts runs as a ring, as gloo's
and NCCL's do:

- **all-reduce** of ``S`` bytes: a reduce-scatter, then an all-gather; every
  host sends ``2 (N-1)/N * S`` bytes in ``2 (N-1)`` sequential rounds;
- **all-gather** of ``s`` bytes per host: every host sends ``(N-1) * s``
  bytes in ``N-1`` rounds;
- **broadcast** of ``S`` bytes: a binomial tree, ``ceil(log2 N)`` rounds in
  each of which a sender sends all ``S`` bytes.

A ring moves at the pace of its slowest link, so the time of a collective is::

    seconds = bytes_sent / (slowest bandwidth in bytes/s) + rounds * latency

``latency`` is the one-way time of one message round (half a round trip).
What the model leaves out: congestion inside the switch, TCP's slow start
and loss recovery, and protocol headers (a measured throughput, as
``recommend`` and ``tests/netbed/linkprobe.py`` take, already includes them).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from exogym.base.plural import plural
from exogym.comm.wire import BUCKET_BYTES, COLLECTIVES, Traffic

__all__ = [
    "COLLECTIVES",
    "TrafficCost",
    "traffic_cost",
    "Network",
    "allgather_bytes",
    "allgather_rounds",
    "broadcast_bytes",
    "broadcast_rounds",
    "collective_bytes",
    "collective_rounds",
    "parse_rate",
    "ring_allreduce_bytes",
    "ring_allreduce_rounds",
]

#: The collectives the model times, by the name :mod:`exogym.comm` reports them with.

# tc's units: bits per second, or bytes per second ("bps"), decimal or binary prefixes.
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?i?)(bit|bps)?\s*$",
                   re.IGNORECASE)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
           "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}


def parse_rate(rate: str | float | int) -> float:
    """A link rate in bits per second, from tc's syntax (``'100mbit'``, ``'1gbit'``, ``'10mbps'``).

    ``bit`` is bits per second, ``bps`` bytes per second (as in tc); ``k``, ``m``,
    ``g``, ``t`` are powers of 1000, ``ki``, ``mi``, ... of 1024. A plain number
    is bits per second.

    Raises:
        ValueError: not a positive rate in that syntax.
    """
    if isinstance(rate, bool):
        raise ValueError(f"a link rate must be like '100mbit' or '1gbit', got {rate!r}")
    if isinstance(rate, (int, float)):
        value = float(rate)
    else:
        match = _RATE.match(str(rate)) if isinstance(rate, str) else None
        if match is None:
            raise ValueError(f"a link rate must be like '100mbit', '1gbit' or '500kbit' "
                             f"(tc's units), got {rate!r}")
        number, prefix, unit = match.groups()
        value = float(number) * _PREFIX[prefix.lower()] * (8.0 if (unit or "").lower() == "bps"
                                                           else 1.0)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"a link rate must be more than 0 bit/s, got {rate!r}")
    return value


def _hosts(hosts: int) -> int:
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
        raise ValueError(f"hosts must be an integer >= 1, got {hosts!r}")
    return hosts


def _payload(payload: float) -> float:
    if isinstance(payload, bool) or not isinstance(payload, (int, float)) or not payload >= 0:
        raise ValueError(f"payload must be a number >= 0, got {payload!r}")
    return float(payload)


def ring_allreduce_bytes(payload: float, hosts: int) -> float:
    """Bytes one host sends in a ring all-reduce of ``payload`` bytes: ``2 (N-1)/N * payload``."""
    hosts = _hosts(hosts)
    return 2.0 * (hosts - 1) / hosts * _payload(payload)


def ring_allreduce_rounds(hosts: int, calls: int = 1) -> int:
    """Sequential message rounds of ``calls`` ring all-reduces: ``2 (N-1)`` each."""
    return 2 * (_hosts(hosts) - 1) * calls


def allgather_bytes(payload: float, hosts: int) -> float:
    """Bytes one host sends in a ring all-gather of ``payload`` bytes per host: ``(N-1) * payload``."""
    return float((_hosts(hosts) - 1) * _payload(payload))


def allgather_rounds(hosts: int, calls: int = 1) -> int:
    """Sequential message rounds of ``calls`` ring all-gathers: ``N - 1`` each."""
    return (_hosts(hosts) - 1) * calls


def broadcast_rounds(hosts: int, calls: int = 1) -> int:
    """Sequential rounds of ``calls`` binomial-tree broadcasts: ``ceil(log2 N)`` each."""
    return math.ceil(math.log2(_hosts(hosts))) * calls


def broadcast_bytes(payload: float, hosts: int) -> float:
    """Bytes on the busiest path of a binomial-tree broadcast: ``payload`` per round."""
    return broadcast_rounds(hosts) * _payload(payload)


_MODEL = {"all_reduce": (ring_allreduce_bytes, ring_allreduce_rounds),
          "all_gather": (allgather_bytes, allgather_rounds),
          "broadcast": (broadcast_bytes, broadcast_rounds)}


def _model(kind: str):
    try:
        return _MODEL[kind]
    except KeyError:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}, "
                         f"got {kind!r}") from None


def collective_bytes(kind: str, payload: float, hosts: int) -> float:
    """Bytes a host sends (on the critical path) in one collective of ``kind``."""
    return _model(kind)[0](payload, hosts)


def collective_rounds(kind: str, hosts: int, calls: int = 1) -> int:
    """Sequential message rounds of ``calls`` collectives of ``kind`` among ``hosts``."""
    return _model(kind)[1](hosts, calls)


@dataclass(frozen=True)
class Network:
    """A modelled network: hosts on one switch, a link each, a latency per message round.

    Args:
        bandwidth: every host's link, in bits per second or tc's syntax
            (``'100mbit'``, ``'1gbit'``).
        latency_s: one-way latency of one message round, in seconds (0: none).
        rank_bandwidth: per rank, its own link (bits per second or tc's syntax),
            overriding ``bandwidth``; a ring runs at its slowest member's pace.
        topology: ``'switch'``, every host on one switch (the only one modelled).

    Raises:
        ValueError: a rate, latency or topology that cannot be.
    """

    bandwidth: float | str
    latency_s: float = 0.0
    rank_bandwidth: Sequence[float | str] | None = None
    topology: str = "switch"

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", parse_rate(self.bandwidth))
        latency = self.latency_s
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) \
                or not (latency >= 0 and math.isfinite(latency)):
            raise ValueError(f"latency_s must be a number of seconds >= 0, got {latency!r}")
        object.__setattr__(self, "latency_s", float(latency))
        if self.rank_bandwidth is not None:
            if isinstance(self.rank_bandwidth, (str, bytes)) or not isinstance(
                    self.rank_bandwidth, Sequence) or not self.rank_bandwidth:
                raise ValueError("rank_bandwidth must be a list of rates, one per rank, got "
                                 f"{self.rank_bandwidth!r}")
            object.__setattr__(self, "rank_bandwidth",
                               tuple(parse_rate(r) for r in self.rank_bandwidth))
        if self.topology != "switch":
            raise ValueError(f"topology must be 'switch' (every host on one switch), "
                             f"got {self.topology!r}")

    @classmethod
    def coerce(cls, value: Network | str | float | Mapping[str, Any]) -> Network:
        """``value`` as a Network: a Network itself, a rate (``'100mbit'``, no latency), or a
        mapping of its arguments (``{"bandwidth": "1gbit", "latency_s": 0.0002}``, as a
        profile writes it)."""
        if isinstance(value, Network):
            return value
        if isinstance(value, Mapping):
            known = {"bandwidth", "latency_s", "rank_bandwidth", "topology"}
            unknown = sorted(set(value) - known)
            if unknown or "bandwidth" not in value:
                raise ValueError(f"a network needs 'bandwidth' and may have "
                                 f"{', '.join(sorted(known - {'bandwidth'}))}; got keys "
                                 f"{sorted(value)}")
            return cls(**value)
        return cls(bandwidth=value)

    def check_ranks(self, num_nodes: int) -> None:
        """Raise ``ValueError`` unless ``rank_bandwidth`` (when given) has one rate per rank."""
        if self.rank_bandwidth is not None and len(self.rank_bandwidth) != num_nodes:
            raise ValueError(f"network.rank_bandwidth has {plural(len(self.rank_bandwidth), 'rate')} "
                             f"for {plural(num_nodes, 'rank')}: give one per rank")

    def link_bits_per_s(self, ranks: Sequence[int] | None = None) -> float:
        """The slowest link among ``ranks`` (all of them when None), in bits per second."""
        if self.rank_bandwidth is None:
            return float(self.bandwidth)
        chosen = self.rank_bandwidth if ranks is None else [self.rank_bandwidth[r] for r in ranks]
        return float(min(chosen))

    def seconds(self, kind: str, payload: float, ranks: Sequence[int], calls: int = 1) -> float:
        """Time of ``calls`` collectives of ``kind`` moving ``payload`` bytes in all among ``ranks``.

        ``payload`` is what one rank hands to the collectives (what exogym's
        counters count): the buffer for an all-reduce or a broadcast, its own
        contribution for an all-gather.
        """
        hosts = len(ranks)
        if hosts <= 1:
            return 0.0
        return self.transfer_s(collective_bytes(kind, payload, hosts),
                               collective_rounds(kind, hosts, calls), ranks)

    def transfer_s(self, bytes_sent: float, rounds: float,
                   ranks: Sequence[int] | None = None) -> float:
        """Seconds to send ``bytes_sent`` bytes in ``rounds`` sequential message rounds
        over the slowest link among ``ranks``: the model's one formula."""
        return bytes_sent * 8.0 / self.link_bits_per_s(ranks) + rounds * self.latency_s

    def describe(self) -> str:
        """One line: ``'100 Mbit/s per host, 0.5 ms latency'``."""
        def rate(bits: float) -> str:
            return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"
        links = (rate(self.bandwidth) + " per host" if self.rank_bandwidth is None
                 else "links " + ", ".join(rate(b) for b in self.rank_bandwidth))
        return f"{links}, {self.latency_s * 1e3:g} ms latency"


@dataclass(frozen=True)
class TrafficCost:
    """What a strategy's stated traffic costs one host per step, averaged over its period.

    Args:
        payload: bytes the host hands to collectives per step (what ``comm_bytes`` counts).
        bytes_sent: bytes it puts on its link per step under the ring model.
        rounds: sequential message rounds per step (each pays one latency).
        collective: the collective carrying most of the payload (``'none'`` without traffic).
        period: steps from one communication to the next (0: never).
    """

    payload: float
    bytes_sent: float
    rounds: float
    collective: str
    period: int


def traffic_cost(traffic: Sequence[Traffic], hosts: int,
                 bucket_bytes: int = BUCKET_BYTES) -> TrafficCost:
    """Per step, the bytes and rounds of ``traffic`` (a strategy's statement) among ``hosts``.

    Each collective costs what :func:`collective_bytes` and :func:`collective_rounds`
    say for its ranks (all ``hosts`` unless it names fewer), in ``calls`` calls
    (one per ``bucket_bytes`` of payload unless it says), divided by ``every``.
    """
    payload = sent = rounds = 0.0
    largest: tuple[float, str] = (-1.0, "none")
    for t in traffic:
        ring = min(t.ranks or hosts, hosts)
        calls = t.calls if t.calls is not None else (
            max(1, math.ceil(t.payload / bucket_bytes)) if t.payload > 0 else 0)
        payload += t.payload / t.every
        sent += collective_bytes(t.collective, t.payload, ring) / t.every
        rounds += collective_rounds(t.collective, ring, calls) / t.every
        if t.payload / t.every > largest[0]:
            largest = (t.payload / t.every, t.collective.replace("_", "-"))
    period = max(1, int(min(t.every for t in traffic))) if traffic else 0
    return TrafficCost(payload, sent, rounds, largest[1], period)
