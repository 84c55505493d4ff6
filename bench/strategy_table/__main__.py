"""``python -m bench.strategy_table``: the command line (see the package's docstring)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

import bench.strategy_table
from bench.harness import ROOT
from bench.harness.tables import markdown_table, print_table
from bench.strategy_table import grid, results
from bench.strategy_table.grid import BY_NAME, NAMES, NETWORK, Entry, Scale
from bench.strategy_table.plot import plot
from bench.strategy_table.runner import Stalled, run_all
from exogym.base.io import atomic_write_bytes, atomic_write_text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.strategy_table",
        description=bench.strategy_table.__doc__.split("\n\n")[0],
        epilog="See the package docstring (bench/strategy_table/__init__.py) and "
               "docs/benchmarks.md for every definition.")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny chargpt (2 layers, 32 wide), 24 steps, 2 seeds: seconds")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"inner steps per rank (default {grid.FULL.steps}; --quick "
                             f"{grid.QUICK.steps}); every swept period must divide it")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"seeds of the final runs (default {len(grid.FULL.seeds)}; "
                             f"--quick {len(grid.QUICK.seeds)})")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time, each a K-rank simulation in a worker process "
                             "(K processes of one thread each on CPU; default 1)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where every rank trains (cuda: all K ranks of a run on GPU 0)")
    parser.add_argument("--only", default=None, metavar="NAME,...",
                        help=f"these strategies (and DDP, the reference): {', '.join(NAMES)}")
    parser.add_argument("--budget", type=float, default=None,
                        help="the budget rule's share of DDP's bytes (default 0.1)")
    parser.add_argument("--out", default=None,
                        help="output folder (default runs/strategy_table, --quick "
                             "runs/strategy_table_quick)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the results in --out: finished runs are not run again")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: the table, table.md and the plot from --out's results")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the runs that would start now and how many in all, run none")
    parser.add_argument("--stall-s", type=float, default=900.0,
                        help="stop with an error when no run finishes for this long (900)")
    return parser


def settle(args: argparse.Namespace, parser: argparse.ArgumentParser
           ) -> tuple[Scale, list[Entry], Path]:
    """The scale, the entries and the output folder; exits with a message on a bad value."""
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.seeds is not None and not 1 <= args.seeds <= 100:
        parser.error(f"--seeds must be within 1..100, got {args.seeds}")
    scale = grid.make_scale("quick" if args.quick else "full", args.steps, args.seeds)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.budget is not None and not 0 < args.budget <= 1:
        parser.error(f"--budget must be within (0, 1] (a share of DDP's bytes), got {args.budget}")
    if not args.stall_s > 0:
        parser.error(f"--stall-s must be a number of seconds > 0, got {args.stall_s}")
    names = list(NAMES)
    if args.only is not None:
        asked = [n.strip().lower().replace("-", "_") for n in args.only.split(",") if n.strip()]
        unknown = [n for n in asked if n not in BY_NAME]
        if unknown or not asked:
            parser.error(f"--only: {', '.join(unknown) or 'nothing'} is not a strategy of the "
                         f"table; give names from {', '.join(NAMES)}")
        names = [n for n in NAMES if n == "ddp" or n in asked]
    entries = [BY_NAME[n] for n in names]
    if args.device == "cuda" and not args.report_only:
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA GPU is usable here; use --device cpu")
    problems = grid.check_scale(scale, entries)
    if problems:
        parser.error("; ".join(problems))
    default = "strategy_table_quick" if args.quick else "strategy_table"
    out = Path(args.out) if args.out else ROOT / "runs" / default
    found = (out / "results.json").exists()
    if found and not (args.resume or args.report_only):
        parser.error(f"{out / 'results.json'} exists: give --resume to continue it, "
                     "--report-only to report it, or another --out")
    if args.report_only and not found:
        parser.error(f"--report-only: {out / 'results.json'} does not exist")
    return scale, entries, out


def report(data: dict[str, Any], scale: Scale, entries: list[Entry],
           unavailable: dict[str, str], out: Path, final: bool) -> list[dict[str, Any]]:
    """Recompute the rows into ``data`` and write results.json; with ``final``, also print
    the table and write table.md and the plot."""
    table = results.rows(data, scale, entries, unavailable)
    data["rows"] = table
    data["pareto"] = [r["label"] for r in table if r.get("pareto")]
    data["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    data["plot"] = "loss_vs_bytes.png"
    results.save(out / "results.json", data)
    if not final:
        return table
    params = next((r["num_params"] for r in table if "num_params" in r), None)
    title = (f"chargpt{f' {params / 1e6:.2f}M parameters' if params else ''}, "
             f"K={scale.num_nodes}, {scale.steps} steps of {scale.batch_size} per rank, "
             f"budget {data['budget']:g} of DDP's bytes")
    cells = [results.table_cells(r) for r in table]
    print_table(title, results.COLUMNS, cells, left=("strategy", "setting"), width=200)
    lines = [f"{title}.", ""] + markdown_table(results.COLUMNS, cells,
                                               left=("strategy", "setting"))
    atomic_write_text(out / "table.md", "\n".join(lines) + "\n")
    atomic_write_bytes(out / "loss_vs_bytes.png", plot(table, data.get("sweeps", {}), title))
    print(f"wrote {out / 'results.json'}, {out / 'table.md'}, {out / 'loss_vs_bytes.png'}")
    return table


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)  # stop the workers and ranks, as on Ctrl-C
    parser = build_parser()
    args = parser.parse_args(argv)
    scale, entries, out = settle(args, parser)
    try:
        data = results.load(out / "results.json", scale, args.budget)
    except results.ResultsError as exc:
        parser.error(str(exc))
    if data.get("budget") is None:
        data["budget"] = 0.1
    unavailable = {e.name: why for e in entries if (why := grid.availability(e))}
    for name, why in unavailable.items():
        print(f"{BY_NAME[name].label}: {why}")
    if args.report_only:
        report(data, scale, entries, unavailable, out, final=True)
        return 0
    runnable = [e for e in entries if e.name not in unavailable]
    runs = data["runs"]

    def todo(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [s for s in specs if runs.get(s["key"], {}).get("status") != "ok"]

    def ready() -> list[dict[str, Any]]:
        """The final seeds of every strategy whose sweep has ended."""
        specs = []
        for entry in runnable:
            if entry.knob is not None:
                chosen = results.choose(data, scale, entry)
                if chosen["done"] and chosen["chosen"] is not None:
                    specs += todo(grid.seed_specs(scale, entry, chosen["chosen"], args.device))
        return specs

    first = [s for e in runnable for s in todo(grid.sweep_specs(scale, e, args.device))]
    # DDP's first seed first (every choice needs it), then the slowest strategy's sweep, so
    # that its final seeds do not start last and leave the other workers idle at the end.
    first.sort(key=lambda s: (s["key"] != grid.run_key(BY_NAME["ddp"], None, scale.seeds[0],
                                                       NETWORK),
                              s["strategy"] not in grid.SLOWEST))
    first += ready()
    planned = sum(len(grid.sweep_specs(scale, e, args.device)) + len(grid.seed_specs(
        scale, e, scale.sweeps.get(e.name, (None,))[0], args.device)) for e in runnable)
    left = sum(1 for k, r in runs.items() if r.get("status") == "ok")
    print(f"{len(first)} runs to start now, {left} already done of about {planned}; "
          f"{args.jobs} at a time on {args.device}; results in {out}", flush=True)
    if args.dry_run:
        for spec in first:
            print(f"  {spec['key']}")
        print("then each strategy's chosen value at its other seeds (and 1 Gbit/s runs where "
              "its time cannot be derived) as its sweep ends")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    count = {"done": 0}

    def on_done(spec: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
        runs[spec["key"]] = {**{k: spec[k] for k in ("strategy", "value", "seed", "network",
                                                     "settings")}, **result}
        count["done"] += 1
        report(data, scale, entries, unavailable, out, final=False)
        said = (f"val {result['val_loss']:.4f}, {result['bytes'] / 1e6:.2f} MB sent, "
                f"sim {result['sim_s']:.1f} s" if result["status"] == "ok"
                else f"FAILED: {result['error'][:300]}")
        print(f"[{count['done'] + left}/{planned}] {spec['label']} "
              f"{grid.describe(BY_NAME[spec['strategy']], spec['value'])} seed {spec['seed']} "
              f"{spec['network']}: {said} ({result['wall_s']:.1f} s; "
              f"{time.monotonic() - started:.0f} s since start)", flush=True)
        return ready()

    try:
        run_all(first, on_done, args.jobs, args.stall_s)
    except Stalled as exc:
        print(f"error: {exc}; the finished runs are in {out / 'results.json'} "
              "(--resume continues)", file=sys.stderr)
        report(data, scale, entries, unavailable, out, final=True)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted; the finished runs are in {out / 'results.json'} "
              "(--resume continues)", file=sys.stderr)
        return 130
    print(f"{count['done']} runs in {time.monotonic() - started:.0f} s "
          f"({NETWORK} simulated)", flush=True)
    report(data, scale, entries, unavailable, out, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
