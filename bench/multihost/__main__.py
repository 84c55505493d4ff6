"""``python -m bench.multihost``: the command line (see the package's docstring)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import bench.multihost
from bench.harness import ROOT
from bench.harness.session import add_sweep_arguments, on_bed, settle_sweep
from bench.harness.slow_host import (
    HEADROOM_CORES,
    cgroup_problems,
    check_share,
    equal_share,
    held_hosts,
    reap_stale_groups,
)
from bench.harness.strategies import StrategyCase
from bench.harness.timing import Window
from bench.multihost.report import markdown, write_outputs
from bench.multihost.rounds import run_benchmark
from tests.netbed import Testbed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.multihost",
                                     description=bench.multihost.__doc__.split("\n\n")[0],
                                     epilog="See the module docstring for every definition.")
    parser.add_argument("--hosts", type=int, default=2, help="hosts (default 2)")
    add_sweep_arguments(parser, rates="1gbit,100mbit",
                        strategies="ddp,diloco:100,streaming_diloco:100:4,sparseloco:30",
                        repeat=1, subnet="10.213.77", quick_window=10)
    parser.add_argument("--share", type=float, default=None,
                        help="fraction of a core every host is held to (default: the largest "
                             f"equal share that leaves {HEADROOM_CORES:g} core to the launcher, "
                             "min(1, (cores - 0.25) / hosts) rounded down to 0.05; refused "
                             "under 0.25)")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="validation loss each run is timed to (default: the reference's "
                             "at the end of its window)")
    parser.add_argument("--val-every", type=int, default=20,
                        help="steps between the strategies' evaluations, for the time to the "
                             "target (default 20, which most communication periods do not "
                             "divide; --quick: 5)")
    parser.add_argument("--probe-seconds", type=float, default=3.0,
                        help="length of each link probe at its nominal rate")
    parser.add_argument("--pin", dest="pin", action="store_true", default=False,
                        help="also pin host i to core i (at most as many hosts as cores)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin hosts to cores (the default: the share holds them)")
    parser.add_argument("--plan", action="store_true",
                        help="print the share and every job's settings, then stop (builds "
                             "nothing, needs no root)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "multihost"),
                        help="output folder (default runs/multihost)")
    return parser


def settle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[StrategyCase]:
    """The strategies, with ``--quick``, ``--hosts`` and ``--share`` checked and settled;
    exits with the message on a value that cannot work."""
    if args.quick:  # one rate, two strategies, a short probe (the rest: settle_quick)
        args.rates, args.strategies, args.probe_seconds = "100mbit", "ddp,diloco:10", 1.0
        args.val_every = 5
    cases = settle_sweep(args, parser)
    if args.hosts < 2:
        parser.error(f"--hosts must be 2 or more, got {args.hosts}")
    if args.val_every < 1:
        parser.error(f"--val-every must be at least 1, got {args.val_every}")
    if args.share is None:
        args.share = equal_share(args.hosts)
    try:
        check_share(args.share, args.hosts)
    except ValueError as exc:
        parser.error(str(exc))
    if args.pin and args.hosts > (os.cpu_count() or 1):
        parser.error(f"--pin needs a core per host: {args.hosts} hosts, {os.cpu_count()} cores")
    return cases


def plan(args: argparse.Namespace, cases: list[StrategyCase]) -> str:
    """What a run would do: hosts, share, and every strategy's settings and window."""
    lines = [f"{args.hosts} hosts, each held to {args.share:g} of a core "
             f"({args.hosts * args.share:g} of this machine's {os.cpu_count()} cores)"
             + (", pinned" if args.pin else "") + f"; rates {', '.join(args.rates)}"]
    for case in cases:
        window = Window.for_period(case.period, args.warmup, args.window, args.periods)
        lines.append(f"{case.label}: {' '.join(case.overrides())}; period {case.period}; "
                     f"compute baseline {case.compute}; steps {window.s0}..{window.s1} timed "
                     f"of {window.max_steps}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cases = settle(args, parser)
    if args.plan:
        print(plan(args, cases))
        return 0
    out = Path(args.out).resolve()

    def measure(bed: Testbed) -> int:
        with held_hosts(bed, args.share) as groups:
            results = run_benchmark(bed, args, cases, out, groups)
        paths = write_outputs(results, out)
        print()
        print(markdown(results))
        print("wrote " + ", ".join(str(p) for p in paths))
        return 0

    return on_bed("python -m bench.multihost", measure, hosts=args.hosts, subnet=args.subnet,
                  pin=args.pin, queue=args.queue, reap_also=reap_stale_groups,
                  also_needs=cgroup_problems)


if __name__ == "__main__":
    sys.exit(main())
