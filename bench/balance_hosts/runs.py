"""The runs of ``bench.balance_hosts``: each case launched on the bed, and its figures."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

from bench.harness.jobs import Bench, BenchError
from bench.harness.machine import own_cpu_s
from bench.harness.slow_host import RankWatch, SlowGroup
from bench.harness.timing import StepEvents, Window, loss_at, round_up, steps_by_rank, time_to_loss

FAST, SLOW = 0, 1  # host indices (and ranks): host 0 is the master


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


def case_settings(case: Case, args: argparse.Namespace
                  ) -> tuple[Window, int, int, list[str]]:
    """The window, period (steps between communications), batch size and overrides."""
    if case.strategy == "diloco":
        period, steps, batch, every = args.H, args.steps, args.batch_size, args.val_every
        strategy = ["strategy=diloco", f"H={args.H}"]
    else:
        period, steps, batch, every = 1, args.ddp_steps, args.ddp_batch, args.ddp_val_every
        strategy = ["strategy=ddp"]
    start = round_up(args.warmup, period)
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
    def of(cls, by_rank: StepEvents, window: Window,
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


def run_case(bench: Bench, case: Case, group: SlowGroup, args: argparse.Namespace,
             pass_number: int) -> dict[str, Any]:
    """Launch ``case``, return its figures (module docstring) and where its ranks ran."""
    window, period, batch, overrides = case_settings(case, args)
    slug = f"{case.strategy}-{case.balance}-{pass_number}"
    throttled_before = group.throttled_s()
    launcher_before, started = own_cpu_s(), time.monotonic()
    with RankWatch(case.hosts, str(bench.bed.workdir / "out" / slug)) as watch:
        job = bench.run_job(f"{case.strategy} {case.label}", case.hosts,
                            [*bench.common_overrides(window, batch, slug), *overrides], window)
    launcher_cores = (own_cpu_s() - launcher_before) / (time.monotonic() - started)
    by_rank = steps_by_rank(bench.events)
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


def compare(run: dict[str, Any], alone: dict[str, Any]) -> dict[str, Any]:
    """``run``'s speedups and loss figures against the fast host alone of its pass."""
    t1, l1 = alone["train_s"], alone["final_val"]
    reach = time_to_loss(run["val_curve"], l1) if l1 is not None else None
    return {"speedup": run["throughput"] / alone["throughput"],
            "speedup_end_to_end": run["end_to_end"] / alone["end_to_end"],
            "loss_at_t1": loss_at(run["val_curve"], t1),
            "time_to_l1": reach, "speedup_to_l1": t1 / reach if reach else None}


# --------------------------------------------------------------------------- the bench


def run_all(bench: Bench, group: SlowGroup, args: argparse.Namespace
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
            f"{fmt(run['eval_s'], '.2f', ' s')}; final val loss "
            f"{fmt(run['final_val'], '.3f')} at {run['train_s']:.1f} s of training "
            f"({run['wall_s']:.1f} s in all); samples by rank "
            f"{'/'.join(map(str, run['samples_by_rank']))}, shares {joined(run['shares'])}, "
            f"measured speeds {joined(run['speeds'], '.2f')}; rank 0's steps inside a round "
            f"{fmt(run['fast_step_s'], '.3f', ' s')} (median); slow group throttled "
            f"{run['throttled_s']:.1f} s; {where}; launcher {run['launcher_cores']:.2f} cores, "
            f"other load {run['other_cores']:.2f} cores")


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` and ``suffix``; ``-`` for a figure not measured."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def joined(values: list[Any], spec: str = "") -> str:
    """One figure per rank, ``/`` between them."""
    return "/".join(fmt(v, spec) for v in values)
