"""``balance`` on real hosts: two hosts over SSH, one held to half its core by a CPU quota.

Run as root from the project root::

    python bench/balance_hosts.py                     # DiLoCo and DDP, one pass
    python bench/balance_hosts.py --repeat 3          # medians of three passes
    python bench/balance_hosts.py --only diloco --steps 100

The hosts are two network namespaces on one bridge (``bench/netbed.py``), each
with its own ``sshd`` pinned to its own core, every link shaped to ``--rate``
(default 1gbit) with ``tc tbf``. Jobs start through the SSH launcher exactly as
``bench/multihost.py`` starts them (its ``Bench`` runs every job here): rank 0
in host 0's namespace, rank 1 in host 1's, one compute thread each.

**The slow host.** Before any rank starts, host 1's ``sshd`` is moved into a
child group of the cgroup v1 ``cpu`` controller (``/sys/fs/cgroup/cpu``,
``exobench-<tag>-slow``) with ``cpu.cfs_quota_us`` = ``--slow`` x
``cpu.cfs_period_us`` (50,000 of 100,000 us by default), so every process it
starts (the rank, gloo's threads, the SSH session) inherits half a core.
While a job runs, the script reads each rank's ``/proc/PID/cgroup`` and prints
the group it found; the group's ``cpu.stat`` gives the seconds it was
throttled. The group is removed at the end (its processes moved back to the
root group first), also on errors and SIGINT/SIGTERM.

**The model.** The ``chargpt-bench`` profile (``config.ini``: a character GPT
of 3.3M parameters, one compute thread), about 0.25 s per step of 16 samples
on one core here, so a DiLoCo run of 320 steps takes about a minute and a
half alone and a pass of the bench about 11 minutes; long enough per step that the quota's 100 ms
period slows every step alike rather than some steps fully and others not.
chargpt-bench rather than the digits profiles: a digits step takes a few
milliseconds, which a 100 ms quota period would stall at random.

**Runs**, in this order in each of ``--repeat`` passes (a ratio compares runs
made minutes apart, not on a machine whose speed drifted):

- DiLoCo (H=``--H``, 40), ``--steps`` steps, batch ``--batch-size`` per rank:
  the fast host alone (host 0, one rank), both hosts with ``balance=none``,
  both hosts with ``balance=steps``. A round's average (13 MB each way at
  1gbit, the slow host's part of it held to its quota) costs about 0.3 s, 5%
  of a round of 20 steps; with 40 steps per round, about 2.5%;
- DDP, ``--ddp-steps`` steps, batch ``--ddp-batch`` per rank (128): the fast
  host alone, both hosts with ``balance=none``, both with ``balance=batch``.
  A larger batch than DiLoCo's: DDP all-reduces the whole gradient (13 MB)
  every step, 0.13-0.17 s at 1gbit here, the slow host's share of that work
  held to its quota too; balance moves compute, not that transfer, so the
  compute per step decides how much of the ideal 1.5x is reachable. With 32
  samples per host the transfer was about a fifth of a balanced step and the
  speedup 1.18x; with 64, about a tenth and the speedup 1.24-1.39x over
  three runs; with 128, about a twentieth.

**Definitions.** A *period* is the steps between two communications: a
DiLoCo round (H steps), a DDP step. Ranks meet at its ends, so its wall time
(each rank's training-loop clock, the mean over ranks) is the same for all.

- *Throughput* (samples/s): training samples of all ranks together per second,
  over the periods of the timed window (from the first communication at or
  after ``--warmup`` steps to the last step) that end without an evaluation.
  Samples are each rank's own count: an idle step of ``balance=steps`` trains
  none. An evaluation comes at the end of a period, and the hosts do not pay
  for it alike (the slow host evaluates at half speed, two hosts also
  evaluate the averaged model), so the periods it ends are left out; *eval s*
  is what it added to its period (the median period with one minus the median
  without). *End to end*: all samples over rank 0's loop time to the last
  step, everything included (the first round and its measuring, every
  evaluation).
- *Speedup*: a run's throughput over the fast host alone's (the same profile
  and steps, one rank): the work done per second. Two hosts train two batches
  per step, so steps per second would not compare work. Ideal for hosts of
  speeds 1 and 0.5: 1.5x; with ``balance=none`` the slow host sets the pace,
  about 1.0x.
- *Validation loss per unit of wall time*: every ``--val-every`` steps
  (``--ddp-val-every`` for DDP) and at the end, each run evaluates the average
  of its ranks' models (``val_global_loss``) on the same ``--val-size``
  sequences. Rank 0's curve of (training time, loss), the training time being
  its loop clock less eval s for every evaluation so far, gives *loss @ T1*: a
  run's loss when it had trained as long as the fast host alone did in all
  (T1; interpolated between evaluations; a run that ended sooner: its final
  loss), and *time to L1*: how long a run trains to reach the fast host
  alone's final loss L1 (interpolated; ``-`` if it never does), with
  *speedup to L1* = T1 over it. No worse validation loss per unit of wall
  time: loss @ T1 at most L1, speedup to L1 at least 1.
- Diagnostics: *rank 0 step*, the fast rank's median step inside a DiLoCo
  round (no communication in it): against the fast host alone's, what
  sharing this machine's memory and caches with a busy second host costs
  (real hosts would not pay it); the *launcher*'s own CPU (this process:
  SSH, events) in cores over the job, which no core is set aside for; the
  seconds the slow group was throttled.

With ``--repeat`` every figure is the median over the passes; each pass's
speedups are taken against that pass's fast-host-alone run, and the table
shows their range. Writes ``results.json`` and every job's rank logs
(``logs/``) to ``--out``. Prints figures, asserts nothing. Latency is not
emulated (no ``netem`` in this kernel).
"""

from __future__ import annotations

import argparse
import errno
import os
import resource
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from multihost import Bench, BenchError, Interrupted, JobResult, Window, signals_raise  # noqa: E402

from exogym.io import atomic_write_json  # noqa: E402
from netbed import (  # noqa: E402
    PREFIX,
    Testbed,
    TestbedError,
    check_requirements,
    rate_bits,
    reap_stale_beds,
    worker_pid,
)

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
FAST, SLOW = 0, 1  # host indices (and ranks): host 0 is the master


# --------------------------------------------------------------------------- the slow host


class SlowGroup:
    """A cgroup v1 ``cpu`` group whose processes share ``fraction`` of one core.

    Args:
        name: the group's folder under ``/sys/fs/cgroup/cpu`` (unique per bench).
        fraction: the quota, a fraction of ``cpu.cfs_period_us`` (100 ms).
    """

    def __init__(self, name: str, fraction: float) -> None:
        self.path = CPU_CGROUP / name
        self.fraction = fraction

    def create(self) -> None:
        """Make the group and set its period and quota."""
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(round(PERIOD_US * self.fraction)))

    def add(self, pid: int) -> None:
        """Move ``pid`` into the group; what it starts from now on is born in it."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def members(self) -> list[int]:
        """The processes in the group."""
        return _read_pids(self.path)

    def throttled_s(self) -> float:
        """Seconds the group's processes have waited for their quota since it was made."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat.get("throttled_time", 0)) / 1e9

    def remove(self) -> None:
        """Move every process back to the root group, then delete the group."""
        release(self.path)


def release(group: Path) -> None:
    """Move ``group``'s processes to the root ``cpu`` group and delete ``group``.

    A process that exits between the listing and the move is skipped; an
    ``rmdir`` refused while the kernel still counts a process that just left
    is tried again for up to 5 seconds.
    """
    deadline = time.monotonic() + 5
    while group.exists():
        for pid in _read_pids(group):
            try:
                (CPU_CGROUP / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                pass
        try:
            group.rmdir()
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _read_pids(group: Path) -> list[int]:
    try:
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def reap_stale_groups() -> list[str]:
    """Remove the slow groups of earlier benches whose test bed is gone (killed unclean)."""
    from netbed.stale import bed_stands

    removed = []
    for group in CPU_CGROUP.glob(f"{PREFIX}-*-slow"):
        tag = group.name.split("-")[1]
        if not bed_stands(tag):
            release(group)
            removed.append(f"cgroup {group}")
    return removed


def cpu_cgroup_of(pid: int) -> str | None:
    """The ``cpu`` controller's group of ``pid`` (``/`` for the root), or None if it is gone."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return None


class RankWatch:
    """While a job runs, finds each rank's process and notes its ``cpu`` group.

    Args:
        ranks: how many ranks the job has.
        marker: a string on the job's command line alone (its output folder).
    """

    def __init__(self, ranks: int, marker: str) -> None:
        self.ranks = ranks
        self.marker = marker
        self.found: dict[int, tuple[int, str]] = {}  # rank -> (pid, cpu group)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> RankWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while len(self.found) < self.ranks and not self._stop.wait(0.5):
            for rank in set(range(self.ranks)) - set(self.found):
                pid = worker_pid(rank, self.marker)
                group = None if pid is None else cpu_cgroup_of(pid)
                if group is not None:
                    self.found[rank] = (pid, group)


# --------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Case:
    """One configuration: a strategy, its balance (``alone``: the fast host by itself)."""

    strategy: str
    balance: str

    @property
    def hosts(self) -> int:
        return 1 if self.balance == "alone" else 2

    @property
    def label(self) -> str:
        if self.balance == "alone":
            return "fast host alone"
        return f"2 hosts, balance={self.balance}"


class BalanceBench(Bench):
    """``multihost.Bench`` that keeps the step events of the job it ran last."""

    def __init__(self, bed: Testbed, args: argparse.Namespace, out: Path) -> None:
        super().__init__(bed, args, out)
        self.events: list[dict[str, Any]] = []

    def _summarize(self, name: str, hosts: int, window: Window, events: list[dict[str, Any]],
                   *rest: Any) -> JobResult:
        self.events = [e for e in events if e.get("event") == "step"]
        return super()._summarize(name, hosts, window, events, *rest)


def case_settings(case: Case, args: argparse.Namespace
                  ) -> tuple[Window, int, int, list[str]]:
    """The window, period (steps between communications), batch size and overrides."""
    if case.strategy == "diloco":
        period, steps, batch, every = args.H, args.steps, args.batch_size, args.val_every
        strategy = ["strategy=diloco", f"H={args.H}"]
    else:
        period, steps, batch, every = 1, args.ddp_steps, args.ddp_batch, args.ddp_val_every
        strategy = ["strategy=ddp"]
    start = -(-args.warmup // period) * period
    balance = "none" if case.balance == "alone" else case.balance
    return (Window(start, steps, steps), period, batch,
            [*strategy, f"balance={balance}", f"val_interval={every}",
             f"val_size={args.val_size}"])


@dataclass(frozen=True)
class Timing:
    """What a run's step events say about its training, evaluations left out.

    Args:
        samples: samples all ranks trained in the window's periods that end without an
            evaluation.
        seconds: those periods' wall time (each the mean over ranks).
        eval_s: what one evaluation adds to the period it ends: the median period
            with one minus the median without (None when the window has none).
    """

    samples: int
    seconds: float
    eval_s: float | None

    @classmethod
    def of(cls, by_rank: dict[int, dict[int, dict[str, Any]]], window: Window,
           period: int) -> Timing:
        ranks = sorted(by_rank)
        samples, seconds, plain, evaluated = 0, 0.0, [], []
        for begin in range(window.s0, window.s1, period):
            end = begin + period
            duration = statistics.mean(by_rank[r][end]["wall_s"] - by_rank[r][begin]["wall_s"]
                                       for r in ranks)
            if by_rank[0][end].get("val_global_loss") is not None:
                evaluated.append(duration)
                continue
            plain.append(duration)
            seconds += duration
            samples += sum(by_rank[r][end]["samples"] - by_rank[r][begin]["samples"]
                           for r in ranks)
        if not plain:
            raise BenchError(f"no period of steps {window.s0}..{window.s1} ends without an "
                             "evaluation: evaluate less often")
        eval_s = (max(0.0, statistics.median(evaluated) - statistics.median(plain))
                  if evaluated else None)
        return cls(samples, seconds, eval_s)


def loss_at(curve: list[tuple[float, float]], at: float) -> float | None:
    """The loss on ``curve`` (wall time, loss) at time ``at``: linear between points, the
    last point's for a run that had ended by then, None before the first point."""
    if not curve or at < curve[0][0]:
        return None
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= at <= t1:
            return l0 + (l1 - l0) * (at - t0) / (t1 - t0) if t1 > t0 else l1
    return curve[-1][1]


def time_to_loss(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first wall time at which ``curve`` reaches ``target`` (linear between points)."""
    previous: tuple[float, float] | None = None
    for t, loss in curve:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return t
            t0, l0 = previous
            return t0 + (t - t0) * (l0 - target) / (l0 - loss)
        previous = (t, loss)
    return None


def run_case(bench: BalanceBench, case: Case, group: SlowGroup, args: argparse.Namespace,
             pass_number: int) -> dict[str, Any]:
    """Launch ``case``, return its figures (module docstring) and where its ranks ran."""
    window, period, batch, overrides = case_settings(case, args)
    slug = f"{case.strategy}-{case.balance}-{pass_number}"
    throttled_before = group.throttled_s()
    launcher_before, started = _own_cpu_s(), time.monotonic()
    with RankWatch(case.hosts, str(bench.bed.workdir / "out" / slug)) as watch:
        job = bench.run_job(f"{case.strategy} {case.label}", case.hosts,
                            [*bench.common_overrides(window, batch, slug), *overrides], window)
    launcher_cores = (_own_cpu_s() - launcher_before) / (time.monotonic() - started)
    by_rank: dict[int, dict[int, dict[str, Any]]] = {}
    for event in bench.events:
        by_rank.setdefault(int(event["rank"]), {})[int(event["step"])] = event
    ranks = sorted(by_rank)
    timing = Timing.of(by_rank, window, period)
    last = {r: by_rank[r][window.max_steps] for r in ranks}
    evals = 0
    curve = []  # (training wall time: evaluations taken out, loss of the averaged model)
    for _, event in sorted(by_rank[0].items()):
        if event.get("val_global_loss") is not None:
            evals += 1
            curve.append((event["wall_s"] - evals * (timing.eval_s or 0.0),
                          event["val_global_loss"]))
    inner = [event["wall_s"] - by_rank[0][step - 1]["wall_s"]
             for step, event in by_rank[0].items()
             if window.s0 < step <= window.s1 and step % period and not event.get("idle")]
    share_key = "inner_steps" if case.strategy == "diloco" else "batch_size"
    samples_total = sum(last[r]["samples"] for r in ranks)
    return {
        "strategy": case.strategy, "balance": case.balance, "hosts": case.hosts,
        "pass": pass_number, "window": [window.s0, window.s1], "batch_size": batch,
        "samples_window": timing.samples, "seconds_window": timing.seconds,
        "throughput": timing.samples / timing.seconds, "eval_s": timing.eval_s,
        "samples_total": samples_total, "wall_s": last[0]["wall_s"],
        "train_s": curve[-1][0] if curve else last[0]["wall_s"],
        "end_to_end": samples_total / last[0]["wall_s"],
        "samples_by_rank": [last[r]["samples"] for r in ranks],
        "shares": [last[r].get(share_key) for r in ranks],
        "speeds": [last[r].get("measured_speed") for r in ranks],
        "val_curve": curve, "final_val": job.val_loss,
        "cgroups": {str(rank): {"pid": pid, "cpu": path}
                    for rank, (pid, path) in sorted(watch.found.items())},
        "throttled_s": group.throttled_s() - throttled_before,
        "fast_step_s": statistics.median(inner) if inner else None,
        "launcher_cores": launcher_cores,
        "other_cores": job.other_cores, "launch_s": job.wall_s,
    }


def _own_cpu_s() -> float:
    """CPU seconds this process (the launcher, the bench) has used, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def compare(run: dict[str, Any], alone: dict[str, Any]) -> dict[str, Any]:
    """``run``'s speedups and loss figures against the fast host alone of its pass."""
    t1, l1 = alone["train_s"], alone["final_val"]
    reach = time_to_loss(run["val_curve"], l1) if l1 is not None else None
    return {"speedup": run["throughput"] / alone["throughput"],
            "speedup_end_to_end": run["end_to_end"] / alone["end_to_end"],
            "loss_at_t1": loss_at(run["val_curve"], t1),
            "time_to_l1": reach, "speedup_to_l1": t1 / reach if reach else None}


# --------------------------------------------------------------------------- the bench


def run_all(bench: BalanceBench, group: SlowGroup, args: argparse.Namespace
            ) -> dict[str, list[dict[str, Any]]]:
    """Every pass over every case; ``{strategy: [run, ...]}`` with each run's comparison."""
    balanced = {"diloco": "steps", "ddp": "batch"}
    strategies = [args.only] if args.only else ["diloco", "ddp"]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in strategies}
    for number in range(1, args.repeat + 1):
        if args.repeat > 1:
            bench.say(f"pass {number} of {args.repeat}:")
        for strategy in strategies:
            alone = None
            for balance in ("alone", "none", balanced[strategy]):
                run = run_case(bench, Case(strategy, balance), group, args, number)
                alone = alone or run
                run.update(compare(run, alone))
                runs[strategy].append(run)
                bench.say("    " + plain_line(run))
    return runs


def plain_line(run: dict[str, Any]) -> str:
    """One run's figures as a line."""
    where = ", ".join(f"rank {h} pid {c['pid']} in cpu:{c['cpu']}"
                      for h, c in run["cgroups"].items()) or "ranks not seen"
    return (f"{run['samples_window']} samples in {run['seconds_window']:.1f} s of training: "
            f"{run['throughput']:.1f} samples/s, {run['speedup']:.2f}x the fast host alone "
            f"(end to end {run['speedup_end_to_end']:.2f}x); an evaluation "
            f"{_fmt(run['eval_s'], '.2f', ' s')}; final val loss "
            f"{_fmt(run['final_val'], '.3f')} at {run['train_s']:.1f} s of training "
            f"({run['wall_s']:.1f} s in all); samples by rank "
            f"{'/'.join(map(str, run['samples_by_rank']))}, shares {_joined(run['shares'])}, "
            f"measured speeds {_joined(run['speeds'], '.2f')}; rank 0's steps inside a round "
            f"{_fmt(run['fast_step_s'], '.3f', ' s')} (median); slow group throttled "
            f"{run['throttled_s']:.1f} s; {where}; launcher {run['launcher_cores']:.2f} cores, "
            f"other load {run['other_cores']:.2f} cores")


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _joined(values: list[Any], spec: str = "") -> str:
    return "/".join(_fmt(v, spec) for v in values)


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


#: Figures given as medians over passes.
MEDIANS = ("throughput", "seconds_window", "samples_window", "speedup", "speedup_end_to_end",
           "eval_s", "final_val", "train_s", "wall_s", "loss_at_t1", "time_to_l1",
           "speedup_to_l1", "fast_step_s", "throttled_s", "launcher_cores", "other_cores")


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per strategy and run: medians over passes, the speedup's range."""
    rows = []
    for strategy, items in runs.items():
        for balance in dict.fromkeys(r["balance"] for r in items):
            mine = [r for r in items if r["balance"] == balance]
            row = {"strategy": strategy, "balance": balance, "passes": len(mine),
                   "shares": mine[-1]["shares"], "speeds": mine[-1]["speeds"],
                   "cgroups": mine[-1]["cgroups"],
                   "speedup_range": [min(r["speedup"] for r in mine),
                                     max(r["speedup"] for r in mine)]}
            row.update({key: _median(mine, key) for key in MEDIANS})
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The rows as a rich table, then one plain sentence per balanced run."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"balance on 2 hosts, host 1 held to {args.slow:.0%} of its core (cgroup "
                        f"cpu quota), links {args.rate}, medians of {args.repeat} pass(es)")
    left = ("strategy", "run", "slow rank's cpu group")
    for name in ("strategy", "run", "samples/s", "speedup (range)", "end to end", "eval s",
                 "val loss", "train s", "loss @ T1", "time to L1", "speedup to L1", "shares",
                 "speeds", "rank 0 step", "slow rank's cpu group"):
        table.add_column(name, justify="left" if name in left else "right")
    for row in rows:
        low, high = row["speedup_range"]
        spread = f" ({low:.2f}-{high:.2f})" if row["passes"] > 1 else ""
        slow = row["cgroups"].get(str(SLOW), {}).get("cpu", "not seen")
        table.add_row(
            f"DiLoCo H={args.H}" if row["strategy"] == "diloco" else "DDP",
            Case(row["strategy"], row["balance"]).label,
            f"{row['throughput']:.1f}", f"{row['speedup']:.2f}x{spread}",
            f"{row['speedup_end_to_end']:.2f}x", _fmt(row["eval_s"], ".2f"),
            _fmt(row["final_val"], ".3f"), f"{row['train_s']:.1f}",
            _fmt(row["loss_at_t1"], ".3f"), _fmt(row["time_to_l1"], ".1f", " s"),
            _fmt(row["speedup_to_l1"], ".2f", "x"), _joined(row["shares"]),
            _joined(row["speeds"], ".2f"), _fmt(row["fast_step_s"], ".3f"),
            slow if row["balance"] != "alone" else "-")
    Console(width=220).print(table)
    print("samples/s: all ranks' training samples per second in the timed window, "
          "evaluations left out; speedup: over the fast host alone's samples/s (ideal 1.5x); "
          "end to end: all samples over all of rank 0's loop time, the same ratio; eval s: "
          "what one evaluation took; train s: rank 0's loop time to the end, evaluations "
          "left out; T1, L1: the fast host alone's train s and final val loss (averaged "
          "model); loss @ T1: a run's val loss at T1 of training; time to L1: the training "
          "time a run takes to reach L1; speedup to L1: T1 over it; shares: inner steps per "
          "round (DiLoCo) or samples per step (DDP) of ranks 0/1 at the end; speeds: as the "
          "ranks measured them; rank 0 step: the fast rank's median step inside a round "
          "(DiLoCo: no communication), against the fast host alone's it shows what sharing "
          "this machine with a busy second host costs.")
    targets = {"steps": 1.4, "batch": 1.3}
    for row in rows:
        if row["balance"] not in targets:
            continue
        none = next(r for r in rows if r["strategy"] == row["strategy"]
                    and r["balance"] == "none")
        alone = next(r for r in rows if r["strategy"] == row["strategy"]
                     and r["balance"] == "alone")
        mode = row["balance"]
        print(f"{row['strategy']}: balance={mode} {row['speedup']:.2f}x the fast host "
              f"alone's samples per second (target {targets[mode]}x, ideal 1.5x; end to end "
              f"{row['speedup_end_to_end']:.2f}x), balance=none {none['speedup']:.2f}x; val "
              f"loss at T1 = {alone['train_s']:.1f} s of training: alone "
              f"{_fmt(alone['final_val'], '.3f')}, none {_fmt(none['loss_at_t1'], '.3f')}, "
              f"{mode} {_fmt(row['loss_at_t1'], '.3f')}; time to reach L1: none "
              f"{_fmt(none['time_to_l1'], '.1f', ' s')}, {mode} "
              f"{_fmt(row['time_to_l1'], '.1f', ' s')} (alone's time over it "
              f"{_fmt(row['speedup_to_l1'], '.2f', 'x')}, none's over it "
              f"{_fmt(_ratio(none['time_to_l1'], row['time_to_l1']), '.2f', 'x')})")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="See the module docstring for every definition.")
    parser.add_argument("--only", choices=("diloco", "ddp"), help="one strategy's runs only")
    parser.add_argument("--steps", type=int, default=320, help="steps of each DiLoCo run")
    parser.add_argument("--H", type=int, default=40, help="DiLoCo's steps per round")
    parser.add_argument("--batch-size", type=int, default=16, help="DiLoCo's samples per rank")
    parser.add_argument("--ddp-steps", type=int, default=30, help="steps of each DDP run")
    parser.add_argument("--ddp-batch", type=int, default=128, help="DDP's samples per rank")
    parser.add_argument("--val-every", type=int, default=80,
                        help="DiLoCo's steps between evaluations (a multiple of H; default 80)")
    parser.add_argument("--ddp-val-every", type=int, default=20,
                        help="DDP's steps between evaluations (default 20)")
    parser.add_argument("--val-size", type=int, default=128, help="validation sequences")
    parser.add_argument("--warmup", type=int, default=10,
                        help="steps before the timed window (rounded up to a round boundary)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="passes over every run; figures are medians (default 1)")
    parser.add_argument("--slow", type=float, default=0.5,
                        help="the slow host's CPU quota, a fraction of its core (default 0.5)")
    parser.add_argument("--rate", default="1gbit", help="every link's rate, tc syntax")
    parser.add_argument("--profile", default="chargpt-bench", help="profile in config.ini")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="profile override for every run (e.g. n_layer=2)")
    parser.add_argument("--quiet-cores", type=float, default=0.25,
                        help="before each run, wait until other processes keep fewer cores busy")
    parser.add_argument("--retry-cores", type=float, default=0.35,
                        help="run again when other processes took more cores during the window")
    parser.add_argument("--wait-max", type=float, default=1200,
                        help="seconds in all to wait for a quiet machine")
    parser.add_argument("--subnet", default="10.213.79", help="the hosts' /24 (three octets)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "balance-hosts"),
                        help="output folder (default runs/balance-hosts)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first option that cannot work."""
    rate_bits(args.rate)
    if not 0 < args.slow < 1:
        raise ValueError(f"--slow must be a fraction between 0 and 1, got {args.slow}")
    if min(args.H, args.batch_size, args.ddp_batch, args.val_size, args.repeat,
           args.warmup) < 1:
        raise ValueError("--H, --batch-size, --ddp-batch, --val-size, --repeat and --warmup "
                         "must be >= 1")
    if args.val_every % args.H or args.val_every < 2 * args.H:
        raise ValueError(f"--val-every {args.val_every} must be a multiple of --H {args.H}, "
                         "at least two rounds: DiLoCo's ranks hold the same model only at a "
                         "round's end, and rounds that end without one time the training")
    first = -(-args.warmup // args.H) * args.H
    if args.steps % args.H or args.steps <= first:
        raise ValueError(f"--steps {args.steps} must be a multiple of --H {args.H} beyond the "
                         f"warm-up round(s) (more than {first})")
    if args.ddp_val_every < 2:
        raise ValueError(f"--ddp-val-every must be 2 or more, got {args.ddp_val_every}: "
                         "a step that ends without an evaluation times the training")
    if args.ddp_steps <= args.warmup:
        raise ValueError(f"--ddp-steps {args.ddp_steps} must be more than --warmup "
                         f"{args.warmup}")
    for name, period, steps, every in (("--steps", args.H, args.steps, args.val_every),
                                       ("--ddp-steps", 1, args.ddp_steps, args.ddp_val_every)):
        start = -(-args.warmup // period) * period
        if all(end % every == 0 for end in range(start + period, steps, period)):
            raise ValueError(f"{name} {steps}: every period after the warm-up ends with an "
                             "evaluation, and only those that do not time the training: "
                             "give more steps")


def requirements() -> list[str]:
    """What this machine lacks to run the bench, each with its fix."""
    problems = check_requirements(pin=True)
    if not (CPU_CGROUP / "cpu.cfs_quota_us").exists():
        problems.append(f"the cgroup v1 cpu controller is not mounted at {CPU_CGROUP}: "
                        f"mount -t cgroup -o cpu cgroup {CPU_CGROUP}")
    if (os.cpu_count() or 1) < 2:
        problems.append("two hosts need two cores of their own")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problems = requirements()
    if problems:
        print("bench/balance_hosts.py cannot run here:\n"
              + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 2
    try:
        check_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    out = Path(args.out).resolve()
    code = 0
    with signals_raise() as state:
        bed: Testbed | None = None
        group: SlowGroup | None = None
        try:
            stale = reap_stale_beds()
            stale += reap_stale_groups()
            if stale:
                print("removed what an earlier benchmark left behind: " + ", ".join(stale),
                      flush=True)
            bed = Testbed(2, args.subnet, pin=True)
            bed.build()
            group = SlowGroup(f"{PREFIX}-{bed.tag}-slow", args.slow)
            group.create()
            slow_host = bed.hosts[SLOW]
            for pid in bed.pids(slow_host):  # its sshd: every rank it starts inherits the group
                group.add(pid)
            print(f"hosts {bed.hosts[FAST].address} (fast, core {bed.hosts[FAST].cpu}) and "
                  f"{slow_host.address} (core {slow_host.cpu}, cpu group {group.path}: "
                  f"quota {round(PERIOD_US * args.slow)} of {PERIOD_US} us; members "
                  f"{group.members()}); links {args.rate}", flush=True)
            bed.shape(args.rate)
            bench = BalanceBench(bed, args, out)
            shutil.rmtree(out / "logs", ignore_errors=True)  # rank logs of an earlier run
            runs = run_all(bench, group, args)
            rows = summarize(runs)
            print()
            print_table(rows, args)
            path = atomic_write_json(out / "results.json", {
                "created": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": vars(args) | {
                    "out": str(out)}, "runs": runs, "rows": rows})
            print(f"wrote {path}")
        except Interrupted as exc:
            print(f"\ninterrupted by {exc}: stopping", file=sys.stderr, flush=True)
            code = 130
        except (BenchError, TestbedError, ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            code = 1
        finally:
            state["cleaning"] = True
            try:
                if bed is not None:
                    bed.close()
                    left = bed.leftovers()
                    if left:
                        print("could not remove: " + ", ".join(left), file=sys.stderr)
                        code = code or 1
            finally:
                if group is not None and group.path.exists():
                    group.remove()
                    print(f"removed {group.path}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
