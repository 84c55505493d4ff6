"""The rounds of ``bench.multihost``: links measured, baselines without communication, then
every strategy on every link; the rounds merged by their medians."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

from bench.harness.jobs import Bench, wait_for_quiet
from bench.harness.strategies import StrategyCase
from bench.harness.timing import Window, with_medians
from tests.netbed import Testbed, rate_bits

FORMAT = "exogym-multihost/1"


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
                  out: Path) -> dict[str, Any]:
    """Measure links, then baselines and every (rate, strategy) ``--repeat`` times.

    Returns the results document: every round as measured, and the medians.
    """
    bench = Bench(bed, args, out)
    say = bench.say
    shutil.rmtree(out / "logs", ignore_errors=True)  # a previous benchmark's rank logs
    hosts = args.hosts
    model = model_facts(args.profile, list(args.set))
    say(f"model: {model['task']} with {model['num_params']:,} trainable parameters; "
        f"batch {args.batch_size} per host; {hosts} hosts"
        + (", each pinned to its own core" if bed.pin else ", NOT pinned (sharing cores)"))
    say("latency is not emulated (no netem in this kernel): links add bandwidth limits only")
    results: dict[str, Any] = {
        "format": FORMAT, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "hosts": hosts,
        "batch_size": args.batch_size, "model": model,
        "settings": {"rates": args.rates, "strategies": [c.label for c in cases],
                     "warmup": args.warmup, "window": args.window, "periods": args.periods,
                     "repeat": args.repeat, "queue": args.queue, "overrides": list(args.set),
                     "pinned": bed.pin},
        "machine": {"cores": os.cpu_count(), "kernel": platform.release(),
                    "python": platform.python_version(),
                    "load_at_start": list(os.getloadavg())},
        "links": [], "baselines": {}, "runs": [],
    }

    say("links:")
    wait_for_quiet(bed, args.quiet_cores, bench.budget, say)  # the probes need CPU too
    for rate in args.rates:
        bed.shape(rate)
        link = bed.measure_link(args.probe_seconds)
        results["links"].append({
            "rate": rate, "rate_bits": rate_bits(rate),
            "goodput_bytes_per_s": link.goodput_bytes_per_s, "rtt_s": link.rtt_s,
            "overhead": link.overhead})
        say(f"  {rate}: goodput {link.goodput_bytes_per_s * 8 / 1e6:.1f} Mbit/s per host "
            f"(both directions busy), round trip {link.rtt_s * 1e6:.0f} us, "
            f"protocol overhead {link.overhead:.1%}")

    results["rounds"] = []
    for number in range(1, args.repeat + 1):
        if args.repeat > 1:
            say(f"round {number} of {args.repeat}:")
        results["rounds"].append(run_round(bench, cases, results["links"], model))
    results["baselines"], results["runs"] = merge_rounds(results["rounds"])
    results["machine"]["load_at_end"] = list(os.getloadavg())
    return results


#: Overrides under which every host trains on its own: a DiLoCo round that never comes.
ALONE = ["strategy=diloco", "H=1000000000"]
#: Rank environment under which a strategy does its own work but sends nothing.
MIRROR = {"EXOGYM_COLLECTIVES": "mirror"}


def run_baselines(bench: Bench, cases: list[StrategyCase]) -> dict[str, Any]:
    """Figures without communication, every host at once: compute per step, and the reference.

    Every baseline runs on all hosts at once, each host training alone, and is
    averaged over the hosts: the hosts of this machine share its memory
    bandwidth and caches, so a host measured while the others idle would be
    faster than any host of the multi-host runs. AdamW's compute time (DDP's
    and DiLoCo's local work) and the reference train alone with
    :data:`ALONE`. SPARTA and DeMo run themselves with mirrored collectives
    (:data:`MIRROR`): their index selection, packing, compression and decoding
    are done every step, for ``N`` hosts, while nothing is sent and no host
    waits for another.
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
        job = bench.run_job(f"compute {kind}", hosts, [
            *bench.common_overrides(plain, args.batch_size, kind), *overrides], plain, env)
        baselines[kind] = job.to_dict()
        say(f"    {job.step_s:.3f} s per step (sd {job.step_sd_s:.3f} s)")
    job = bench.run_job("reference", hosts, [
        *bench.common_overrides(plain, hosts * args.batch_size, "reference"), *ALONE,
        f"minibatch_size={args.batch_size}"], plain)
    baselines["reference"] = {**job.to_dict(), "minibatches": hosts}
    say(f"    {job.step_s:.3f} s per step for {hosts} minibatches of {args.batch_size}")
    return baselines


def run_round(bench: Bench, cases: list[StrategyCase], links: list[dict[str, Any]],
              model: dict[str, Any]) -> dict[str, Any]:
    """One pass over every rate: its baselines, then every strategy on ``--hosts`` hosts.

    The baselines are measured again for every rate, just before its runs, and
    a run's speedup and comm share use them: this machine's speed drifts from
    minute to minute, and a baseline far away in time would carry that drift
    into the ratio.
    """
    from distributed.planning.projection import bytes_per_step

    args, say, hosts = bench.args, bench.say, bench.args.hosts
    blocks: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for link in links:
        rate = link["rate"]
        say(f"{rate}:")
        baselines = run_baselines(bench, cases)
        blocks.append({"rate": rate, "baselines": baselines})
        reference_s = baselines["reference"]["step_s"]
        bench.bed.shape(rate)
        say(f"  {hosts} hosts at {rate}:")
        for case in cases:
            window = Window.for_period(case.period, args.warmup, args.window, args.periods)
            job = bench.run_job(f"{case.label} @ {rate}", hosts, [
                *bench.common_overrides(window, args.batch_size, case.slug), *case.overrides()],
                window)
            compute = baselines[case.compute]
            formula = bytes_per_step(case.name, model["num_params"], hosts,
                                     **case.projection_settings(model["shapes"]))
            expected = formula * (1 + link["overhead"])
            run = {**job.to_dict(), "label": case.label, "strategy": case.name,
                   "settings": case.settings, "period": case.period, "compute": case.compute,
                   "rate": rate, "speedup": reference_s / job.step_s,
                   "comm_fraction": max(0.0, 1 - compute["step_s"] / job.step_s),
                   "compute_s": compute["step_s"], "compute_sd_s": compute["step_sd_s"],
                   "reference_s": reference_s,
                   "formula_bytes_per_step": formula,
                   "wire_ratio": job.wire_bytes_per_step / expected if expected else None}
            runs.append(run)
            say(f"    {job.step_s:.3f} s per step, speedup {run['speedup']:.2f}x, "
                f"comm {run['comm_fraction']:.0%}, wire {job.wire_bytes_per_step / 1e3:,.1f} kB "
                f"per host per step (formula {formula / 1e3:,.1f} kB), "
                f"val loss {job.val_loss if job.val_loss is None else round(job.val_loss, 3)}, "
                f"other load {job.other_cores:.2f} cores")
    return {"blocks": blocks, "runs": runs}


#: Figures that are combined over rounds by their median (the rest are taken from round 1,
#: except "other_cores", the largest).
MEDIAN_FIELDS = ("step_s", "step_sd_s", "counted_bytes_per_step", "wire_bytes_per_step",
                 "launcher_bytes_per_step", "speedup", "comm_fraction", "wire_ratio", "wall_s",
                 "compute_s", "compute_sd_s", "reference_s")


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
