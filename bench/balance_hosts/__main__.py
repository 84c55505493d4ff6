"""``python -m bench.balance_hosts``: the command line (see the package's docstring)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import bench.balance_hosts
from bench.balance_hosts.report import print_summary, summarize
from bench.balance_hosts.runs import FAST, SLOW, run_all
from bench.harness import ROOT
from bench.harness.jobs import Bench
from bench.harness.session import add_job_arguments, on_bed
from bench.harness.slow_host import PERIOD_US, cgroup_problems, reap_stale_groups, slowed
from bench.harness.timing import round_up
from exogym.base.io import atomic_write_json
from tests.netbed import Testbed, rate_bits


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.balance_hosts",
                                     description=bench.balance_hosts.__doc__.split("\n\n")[0],
                                     epilog="See the module docstring for every definition.")
    parser.add_argument("--only", choices=("diloco", "ddp"), help="one strategy's runs only")
    parser.add_argument("--steps", type=int, default=320, help="steps of each DiLoCo run")
    parser.add_argument("--H", type=int, default=40, help="DiLoCo's steps per round")
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
    add_job_arguments(parser, subnet="10.213.79", wait_max=1200,
                      batch_help="DiLoCo's samples per rank")
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
    first = round_up(args.warmup, args.H)
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
        start = round_up(args.warmup, period)
        if all(end % every == 0 for end in range(start + period, steps, period)):
            raise ValueError(f"{name} {steps}: every period after the warm-up ends with an "
                             "evaluation, and only those that do not time the training: "
                             "give more steps")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    out = Path(args.out).resolve()

    def measure(bed: Testbed) -> int:
        slow_host = bed.hosts[SLOW]
        # its sshd goes into the group: every rank it starts inherits it
        with slowed(bed, slow_host, args.slow) as group:
            print(f"hosts {bed.hosts[FAST].address} (fast, core {bed.hosts[FAST].cpu}) and "
                  f"{slow_host.address} (core {slow_host.cpu}, cpu group {group.path}: "
                  f"quota {round(PERIOD_US * args.slow)} of {PERIOD_US} us; members "
                  f"{group.members()}); links {args.rate}", flush=True)
            bed.shape(args.rate)
            bench = Bench(bed, args, out)
            shutil.rmtree(out / "logs", ignore_errors=True)  # rank logs of an earlier run
            runs = run_all(bench, group, args)
            rows = summarize(runs)
            print()
            print_summary(rows, args)
            path = atomic_write_json(out / "results.json", {
                "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                "settings": vars(args) | {"out": str(out)}, "runs": runs, "rows": rows})
            print(f"wrote {path}")
        return 0

    return on_bed("python -m bench.balance_hosts", measure, hosts=2, subnet=args.subnet,
                  queue=args.queue, reap_also=reap_stale_groups,
                  also_needs=lambda: cgroup_problems() + (
                      [] if (os.cpu_count() or 1) >= 2
                      else ["two hosts need two cores of their own"]))


if __name__ == "__main__":
    sys.exit(main())
