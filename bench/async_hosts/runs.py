"""One run of ``bench.async_hosts``: launched on the bed, a host lost and back, its figures."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness.elastic_job import ElasticJob
from bench.harness.jobs import BenchError, bench_pids, wait_for_quiet
from bench.harness.machine import CpuSample
from bench.harness.outage import HostOutage
from bench.harness.slow_host import SlowGroup, cpu_cgroup_of
from bench.harness.timing import steps_by_rank
from tests.netbed import Testbed, worker_pid

SLOW, LOST = 1, 2  # host indices (and ranks): host 0 is the master, never lost
#: Seconds a run may take to start its ranks and train its first step.
START_S = 240.0

Event = dict[str, Any]


def overrides(strategy: str, args: argparse.Namespace, output_dir: Path) -> list[str]:
    """The profile overrides of a run with ``strategy`` (``diloco`` or ``async_diloco``)."""
    common = [f"H={args.H}", "num_nodes=3", f"batch_size={args.batch_size}",
              f"val_interval={args.val_every}", f"val_size={args.val_size}", "num_threads=1",
              "checkpoint_interval=None", f"output_dir={output_dir}", *args.set]
    if strategy == "diloco":
        return ["strategy=diloco", f"max_steps={args.steps}", *common]
    return ["strategy=async_diloco", f"max_steps={args.async_steps}",
            f"quorum={args.quorum}", f"grace_s={args.grace_s}",
            f"max_staleness={args.max_staleness}", "weighting=tokens",
            f"adaptive_H={'true' if args.adaptive_H else 'false'}", *common]


def _wait(job: ElasticJob, test: Callable[[Event], bool], timeout: float, what: str,
          after: float = 0.0) -> tuple[float, Event]:
    """The first event passing ``test``; BenchError naming ``what`` when the launcher ends
    first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        found = job.events.first(test, min(2.0, max(0.0, deadline - time.monotonic())), after)
        if found is not None:
            return found
        assert job.proc is not None
        if job.proc.poll() is not None:
            found = job.events.first(test, 1.0, after)  # the last lines, read
            if found is not None:
                return found
            raise BenchError(f"the run ended before {what}; launcher log {job.log_path}")
        if time.monotonic() >= deadline:
            raise BenchError(f"no {what} within {timeout:.0f} s; launcher log {job.log_path}")


def run_case(bed: Testbed, strategy: str, args: argparse.Namespace, group: SlowGroup,
             number: int, out: Path, budget: dict[str, float],
             say: Callable[[str], None],
             held: dict[int, SlowGroup] | None = None) -> dict[str, Any]:
    """Launch one run, lose host 2 at ``--kill-at`` s for ``--away`` s, return its figures.

    Waits first (within ``budget['left']`` seconds, shared by the runs) until other
    processes keep fewer than ``--quiet-cores`` cores busy. ``held`` (``--fast``): the
    groups holding hosts 0 and 2 to part of a core; the launcher (and so rank 0, which
    it starts beside it) joins host 0's, and host 2's sshd joins its group again when
    it is back.
    """
    held = held or {}
    slug = f"{number}-{strategy}"
    folder = bed.workdir / slug
    output_dir = bed.workdir / "out" / slug
    steps = args.steps if strategy == "diloco" else args.async_steps
    job = ElasticJob(bed, args.profile, overrides(strategy, args, output_dir), folder,
                     min_nodes=2, port=29600 + number)
    waited = time.monotonic()
    wait_for_quiet(bed, args.quiet_cores, budget, say)
    waited = time.monotonic() - waited
    throttled = group.throttled_s()
    held_before = {rank: g.throttled_s() for rank, g in held.items()}
    say(f"  {strategy}: {steps} steps, host {LOST} lost at {args.kill_at:g} s of training "
        f"for {args.away:g} s")
    with job:
        job.start()
        assert job.proc is not None
        if 0 in held:  # before the launcher (busy with its pre-flight) starts rank 0
            held[0].add(job.proc.pid)
        started = time.monotonic()
        arrived, first = _wait(job, lambda e: e.get("event") == "step" and e.get("rank") == 0,
                               START_S, "rank 0's first step")
        _check_groups(held, str(output_dir))
        before = CpuSample.take(bench_pids(bed))
        # Rank 0's clock started when its loop did: the kill comes at --kill-at on that
        # clock, whatever step rank 0 is at (it may wait at a round's end for long).
        loop_start = arrived - first["wall_s"]
        while time.monotonic() < loop_start + args.kill_at:
            if job.proc is not None and job.proc.poll() is not None:
                raise BenchError(f"the run ended before {args.kill_at:g} s of training; "
                                 f"launcher log {job.log_path}")
            time.sleep(min(0.5, max(0.0, loop_start + args.kill_at - time.monotonic())))
        at_kill = {"step": max(e["step"] for _, e in job.events.of("step", rank=0)),
                   "wall_s": time.monotonic() - loop_start}
        other_cores = before.other_cores(CpuSample.take(bench_pids(bed)))
        outage = HostOutage(bed, bed.hosts[LOST], LOST, str(output_dir))
        try:
            hit = outage.hit()
            say(f"    step {at_kill['step']}, {at_kill['wall_s']:.1f} s: host {LOST}'s sshd "
                f"stopped, rank {LOST} (pid {outage.killed}) killed")
            time.sleep(max(0.0, args.away - (time.monotonic() - hit)))
        finally:
            back = outage.back()
            if LOST in held:  # the new sshd starts the rank again: in its group
                for pid in bed.pids(bed.hosts[LOST]):
                    held[LOST].add(pid)
        say(f"    {back - hit:.1f} s later: host {LOST}'s sshd answers again")
        result = job.wait(timeout=args.run_timeout - (time.monotonic() - started))
    _keep_logs(folder, out / "logs" / slug)
    if not result["ok"]:
        raise BenchError(f"{strategy}: the run failed: {result['describe']}\n"
                         f"logs in {out / 'logs' / slug}")
    summary_path = output_dir / "summary.json"
    if not summary_path.exists():
        raise BenchError(f"{strategy}: no summary.json in {output_dir}")
    summary = json.loads(summary_path.read_text())
    return figures(strategy, job, summary, at_kill, hit, back, steps) | {
        "throttled_s": group.throttled_s() - throttled, "other_cores": other_cores,
        "held_throttled_s": {str(rank): g.throttled_s() - held_before[rank]
                             for rank, g in held.items()},
        "waited_for_quiet_s": waited}


def _check_groups(held: dict[int, SlowGroup], marker: str) -> None:
    """BenchError unless the ranks of the held hosts run in their hosts' groups."""
    for rank, group in held.items():
        pid = worker_pid(rank, marker)
        where = None if pid is None else cpu_cgroup_of(pid)
        if where is None or where.strip("/") != group.path.name:
            raise BenchError(f"rank {rank} (pid {pid}) runs in cpu group {where}, not in "
                             f"{group.path}: its host is not held to {group.fraction:g} of a "
                             "core")


def figures(strategy: str, job: ElasticJob, summary: dict[str, Any], at_kill: Event,
            hit: float, back: float, steps: int) -> dict[str, Any]:
    """What a finished run measured (the package's docstring defines each figure)."""
    items = job.events.items
    by_rank = steps_by_rank(e for _, e in items if e.get("event") == "step")
    if 0 not in by_rank or steps not in by_rank[0]:
        raise BenchError(f"{strategy}: rank 0 reported no step {steps}")
    rank0 = by_rank[0]
    curve = [(e["wall_s"], e["val_global_loss"]) for _, e in sorted(rank0.items())
             if e.get("val_global_loss") is not None]
    readmitted = next(((t, e) for t, e in items if t >= back and e.get("event") == "membership"
                       and LOST in e.get("ranks", [])), None)
    lost = next(((t, e) for t, e in items if t >= hit and e.get("event") == "membership"
                 and LOST not in e.get("ranks", [LOST])), None)
    trained = {rank: sum(1 for e in mine.values() if not e.get("idle"))
               for rank, mine in by_rank.items()}
    return {
        "strategy": strategy, "steps": steps, "curve": curve,
        "final_val": summary.get("final_val_global_loss"),
        "wall_s": rank0[steps]["wall_s"],
        "kill": {"step": at_kill["step"], "wall_s": at_kill["wall_s"]},
        "lost_after_s": None if lost is None else lost[0] - hit,
        "lost_step": None if lost is None else lost[1].get("step"),
        "readmitted_after_s": None if readmitted is None else readmitted[0] - back,
        "readmitted_step": None if readmitted is None else readmitted[1].get("step"),
        "membership": [(m["step"], m["ranks"]) for m in summary.get("membership", [])],
        "merges": _merges(summary.get("merges")),
        "trained_steps": {str(r): n for r, n in sorted(trained.items())},
        "step_compute_s": {str(r): statistics.median(
            [e["compute_s"] for e in mine.values() if not e.get("idle")] or [0.0])
            for r, mine in sorted(by_rank.items())},
        "speeds": {str(r): mine[max(mine)].get("measured_speed")
                   for r, mine in sorted(by_rank.items())},
    }


def _merges(merges: dict[str, Any] | None) -> dict[str, Any] | None:
    if merges is None:
        return None
    keep = ("versions", "merged", "steps", "dropped", "dropped_steps", "dropped_tokens",
            "staleness_max", "staleness_mean", "ranks")
    out = {key: merges[key] for key in keep}
    out["left"] = [gone for r in merges["rounds"] for gone in r.get("left", [])]
    out["contributors"] = [len(r["contributors"]) for r in merges["rounds"]]
    return out


def _keep_logs(folder: Path, target: Path) -> None:
    """The launcher's log and events and the ranks' logs, kept beyond the bed."""
    target.mkdir(parents=True, exist_ok=True)
    for path in [*folder.glob("*.log"), *folder.glob("*.jsonl"), *folder.glob("launcher.out"),
                 *folder.glob("launch/rank*.log"), *folder.glob("launch/launch.json")]:
        shutil.copy2(path, target / path.name)
