"""The live dashboard: what a person watches while a run trains, here or across hosts.

It consumes metric events (``exogym.report.metrics``: the dicts of ``trainer.history``
and of the launcher's ``on_event``) and shows one row per rank — host, status,
step, training loss, validation loss and accuracy (when the task scores one),
samples per second, bytes sent, seconds since the rank last reported — plus
the run's totals, and the time left in the title: the steps to go over each
rank's recent step rate (its last :data:`RATE_WINDOW_S` seconds), so it
follows a run that speeds up or slows down. Once the ranks report their link
and host (``link`` and ``system`` events), a second table shows each host at a
glance (:mod:`exogym.report.health`): link rate, share of the collective in
flight done, share of the steps spent waiting on the network, CPU, the ranks'
memory and what the host has left, GPU; a host low on memory is marked there,
and told once in a line. On a terminal the tables redraw in place
(``rich.live``); elsewhere (CI, pipes, log files) it prints plain log lines
instead: a rank's start and end, and every ``log_every`` steps. At the end, a
summary table: each rank's final figures and the run's.

It is an ``exogym.report.summary.ProgressSink``, so a local simulation feeds it with
``Trainer.fit(progress=dashboard)``; for a multi-host run the launcher's
``on_event`` and ``on_output`` feed it. Imports no torch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from exogym.base.plural import plural
from exogym.base.terminal import output_console
from exogym.report.health import HealthBoard, HostHealth, LowMemoryNotice, gib, memory_line
from exogym.report.summary import (
    VAL_ACCURACY_COLUMN,
    balance_table,
    hand_over_line,
    human_bytes,
    label_table,
    summarize,
)

from ..launch.faults import FaultLog, describe_fault_event

#: Status of a rank that has not reported yet.
WAITING = "waiting"
#: Seconds of recent steps the time left is estimated from.
RATE_WINDOW_S = 30.0
#: The states of a host that comes and goes (``min_nodes``), shown in the table only.
MEMBERSHIP_STATES = ("lost", "rejoining", "training")
STATUS_STYLES = {WAITING: "dim", "started": "cyan", "training": "green", "done": "bold green",
                 "failed": "bold red", "stopped": "yellow", "lost": "bold red",
                 "rejoining": "magenta"}


@dataclass
class RankState:
    """What the dashboard knows about one rank.

    Args:
        rank: the rank.
        host: where it runs (``local`` in a simulation).
        status: ``waiting``, ``started``, ``training``, ``done``, ``failed`` or ``stopped``;
            where hosts come and go (``min_nodes``), also ``lost`` and ``rejoining``.
        step: its last reported step.
        max_steps: the steps it will run, once it has said.
        train_loss: training loss of its last step.
        val_loss: its last validation loss (of the averaged model when known).
        val_accuracy: its last validation accuracy, for a task that scores one.
        samples: samples it has trained on.
        wall_s: seconds it has trained (its own clock).
        comm_bytes: bytes it has sent through the collectives.
        last_seen: this process's clock when it last reported, or None.
        started_at: this process's clock at its start event, or None.
        recent: ``(clock, step)`` of its recent step events, for the step rate.
        share: its share of the work under ``balance`` (``batch 21``, ``12 steps/round``),
            or the global version it trains from under asynchronous DiLoCo (``v12 at 0.50x``:
            its measured speed relative to the fastest rank).
    """

    rank: int
    host: str
    status: str = WAITING
    step: int = 0
    max_steps: int | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    val_accuracy: float | None = None
    samples: int = 0
    wall_s: float = 0.0
    comm_bytes: int = 0
    last_seen: float | None = None
    started_at: float | None = None
    share: str | None = None
    #: The line last logged for this rank: the same step is never told twice (a rank that
    #: stops reports its last step again).
    told: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    recent: deque[tuple[float, int]] = field(default_factory=deque)

    def seconds_left(self) -> float | None:
        """Seconds until its last step at its recent step rate; 0 once done, None while
        unknown (no step count to reach, or fewer than two recent steps)."""
        if self.status == "done":
            return 0.0
        if not self.max_steps or len(self.recent) < 2:
            return None
        (t0, s0), (t1, s1) = self.recent[0], self.recent[-1]
        if t1 <= t0 or s1 <= s0:
            return None
        return max(0, int(self.max_steps) - self.step) * (t1 - t0) / (s1 - s0)

    @property
    def samples_per_s(self) -> float | None:
        """Samples per second since the rank started training."""
        return self.samples / self.wall_s if self.wall_s > 0 else None

    @property
    def label(self) -> str:
        """``[host:rank]``, as the launcher prefixes a rank's lines."""
        return f"[{self.host}:{self.rank}]"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def human_duration(seconds: float | None) -> str:
    """42.3 -> '42 s', 125 -> '2 min 5 s', 7300 -> '2 h 1 min', 0.3 -> '<1 s'; None -> '-'."""
    if seconds is None:
        return "-"
    if 0 < seconds < 0.5:
        return "<1 s"
    total = int(round(seconds))
    if total < 60:
        return f"{total} s"
    if total < 3600:
        return f"{total // 60} min {total % 60} s"
    return f"{total // 3600} h {total % 3600 // 60} min"


#: The live table's columns a narrow terminal drops first, in order; the rest always stay.
DROPPED_FIRST = ("last report", "samples/s", "share", "version", "val acc", "sent")
#: The hosts table's columns a narrow terminal drops first, in order.
HOST_COLUMNS_DROPPED_FIRST = ("GPU memory", "ranks' memory", "GPU", "waiting", "sync")


def fitting_columns(names: list[str], rows: list[list[Any]], width: int,
                    dropped_first: Sequence[str] = DROPPED_FIRST) -> list[int]:
    """The indices of ``names`` to show in ``width`` columns: every column while the table
    fits, else without those of ``dropped_first``, one by one, so that no cell is cut."""
    def need(i: int) -> int:
        cells = [len(str(row[i])) for row in rows]
        return max([len(names[i]), *cells]) + 3  # a cell's padding and its border

    kept = list(range(len(names)))
    for name in dropped_first:
        if sum(need(i) for i in kept) + 1 <= width:
            break
        kept = [i for i in kept if names[i] != name]
    return kept


class Dashboard:
    """A run's live view and final summary, fed with metric events.

    Args:
        num_ranks: ranks expected (rows are shown for them before they report).
        hosts: the host of each rank (a sequence in rank order or a mapping);
            events carrying ``host`` override it. Default ``local``.
        title: the table's title.
        console: where to draw (default: standard output).
        live: redraw in place (True) or print plain lines (False); default:
            in place exactly when ``console`` is a terminal that can move the cursor.
        log_every: steps between plain log lines per rank; default a tenth of
            the run's steps.
        refresh_per_second: redraws per second of the live table.
        show_summary: print the summary table in ``finish`` (off when the caller
            prints its own, e.g. a comparison of several runs).
        clock: the time source (seconds), for "seconds since last report".
    """

    def __init__(self, num_ranks: int | None = None,
                 hosts: Sequence[str] | Mapping[int, str] | None = None, *,
                 title: str = "training", console: Console | None = None,
                 live: bool | None = None, log_every: int | None = None,
                 refresh_per_second: float = 4.0, show_summary: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console or output_console()
        self.title = title
        self.live_mode = (self.console.is_terminal and not self.console.is_dumb_terminal
                          if live is None else bool(live))
        self.log_every = log_every
        self.refresh_per_second = refresh_per_second
        self.show_summary = show_summary
        self.clock = clock
        self.versions = False  # some rank reports the global version it trains from
        self.history: list[dict[str, Any]] = []
        self.labels: dict[int, list[int]] = {}  # rank -> samples per label (non-iid partition)
        #: Every change of membership (hosts that came and went): step, ranks, hosts, reason.
        self.membership: list[dict[str, Any]] = []
        #: The faults injected into the run (``--inject``), from their events.
        self.faults = FaultLog()
        #: Each host's link and health (``link``, ``system`` and ``step`` events).
        self.health = HealthBoard()
        self.low_memory = LowMemoryNotice()
        self.ranks: dict[int, RankState] = {}
        self._host_of = dict(enumerate(hosts)) if isinstance(hosts, Sequence) else dict(hosts or {})
        for rank in range(num_ranks or 0):
            self._state(rank)
        for rank in self._host_of:
            self._state(rank)
        self._lock = threading.RLock()
        self._live_lock = threading.Lock()
        self._live: Live | None = None
        self._closed = False
        self._started: float | None = None  # the clock at the first event: the run's start

    # ------------------------------------------------------------------ feeding

    def _state(self, rank: int, host: str | None = None) -> RankState:
        state = self.ranks.get(rank)
        if state is None:
            state = RankState(rank, host or self._host_of.get(rank, "local"))
            self.ranks[rank] = state
        elif host:
            state.host = host
        return state

    def on_event(self, event: dict[str, Any]) -> None:
        """Take one metric event (``start``, ``step``, ``done``, ``hand_over``, ``link``,
        ``system``; from the launcher of a run whose hosts come and go, ``host`` and
        ``membership``; others are ignored)."""
        kind = event.get("event", "step")
        if kind in ("link", "system", "step") and isinstance(event.get("rank"), int):
            with self._lock:
                state = self._state(int(event["rank"]), event.get("host"))
                if kind != "step":
                    state.last_seen = self.clock()  # a rank in a long collective still reports
                self.health.on_event(event, state.host)
            # A host's event relayed by the launcher carries its host, and the launcher
            # tells the line itself; a simulation's is told here.
            line = None if "host" in event else self.low_memory.check(event)
            if line is not None:
                self.console.print(line, style="bold red", markup=False, highlight=False,
                                   soft_wrap=True)
            if kind != "step":
                self._ensure_live()
                return
        if kind == "host" and "rank" in event:
            self.set_status(int(event["rank"]), str(event["state"]))
            return
        if kind == "fault" and event.get("injected"):
            with self._lock:
                self.faults.add(event)
            self._log(describe_fault_event(event))
            return
        if kind == "hand_over":
            line = hand_over_line(event)
            if line:
                self._log(line)
            return
        if kind == "membership":  # told by the launcher, once (distributed.launch)
            self.membership.append({k: event[k] for k in ("step", "ranks", "hosts", "reason")})
            return
        if "rank" not in event or kind not in ("start", "step", "done"):
            return
        with self._lock:
            line = self._apply(kind, event)
        self._ensure_live()
        if line is not None:
            self._log(line)

    def _apply(self, kind: str, event: dict[str, Any]) -> str | None:
        """Update the rank's state; the plain log line this event deserves, if any."""
        now = self.clock()
        if self._started is None:
            self._started = now
        state = self._state(int(event["rank"]), event.get("host"))
        state.last_seen = now
        if kind == "start":
            state.started_at = now
            state.max_steps = event.get("max_steps", state.max_steps)
            if event.get("joining"):
                # A process started again to rejoin: its step comes with the state a member
                # hands it, and the membership change that admits it is what is told.
                return None
            state.status = "started"
            state.step = int(event.get("step") or 0)
            if "labels" in event:
                self.labels[state.rank] = list(event["labels"])
            if self.log_every is None and state.max_steps:
                self.log_every = max(1, int(state.max_steps) // 10)
            resumed = f" from step {state.step}" if state.step else ""
            steps = f", {plural(state.max_steps, 'step')}" if state.max_steps else ""
            return f"{state.label} started{resumed}{steps}"
        if kind == "done":
            state.status = "done"
            state.step = int(event.get("step", state.step))
            state.comm_bytes = int(event.get("comm_bytes", state.comm_bytes))
            return f"{state.label} done at step {state.step}, sent {human_bytes(state.comm_bytes)}"
        self.history.append({k: v for k, v in event.items() if k != "event"})
        state.status = "training"
        state.step = int(event["step"])
        state.train_loss = event.get("train_loss", state.train_loss)
        state.samples = int(event.get("samples", state.samples))
        state.wall_s = float(event.get("wall_s", state.wall_s))
        state.comm_bytes = int(event.get("comm_bytes", state.comm_bytes))
        if "batch_size" in event:  # balance='batch' (exogym.run.balance)
            state.share = f"batch {event['batch_size']}"
        elif "inner_steps" in event:  # balance='steps'
            state.share = f"{event['inner_steps']} steps/round"
        elif "version" in event:  # asynchronous DiLoCo: the global version it trains from
            speed = event.get("measured_speed")
            state.share = f"v{event['version']}" + (f" at {speed:.2f}x" if speed else "")
            self.versions = True
        state.recent.append((now, state.step))
        while len(state.recent) > 2 and now - state.recent[0][0] > RATE_WINDOW_S:
            state.recent.popleft()
        val = event.get("val_global_loss", event.get("val_loss"))
        if val is not None:
            state.val_loss = val
        if event.get("val_accuracy") is not None:
            state.val_accuracy = float(event["val_accuracy"])
        every = self.log_every or 10
        if state.step % every == 0 or state.step == state.max_steps or val is not None:
            line = self._step_line(state, val)
            if line == state.told:
                return None
            state.told = line
            return line
        return None

    def on_output(self, line: Any) -> None:
        """Show a line a rank printed (a launcher ``OutputLine`` or text) above the table."""
        self.console.print(str(line), markup=False, highlight=False, soft_wrap=True,
                           style="dim" if getattr(line, "stream", "") == "stderr" else None)

    def set_status(self, rank: int, status: str) -> None:
        """Mark a rank's state (``done``, ``failed``, ``stopped``, ``lost``, ``rejoining``,
        ``training``), e.g. from the launcher. The states of hosts that come and go are
        shown in the table only: the membership change is what is told of them, once,
        at its step (a lost rank's last step seen is not the step the others went on
        without it)."""
        line = None
        with self._lock:
            state = self._state(rank)
            if state.status != status:
                state.status = status
                if status not in ("done", *MEMBERSHIP_STATES):
                    line = f"{state.label} {status} at step {state.step}"
        if line is not None:
            self._log(line)

    # ------------------------------------------------------------------ drawing

    def _step_line(self, state: RankState, val: float | None) -> str:
        total = f"/{state.max_steps}" if state.max_steps else ""
        parts = [f"{state.label} step {state.step}{total}",
                 f"loss {_fmt(state.train_loss, '.4f')}"]
        if val is not None:
            parts.append(f"val {val:.4f}")
            if state.val_accuracy is not None:
                parts.append(f"acc {state.val_accuracy:.1%}")
        parts.append(f"{_fmt(state.samples_per_s, '.1f')} samples/s")
        parts.append(f"sent {human_bytes(state.comm_bytes)}")
        left = state.seconds_left()
        if left is not None and left >= 1:  # under a second, a log line has nothing to say
            parts.append(f"ETA {human_duration(left)}")
        return " | ".join(parts)

    def _log(self, text: str) -> None:
        if not self.live_mode:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    # Locking: the state lock is never held while printing or while starting or
    # stopping the live display, because rich's refresh thread takes its own lock
    # and then calls render(), which takes the state lock.

    def _ensure_live(self) -> None:
        if not self.live_mode or self._live is not None or self._closed:
            return
        with self._live_lock:
            if self._live is None and not self._closed:
                live = Live(console=self.console, get_renderable=self.frame,
                            refresh_per_second=self.refresh_per_second, transient=False,
                            redirect_stdout=False, redirect_stderr=False)
                live.start()
                self._live = live

    def start(self) -> None:
        """Show the table now, before the first event (it also starts on the first event)."""
        self._ensure_live()

    def frame(self) -> Table | Group:
        """What the live display draws: the ranks' table, and the hosts' once they report."""
        hosts = self.hosts_table()
        return self.render() if hosts is None else Group(self.render(), hosts)

    def hosts_table(self) -> Table | None:
        """A row per host: link rate, sync done, waiting share, CPU, memory, GPU (None
        until a rank has reported its link or host)."""
        with self._lock:
            if not self.health.reporting:
                return None
            hosts = self.health.hosts()
        gpu = any(h.gpu_bytes is not None or h.gpu_percent is not None for h in hosts)
        names = ["host", "link", "sync", "waiting", "CPU", "ranks' memory", "available",
                 *(("GPU", "GPU memory") if gpu else ())]
        rows = [host_row(h, gpu) for h in hosts]
        low = [memory_line(h.host, h.available_bytes, h.total_bytes) for h in hosts
               if h.low_memory and h.available_bytes is not None and h.total_bytes is not None]
        table = Table(title="hosts", title_justify="left", expand=False,
                      caption="; ".join(low) or None, caption_justify="left",
                      caption_style="bold red")
        kept = fitting_columns(names, rows, self.console.width, HOST_COLUMNS_DROPPED_FIRST)
        for i in kept:
            table.add_column(names[i], justify="left" if names[i] == "host" else "right",
                             no_wrap=True)
        for h, row in zip(hosts, rows):
            table.add_row(*(row[i] for i in kept), style="bold red" if h.low_memory else None)
        return table

    def render(self) -> Table:
        """The table as it stands: a row per rank and a totals row."""
        with self._lock:
            now = self.clock()
            elapsed = 0.0 if self._started is None else now - self._started
            states = [self.ranks[r] for r in sorted(self.ranks)]
            lefts = [s.seconds_left() for s in states]
            # the run ends with its slowest rank; unknown until every rank has a rate
            left = ("" if not states or None in lefts
                    else ", done" if max(lefts) == 0
                    else f", about {human_duration(max(lefts))} left")
            active = self.faults.active()
            caption = None
            if self.faults:
                caption = f"injected faults: {len(self.faults.entries())}" + (
                    "; under way: " + ", ".join(f"{f['what']} on {f['host']}" for f in active)
                    if active else "")
            table = Table(title=f"{self.title}  ({elapsed:.0f} s{left})",
                          title_justify="left", expand=False, caption=caption,
                          caption_justify="left", caption_style="magenta")
            accuracy = any(s.val_accuracy is not None for s in states)
            shares = any(s.share is not None for s in states)
            names = ["rank", "host", "status", "step", "loss", "val loss",
                     *(("val acc",) if accuracy else ()), "samples/s",
                     *(("version" if self.versions else "share",) if shares else ()),
                     "sent", "last report"]
            rows: list[list[Any]] = []
            for s in states:
                step = f"{s.step}/{s.max_steps}" if s.max_steps else str(s.step)
                ago = "-" if s.last_seen is None else f"{now - s.last_seen:.1f} s ago"
                rows.append([str(s.rank), s.host,
                             Text(s.status, STATUS_STYLES.get(s.status, "")),
                             step, _fmt(s.train_loss, ".4f"), _fmt(s.val_loss, ".4f"),
                             *((_fmt(s.val_accuracy, ".1%"),) if accuracy else ()),
                             _fmt(s.samples_per_s, ".1f"), *((s.share or "-",) if shares else ()),
                             human_bytes(s.comm_bytes), ago])
            total: list[Any] = []
            if states:
                reported = [s for s in states if s.train_loss is not None]
                rates = [s.samples_per_s for s in states if s.samples_per_s is not None]
                seen = [s.last_seen for s in states if s.last_seen is not None]
                finished = sum(s.status == "done" for s in states)
                steps = [s.step for s in states]
                total = [
                    "all", plural(len(states), "rank"), f"{finished}/{len(states)} done",
                    f"{min(steps)}" if min(steps) == max(steps) else f"{min(steps)}-{max(steps)}",
                    _fmt(sum(s.train_loss for s in reported) / len(reported) if reported
                         else None, ".4f"),
                    "", *(("",) if accuracy else ()), _fmt(sum(rates) if rates else None, ".1f"),
                    *(("",) if shares else ()),
                    human_bytes(sum(s.comm_bytes for s in states)),
                    "-" if not seen else f"{now - max(seen):.1f} s ago"]
            kept = fitting_columns(names, rows + ([total] if total else []),
                                   self.console.width)
            for i in kept:
                name = names[i]
                table.add_column(name, justify="left" if name in ("host", "status") else "right",
                                 no_wrap=True)
            for row in rows:
                table.add_row(*(row[i] for i in kept))
            if total:
                table.add_section()
                table.add_row(*(total[i] for i in kept), style="bold")
            return table

    # ------------------------------------------------------------------ the end

    def close(self) -> None:
        """Stop redrawing, leaving the last frame on screen (idempotent)."""
        with self._live_lock:
            self._closed = True
            live, self._live = self._live, None
        if live is not None:
            live.stop()  # draws the final frame

    def summary(self, wall_s: float | None = None) -> dict[str, Any]:
        """The run's final figures from the events seen (``exogym.report.summary.summarize``)."""
        with self._lock:
            if wall_s is None:
                wall_s = 0.0 if self._started is None else self.clock() - self._started
            summary = summarize(sorted(self.history, key=lambda r: (r["step"], r["rank"])),
                                max(1, len(self.ranks)), wall_s, self.labels)
            if self.membership:
                summary["membership"] = list(self.membership)
            if self.faults:
                summary["faults"] = self.faults.entries()
            return summary

    def summary_table(self, summary: Mapping[str, Any], title: str = "run summary") -> Group:
        """Each rank's final figures, then the run's (as ``exogym.report.summary`` names them).

        The run's nodes, steps, train loss and bytes per node are computed from the rank
        rows above them, so the two tables cannot disagree; validation, speed and wall
        time come from ``summary``.
        """
        with self._lock:
            ranks = Table(title=title, title_justify="left")
            for name in ("rank", "host", "status", "steps", "train loss", "samples/s", "sent"):
                ranks.add_column(name, justify="left" if name in ("host", "status") else "right")
            states = [self.ranks[r] for r in sorted(self.ranks)]
            for s in states:
                ranks.add_row(str(s.rank), s.host, s.status, str(s.step),
                              _fmt(s.train_loss, ".4f"), _fmt(s.samples_per_s, ".1f"),
                              human_bytes(s.comm_bytes))
            if states:
                losses = [s.train_loss for s in states if s.train_loss is not None]
                summary = {**summary, "num_nodes": len(states),
                           "steps": max(s.step for s in states),
                           "final_train_loss": sum(losses) / len(losses) if losses else None,
                           "bytes_per_node": sum(s.comm_bytes for s in states) / len(states)}
        run = Table(show_header=True)
        accuracy = summary.get("final_val_accuracy")
        for name in ("nodes", "steps", "train loss", "val loss (avg model)",
                     *((VAL_ACCURACY_COLUMN,) if accuracy is not None else ()), "steps/s",
                     "sent per node", "wall"):
            run.add_column(name, justify="right")
        val = summary.get("final_val_global_loss", summary.get("final_val_loss"))
        run.add_row(str(summary.get("num_nodes", len(self.ranks))), str(summary.get("steps", 0)),
                    _fmt(summary.get("final_train_loss"), ".4f"), _fmt(val, ".4f"),
                    *((_fmt(accuracy, ".1%"),) if accuracy is not None else ()),
                    _fmt(summary.get("steps_per_s"), ".1f"),
                    human_bytes(summary.get("bytes_per_node") or 0),
                    f"{summary.get('wall_s', 0.0):.1f} s")
        return Group(ranks, run)

    def finish(self, summary: Mapping[str, Any] | None = None, title: str = "run summary") -> None:
        """Stop redrawing and print the summary table (``summary``: default from the events)."""
        self.close()
        if self.show_summary:
            summary = summary or self.summary()
            self.console.print(self.summary_table(summary, title))
            if summary.get("balance"):
                self.console.print(balance_table(summary["balance"]))
            # The membership changes were told as they happened; the goodput's lines give
            # what each cost.
            if summary.get("faults"):
                self.console.print(fault_table(summary["faults"]))
            if summary.get("label_histogram"):
                self.console.print(label_table(summary["label_histogram"]))

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def mbit(bits_per_s: float | None) -> str:
    """A link rate as the hosts table shows it: ``'38.2 Mbit/s'``; None -> ``'-'``."""
    if bits_per_s is None:
        return "-"
    if bits_per_s >= 1e9:
        return f"{bits_per_s / 1e9:.2f} Gbit/s"
    return f"{bits_per_s / 1e6:.1f} Mbit/s"


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def host_row(h: HostHealth, gpu: bool) -> list[str]:
    """The hosts table's cells for one host (with the GPU's when ``gpu``)."""
    available = "-" if h.available_bytes is None else (
        gib(h.available_bytes) if h.total_bytes is None
        else f"{gib(h.available_bytes)} of {gib(h.total_bytes)}")
    if h.low_memory:
        available += " LOW"
    row = [h.host, mbit(h.link_bps), "idle" if h.sync_done is None else _percent(h.sync_done),
           _percent(h.waiting), "-" if h.cpu_percent is None else f"{h.cpu_percent:.0f}%",
           "-" if h.rss_bytes is None else gib(h.rss_bytes), available]
    if gpu:
        used = "-" if h.gpu_bytes is None else (
            gib(h.gpu_bytes) if h.gpu_total_bytes is None
            else f"{gib(h.gpu_bytes)} of {gib(h.gpu_total_bytes)}")
        row += ["-" if h.gpu_percent is None else f"{h.gpu_percent:.0f}%", used]
    return row


def fault_table(faults: Sequence[Mapping[str, Any]]) -> Table:
    """The faults injected into a run (``summary["faults"]``), one row each."""
    table = Table(title="injected faults", title_justify="left")
    for name in ("#", "fault", "host", "ranks", "fired at", "ended at", "outcome"):
        table.add_column(name, justify="right" if name == "#" else "left")

    def moment(step: Any, at_s: Any) -> str:
        if step is None and at_s is None:
            return "-"
        return ", ".join(p for p in (f"step {step}" if step is not None else "",
                                     f"{at_s:.1f} s" if at_s is not None else "") if p)

    for f in faults:
        what = str(f.get("what"))
        if f.get("factor"):
            what += f" x{f['factor']:g}"
        if f.get("duration_s") is not None:
            what += f" +{f['duration_s']:g}s"
        if f.get("random"):
            what += " (random)"
        outcome = f.get("outcome") or f.get("state") or "-"
        if f.get("reason"):
            outcome += f": {f['reason']}"
        if f.get("error"):
            outcome += f": {f['error']}"
        table.add_row(str(f.get("id")), what, str(f.get("host")),
                      ", ".join(map(str, f.get("ranks") or [])),
                      moment(f.get("fired_step"), f.get("fired_at_s")),
                      moment(f.get("ended_step"), f.get("ended_at_s")), outcome)
    return table
