"""How closely ``replay`` reproduces a real run across hosts: the digital twin, measured.

Three hosts: the master (this machine: with ``min_nodes`` the launcher must run
on the master) and two network-namespace hosts (:mod:`tests.netbed`), every link
shaped to ``--rate`` (100 Mbit/s; the master's is what it sends into the bed), the
``chargpt-bench`` profile with ``min_nodes=2``, once per strategy (DiLoCo, DDP).
In every run the first namespace host (rank 1) is slowed (its sshd, and so its
rank, in a cgroup v1 ``cpu`` group of half a core) and the second one's rank
(rank 2) is killed once by the bench itself (SIGKILL to its PID at ``--kill-at``
of the steps); the elastic launcher readmits it when its host answers. Each run is
started through ``distributed-train``'s own code (:func:`distributed.app.run.train`),
so it records its trace with the hosts' pre-flight links; then the run is
replayed here (:mod:`distributed.app.replay`) and the bench prints, real and
replay, with their ratio:

- total wall time (the reference rank's last step, evaluations included);
- the median round (``H`` steps for DiLoCo, one step for DDP);
- the time each membership change cost;
- the validation loss at each evaluation.

Targets: total and median round within 15 %, every validation loss within 2 %.

    python -m bench.twin                      # chargpt-bench, 100mbit
    python -m bench.twin --quick              # a small model, fewer steps
    python -m bench.twin --replay-only        # replay the runs in --out again, no bed

Needs root, iproute2, sshd and cgroup v1 ``cpu`` (``tests/setup_system.sh``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import ROOT
from bench.harness.session import QUICK_MODEL, on_bed
from bench.harness.slow_host import SlowGroup, cpu_cgroup_of, reap_stale_groups, slowed
from tests.netbed import Testbed, free_port, worker_pid

#: Targets: replay / real within these.
TIME_TOLERANCE = 0.15
LOSS_TOLERANCE = 0.02


class Watch:
    """A progress sink for :func:`distributed.app.run.train` that notes each rank's last
    step and, once, kills ``rank``'s process when it reaches ``kill_step``."""

    def __init__(self, rank: int, kill_step: int, marker: str, slow_rank: int = 1) -> None:
        self.rank = rank
        self.kill_step = kill_step
        self.marker = marker
        self.slow_rank = slow_rank
        #: the ``cpu`` cgroup the slowed rank's process ran in (seen at its first step)
        self.slow_cgroup: str | None = None
        self.killed: dict[str, Any] = {}
        self.steps: dict[int, int] = {}
        self.lock = threading.Lock()

    def begin_run(self, *args: Any, **kwargs: Any) -> None:
        pass

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("event") != "step":
            return
        rank, step = event.get("rank"), event.get("step", 0)
        self.steps[rank] = step
        if rank == self.slow_rank and self.slow_cgroup is None:
            pid = worker_pid(rank, self.marker)
            self.slow_cgroup = cpu_cgroup_of(pid) if pid is not None else "not found"
        with self.lock:
            if rank == self.rank and step >= self.kill_step and not self.killed:
                pid = worker_pid(rank, self.marker)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    self.killed.update(pid=pid, step=step, at=time.monotonic())

    def close(self) -> None:
        pass

    def finish(self, *args: Any, **kwargs: Any) -> None:
        pass


def run_case(bed: Testbed, strategy: str, args: argparse.Namespace, out: Path,
             group: SlowGroup) -> dict:
    """One real run on the bed, then its replay here; the comparison (``to_dict``)."""
    from rich.console import Console

    from distributed.app.run import TrainRequest, train
    from distributed.hosts.hostsfile import load_hosts

    folder = out / strategy
    if folder.exists():  # an earlier bench's run of this strategy: replaced
        import shutil

        shutil.rmtree(folder)
    steps = args.ddp_steps if strategy == "ddp" else args.steps
    overrides = {"strategy": strategy, "max_steps": steps, "batch_size": args.batch_size,
                 "val_interval": max(1, steps // args.evals), "val_size": args.val_size,
                 "num_threads": 1, "checkpoint_interval": None, "min_nodes": 2,
                 "lost_after": args.lost_after, "output_dir": str(folder), "logger": None}
    if strategy == "diloco":
        overrides["H"] = args.H
    for item in args.set:
        key, _, value = item.partition("=")
        from distributed.profiles.profile import parse_value

        overrides[key.strip()] = parse_value(value)
    config = bed.hosts_config(free_port(), launcher_is_master=True)
    hosts_file = bed.workdir / f"hosts-{strategy}.json"
    hosts_file.write_text(json.dumps(config))
    request = TrainRequest(
        profile=args.profile, overrides=overrides, hosts=load_hosts(hosts_file),
        known_hosts=str(bed.known_hosts), ssh_config=str(bed.ssh_config),
        run_dir=str(bed.workdir / "launch" / strategy),
        launcher_options={"allow_agent": False, "look_for_keys": False, "grace_period": 2,
                          "env": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    watch = Watch(len(bed.hosts), int(steps * args.kill_at), str(folder))
    log = io.StringIO()
    throttled = group.throttled_s()
    began = time.monotonic()
    print(f"{strategy}: {steps} steps on {len(bed.hosts) + 1} hosts at {args.rate}, rank 1 "
          f"at {args.slow:g} of a core, rank {watch.rank} killed at step {watch.kill_step}",
          flush=True)
    try:
        train(request, Console(file=log, width=160), live=False, web=watch)
    except BaseException:
        print(log.getvalue()[-4000:], file=sys.stderr)
        raise
    real_s = time.monotonic() - began
    throttled = round(group.throttled_s() - throttled, 2)
    print(f"  real run done in {real_s:.0f} s (killed: {watch.killed or 'not reached'}; rank 1 "
          f"in cpu cgroup {watch.slow_cgroup}, throttled {throttled:.1f} s); replaying it here",
          flush=True)
    report = replay_run(folder)
    report["bench"] = {"run_dir": str(folder), "real_run_s": real_s,
                       "slow_rank_cgroup": watch.slow_cgroup, "slow_group_throttled_s": throttled,
                       "killed": {k: v for k, v in watch.killed.items() if k != "at"}}
    return report


def replay_run(folder: Path) -> dict:
    """Replay the recorded run in ``folder`` here; the comparison (``to_dict``)."""
    from distributed.app.replay import load_recording, plan_variants, replay, write_outputs

    recording = load_recording(folder)
    began = time.monotonic()
    result = replay(recording, plan_variants(recording, [], {}, folder / "replay"))
    report, _ = write_outputs(result, folder / "replay")
    report["replay_run_s"] = round(time.monotonic() - began, 1)
    return report


def print_case(strategy: str, report: dict) -> list[str]:
    """The comparison as lines; returns the targets missed."""
    real, rep, ratios = report["real"], report["replay"], report["ratios"]
    missed = []

    def line(name: str, a: Any, b: Any, ratio: float | None, target: float | None) -> None:
        ok = "" if ratio is None or target is None else (
            "ok" if abs(ratio - 1) <= target else f"MISSED (target {target:.0%})")
        if ok.startswith("MISSED"):
            missed.append(f"{strategy} {name}")
        fa = "-" if a is None else f"{a:.4g}"
        fb = "-" if b is None else f"{b:.4g}"
        fr = "-" if ratio is None else f"{ratio:.3f}"
        print(f"  {name:<38} {fa:>10} {fb:>10} {fr:>8}  {ok}")

    print(f"\n{strategy}: real ({real['clock']} clock) vs replay; links "
          f"{report['cluster']['network']}, rank_speeds {report['cluster']['rank_speeds']}, "
          f"rank_failures {report['cluster']['rank_failures']}, evaluation "
          f"{report['cluster']['eval_s']} s, hand-overs {report['cluster']['hand_over_s']} s")
    print(f"  {'':<38} {'real':>10} {'replay':>10} {'ratio':>8}")
    line("total wall time (s)", real["wall_s"], rep["wall_s"], ratios["wall_s"], TIME_TOLERANCE)
    line(f"median round of {real['round_steps']} step(s) (s)", real["round_s_median"],
         rep["round_s_median"], ratios["round_s_median"], TIME_TOLERANCE)
    replayed = {m["step"]: m for m in rep["membership"]}
    for change in real["membership"]:
        if change["step"] > 1:
            line(f"lost at step {change['step']} ({change['reason'][:18]}) (s)",
                 change.get("lost_s"), replayed.get(change["step"], {}).get("lost_s"), None,
                 None)
    losses = dict((s, v) for s, v in rep["evaluations"])
    for (step, value), (_, ratio) in zip(real["evaluations"], ratios["val_loss"]):
        line(f"val loss at step {step}", value, losses.get(step), ratio, LOSS_TOLERANCE)
    return missed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.twin",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="chargpt-bench")
    parser.add_argument("--rate", default="100mbit", help="every host's link (tc syntax)")
    parser.add_argument("--strategies", default="diloco,ddp")
    parser.add_argument("--steps", type=int, default=200, help="DiLoCo's steps (default 200)")
    parser.add_argument("--H", type=int, default=20, help="DiLoCo's inner steps (default 20)")
    parser.add_argument("--ddp-steps", type=int, default=60, help="DDP's steps (default 60)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--val-size", type=int, default=128)
    parser.add_argument("--evals", type=int, default=4, help="evaluations per run")
    parser.add_argument("--kill-at", type=float, default=0.4,
                        help="the share of the steps at which the last host's rank is killed")
    parser.add_argument("--lost-after", type=float, default=5.0,
                        help="seconds of silence before the launcher drops a rank")
    parser.add_argument("--slow", type=float, default=0.5,
                        help="the slowed host's CPU quota, in cores (default 0.5)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--quick", action="store_true",
                        help=f"a small model ({', '.join(QUICK_MODEL)}), fewer steps")
    parser.add_argument("--replay-only", action="store_true",
                        help="build no bed and run nothing: replay the runs an earlier bench "
                             "left in --out again (after a change to the replay)")
    parser.add_argument("--subnet", default="10.213.81")
    parser.add_argument("--out", default=str(ROOT / "runs" / "twin"),
                        help="where the runs (each with its trace and replay) and twin.json "
                             "go (default runs/twin)")
    args = parser.parse_args(argv)
    if args.quick:
        args.set = [*QUICK_MODEL, *args.set]
        args.steps, args.ddp_steps = min(args.steps, 100), min(args.ddp_steps, 30)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - {"diloco", "ddp"})
    if unknown:
        parser.error(f"--strategies: {', '.join(unknown)}; this bench runs diloco and ddp")
    if not 0 < args.kill_at < 1:
        parser.error(f"--kill-at must be between 0 and 1, got {args.kill_at}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.replay_only:
        missed = []
        for strategy in strategies:
            if not (out / strategy / "trace.jsonl").is_file():
                parser.error(f"--replay-only: {out / strategy} holds no recorded run; run the "
                             "bench without --replay-only first")
        for strategy in strategies:
            missed += print_case(strategy, replay_run(out / strategy))
        print("targets missed: " + (", ".join(missed) if missed else "none"))
        return 0

    def body(bed: Testbed) -> int:
        bed.shape(args.rate)
        bed.shape_uplink(args.rate)
        with slowed(bed, bed.hosts[0], args.slow) as group:
            reports, missed = {}, []
            for strategy in strategies:
                reports[strategy] = run_case(bed, strategy, args, out, group)
                missed += print_case(strategy, reports[strategy])
            path = out / "twin.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(reports, indent=1))
            os.replace(tmp, path)
            print(f"\nwrote {path}")
            print("targets missed: " + (", ".join(missed) if missed else "none"))
            return 0

    return on_bed("python -m bench.twin", body, hosts=2, subnet=args.subnet, pin=False,
                  reap_also=reap_stale_groups)


if __name__ == "__main__":
    sys.exit(main())
