"""Jobs on the bed: a profile launched on its hosts over SSH, and what its step events say.

A job's figures come from a window of steps (:class:`bench.harness.timing.Window`):

- **time per step**: each rank's wall time (``wall_s`` of its step events) over
  the window, divided by its steps; averaged over ranks;
- **wire bytes**: what the hosts' veths sent each other during the window
  (the bed's interface counters, less what went to the launcher), per host and
  step; **counted bytes**: the same from the comm module's counters;
- **evaluations in the window** (:attr:`Bench.eval_every`): left out of the
  time per step (:func:`bench.harness.timing.training_clock`) and of the wire
  bytes (each evaluation's traffic, the least over the window's evaluations of
  what the steps around it sent beyond the steps before, times their number:
  :func:`evaluation_bytes`). An evaluation whose two scores are one (every rank
  held the same model, as right after a DiLoCo round: no average is built)
  sent nothing and is not counted;
- **other load**: cores kept busy during the window by processes that are not
  the bench's. Before each job :class:`Bench` waits until that falls under
  ``--quiet-cores``, and measures a job again when it was over ``--retry-cores``.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.machine import CLOCK_TICKS, CpuSample
from bench.harness.slow_host import worker_groups
from bench.harness.timing import Window, steps_by_rank, training_clock
from tests.netbed import Counters, Testbed

#: Steps around an evaluation at step ``k`` (``k + d``) at which :func:`evaluation_bytes`
#: reads the hosts' counters.
EVAL_SNAPS = (-5, -2, 1)


class BenchError(RuntimeError):
    """A job failed or gave no usable measurement; the message says which and why."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived: stop, clean up, exit."""


def bench_pids(bed: Testbed) -> list[int]:
    """This process and every process in the bed's hosts."""
    return [os.getpid()] + [p for h in bed.hosts for p in bed.pids(h)]


def wait_for_quiet(bed: Testbed, cores: float, budget: dict[str, float],
                   say: Callable[[str], None]) -> float:
    """Wait (within ``budget['left']`` seconds) until others keep fewer than ``cores`` busy."""
    while True:
        first = CpuSample.take(bench_pids(bed))
        time.sleep(3.0)
        other = first.other_cores(CpuSample.take(bench_pids(bed)))
        if other < cores or budget["left"] <= 0:
            if other >= cores:
                say(f"  other processes keep {other:.2f} cores busy; the waiting budget is "
                    "spent, measuring anyway (the table marks it)")
            return other
        say(f"  other processes keep {other:.2f} cores busy (load average "
            f"{os.getloadavg()[0]:.2f}); waiting for under {cores:.2f}")
        time.sleep(min(27.0, budget["left"]))
        budget["left"] -= 30.0


@dataclass
class JobResult:
    """What one launched job measured (see the module docstring for each figure)."""

    name: str
    hosts: int
    window: Window
    step_s: float
    rank_step_s: list[float]
    step_sd_s: float
    counted_bytes_per_step: float
    wire_bytes_per_step: float
    launcher_bytes_per_step: float
    train_loss: float
    val_loss: float | None
    other_cores: float
    load_before: float
    affinity: dict[int, list[int]]
    wall_s: float
    #: Rank 0's validation losses: ``[step, seconds of training, the global model's loss,
    #: rank 0's own model's loss]``.
    val_curve: list[list[float]] = field(default_factory=list)
    #: For each host running a rank at the window's start, that rank's ``cpu`` cgroup.
    groups: dict[int, str] = field(default_factory=dict)
    #: Bytes the hosts sent each other for the evaluations inside the window (left out of
    #: ``wire_bytes_per_step``).
    eval_bytes: float = 0.0
    #: Cores the bed's hosts' processes (ranks, sshds) kept busy during the window.
    host_cores: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["window"] = [self.window.s0, self.window.s1, self.window.max_steps]
        out["affinity"] = {str(k): v for k, v in self.affinity.items()}
        out["groups"] = {str(k): v for k, v in self.groups.items()}
        return out


def evaluation_bytes(snaps: dict[int, Counters], evaluated: set[int]) -> float:
    """The hosts' traffic for the evaluations at the steps ``evaluated``, from counters taken
    at rank 0's step events (``snaps``): per evaluation at step ``k``, what steps ``k-1..k+1``
    sent beyond steps ``k-4..k-2`` (three steps on each side: a rank ahead of rank 0, or a
    launcher late to read an event, moves the traffic a step or so); the least of those,
    times how many there were. An evaluation next to a step that communicates for training
    (DiLoCo's round's last) counts that traffic too; the least passes it over as long as one
    evaluation falls between rounds."""
    extra = [snaps[k - 2].between_hosts(snaps[k + 1]) - snaps[k - 5].between_hosts(snaps[k - 2])
             for k in sorted(evaluated) if all(k + d in snaps for d in EVAL_SNAPS)]
    return max(0.0, min(extra)) * len(evaluated) if extra else 0.0


def host_cores(first: CpuSample, later: CpuSample) -> float:
    """Cores the processes sampled, this one (the launcher) left out, kept busy between the
    two samples: the bed's hosts' own."""
    me = os.getpid()
    ticks = sum(later.ours.get(p, t) - t for p, t in first.ours.items() if p != me)
    ticks += sum(t for p, t in later.ours.items() if p not in first.ours and p != me)
    seconds = later.at - first.at
    return ticks / CLOCK_TICKS / seconds if seconds > 0 else 0.0


class Bench:
    """Runs jobs on a test bed and keeps what they measured.

    Args:
        bed: the built bed; host 0 is each job's master.
        args: the bench's options (:func:`bench.harness.session.add_job_arguments`).
        out: the bench's output folder; every job's rank logs are kept in ``out/logs``.
    """

    def __init__(self, bed: Testbed, args: argparse.Namespace, out: Path) -> None:
        self.bed = bed
        self.args = args
        self.out = out
        self.jobs = 0
        self.budget = {"left": float(args.wait_max)}
        #: Steps between the evaluations of jobs that evaluate inside their window (their
        #: time and traffic are then left out of the window's figures); None: they do not.
        self.eval_every: int | None = None
        #: The step events of the job run last.
        self.events: list[dict[str, Any]] = []

    def say(self, text: str) -> None:
        print(text, flush=True)

    def common_overrides(self, window: Window, batch_size: int, slug: str) -> list[str]:
        return [f"batch_size={batch_size}", f"max_steps={window.max_steps}",
                f"val_interval={window.max_steps}", "num_threads=1",
                "checkpoint_interval=None",
                f"output_dir={self.bed.workdir / 'out' / slug}", *self.args.set]

    def run_job(self, name: str, hosts: int, overrides: list[str], window: Window,
                env: dict[str, str] | None = None) -> JobResult:
        """Launch ``hosts`` ranks of the profile with ``overrides`` and measure the window.

        ``env`` adds variables to every rank's environment. Retries once, after
        waiting for quiet, when other processes took more than ``--retry-cores``
        cores during the window.
        """
        for attempt in (1, 2):
            result = self._launch(name, hosts, overrides, window, env or {})
            if result.other_cores <= self.args.retry_cores or attempt == 2:
                return result
            self.say(f"  other processes took {result.other_cores:.2f} cores during the window; "
                     "measuring again")
        raise AssertionError("unreachable")

    def _launch(self, name: str, hosts: int, overrides: list[str], window: Window,
                env: dict[str, str]) -> JobResult:
        from rich.console import Console

        from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram, SSHOptions

        self.jobs += 1
        wait_for_quiet(self.bed, self.args.quiet_cores, self.budget, self.say)
        load_before = os.getloadavg()[0]
        config = self.bed.hosts_config(29500 + self.jobs, count=hosts)
        program = RankProgram.from_profile(self.args.profile, overrides=overrides, quiet=True)
        events: list[dict[str, Any]] = []
        marks: dict[int, tuple[Counters, CpuSample]] = {}
        affinity: dict[int, list[int]] = {}
        groups: dict[int, str] = {}
        lines: deque[str] = deque(maxlen=60)

        every = self.eval_every
        evaluated = set() if every is None else \
            {k for k in range(window.s0 + 1, window.s1 + 1) if k % every == 0}
        around = {k + d for k in evaluated for d in EVAL_SNAPS}
        snaps: dict[int, Counters] = {}
        averaged: set[int] = set()  # evaluations that built the ranks' average model

        def on_event(event: dict[str, Any]) -> None:
            events.append(event)
            if event.get("event") == "step" and event.get("rank") == 0 \
                    and event.get("step") in evaluated and "val_global_loss" in event \
                    and event["val_global_loss"] != event.get("val_loss"):
                averaged.add(event["step"])
            if event.get("event") == "step" and event.get("rank") == 0 \
                    and event.get("step") in around:
                snaps[event["step"]] = self.bed.counters()
            if event.get("event") == "step" and event.get("rank") == 0 \
                    and event.get("step") in (window.s0, window.s1):
                marks[event["step"]] = (self.bed.counters(), CpuSample.take(bench_pids(self.bed)))
                if event["step"] == window.s0:
                    affinity.update(self.bed.worker_affinity())
                    groups.update(worker_groups(self.bed))

        run_dir = self.bed.workdir / "launch" / f"{self.jobs:02d}"
        console = Console(file=io.StringIO(), width=160)
        started = time.monotonic()
        self.say(f"  {name}: {hosts} host(s), steps {window.s0}..{window.s1} timed of "
                 f"{window.max_steps}")
        options = LaunchOptions(run_dir=run_dir, master_local=False, grace_period=3,
                                env={"PYTHONPATH": config["project_path"], "OMP_NUM_THREADS": "1",
                                     **env})
        ssh = SSHOptions(**self.bed.ssh_settings())
        with Launcher(config, program, options=options, ssh=ssh, console=console,
                      on_output=lambda line: lines.append(str(line)), on_event=on_event) as job:
            result = job.run()
        self._keep_logs(run_dir, f"{self.jobs:02d}-{name.lower().replace(' ', '-')}")
        if result.interrupted:
            raise Interrupted(result.interrupted)
        if not result.ok:
            raise BenchError(f"{name}: {result.describe()}\nlauncher:\n"
                             + console.file.getvalue()[-3000:] + "\noutput:\n" + "\n".join(lines))
        if window.s0 not in marks or window.s1 not in marks:
            raise BenchError(f"{name}: rank 0 reported no step {window.s0} or {window.s1}; "
                             f"logs in {self.out / 'logs'}")
        self.events = [e for e in events if e.get("event") == "step"]
        result = self._summarize(name, hosts, window, marks, affinity, load_before,
                                 time.monotonic() - started)
        result.groups = groups
        result.eval_bytes = evaluation_bytes(snaps, averaged)
        if result.eval_bytes:
            result.wire_bytes_per_step -= result.eval_bytes / hosts / window.steps
        return result

    def _keep_logs(self, run_dir: Path, slug: str) -> None:
        target = self.out / "logs" / slug
        target.mkdir(parents=True, exist_ok=True)
        for log in list(run_dir.glob("rank*.log")) + list(run_dir.glob("launch.json")):
            shutil.copy2(log, target / log.name)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(self.bed.workdir / "out", ignore_errors=True)  # final models: not needed

    def _summarize(self, name: str, hosts: int, window: Window,
                   marks: dict[int, tuple[Counters, CpuSample]], affinity: dict[int, list[int]],
                   load_before: float, wall_s: float) -> JobResult:
        steps = steps_by_rank(self.events)
        if sorted(steps) != list(range(hosts)):
            raise BenchError(f"{name}: step events came from ranks {sorted(steps)}, "
                             f"expected 0..{hosts - 1}")
        rank_step_s, rank_sd_s, counted, losses = [], [], [], []
        for rank in range(hosts):
            mine = steps[rank]
            missing = [s for s in (window.s0, window.s1) if s not in mine]
            if missing:
                raise BenchError(f"{name}: rank {rank} reported no step {missing[0]}")
            clock = training_clock(mine) if self.eval_every is not None else \
                {k: e["wall_s"] for k, e in mine.items()}
            rank_step_s.append((clock[window.s1] - clock[window.s0]) / window.steps)
            each = [clock[k] - clock[k - 1]
                    for k in range(window.s0 + 1, window.s1 + 1) if k in mine and k - 1 in mine]
            rank_sd_s.append(statistics.stdev(each) if len(each) > 1 else 0.0)
            counted.append(window.per_step(mine, "comm_bytes"))
            losses += [mine[s]["train_loss"] for s in range(window.s1 - 9, window.s1 + 1)
                       if s in mine]
        final = steps[0].get(window.max_steps, {})
        clock0 = training_clock(steps[0])
        curve = [[step, clock0[step], event.get("val_global_loss", event["val_loss"]),
                  event["val_loss"]]
                 for step, event in sorted(steps[0].items()) if "val_loss" in event]
        (c0, cpu0), (c1, cpu1) = marks[window.s0], marks[window.s1]
        return JobResult(
            name=name, hosts=hosts, window=window,
            step_s=statistics.mean(rank_step_s), rank_step_s=rank_step_s,
            step_sd_s=statistics.mean(rank_sd_s),
            counted_bytes_per_step=statistics.mean(counted),
            wire_bytes_per_step=c0.between_hosts(c1) / hosts / window.steps,
            launcher_bytes_per_step=c0.launcher_bytes(c1) / window.steps,
            train_loss=statistics.mean(losses),
            val_loss=final.get("val_global_loss", final.get("val_loss")),
            other_cores=cpu0.other_cores(cpu1), host_cores=host_cores(cpu0, cpu1),
            load_before=load_before, affinity=affinity, wall_s=wall_s, val_curve=curve)
