"""What a person sees during and after a run: a progress bar, then a summary table.

On a terminal, a rich progress bar follows the slowest rank with the mean
training loss and the learning rate. Elsewhere (CI, pipes, log files) a plain
line is printed every ``log_interval`` steps instead. At the end a short table
gives the final losses (and validation accuracy, for a task that scores
one), steps per second and bytes sent per node.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol, runtime_checkable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from exogym.base.plural import plural
from exogym.base.terminal import output_console
from exogym.report.health import LowMemoryNotice

#: The summary's column for ``final_val_accuracy``: rank 0's own model, scored on the
#: validation set (the loss column beside it is the averaged model's).
VAL_ACCURACY_COLUMN = "val acc (rank 0)"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def summarize(history: list[dict[str, Any]], num_nodes: int, wall_s: float,
              labels: dict[int, list[int]] | None = None) -> dict[str, Any]:
    """Final figures of a run from its history.

    ``labels`` (rank -> count of each label in its training part, from the ranks'
    start events under a non-iid ``partition``) becomes ``label_histogram``.
    """
    last: dict[int, dict[str, Any]] = {}
    last_eval: dict[str, Any] | None = None
    for row in history:
        last[row["rank"]] = row
        # the latest evaluation, of the lowest rank that ran it (rows come sorted by step, rank)
        if "val_loss" in row and (last_eval is None or row["step"] > last_eval["step"]):
            last_eval = row
    steps = max((r["step"] for r in last.values()), default=0)
    finishers = [r for r in last.values() if r["step"] == steps]  # not ranks that left early
    train_wall = max((r.get("wall_s", 0.0) for r in last.values()), default=0.0)
    summary: dict[str, Any] = {
        "steps": steps,
        "num_nodes": num_nodes,
        "final_train_loss": (sum(r["train_loss"] for r in finishers) / len(finishers)
                             if finishers else None),
        "steps_per_s": steps / train_wall if train_wall > 0 else None,
        "bytes_per_node": (sum(r["comm_bytes"] for r in last.values()) / len(last)
                           if last else 0),
        "wall_s": wall_s,
        # the ranks' training loops alone (the slowest rank's): no process start, no set-up
        "train_s": train_wall,
    }
    clocks = [r["sim_time_s"] for r in last.values() if r.get("sim_time_s") is not None]
    if clocks:
        # the simulated end of the run: when its slowest rank finished
        summary["sim_time_s"] = max(clocks)
        summary["sim_time_per_step_s"] = max(clocks) / steps if steps else None
    if labels:
        summary["label_histogram"] = {str(rank): list(labels[rank]) for rank in sorted(labels)}
    balance = balance_summary(history)
    if balance is not None:
        summary["balance"] = balance
    merges = merges_summary(history)
    if merges is not None:
        summary["merges"] = merges
    if last_eval is not None:
        summary["final_val_loss"] = last_eval["val_loss"]
        summary["final_val_global_loss"] = last_eval.get("val_global_loss")
        for key, value in last_eval.items():  # extra metrics, e.g. val_accuracy, val_wer
            if key.startswith("val_") and key not in ("val_loss", "val_global_loss"):
                summary[f"final_{key}"] = value
    return summary


def balance_summary(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``summary['balance']`` from a run's step rows (sorted by step, then rank); None when
    the run was not balanced (``fit(balance=...)``, :mod:`exogym.run.balance`).

    ``{"mode": "batch" | "steps", "ranks": [{"rank", "speed", "batch_size" | "inner_steps",
    "share", "samples"}], "changes": [{"step", "shares", "speeds"}]}``: each rank's final
    share (``speed``: measured, relative to the fastest rank; ``share``: its part of the
    sum of the shares; ``samples``: what it trained in the run), and each step from which
    the shares were new.
    """
    key = next((k for k in ("batch_size", "inner_steps") if any(k in row for row in history)),
               None)
    if key is None:
        return None
    last: dict[int, dict[str, Any]] = {}
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    for row in history:
        if key in row:
            last[row["rank"]] = row
            by_step.setdefault(row["step"], {})[row["rank"]] = row
    changes: list[dict[str, Any]] = []
    previous = None
    for step in sorted(by_step):
        rows = [by_step[step][rank] for rank in sorted(by_step[step])]
        shares = [row[key] for row in rows]
        if shares != previous:
            changes.append({"step": step, "shares": shares,
                            "speeds": [row.get("measured_speed") for row in rows]})
            previous = shares
    total = sum(row[key] for row in last.values()) or 1
    ranks = [{"rank": rank, "speed": row.get("measured_speed"), key: row[key],
              "share": row[key] / total, "samples": row.get("samples")}
             for rank, row in sorted(last.items())]
    return {"mode": "batch" if key == "batch_size" else "steps", "ranks": ranks,
            "changes": changes}


def merges_summary(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``summary['merges']`` of an asynchronous run (:mod:`exogym.strategy.async_diloco`):
    None when no step row reports a merge.

    ``{"versions", "merged", "steps", "dropped", "dropped_steps", "dropped_tokens",
    "staleness_max", "staleness_mean", "rounds": [{"version", "step", "contributors",
    "steps", "tokens", "staleness", "dropped", "dropped_steps", "dropped_tokens"}, ...],
    "ranks": [{"rank", "version", "contributed"}]}``: every merge in order (a rank that
    left mid-round shows under ``left`` of the next merge, its steps among the dropped
    ones), and the version each rank trained from at its last step (None where the
    history holds none of its steps: a host sees only its own). ``steps`` merged plus
    ``dropped_steps`` is every step the ranks trained.
    """
    rounds = [row["merge"] for row in history if row.get("merge")]
    if not rounds:
        return None
    staleness = [s for merge in rounds for s in merge["staleness"]]
    left = [gone for merge in rounds for gone in merge.get("left", [])]
    contributed: dict[int, int] = {}
    for merge in rounds:
        for rank in merge["contributors"]:
            contributed[rank] = contributed.get(rank, 0) + 1
    last: dict[int, dict[str, Any]] = {}
    for row in history:
        if "version" in row:
            last[row["rank"]] = row
    return {
        "versions": max(merge["version"] for merge in rounds),
        "merged": sum(len(merge["contributors"]) for merge in rounds),
        "dropped": sum(len(merge["dropped"]) for merge in rounds) + len(left),
        "steps": sum(merge["steps"] for merge in rounds),
        "dropped_steps": (sum(merge["dropped_steps"] for merge in rounds)
                          + sum(gone["steps"] for gone in left)),
        "dropped_tokens": (sum(merge["dropped_tokens"] for merge in rounds)
                           + sum(gone["tokens"] for gone in left)),
        "staleness_max": max(staleness, default=0),
        "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "rounds": rounds,
        "ranks": [{"rank": rank,
                   "version": last[rank]["version"] if rank in last else None,
                   "contributed": contributed.get(rank, 0)}
                  for rank in sorted(set(last) | set(contributed))],
    }


class MergeLog:
    """The merges of an asynchronous run across hosts, gathered from every rank's step
    events as the launcher receives them: ``summary['merges']``
    (:func:`merges_summary`) in full, where the rank that writes ``summary.json`` holds
    only its own history. Each merge comes in the step event of the lowest rank present
    at it, so a run whose ranks came and went has merges in several ranks' histories."""

    def __init__(self) -> None:
        self._merges: list[dict[str, Any]] = []
        self._last: dict[int, dict[str, Any]] = {}

    def on_event(self, event: dict[str, Any]) -> None:
        """Take one metric event (only step events count)."""
        if event.get("event") != "step":
            return
        if event.get("merge"):
            self._merges.append({"merge": event["merge"]})
        if "version" in event:
            self._last[int(event["rank"])] = {"rank": int(event["rank"]),
                                              "version": event["version"]}

    def merges(self) -> dict[str, Any] | None:
        """``summary['merges']`` from every rank's events (None: no merge was reported)."""
        return merges_summary([*self._merges, *self._last.values()])


def balance_table(balance: dict[str, Any]) -> Table:
    """Each rank's final share under ``balance`` (``summary['balance']``)."""
    key = "batch_size" if balance["mode"] == "batch" else "inner_steps"
    table = Table(title=f"balance={balance['mode']}: each rank's share "
                        f"({plural(len(balance['changes']), 'setting')} over the run)")
    for column in ("rank", "measured speed", key.replace("_", " ") +
                   (" per round" if key == "inner_steps" else ""), "share", "samples trained"):
        table.add_column(column, justify="right")
    for rank in balance["ranks"]:
        speed = rank.get("speed")
        table.add_row(str(rank["rank"]), "-" if speed is None else f"{speed:.2f}",
                      str(rank[key]), f"{rank['share']:.1%}",
                      "-" if rank.get("samples") is None else str(rank["samples"]))
    return table


_TIME_WORDS = {"simulated": "simulated time", "wall": "wall time"}


def goodput_line(goodput: dict[str, Any]) -> str | None:
    """``summary['goodput']`` in one line, saying what its figures mean.

    Goodput (the share of what the hosts could have trained while up that reached the
    final model) measures what faults and membership changes cost, so the fraction is
    given only for a run that had some (``goodput['ranks']`` present), with where the rest
    of the hosts' time went. A run without any has nothing lost to them: its line says how
    the hosts spent their time (computing, in collectives, idle) and how many trained
    samples reached the final model, never a "goodput" that would read as work lost.
    Where no time is measured (``goodput`` None, ``note`` says why): for a run whose ranks
    came and went, the samples that reached the final model of those trained; otherwise
    nothing (None)."""
    value = goodput.get("goodput")
    useful = goodput.get("useful_samples", 0)
    trained = goodput.get("trained_samples", useful)
    faulted = bool(goodput.get("ranks"))
    if value is None:
        if not faulted:  # nobody came or went, and no time to say anything in
            return None
        return (f"goodput not measured: {goodput.get('note') or 'no time to measure it in'}; "
                f"{useful} of {trained} trained samples reached the final model "
                f"({trained - useful} dropped)")
    time_words = _TIME_WORDS.get(goodput.get("time"), goodput.get("time"))
    lost = goodput.get("lost") or {}
    if not faulted:
        computing = max(0.0, 1.0 - lost.get("collectives", 0.0) - lost.get("idle", 0.0))
        reached = (f"all {trained} trained samples" if useful == trained
                   else f"{useful} of {trained} trained samples")
        return (f"the hosts' time ({time_words}): {computing:.1%} computing, "
                f"{lost.get('collectives', 0.0):.1%} in collectives, "
                f"{lost.get('idle', 0.0):.1%} idle; {reached} reached the final model "
                "(no faults and no membership changes: no goodput to measure)")
    line = (f"goodput {value:.1%}: of the {goodput.get('possible_samples', 0.0):.0f} samples "
            f"the hosts could have trained while up (each at its own speed, in "
            f"{time_words}), {useful} reached the final model")
    parts = [f"{share:.1%} {where}" for where, share in
             (("in collectives", lost.get("collectives", 0.0)), ("idle", lost.get("idle", 0.0)),
              ("on dropped work", lost.get("dropped", 0.0))) if share >= 0.0005]
    if parts:
        line += "; the rest of their time went " + ", ".join(parts)
    line += (f"; {goodput['dropped_samples']} trained samples dropped, hosts down "
             f"{goodput.get('down_s', 0.0):.1f} s in all")
    return line


def goodput_table(goodput: dict[str, Any]) -> Table:
    """Each host's part of the goodput (``summary['goodput']`` of a run whose ranks came
    and went): time up, down, computing, waiting in collectives and idle, its speed alone,
    and its samples trained, in the final model and dropped."""
    table = Table(title="goodput per host")
    for column in ("rank", "up", "down", "computing", "waiting", "idle", "samples/s alone",
                   "trained", "in the model", "dropped"):
        table.add_column(column, justify="right")
    for rank in goodput.get("ranks") or []:
        rate = rank.get("samples_per_s")
        table.add_row(str(rank["rank"]), f"{rank['up_s']:.1f} s", f"{rank['down_s']:.1f} s",
                      f"{rank['compute_s']:.1f} s", f"{rank['wait_s']:.1f} s",
                      f"{rank['idle_s']:.1f} s", "-" if rate is None else f"{rate:.1f}",
                      str(rank["trained"]), str(rank["useful"]), str(rank["dropped"]))
    return table


def goodput_change_lines(goodput: dict[str, Any]) -> list[str]:
    """One line per membership change: the time lost to it (where goodput has no time to
    count in, the samples dropped there)."""
    lines = []
    for change in goodput.get("changes") or []:
        if goodput.get("goodput") is None:
            if change["dropped_samples"]:
                lines.append(f"step {change['step']} ({change['reason']}): "
                             f"{change['dropped_samples']} trained samples dropped")
            continue
        parts = [f"{change['dropped_samples']} samples dropped ({change['dropped_s']:.1f} s)"]
        if change.get("rejoin_wait_s"):
            parts.append(f"{change['rejoin_wait_s']:.1f} s waiting to rejoin")
        if change.get("hand_over_s"):
            parts.append(f"{change['hand_over_s']:.1f} s handing over")
        lines.append(f"step {change['step']} ({change['reason']}): lost "
                     f"{change['lost_s']:.1f} s of host time: {', '.join(parts)}")
    return lines


def print_goodput(console: Console, goodput: dict[str, Any] | None) -> None:
    """Print ``summary['goodput']``: its line, and for a run whose ranks came and went, the
    table per host and the time lost to each membership change."""
    if not goodput:
        return
    line = goodput_line(goodput)
    if line is None:
        return
    console.print(line, markup=False, highlight=False, soft_wrap=True)
    if goodput.get("ranks"):
        if goodput.get("goodput") is not None:  # its seconds are the hosts' own
            console.print(goodput_table(goodput))
        for line in goodput_change_lines(goodput):
            console.print(line, markup=False, highlight=False, soft_wrap=True)


def label_table(histogram: dict[str, list[int]]) -> Table:
    """Each rank's training samples per label (a non-iid ``partition``)."""
    width = max(len(counts) for counts in histogram.values())
    table = Table(title="training samples per label")
    table.add_column("rank", justify="right")
    for label in range(width):
        table.add_column(str(label), justify="right")
    table.add_column("total", justify="right")
    for rank, counts in histogram.items():
        padded = list(counts) + [0] * (width - len(counts))
        table.add_row(rank, *(str(c) if c else "." for c in padded), str(sum(counts)))
    return table


@runtime_checkable
class ProgressSink(Protocol):
    """What ``Trainer.fit(progress=...)`` accepts besides True/False: any object that
    takes the run's metric events and shows them (``RunReporter`` is one; a live
    dashboard is another)."""

    def on_event(self, event: dict[str, Any]) -> None:
        """Receive one metric event (see ``exogym.report.metrics``)."""

    def close(self) -> None:
        """Stop any live display; called once the ranks have stopped, also on failure."""

    def finish(self, summary: dict[str, Any], title: str = "run summary") -> None:
        """Show the run's final figures (``summarize``'s dict); called after a success."""


def hand_over_line(event: dict[str, Any]) -> str | None:
    """The line a ``hand_over`` event is told as (by the rank that handed the state over;
    None for a joiner's own event, which would tell the same hand-over again)."""
    if event.get("rank") != event.get("source"):
        return None
    joiners = list(event.get("joiners") or [])
    ranks = ("rank " if len(joiners) == 1 else "ranks ") + ", ".join(map(str, joiners))
    return (f"step {event.get('step')}: rank {event.get('source')} handed the state to {ranks}: "
            f"{(event.get('bytes') or 0) / 2**20:.1f} MiB in {event.get('seconds') or 0:.2f} s")


class RunReporter:
    """Shows a run's progress from its events and prints the final summary.

    Args:
        num_nodes: ranks in the run.
        show: print anything at all.
        log_interval: steps between plain log lines when not on a terminal.
        console: where to print (default: standard error).
    """

    def __init__(self, num_nodes: int, show: bool = True, log_interval: int = 10,
                 console: Console | None = None):
        self.num_nodes = num_nodes
        self.show = show
        self.log_interval = log_interval
        self.console = console or output_console(stderr=True)
        self.latest: dict[int, dict[str, Any]] = {}
        self.total: int | None = None
        self.progress: Progress | None = None
        self.task = None
        self.printed_step = 0
        self.interactive = self.console.is_terminal and sys.stderr.isatty()
        self.low_memory = LowMemoryNotice()

    def _start_bar(self) -> None:
        self.progress = Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("lr {task.fields[lr]}"),
            TimeElapsedColumn(), console=self.console, transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=self.total, loss="-", lr="-")

    def on_event(self, event: dict[str, Any]) -> None:
        """Feed one metric event."""
        if not self.show:
            return
        kind = event.get("event")
        if kind == "start" and self.total is None:
            self.total = event.get("max_steps")
            if self.interactive:
                self._start_bar()
            return
        if kind == "hand_over":
            line = hand_over_line(event)
            if line:
                self.console.print(line, markup=False, highlight=False)
            return
        if kind == "system":
            line = self.low_memory.check(event)
            if line:
                self.console.print(line, style="bold red", markup=False, highlight=False)
            return
        if kind != "step":
            return
        self.latest[event["rank"]] = event
        if len(self.latest) < self.num_nodes:
            return
        step = min(e["step"] for e in self.latest.values())
        loss = sum(e["train_loss"] for e in self.latest.values()) / len(self.latest)
        lr = self.latest.get(0, event)["lr"]
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        elif step > self.printed_step and (step % self.log_interval == 0 or step == self.total):
            self.printed_step = step
            extra = ""
            if "val_global_loss" in event:
                extra = f" val_loss {event['val_global_loss']:.4f}"
            if event.get("val_accuracy") is not None:
                extra += f" val_acc {event['val_accuracy']:.1%}"
            self.console.print(
                f"step {step}/{self.total} loss {loss:.4f} lr {lr:.2e}"
                f" sent {human_bytes(event['comm_bytes'])}{extra}", highlight=False)

    def close(self) -> None:
        """Stop the progress bar (idempotent)."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def finish(self, summary: dict[str, Any], title: str = "run summary") -> None:
        """Stop the bar and print the summary table."""
        self.close()
        if not self.show:
            return
        table = Table(title=title)
        accuracy = summary.get("final_val_accuracy")
        for column in ("nodes", "steps", "train loss", "val loss (avg model)",
                       *((VAL_ACCURACY_COLUMN,) if accuracy is not None else ()), "steps/s",
                       "sent per node", "wall",
                       *(("simulated",) if summary.get("sim_time_s") is not None else ())):
            table.add_column(column, justify="right")

        def fmt(value: Any, spec: str) -> str:
            return "-" if value is None else format(value, spec)

        table.add_row(
            str(summary["num_nodes"]), str(summary["steps"]),
            fmt(summary.get("final_train_loss"), ".4f"),
            fmt(summary.get("final_val_global_loss"), ".4f"),
            *((fmt(accuracy, ".1%"),) if accuracy is not None else ()),
            fmt(summary.get("steps_per_s"), ".1f"),
            human_bytes(summary.get("bytes_per_node") or 0),
            f"{summary['wall_s']:.1f} s",
            *((f"{summary['sim_time_s']:.2f} s",) if summary.get("sim_time_s") is not None
              else ()),
        )
        self.console.print(table)
        for note in summary.get("notes") or []:
            self.console.print(f"note: {note}", markup=False, highlight=False)
        for change in summary.get("membership") or []:
            if change["reason"] != "start":
                self.console.print(f"step {change['step']}: {change['reason']}; present: ranks "
                                   f"{', '.join(map(str, change['ranks']))}")
        if summary.get("balance"):
            self.console.print(balance_table(summary["balance"]))
        merges = summary.get("merges")
        if merges:
            self.console.print(
                f"asynchronous merges: {plural(merges['versions'], 'version')}, "
                f"{plural(merges['merged'], 'contribution')} merged (staleness mean "
                f"{merges['staleness_mean']:.2f}, max {merges['staleness_max']}), "
                f"{merges['dropped']} dropped ({merges['dropped_tokens']} samples); "
                "contributions per rank: " + ", ".join(
                    f"{r['rank']}: {r['contributed']}" for r in merges["ranks"]))
        if summary.get("label_histogram"):
            self.console.print(label_table(summary["label_histogram"]))
        print_goodput(self.console, summary.get("goodput"))
