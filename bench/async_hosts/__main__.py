"""``python -m bench.async_hosts``: the command line (see the package's docstring)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import bench.async_hosts
from bench.async_hosts.runs import LOST, SLOW, run_case
from bench.harness import ROOT
from bench.harness.session import on_bed
from bench.harness.slow_host import PERIOD_US, cgroup_problems, reap_stale_groups, slowed
from bench.harness.tables import print_table
from bench.harness.timing import time_to_loss
from exogym.base.io import atomic_write_json
from tests.netbed import Testbed, rate_bits

RUNS = ("diloco", "async_diloco")
LABELS = {"diloco": "DiLoCo (synchronous)", "async_diloco": "AsyncDiLoCo"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.async_hosts",
                                     description=bench.async_hosts.__doc__.split("\n\n")[0],
                                     epilog="See the package's docstring for every definition.")
    parser.add_argument("--profile", default="chargpt-bench", help="profile in config.ini")
    parser.add_argument("--steps", type=int, default=200, help="steps of the DiLoCo run")
    parser.add_argument("--async-steps", type=int, default=None,
                        help="steps of the AsyncDiLoCo run (default: 1.5 x --steps, rounded "
                             "to whole rounds)")
    parser.add_argument("--H", type=int, default=20, help="inner steps per round (both runs)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--quorum", type=float, default=0.5,
                        help="AsyncDiLoCo's quorum: a fraction of the workers present "
                             "(0.5: 2 of 3, 1 of 2), or a count >= 1 (default 0.5)")
    parser.add_argument("--grace-s", type=float, default=0.0, help="AsyncDiLoCo's grace_s")
    parser.add_argument("--max-staleness", type=int, default=4,
                        help="AsyncDiLoCo's max_staleness (default 4)")
    parser.add_argument("--adaptive-H", action="store_true",
                        help="AsyncDiLoCo's adaptive_H: each worker's round as long as its "
                             "measured speed allows")
    parser.add_argument("--val-every", type=int, default=40,
                        help="steps between evaluations, a multiple of --H (default 40)")
    parser.add_argument("--val-size", type=int, default=128, help="validation sequences")
    parser.add_argument("--target", type=float, default=None,
                        help="validation loss to reach (default: the DiLoCo run's final one)")
    parser.add_argument("--kill-at", type=float, default=45.0,
                        help="seconds of rank 0's training at which host 2 is lost (default 45)")
    parser.add_argument("--away", type=float, default=15.0,
                        help="seconds host 2 stays away before its sshd is back (default 15)")
    parser.add_argument("--slow", type=float, default=0.5,
                        help="host 1's CPU quota, a fraction of one core (default 0.5)")
    parser.add_argument("--fast", type=float, default=None,
                        help="hosts 0 and 2 each held to this fraction of a core too (default: "
                             "not held, they share the machine's cores): hosts with a core "
                             "of their own, scaled to fit this machine")
    parser.add_argument("--rate", default="100mbit", help="every link's rate, tc syntax")
    parser.add_argument("--queue", default="100ms", help="tbf queue of each link (tc latency)")
    parser.add_argument("--run-timeout", type=float, default=900.0,
                        help="seconds a run may take in all before it is stopped (default 900)")
    parser.add_argument("--quiet-cores", type=float, default=0.5,
                        help="before each run, wait until other processes keep fewer cores "
                             "busy (default 0.5)")
    parser.add_argument("--wait-max", type=float, default=600.0,
                        help="seconds in all to wait for a quiet machine (default 600)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="profile override for both runs (e.g. n_layer=2)")
    parser.add_argument("--subnet", default="10.213.83", help="the hosts' /24 (three octets)")
    parser.add_argument("--report", metavar="RESULTS", default=None,
                        help="print the comparison of a results.json written earlier (with "
                             "--target: against that loss) instead of running")
    parser.add_argument("--out", default=str(ROOT / "runs" / "async-hosts"),
                        help="output folder (default runs/async-hosts)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first option that cannot work."""
    rate_bits(args.rate)
    if args.async_steps is None:
        args.async_steps = round(1.5 * args.steps / args.H) * args.H
    if not 0 < args.slow < 1:
        raise ValueError(f"--slow must be a fraction between 0 and 1, got {args.slow}")
    if args.fast is not None and not args.slow < args.fast <= 1:
        raise ValueError(f"--fast must be a fraction above --slow {args.slow:g} and at most 1, "
                         f"got {args.fast}")
    if min(args.H, args.batch_size, args.val_size, args.max_staleness + 1) < 1:
        raise ValueError("--H, --batch-size and --val-size must be >= 1, --max-staleness >= 0")
    if args.quorum <= 0 or (args.quorum > 1 and not args.quorum.is_integer()) \
            or args.quorum > 3:
        raise ValueError(f"--quorum {args.quorum:g}: give a fraction in (0, 1] or a count "
                         "of workers 1..3")
    args.quorum = int(args.quorum) if args.quorum > 1 else args.quorum
    if args.val_every % args.H or args.val_every < args.H:
        raise ValueError(f"--val-every {args.val_every} must be a multiple of --H {args.H}: "
                         "DiLoCo's ranks hold one model only at a round's end")
    for name, steps in (("--steps", args.steps), ("--async-steps", args.async_steps)):
        if steps < 3 * args.H:
            raise ValueError(f"{name} {steps} must be at least three rounds ({3 * args.H})")
    if args.kill_at <= 0 or args.away <= 0:
        raise ValueError("--kill-at and --away must be > 0 seconds")
    if args.run_timeout < args.kill_at + args.away + 120:
        raise ValueError(f"--run-timeout {args.run_timeout:g} leaves no time to train after "
                         "the host is back")


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def compare(runs: dict[str, dict[str, Any]], target: float | None) -> dict[str, Any]:
    """The target, each run's time to it, and the ratio (DiLoCo's over AsyncDiLoCo's)."""
    if target is None:
        target = runs["diloco"]["final_val"]
    times = {name: time_to_loss(run["curve"], target) for name, run in runs.items()}
    sync, fast = times.get("diloco"), times.get("async_diloco")
    return {"target": target, "time_to_target": times,
            "ratio": sync / fast if sync is not None and fast else None}


def report(runs: dict[str, dict[str, Any]], verdict: dict[str, Any],
           args: argparse.Namespace) -> None:
    rows = []
    for name, run in runs.items():
        merges = run["merges"]
        rows.append((
            LABELS[name], str(run["steps"]), f"{run['wall_s']:.1f} s",
            fmt(run["final_val"], ".4f"), fmt(verdict["time_to_target"][name], ".1f", " s"),
            f"{run['kill']['step']} / {run['kill']['wall_s']:.1f} s "
            f"({run['kill']['wall_s'] / run['wall_s']:.0%})",
            fmt(run["readmitted_after_s"], ".1f", " s") + f" (step {run['readmitted_step']})",
            " -> ".join(f"{s}:{len(r)}" for s, r in run["membership"]),
            f"{args.steps // args.H} rounds" if merges is None else
            f"{merges['versions']} versions, {merges['merged']} merged, "
            f"{merges['dropped']} dropped ({merges['dropped_steps']} steps)",
            "-" if merges is None else
            f"{merges['staleness_mean']:.2f} / {merges['staleness_max']}",
            "/".join(str(n) for n in run["trained_steps"].values()),
            "/".join(f"{s:.2f}" for s in run["step_compute_s"].values()),
            f"{run['throttled_s']:.0f} s", f"{run['other_cores']:.2f}"))
    fast = getattr(args, "fast", None)  # absent from results saved before --fast
    others = "" if fast is None else f" (hosts 0 and {LOST}: {fast:.0%})"
    print_table(f"DiLoCo against AsyncDiLoCo on 3 hosts: links {args.rate}, host {SLOW} held to "
                f"{args.slow:.0%} of a core{others}, host {LOST} lost at {args.kill_at:g} s "
                f"for {args.away:g} s, min_nodes=2, H={args.H}, {args.profile}",
                ("run", "steps", "wall time", "final val loss",
                 f"time to {verdict['target']:.4f}", "kill at step / s",
                 "readmitted after", "membership (step:ranks)", "merges",
                 "staleness mean / max", "steps trained by rank",
                 "step compute by rank (median s)", "slow host throttled",
                 "other load (cores)"),
                rows, left=("run", "membership (step:ranks)", "merges"), width=250)
    ratio = verdict["ratio"]
    print(f"target {verdict['target']:.4f} ("
          f"{'--target' if args.target is not None else 'the DiLoCo run' + chr(39) + 's final'}"
          " validation loss); time to target: DiLoCo "
          f"{fmt(verdict['time_to_target']['diloco'], '.1f', ' s')}, AsyncDiLoCo "
          f"{fmt(verdict['time_to_target']['async_diloco'], '.1f', ' s')}; ratio "
          f"{fmt(ratio, '.2f', 'x')} (the project's target: >= 1.2x)")


def reprint(path: Path, target: float | None) -> int:
    """Print the comparison of the runs saved in ``path``, against ``target`` if given."""
    try:
        saved = json.loads(path.read_text())
        settings = argparse.Namespace(**saved["settings"])
        runs = saved["runs"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"--report {path}: not a results.json of this bench ({exc})", file=sys.stderr)
        return 2
    settings.target = target
    for run in runs.values():
        run["curve"] = [tuple(point) for point in run["curve"]]
    report(runs, compare(runs, target), settings)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.report is not None:
        return reprint(Path(args.report), args.target)
    try:
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    out = Path(args.out).resolve()

    def measure(bed: Testbed) -> int:
        with slowed(bed, bed.hosts[SLOW], args.slow) as group, ExitStack() as stack:
            # rank 1 is born in its host's group; rank 0 in the launcher's (run_case)
            held = {} if args.fast is None else {
                index: stack.enter_context(slowed(bed, bed.hosts[index], args.fast, f"h{index}"))
                for index in (0, LOST)}
            bed.shape(args.rate)
            print(f"hosts {', '.join(h.address for h in bed.hosts)}; host {SLOW} in cpu group "
                  f"{group.path} (quota {round(PERIOD_US * args.slow)} of {PERIOD_US} us, "
                  f"members {group.members()}); links {args.rate}", flush=True)
            shutil.rmtree(out / "logs", ignore_errors=True)  # logs of an earlier run
            budget = {"left": args.wait_max}
            if held:
                print(f"hosts 0 and {LOST} each held to {args.fast:g} of a core "
                      f"({', '.join(str(g.path) for g in held.values())})", flush=True)
            runs = {name: run_case(bed, name, args, group, number, out, budget,
                                   lambda text: print(text, flush=True), held)
                    for number, name in enumerate(RUNS, 1)}
            verdict = compare(runs, args.target)
            print()
            report(runs, verdict, args)
            path = atomic_write_json(out / "results.json", {
                "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                "settings": vars(args) | {"out": str(out)}, "runs": runs, **verdict})
            print(f"wrote {path}")
        return 0

    return on_bed("python -m bench.async_hosts", measure, hosts=3, subnet=args.subnet,
                  pin=False, queue=args.queue, reap_also=reap_stale_groups,
                  also_needs=cgroup_problems)


if __name__ == "__main__":
    sys.exit(main())
