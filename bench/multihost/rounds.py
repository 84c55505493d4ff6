"""The rounds of ``bench.multihost``: links measured, baselines without communication, then
every strategy on every link, each timed per step and to the target loss; the rounds merged
by their medians."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

from bench.harness.jobs import Bench, BenchError, JobResult, wait_for_quiet
from bench.harness.slow_host import SlowGroup
from bench.harness.strategies import StrategyCase
from bench.harness.timing import Window, time_to_loss, with_medians
from bench.multihost.links import measure_held_ring
from tests.netbed import Testbed, rate_bits

FORMAT = "exogym-multihost/2"


def share_used(job: JobResult, share: float) -> float:
    """The part of their quota the hosts' processes used during the window: 1.0 when every
    host was busy its whole share (a host waiting for a peer uses less)."""
    return job.host_cores / (job.hosts * share)


def check_groups(job: JobResult, groups: list[SlowGroup]) -> None:
    """BenchError unless every rank of ``job`` ran in its host's group."""
    wanted = {i: "/" + group.path.name for i, group in enumerate(groups[:job.hosts])}
    if job.groups != wanted:
        raise BenchError(f"{job.name}: ranks ran in cpu groups {job.groups}, expected {wanted}: "
                         "a rank escaped its host's share")


def model_facts(profile: str, overrides: list[str]) -> dict[str, Any]:
    """Parameter count and tensor shapes of the profile's model (built here, once)."""
    from distributed.profiles.profile import load_profile, parse_overrides

    loaded = load_profile(profile, overrides=parse_overrides(overrides))
    task_kwargs = loaded.resolved.task_kwargs
    model, _, _ = loaded.resolved.task_fn(**task_kwargs)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"profile": profile, "task": loaded.task, "task_settings": task_kwargs,
            "num_params": sum(p.numel() for p in trainable),
            "shapes": [list(p.shape) for p in trainable]}


def run_benchmark(bed: Testbed, args: argparse.Namespace, cases: list[StrategyCase],
                  out: Path, groups: list[SlowGroup]) -> dict[str, Any]:
    """Measure links, then baselines and every (rate, strategy) ``--repeat`` times, every
    host held to ``args.share`` of a core by its group in ``groups``.

    Returns the results document: every round as measured, and the medians.
    """
    bench = Bench(bed, args, out)
    say = bench.say
    shutil.rmtree(out / "logs", ignore_errors=True)  # a previous benchmark's rank logs
    hosts = args.hosts
    model = model_facts(args.profile, list(args.set))
    say(f"model: {model['task']} with {model['num_params']:,} trainable parameters; "
        f"batch {args.batch_size} per host; {hosts} hosts"
        + f", each held to {args.share:g} of a core (cgroup cpu quota)"
        + (" and pinned to its own core" if bed.pin else ""))
    say("latency is not emulated (no netem in this kernel): links add bandwidth limits only")
    results: dict[str, Any] = {
        "format": FORMAT, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "hosts": hosts,
        "batch_size": args.batch_size, "model": model,
        "settings": {"rates": args.rates, "strategies": [c.label for c in cases],
                     "warmup": args.warmup, "window": args.window, "periods": args.periods,
                     "repeat": args.repeat, "queue": args.queue, "overrides": list(args.set),
                     "pinned": bed.pin, "share": args.share, "val_every": args.val_every,
                     "target_loss": args.target_loss},
        "machine": {"cores": os.cpu_count(), "kernel": platform.release(),
                    "python": platform.python_version(),
                    "load_at_start": list(os.getloadavg())},
        "links": [], "baselines": {}, "runs": [],
    }

    say("links:")
    wait_for_quiet(bed, args.quiet_cores, bench.budget, say)  # the probes need CPU too
    for rate in args.rates:
        bed.shape(rate)
        link = measure_held_ring(bed, groups, args.probe_seconds)
        results["links"].append({
            "rate": rate, "rate_bits": rate_bits(rate),
            "goodput_bytes_per_s": link.goodput_bytes_per_s, "rtt_s": link.rtt_s,
            "overhead": link.overhead})
        say(f"  {rate}: goodput {link.goodput_bytes_per_s * 8 / 1e6:.1f} Mbit/s per host "
            f"(both directions busy), round trip {link.rtt_s * 1e6:.0f} us, "
            f"protocol overhead {link.overhead:.1%}")

    results["rounds"] = []
    results["target"] = {"loss": args.target_loss, "given": args.target_loss is not None}
    for number in range(1, args.repeat + 1):
        if args.repeat > 1:
            say(f"round {number} of {args.repeat}:")
        results["rounds"].append(run_round(bench, cases, results["links"], model,
                                           results["target"], groups))
    results["baselines"], results["runs"] = merge_rounds(results["rounds"])
    results["machine"]["load_at_end"] = list(os.getloadavg())
    return results


#: Overrides under which every host trains on its own: a DiLoCo round that never comes.
ALONE = ["strategy=diloco", "H=1000000000"]
#: Rank environment under which a strategy does its own work but sends nothing.
MIRROR = {"EXOGYM_COLLECTIVES": "mirror"}


def run_baselines(bench: Bench, cases: list[StrategyCase],
                  groups: list[SlowGroup]) -> dict[str, Any]:
    """Figures without communication, every host at once: compute per step, and the reference.

    Every baseline runs on all hosts at once, each host training alone, and is
    averaged over the hosts: the hosts of this machine share its memory
    bandwidth and caches, so a host measured while the others idle would be
    faster than any host of the multi-host runs. AdamW's compute time (DDP's
    and DiLoCo's local work) and the reference train alone with
    :data:`ALONE`. SPARTA and DeMo run themselves with mirrored collectives
    (:data:`MIRROR`): their index selection, packing, compression and decoding
    are done every step, for ``N`` hosts, while nothing is sent and no host
    waits for another. The reference evaluates rank 0's model at the window's
    end: the default target loss.
    """
    args, say, hosts = bench.args, bench.say, bench.args.hosts
    baselines: dict[str, Any] = {}
    say("  baselines, no communication:")
    plain = Window.for_period(1, args.warmup, args.window, 1)
    kinds: dict[str, tuple[list[str], dict[str, str]]] = {"adamw": (ALONE, {})}
    for case in cases:
        if case.compute != "adamw":
            kinds.setdefault(case.compute, (case.overrides(), MIRROR))
    for kind, (overrides, env) in kinds.items():
        bench.eval_every = None  # evaluated after the window only
        job = bench.run_job(f"compute {kind}", hosts, [
            *bench.common_overrides(plain, args.batch_size, kind), *overrides], plain, env)
        check_groups(job, groups)
        baselines[kind] = {**job.to_dict(), "share_used": share_used(job, args.share)}
        say(f"    {job.step_s:.3f} s per step (sd {job.step_sd_s:.3f} s); hosts used "
            f"{share_used(job, args.share):.0%} of their quota; other load "
            f"{job.other_cores:.2f} cores")
    bench.eval_every = plain.s1  # evaluated at the window's end too: the default target
    job = bench.run_job("reference", hosts, [
        *bench.common_overrides(plain, hosts * args.batch_size, "reference"), *ALONE,
        f"minibatch_size={args.batch_size}", f"val_interval={plain.s1}"], plain)
    check_groups(job, groups)
    # rank 0's own model: the others trained alone too, and their average is no reference
    curve = [(step, clock, own) for step, clock, _, own in job.val_curve]
    at_end = [point for point in curve if point[0] <= plain.s1]
    baselines["reference"] = {**job.to_dict(), "minibatches": hosts, "curve": curve,
                              "end_loss": at_end[-1][2] if at_end else None,
                              "share_used": share_used(job, args.share)}
    say(f"    {job.step_s:.3f} s per step for {hosts} minibatches of {args.batch_size}; "
        f"val loss {baselines['reference']['end_loss']} at step {plain.s1}; hosts used "
        f"{share_used(job, args.share):.0%} of their quota; other load "
        f"{job.other_cores:.2f} cores")
    return baselines


def to_target(curve: list[tuple[float, float, float]], target: float | None
              ) -> tuple[float | None, float | None]:
    """(steps, seconds of training) at which ``curve`` (step, clock, loss) first reaches
    ``target``, linear between evaluations; None when it does not."""
    if target is None:
        return None, None
    steps = time_to_loss([(p[0], p[2]) for p in curve], target)
    seconds = time_to_loss([(p[1], p[2]) for p in curve], target)
    return steps, seconds


def run_round(bench: Bench, cases: list[StrategyCase], links: list[dict[str, Any]],
              model: dict[str, Any], target: dict[str, Any],
              groups: list[SlowGroup]) -> dict[str, Any]:
    """One pass over every rate: its baselines, then every strategy on ``--hosts`` hosts.

    The baselines are measured again for every rate, just before its runs, and
    a run's speedup and comm share use them: this machine's speed drifts from
    minute to minute, and a baseline far away in time would carry that drift
    into the ratio. ``target['loss']``, when None, is set to the first
    reference's validation loss at its window's end.
    """
    from distributed.planning.projection import bytes_per_step

    args, say, hosts = bench.args, bench.say, bench.args.hosts
    blocks: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for link in links:
        rate = link["rate"]
        say(f"{rate}:")
        baselines = run_baselines(bench, cases, groups)
        blocks.append({"rate": rate, "baselines": baselines})
        reference = baselines["reference"]
        reference_s = reference["step_s"]
        if target["loss"] is None:
            target.update(loss=reference["end_loss"], step=reference["window"][1])
        ref_steps, ref_time = to_target(reference["curve"], target["loss"])
        bench.bed.shape(rate)
        say(f"  {hosts} hosts at {rate}:")
        for case in cases:
            window = Window.for_period(case.period, args.warmup, args.window, args.periods)
            bench.eval_every = args.val_every  # evaluated inside the window, for the target
            job = bench.run_job(f"{case.label} @ {rate}", hosts, [
                *bench.common_overrides(window, args.batch_size, case.slug), *case.overrides(),
                f"val_interval={args.val_every}"], window)
            check_groups(job, groups)
            compute = baselines[case.compute]
            formula = bytes_per_step(case.name, model["num_params"], hosts,
                                     **case.projection_settings(model["shapes"]))
            expected = formula * (1 + link["overhead"])
            curve = [(step, clock, loss) for step, clock, loss, _ in job.val_curve]
            steps, seconds = to_target(curve, target["loss"])
            run = {**job.to_dict(), "label": case.label, "strategy": case.name,
                   "settings": case.settings, "period": case.period, "compute": case.compute,
                   "rate": rate, "speedup": reference_s / job.step_s,
                   "comm_fraction": max(0.0, 1 - compute["step_s"] / job.step_s),
                   "compute_s": compute["step_s"], "compute_sd_s": compute["step_sd_s"],
                   "reference_s": reference_s,
                   "formula_bytes_per_step": formula,
                   "wire_ratio": job.wire_bytes_per_step / expected if expected else None,
                   "curve": curve, "target_loss": target["loss"],
                   "steps_to_target": steps, "time_to_target_s": seconds,
                   "reference_steps_to_target": ref_steps,
                   "reference_time_to_target_s": ref_time,
                   "loss_speedup": ref_time / seconds if ref_time and seconds else None,
                   "share_used": share_used(job, args.share)}
            runs.append(run)
            reached = "not reached" if seconds is None else \
                f"{seconds:.1f} s (step {steps:.0f}; reference {ref_time or float('nan'):.1f} s)"
            say(f"    {job.step_s:.3f} s per step, speedup {run['speedup']:.2f}x, "
                f"comm {run['comm_fraction']:.0%}, wire {job.wire_bytes_per_step / 1e3:,.1f} kB "
                f"per host per step (formula {formula / 1e3:,.1f} kB), "
                f"val loss {job.val_loss if job.val_loss is None else round(job.val_loss, 3)}, "
                f"to {target['loss'] or float('nan'):.3f}: {reached}, hosts used "
                f"{run['share_used']:.0%} of their quota, other load {job.other_cores:.2f} cores")
    return {"blocks": blocks, "runs": runs}


#: Figures that are combined over rounds by their median (the rest are taken from round 1,
#: except "other_cores", the largest).
MEDIAN_FIELDS = ("step_s", "step_sd_s", "counted_bytes_per_step", "wire_bytes_per_step",
                 "launcher_bytes_per_step", "speedup", "comm_fraction", "wire_ratio", "wall_s",
                 "compute_s", "compute_sd_s", "reference_s", "steps_to_target",
                 "time_to_target_s", "reference_steps_to_target",
                 "reference_time_to_target_s", "loss_speedup", "share_used")


def _merge(items: list[dict[str, Any]]) -> dict[str, Any]:
    merged = with_medians(items[0], items, MEDIAN_FIELDS)
    merged["other_cores"] = max(item["other_cores"] for item in items)
    merged["repeats"] = len(items)
    if "speedup" in merged:
        merged["speedup_range"] = [min(i["speedup"] for i in items),
                                   max(i["speedup"] for i in items)]
    merged["step_s_each"] = [item["step_s"] for item in items]
    return merged


def merge_rounds(rounds: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Baselines and runs over every round: medians, the speedup's range, every step time."""
    blocks = [block["baselines"] for r in rounds for block in r["blocks"]]
    baselines = {kind: _merge([b[kind] for b in blocks]) for kind in blocks[0]}
    runs = [_merge([r["runs"][i] for r in rounds]) for i in range(len(rounds[0]["runs"]))]
    return baselines, runs
