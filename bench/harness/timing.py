"""How the benches time: a window of steps, medians over repeated runs, a loss curve against
the clock, a child timed.

A bench times whole communication periods (DiLoCo's ``H`` steps, a DDP step):
ranks run freely between communications and meet at each one, so only a
window that starts and ends at a communication times every rank alike.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import ROOT
from exogym.report.metrics import time_to_loss  # noqa: F401 (the benches' name for it)

StepEvents = dict[int, dict[int, Mapping[str, Any]]]


def round_up(steps: int, period: int) -> int:
    """The first multiple of ``period`` at or after ``steps``."""
    return math.ceil(steps / period) * period


@dataclass(frozen=True)
class Window:
    """The timed steps of a job: ``(s0, s1]``, then up to ``max_steps`` (the final evaluation)."""

    s0: int
    s1: int
    max_steps: int

    @classmethod
    def for_period(cls, period: int, warmup: int, window: int, periods: int) -> Window:
        """Whole periods, from the first communication at or after ``warmup`` steps: at
        least ``periods`` of them and ``window`` steps; one step more ends the run."""
        start = round_up(warmup, period)
        length = round_up(max(window, periods * period), period)
        return cls(start, start + length, start + length + 1)

    @property
    def steps(self) -> int:
        return self.s1 - self.s0

    def per_step(self, steps: Mapping[int, Mapping[str, Any]], key: str) -> float:
        """How much ``key`` (``wall_s``, ``comm_bytes``, ``sim_time_s``) of one rank's step
        events grew per step over the window."""
        return (steps[self.s1][key] - steps[self.s0][key]) / self.steps

    def mean_per_step(self, by_rank: StepEvents, key: str) -> float:
        """:meth:`per_step` averaged over the ranks."""
        return statistics.mean(self.per_step(steps, key) for steps in by_rank.values())


def steps_by_rank(events: Iterable[Mapping[str, Any]]) -> StepEvents:
    """``{rank: {step: event}}`` of the step events among ``events`` (rows of
    ``trainer.history`` count as step events)."""
    found: StepEvents = {}
    for event in events:
        if event.get("event", "step") == "step" and "step" in event:
            found.setdefault(int(event["rank"]), {})[int(event["step"])] = event
    return found


def median_of(items: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the items that have it (None when none does)."""
    values = [item[key] for item in items if item.get(key) is not None]
    return statistics.median(values) if values else None


def with_medians(base: Mapping[str, Any], items: Sequence[Mapping[str, Any]],
                 keys: Iterable[str]) -> dict[str, Any]:
    """``base`` with each of ``keys`` that some item has replaced by its median over ``items``."""
    merged = dict(base)
    for key in keys:
        value = median_of(items, key)
        if value is not None:
            merged[key] = value
    return merged


def loss_at(curve: list[tuple[float, float]], at: float) -> float | None:
    """The loss on ``curve`` (wall time, loss) at time ``at``: linear between points, the
    last point's for a run that had ended by then, None before the first point."""
    if not curve or at < curve[0][0]:
        return None
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= at <= t1:
            return l0 + (l1 - l0) * (at - t0) / (t1 - t0) if t1 > t0 else l1
    return curve[-1][1]


def training_clock(steps: Mapping[int, Mapping[str, Any]]) -> dict[int, float]:
    """One rank's clock of training: each step's ``wall_s`` less the time its evaluations took.

    An evaluation runs inside the step it follows, after the step's training
    (``compute_s`` + ``comm_s``); what the step lasted beyond that, at a step that
    reports a validation loss, is taken as the evaluation's time. A step whose
    predecessor is missing keeps what was taken so far.
    """
    clock: dict[int, float] = {}
    spent = 0.0
    for step in sorted(steps):
        event = steps[step]
        before = steps.get(step - 1)
        if before is not None and "val_loss" in event:
            trained = event.get("compute_s", 0.0) + event.get("comm_s", 0.0)
            spent += max(0.0, event["wall_s"] - before["wall_s"] - trained)
        clock[step] = event["wall_s"] - spent
    return clock


@dataclass(frozen=True)
class TimedRun:
    """A child process's wall time, start to exit, and its standard output."""

    wall_s: float
    stdout: str


def bench_command(module: str, *args: str) -> list[str]:
    """``python -m MODULE ARGS``: how a bench starts a child of its own (run it from ROOT)."""
    return [sys.executable, "-m", module, *args]


def timed_run(command: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: Path = ROOT, log: Path | None = None,
              sample: Callable[[int], None] | None = None, every: float = 0.2) -> TimedRun:
    """Run ``command`` to its end and time it.

    Args:
        env: its environment (default: this process's).
        cwd: where it runs.
        log: write its output (stdout and stderr) there instead of returning it.
        sample: called with its PID every ``every`` seconds while it runs (memory, CPU).

    Raises RuntimeError, with the end of its output, when it fails.
    """
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "w")) if log is not None else subprocess.PIPE
        started = time.perf_counter()
        proc = subprocess.Popen(list(command), cwd=cwd, env=None if env is None else dict(env),
                                stdout=out, stderr=subprocess.STDOUT if log else subprocess.PIPE,
                                text=True)
        done = threading.Event()
        if sample is not None:
            def watch() -> None:
                while not done.is_set():
                    sample(proc.pid)
                    done.wait(every)

            sampler = threading.Thread(target=watch, daemon=True)
            sampler.start()
            stack.callback(sampler.join)
        stack.callback(done.set)
        stdout, stderr = proc.communicate()
        wall = time.perf_counter() - started
    if proc.returncode != 0:
        said = log.read_text() if log is not None else f"{stdout}\n{stderr}"
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{said[-3000:]}")
    return TimedRun(wall, stdout or "")
