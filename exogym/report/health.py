"""Each host's link and health at a glance, from its ranks' ``link``, ``system`` and ``step`` events.

Both dashboards (the terminal's and the browser's) show these figures per host;
they are computed here, once, from the metric events (:mod:`exogym.report.metrics`):

- **link**: the payload rate the host's ranks achieve now, in bit/s: the sum of
  each rank's latest ``rate_bps`` (its ``link`` event, :mod:`exogym.run.monitor`);
- **sync**: the share done of the collective in flight (the least among the host's
  ranks that are in one); None while none is;
- **waiting**: the share of the steps' time spent inside collectives (waiting for the
  network and for the peers): each rank's ``comm_s`` over its steps' wall time in its
  last :data:`WAIT_WINDOW_S` seconds, averaged over the host's ranks; with a simulated
  network (``fit(network=...)``), the simulated ``sim_comm_s`` over the simulated step;
- **CPU**: the host's CPU use, percent of all its cores;
- **memory**: the resident memory of the host's rank processes (each process once),
  and what the host has left (``available``) of its total;
- **GPU**: utilization and the ranks' GPU memory, where the ranks have a GPU.

A host whose available memory falls under :data:`LOW_MEMORY_SHARE` of its total is
flagged by its own sampler (the ``system`` event's ``low_memory``) before the system
kills a process; :class:`LowMemoryNotice` words it once per host for whoever prints the
run's lines. Pure Python; values that arrive malformed are left out, never raised on.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LOW_MEMORY_SHARE", "WAIT_WINDOW_S", "HealthBoard", "HostHealth", "LowMemoryNotice",
           "gib", "low_memory_threshold", "memory_line"]

#: A host is low on memory when what it has available falls under this share of its total.
LOW_MEMORY_SHARE = 0.10
#: Seconds of a rank's own clock over which its share of time spent waiting is measured.
WAIT_WINDOW_S = 30.0


def low_memory_threshold(total_bytes: float, low_memory_bytes: float | None = None) -> float:
    """Available bytes under which a host is low on memory: ``low_memory_bytes`` when
    given, else :data:`LOW_MEMORY_SHARE` of ``total_bytes``."""
    return float(low_memory_bytes) if low_memory_bytes is not None \
        else LOW_MEMORY_SHARE * float(total_bytes)


def gib(nbytes: float) -> str:
    """Bytes in GiB as a person reads them: ``'0.8 GiB'``, ``'16 GiB'``."""
    value = nbytes / 2**30
    return f"{value:.1f} GiB" if value < 10 else f"{value:.0f} GiB"


def memory_line(host: str, available: float, total: float) -> str:
    """``'192.168.1.101 has 0.8 GiB of 16 GiB memory left'``."""
    return f"{host} has {gib(available)} of {gib(total)} memory left"


def _number(value: Any) -> float | None:
    """A finite number from an event, or None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class LowMemoryNotice:
    """The line to print, once per host, when a ``system`` event says its host is low on
    memory (the launcher's and the progress bar's)."""

    def __init__(self) -> None:
        self.told: set[str] = set()

    def check(self, event: Mapping[str, Any], host: str | None = None) -> str | None:
        """The line for ``event`` the first time its host is low on memory, else None.

        Args:
            event: any metric event (only a ``system`` one flagged ``low_memory`` counts).
            host: the host it came from, when the event does not say (default: its
                ``host``, else ``this machine``).
        """
        if event.get("event") != "system" or event.get("low_memory") is not True:
            return None
        available = _number(event.get("mem_available_bytes"))
        total = _number(event.get("mem_total_bytes"))
        where = str(event.get("host") or host or "this machine")
        if available is None or total is None or where in self.told:
            return None
        self.told.add(where)
        return memory_line(where, available, total)


@dataclass(frozen=True)
class HostHealth:
    """One host's figures as the dashboards show them (None: not known yet, or absent).

    Args:
        host: the host.
        link_bps: payload bits per second its ranks achieve now (their sum).
        sync_done: share done of the collective in flight (its least advanced rank's);
            None when no rank of it is in one.
        waiting: share of its ranks' recent step time spent inside collectives.
        cpu_percent: CPU use, percent of all its cores.
        rss_bytes: resident memory of its rank processes.
        available_bytes, total_bytes: memory it has left, and its total.
        low_memory: its sampler flagged it low on memory.
        gpu_percent: mean utilization of its ranks' GPUs (where the driver says).
        gpu_bytes: GPU memory its ranks hold; ``gpu_total_bytes``: of their GPUs' total.
    """

    host: str
    link_bps: float | None = None
    sync_done: float | None = None
    waiting: float | None = None
    cpu_percent: float | None = None
    rss_bytes: float | None = None
    available_bytes: float | None = None
    total_bytes: float | None = None
    low_memory: bool = False
    gpu_percent: float | None = None
    gpu_bytes: float | None = None
    gpu_total_bytes: float | None = None

    def as_json(self) -> dict[str, Any]:
        """The figures as a JSON object (the browser's hosts table)."""
        return dict(self.__dict__)


@dataclass
class _Rank:
    """What the board keeps of one rank."""

    host: str
    rate_bps: float | None = None
    in_flight: bool = False
    done: float | None = None
    last_clock: float | None = None  # its own clock (wall_s) at its last step
    steps: deque[tuple[float, float, float]] = field(default_factory=deque)  # clock, comm, time
    comm_s: float = 0.0
    step_s: float = 0.0
    system: dict[str, Any] | None = None
    seen: int = 0  # when its system sample came, in the board's order of events

    def add_step(self, clock: float, comm: float, duration: float) -> None:
        if self.steps and clock < self.steps[-1][0]:  # a new process: its clock starts over
            self.steps.clear()
            self.comm_s = self.step_s = 0.0
        self.steps.append((clock, comm, duration))
        self.comm_s += comm
        self.step_s += duration
        while len(self.steps) > 1 and clock - self.steps[0][0] > WAIT_WINDOW_S:
            _, old_comm, old_duration = self.steps.popleft()
            self.comm_s -= old_comm
            self.step_s -= old_duration

    @property
    def waiting(self) -> float | None:
        if self.step_s <= 0:
            return None
        return min(1.0, max(0.0, self.comm_s / self.step_s))


class HealthBoard:
    """Each host's :class:`HostHealth`, kept from the run's events.

    Feed it every event with the host its rank runs on (:meth:`on_event`); read
    :meth:`hosts`. Not thread-safe: its dashboard holds its own lock around it.
    """

    def __init__(self) -> None:
        self.ranks: dict[int, _Rank] = {}
        self.order: list[str] = []  # hosts in the order they first reported a figure
        self._events = 0

    @property
    def reporting(self) -> bool:
        """True once some rank has sent a ``link`` or ``system`` event."""
        return any(r.system is not None or r.rate_bps is not None or r.in_flight
                   for r in self.ranks.values())

    def on_event(self, event: Mapping[str, Any], host: str) -> None:
        """Take one event of a rank on ``host`` (``link``, ``system`` and ``step`` count)."""
        kind = event.get("event", "step")
        rank_number = event.get("rank")
        if kind not in ("link", "system", "step") or isinstance(rank_number, bool) \
                or not isinstance(rank_number, int):
            return
        rank = self.ranks.get(rank_number)
        if rank is None:
            rank = self.ranks[rank_number] = _Rank(host)
        rank.host = host
        self._events += 1
        if kind == "link":
            rank.in_flight = event.get("in_flight") is True
            rank.done = _number(event.get("done")) if rank.in_flight else None
            rate = _number(event.get("rate_bps"))
            if rate is not None:
                rank.rate_bps = rate
        elif kind == "system":
            rank.system = dict(event)
            rank.seen = self._events
        else:
            self._step(rank, event)
            if rank.waiting is None:
                return
        if host not in self.order:
            self.order.append(host)

    def _step(self, rank: _Rank, event: Mapping[str, Any]) -> None:
        compute = _number(event.get("compute_s"))
        sim_comm = _number(event.get("sim_comm_s"))
        if sim_comm is not None and compute is not None:  # a simulated network: its time
            clock = _number(event.get("sim_time_s"))
            rank.add_step(clock if clock is not None else rank.step_s, sim_comm,
                          sim_comm + compute)
            return
        comm = _number(event.get("comm_s"))
        clock = _number(event.get("wall_s"))
        if comm is None:
            return
        if clock is not None and rank.last_clock is not None and clock > rank.last_clock:
            duration = clock - rank.last_clock
        elif compute is not None:
            duration = comm + compute
        else:
            rank.last_clock = clock
            return
        rank.last_clock = clock
        rank.add_step(clock if clock is not None else rank.step_s + duration, comm, duration)

    def hosts(self) -> list[HostHealth]:
        """Every host that has reported a figure, in the order they first did."""
        return [self._host(host) for host in self.order]

    def _host(self, host: str) -> HostHealth:
        ranks = [r for r in self.ranks.values() if r.host == host]
        rates = [r.rate_bps for r in ranks if r.rate_bps is not None]
        flying = [r.done for r in ranks if r.in_flight and r.done is not None]
        waits = [r.waiting for r in ranks if r.waiting is not None]
        samples = sorted((r for r in ranks if r.system is not None), key=lambda r: r.seen)
        by_process = {s.system.get("pid"): s.system for s in samples}  # the latest of each
        newest = samples[-1].system if samples else {}

        def total(key: str, among: Mapping[Any, dict[str, Any]]) -> float | None:
            values = [v for v in (_number(s.get(key)) for s in among.values()) if v is not None]
            return sum(values) if values else None

        by_gpu = {s.get("gpu"): s for s in by_process.values() if s.get("gpu")}
        gpu_use = [v for v in (_number(s.get("gpu_percent")) for s in by_gpu.values())
                   if v is not None]
        return HostHealth(
            host=host, link_bps=sum(rates) if rates else None,
            sync_done=min(flying) if flying else None,
            waiting=sum(waits) / len(waits) if waits else None,
            cpu_percent=_number(newest.get("cpu_percent")),
            rss_bytes=total("rss_bytes", by_process),
            available_bytes=_number(newest.get("mem_available_bytes")),
            total_bytes=_number(newest.get("mem_total_bytes")),
            low_memory=newest.get("low_memory") is True,
            gpu_percent=sum(gpu_use) / len(gpu_use) if gpu_use else None,
            gpu_bytes=total("gpu_bytes", by_process) if by_gpu else None,
            gpu_total_bytes=total("gpu_total_bytes", by_gpu))
