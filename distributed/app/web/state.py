"""What the browser dashboard knows: the runs, a row per rank, and the chart points.

Fed with the same metric events as the terminal dashboard (``start``, ``step``,
``done``; see ``exogym.report.metrics``). The throughput chart's points are each host's
recent rate: the sum of its ranks' samples per second over their last
:data:`RATE_WINDOW_S` seconds of training, on their own clocks (``wall_s``), from
their first step on, once they span :data:`RATE_MIN_SPAN_S`. The interval before a
rank's first step (loading, warm-up) is left out: there a rank that has trained
64 samples in a millisecond reports 45,000 samples/s, which once dwarfed a steady
2,000 on the chart; so are the rates of a handful of milliseconds that follow it.

Each host's link and health (``link``, ``system`` and ``step`` events) are kept by an
``exogym.report.health.HealthBoard`` per run, the terminal dashboard's figures, and
shown as a row per host.

Every change bumps a version and wakes the server's event streams;
:meth:`WebState.view` gives a JSON-ready picture of everything, or of what
changed since a point, for ``/state`` and ``/events``.
Pure Python and thread-safe; imports neither torch nor the server.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from exogym.report.health import HealthBoard

from ...launch.faults import FaultLog, describe_fault_event

#: A rank's state before it reports.
WAITING = "waiting"
#: Chart points kept per rank and run, about: a longer run keeps every n-th step (and every
#: evaluation), so a page that (re)connects to a long run loads quickly.
POINTS_PER_RANK = 2000
#: Seconds of a rank's own training clock its recent throughput is measured over.
RATE_WINDOW_S = 2.0
#: Seconds of training a rank's recent throughput needs before it is shown.
RATE_MIN_SPAN_S = 0.5


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: a non-finite float becomes None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _plain(value: Any) -> Any:
    """A profile value as JSON shows it (paths, classes and the like as text)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


@dataclass
class RankRow:
    """One rank of one run, as its row on the page shows it.

    Args:
        run: index of the run it belongs to.
        rank: the rank.
        host: where it runs (``local`` in a simulation).
        state: ``waiting``, ``started``, ``training``, ``done``, ``failed`` or ``stopped``.
        step: its last reported step; ``max_steps`` the steps it will run once it has said.
        loss: training loss of its last step; ``val_loss`` its last validation loss.
        val_accuracy: its own model's last validation accuracy, for a task that scores one.
        samples: samples trained on; ``wall_s`` the seconds it has trained (its own clock).
        bytes_sent: bytes it sent through the collectives.
        version: the global version it trains from (asynchronous DiLoCo), or None.
        last_seen: the state's clock when it last reported, or None.
        recent: ``(wall_s, samples)`` of its steps within its last ``RATE_WINDOW_S``
            seconds of training (and the one before them), for its recent throughput.
    """

    run: int
    rank: int
    host: str
    state: str = WAITING
    step: int = 0
    max_steps: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    val_accuracy: float | None = None
    samples: int = 0
    wall_s: float = 0.0
    bytes_sent: int = 0
    version: int | None = None
    last_seen: float | None = None
    recent: deque[tuple[float, int]] = field(default_factory=deque, repr=False)

    @property
    def samples_per_s(self) -> float | None:
        """Samples per second since the rank started training (as the terminal's table)."""
        return self.samples / self.wall_s if self.wall_s > 0 else None

    def record_rate(self) -> None:
        """Add its latest step (``wall_s``, ``samples``) to its recent steps."""
        if self.recent and self.wall_s < self.recent[-1][0]:
            self.recent.clear()  # a new process (resumed, rejoined): its clock starts over
        self.recent.append((self.wall_s, self.samples))
        while len(self.recent) > 2 and self.wall_s - self.recent[1][0] >= RATE_WINDOW_S:
            self.recent.popleft()

    @property
    def recent_samples_per_s(self) -> float | None:
        """Samples per second over its last ``RATE_WINDOW_S`` seconds of training, from its
        first step on (never the interval before it); None until its steps since the
        first span ``RATE_MIN_SPAN_S``."""
        if len(self.recent) < 2:
            return None
        (w0, s0), (w1, s1) = self.recent[0], self.recent[-1]
        return (s1 - s0) / (w1 - w0) if w1 - w0 >= RATE_MIN_SPAN_S else None

    def as_json(self, now: float | None) -> dict[str, Any]:
        """The row for the page; ``heartbeat_age_s`` is seconds since the last report (None
        once its run has ended: ``now`` is None)."""
        return {"run": self.run, "rank": self.rank, "host": self.host, "state": self.state,
                "step": self.step, "max_steps": self.max_steps, "loss": _finite(self.loss),
                "val_loss": _finite(self.val_loss), "val_accuracy": _finite(self.val_accuracy),
                "samples_per_s": self.samples_per_s,
                "bytes_sent": self.bytes_sent, "version": self.version,
                "heartbeat_age_s": None if self.last_seen is None or now is None
                else now - self.last_seen}


@dataclass
class RunInfo:
    """One run shown on the page (a comparison shows one per strategy).

    Args:
        name: what the page calls it (the profile, or the strategy in a comparison).
        config: the run's configuration (the resolved profile's keys).
        hosts: the host of each rank, by rank.
        status: ``waiting``, ``running``, ``done`` or ``failed``.
        started: the state's clock at its first event, or None.
        ended: the state's clock when it finished or failed, or None while it runs.
        summary: the final figures (``exogym.report.summary.summarize``), once finished.
        membership: every change of membership where hosts come and go
            (``min_nodes``): ``{"step", "ranks", "hosts", "reason"}``.
        faults: the faults injected into the run (``--inject``), one entry each
            (:class:`distributed.launch.faults.FaultLog`), with a line in words.
        health: each host's link and health (:class:`exogym.report.health.HealthBoard`).
    """

    name: str
    config: dict[str, Any]
    hosts: dict[int, str]
    status: str = WAITING
    started: float | None = None
    ended: float | None = None
    summary: dict[str, Any] | None = None
    ranks: dict[int, RankRow] = field(default_factory=dict)
    membership: list[dict[str, Any]] = field(default_factory=list)
    faults: FaultLog = field(default_factory=FaultLog)
    fault_lines: list[str] = field(default_factory=list)
    health: HealthBoard = field(default_factory=HealthBoard)

    def elapsed_s(self, now: float) -> float | None:
        """Seconds the run has lasted: up to ``now`` while it runs; once over, its own
        duration, which stays put: the summary's ``wall_s`` (the figure the terminal's
        summary shows) when it has one, else from its first event to its end."""
        if self.ended is not None:
            wall = self.summary.get("wall_s") if self.summary else None
            if isinstance(wall, (int, float)) and math.isfinite(wall):
                return float(wall)
            return None if self.started is None else self.ended - self.started
        return None if self.started is None else now - self.started

    def as_json(self, now: float) -> dict[str, Any]:
        """The run's header for the page (``elapsed_s``: see :meth:`elapsed_s`)."""
        return {"name": self.name, "config": self.config, "status": self.status,
                "elapsed_s": self.elapsed_s(now),
                "summary": None if self.summary is None else _plain(self.summary),
                "membership": _plain(self.membership),
                "faults": _plain(self.faults.entries()), "fault_lines": list(self.fault_lines)}


class WebState:
    """The runs of one command, their ranks and their chart points, shared by the
    training thread that feeds events and the server threads that read them.

    Args:
        title: the page's title.
        clock: the time source in seconds (for heartbeats and the throughput chart).
    """

    def __init__(self, title: str = "exogym", clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.title = title
        self.clock = clock
        self.runs: list[RunInfo] = []
        self.points: list[dict[str, Any]] = []
        self.version = 0
        self.closed = False
        self.changed = threading.Condition(threading.RLock())

    # ------------------------------------------------------------------ feeding

    def _bump(self) -> None:
        self.version += 1
        self.changed.notify_all()

    def begin_run(self, name: str, config: Mapping[str, Any] | None = None,
                  num_ranks: int = 0, hosts: Sequence[str] | Mapping[int, str] | None = None
                  ) -> int:
        """Add a run; the events that follow belong to it. Returns its index."""
        host_of = dict(enumerate(hosts)) if isinstance(hosts, Sequence) else dict(hosts or {})
        with self.changed:
            run = RunInfo(name, {str(k): _plain(v) for k, v in (config or {}).items()}, host_of)
            index = len(self.runs)
            for rank in sorted(set(range(num_ranks)) | set(host_of)):
                run.ranks[rank] = RankRow(index, rank, host_of.get(rank, "local"))
            self.runs.append(run)
            self._bump()
            return index

    def _current(self) -> RunInfo:
        if not self.runs:
            self.begin_run("run")
        return self.runs[-1]

    def on_event(self, event: Mapping[str, Any]) -> None:
        """Take one metric event (``start``, ``step``, ``done``, ``link``, ``system``; others
        are ignored).

        Every ``step`` event updates its rank's row; it adds a chart point unless the run
        is longer than ``POINTS_PER_RANK`` steps and the step falls between two kept ones."""
        kind = event.get("event", "step")
        if kind == "host" and "rank" in event:  # a host lost or rejoining (min_nodes)
            self.set_status(int(event["rank"]), str(event["state"]))
            return
        if kind == "fault" and event.get("injected"):
            with self.changed:
                run = self._current()
                run.faults.add(dict(event))
                run.fault_lines.append(describe_fault_event(dict(event)))
                self._bump()
            return
        if kind == "membership":
            with self.changed:
                self._current().membership.append(
                    {k: _plain(event[k]) for k in ("step", "ranks", "hosts", "reason")})
                self._bump()
            return
        if kind in ("link", "system") and isinstance(event.get("rank"), int):
            with self.changed:
                row = self._row(event)
                row.last_seen = self.clock()  # a rank in a long collective still reports
                self._current().health.on_event(event, row.host)
                self._bump()
            return
        if "rank" not in event or kind not in ("start", "step", "done"):
            return
        with self.changed:
            now = self.clock()
            run = self._current()
            index = len(self.runs) - 1
            if run.started is None:
                run.started = now
            if run.status == WAITING:
                run.status = "running"
            row = self._row(event)
            row.last_seen = now
            if kind == "start":
                row.state = "started"
                row.max_steps = event.get("max_steps", row.max_steps)
                row.step = int(event.get("step") or 0)
            elif kind == "done":
                row.state = "done"
                row.step = int(event.get("step", row.step))
                row.bytes_sent = int(event.get("comm_bytes", row.bytes_sent))
            else:
                self._step(run, index, row, event, now)
                run.health.on_event(event, row.host)
            self._bump()

    def _row(self, event: Mapping[str, Any]) -> RankRow:
        """The row of the event's rank in the current run (made when new), its host set
        from the event when it names one."""
        run = self._current()
        rank = int(event["rank"])
        row = run.ranks.get(rank)
        if row is None:
            row = run.ranks[rank] = RankRow(len(self.runs) - 1, rank, run.hosts.get(rank, "local"))
        if event.get("host"):
            row.host = str(event["host"])
        return row

    def _step(self, run: RunInfo, index: int, row: RankRow, event: Mapping[str, Any],
              now: float) -> None:
        row.state = "training"
        row.step = int(event["step"])
        row.loss = _finite(event.get("train_loss", row.loss))
        row.samples = int(event.get("samples", row.samples))
        row.wall_s = float(event.get("wall_s", row.wall_s))
        row.bytes_sent = int(event.get("comm_bytes", row.bytes_sent))
        if event.get("version") is not None:
            row.version = int(event["version"])
        row.record_rate()
        val = _finite(event.get("val_global_loss", event.get("val_loss")))
        if val is not None:
            row.val_loss = val
        if event.get("val_accuracy") is not None:
            row.val_accuracy = _finite(float(event["val_accuracy"]))
        stride = max(1, int(row.max_steps or 0) // POINTS_PER_RANK)
        if row.step % stride and val is None and row.step != row.max_steps:
            return
        # The host's rate, once each of its training ranks has one; a rank that has finished
        # counts with its last (the ranks of a host finish together, and its events come
        # before theirs: leaving it out drew a drop at every run's end).
        rates = [r.recent_samples_per_s for r in run.ranks.values() if r.host == row.host
                 and (r.state == "training" or r.state == "done" and r.recent_samples_per_s)]
        point = {"seq": len(self.points) + 1, "run": index, "rank": row.rank, "host": row.host,
                 "step": row.step, "loss": row.loss, "bytes": row.bytes_sent,
                 "t": now - (run.started or now),
                 "host_wall_s": max(r.wall_s for r in run.ranks.values() if r.host == row.host),
                 "host_samples_per_s": None if None in rates else sum(rates)}
        if val is not None:
            point["val_loss"] = val
        self.points.append(point)

    def set_status(self, rank: int, status: str) -> None:
        """Mark a rank of the current run ``done``, ``failed``, ``stopped``, ``lost``,
        ``rejoining`` or ``training``."""
        with self.changed:
            run = self._current()
            row = run.ranks.get(rank)
            if row is None:
                row = run.ranks[rank] = RankRow(len(self.runs) - 1, rank,
                                                run.hosts.get(rank, "local"))
            row.state = status
            self._bump()

    def end_run(self, summary: Mapping[str, Any] | None, failed: bool = False) -> None:
        """The current run finished (``failed``: it did not); keep its final figures."""
        with self.changed:
            run = self._current()
            if run.status in ("done", "failed") and summary is None:
                return
            run.status = "failed" if failed else "done"
            if run.ended is None:
                run.ended = self.clock()
            if summary is not None:
                run.summary = dict(summary)
            for row in run.ranks.values():
                if failed and row.state in (WAITING, "started", "training"):
                    row.state = "stopped"
            self._bump()

    def close(self) -> None:
        """No more events will come: wake the event streams so they can end."""
        with self.changed:
            self.closed = True
            self._bump()

    # ------------------------------------------------------------------ reading

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest chart point (0 when there is none)."""
        with self.changed:
            return len(self.points)

    def view(self, since: int = 0) -> dict[str, Any]:
        """Everything the page shows, with the chart points newer than ``since``
        (0: all of them; the page starts over when it gets ``since == 0``)."""
        with self.changed:
            now = self.clock()
            return {
                "title": self.title, "version": self.version, "since": since,
                "rate_window_s": RATE_WINDOW_S, "rate_min_span_s": RATE_MIN_SPAN_S,
                "seq": len(self.points), "closed": self.closed,
                "runs": [run.as_json(now) for run in self.runs],
                # A run that has ended has no heartbeats to age: its rows show none.
                "ranks": [row.as_json(now if run.ended is None else None) for run in self.runs
                          for row in (run.ranks[r] for r in sorted(run.ranks))],
                "hosts": [{"run": index, **{k: _finite(v) for k, v in host.as_json().items()}}
                          for index, run in enumerate(self.runs)
                          for host in run.health.hosts()],
                "points": self.points[since:],
            }

    def wait_for_change(self, version: int, timeout: float) -> int:
        """Block until the version differs from ``version`` (or ``timeout`` seconds pass);
        return the version now."""
        with self.changed:
            self.changed.wait_for(lambda: self.version != version, timeout=timeout)
            return self.version
