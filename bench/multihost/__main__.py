"""``python -m bench.multihost``: the command line (see the package's docstring)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import bench.multihost
from bench.harness import ROOT
from bench.harness.session import add_sweep_arguments, on_bed, settle_sweep
from bench.multihost.report import markdown, write_outputs
from bench.multihost.rounds import run_benchmark
from tests.netbed import Testbed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.multihost",
                                     description=bench.multihost.__doc__.split("\n\n")[0],
                                     epilog="See the module docstring for every definition.")
    parser.add_argument("--hosts", type=int, default=2, help="hosts (default 2)")
    add_sweep_arguments(parser, rates="1gbit,100mbit,20mbit",
                        strategies="ddp,diloco:10,diloco:100,sparta,demo", repeat=1,
                        subnet="10.213.77", quick_window=10)
    parser.add_argument("--probe-seconds", type=float, default=3.0,
                        help="length of each link probe at its nominal rate")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin hosts to cores (needed for more hosts than cores)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "multihost"),
                        help="output folder (default runs/multihost)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:  # one rate, two strategies, a short probe (the rest: settle_quick)
        args.rates, args.strategies, args.probe_seconds = "100mbit", "ddp,diloco:10", 1.0
    cases = settle_sweep(args, parser)
    if args.hosts < 2:
        parser.error(f"--hosts must be 2 or more, got {args.hosts}")
    out = Path(args.out).resolve()

    def measure(bed: Testbed) -> int:
        results = run_benchmark(bed, args, cases, out)
        paths = write_outputs(results, out)
        print()
        print(markdown(results))
        print("wrote " + ", ".join(str(p) for p in paths))
        return 0

    return on_bed("python -m bench.multihost", measure, hosts=args.hosts, subnet=args.subnet,
                  pin=args.pin, queue=args.queue)


if __name__ == "__main__":
    sys.exit(main())
