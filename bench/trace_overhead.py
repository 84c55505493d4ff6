"""What writing the run's trace costs: the same simulation with and without ``trace=``.

Workload: K=4 ranks of DDP (one step event per rank and step, the most events a
run sends), batch 8, evaluation every 500 steps, on MLPs of a few sizes. The
trace's work is per event, never per parameter, so the smallest model (the
fastest steps) is its worst case. Runs with and without the trace alternate
(ABBA: neither always first), in this process; the figure is the ratio of
their median wall times, and beside it the CPU time the trace adds to this
process, where it is written. Then the writer's own cost per step event, fed
events without a run (no noise from the ranks), and the trace's size.

    python -m bench.trace_overhead                    # tiny and 235k models
    python -m bench.trace_overhead --sizes tiny --steps 5000 --repeat 7
    python -m bench.trace_overhead --sizes 23M --steps 50   # a real-size model
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness.tables import print_table

#: Hidden widths of each model size: an MLP 784-w1-w2-10.
SIZES = {"tiny": (4, 4), "235k": (256, 128), "23M": (4096, 4096)}


def workload(size: str):
    """An MLP of ``size`` and 2,000 synthetic 28x28 samples."""
    import torch

    from bench.harness.workloads import SyntheticMLP, synthetic_digits

    data = synthetic_digits(2000)
    torch.manual_seed(0)
    return SyntheticMLP(*SIZES[size]), data


def one_fit(model, data, nodes: int, steps: int, trace: Path | None) -> tuple[float, float]:
    """Wall seconds of one fit, start to end, as a user's script sees it, and the CPU
    seconds of this process (where the trace is written; the ranks are processes of
    their own) in it."""
    from exogym import Trainer
    from exogym.strategy import SimpleReduceStrategy

    trainer = Trainer(model, data, data)
    started, cpu = time.perf_counter(), time.process_time()
    trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=nodes, max_steps=steps,
                batch_size=8, val_size=64, val_interval=500, logger=None, progress=False,
                num_threads=1, trace=None if trace is None else str(trace))
    return time.perf_counter() - started, time.process_time() - cpu


def writer_cost_us(events: int = 200_000) -> float:
    """Microseconds the trace writer spends on one step event (past its full-step bound
    half the time, as in a long run), fed straight from a loop."""
    from exogym.report.trace import TraceWriter

    with tempfile.TemporaryDirectory() as folder:
        writer = TraceWriter(full_steps=events // 8)  # 4 ranks: half the steps in blocks
        writer.start(Path(folder) / "trace.jsonl", source="simulation", num_nodes=4, config={})
        started = time.perf_counter()
        for i in range(events):
            step, rank = divmod(i, 4)
            writer.on_event({"event": "step", "rank": rank, "step": step + 1,
                             "train_loss": 1.234, "lr": 0.001, "comm_bytes": 4096 * (step + 1),
                             "samples": 8 * (step + 1), "comm_s": 0.000123,
                             "compute_s": 0.000456, "wall_s": 0.001 * step})
        writer.end()
        return (time.perf_counter() - started) / events * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.trace_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["tiny", "235k"])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs with and without the trace each, alternating")
    args = parser.parse_args()
    if args.repeat < 1 or args.steps < 1:
        parser.error("--repeat and --steps must be >= 1")

    rows = []
    first_without = 0.0
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes:
            model, data = workload(size)
            params = sum(p.numel() for p in model.parameters())
            one_fit(model, data, args.nodes, min(args.steps, 20), None)  # warm: imports, caches
            plain, traced = [], []
            path = Path(folder) / size
            for i in range(args.repeat):  # ABBA: neither goes first every time
                for trace in ((None, path) if i % 2 == 0 else (path, None)):
                    (plain if trace is None else traced).append(
                        one_fit(model, data, args.nodes, args.steps, trace))
            without = statistics.median(wall for wall, _ in plain)
            with_trace = statistics.median(wall for wall, _ in traced)
            added_cpu = statistics.median(c for _, c in traced) - \
                statistics.median(c for _, c in plain)
            first_without = first_without or without
            trace_file = path / "trace.jsonl"
            rows.append((size, f"{params:,}", f"{args.nodes * args.steps / without:,.0f}",
                         f"{without:.2f}", f"{with_trace:.2f}",
                         f"{with_trace / without:.3f}", f"{added_cpu * 1e3:+.0f} ms",
                         f"{added_cpu / without * 100:+.2f}%",
                         f"{trace_file.stat().st_size / 2**10:,.0f} KiB"))
    print_table(f"trace overhead: DDP, K={args.nodes}, batch 8, {args.steps} steps, median of "
                f"{args.repeat} alternating runs each",
                ("model", "parameters", "step events/s", "wall s without", "wall s with",
                 "ratio with/without", "parent CPU added", "of the wall time", "trace size"),
                rows, left={"model"}, width=160)
    print("parent CPU: this process's CPU time in fit, where every rank's events arrive and "
          "the trace is written (the ranks run in processes of their own); on a busy "
          "machine it measures the trace's cost where the wall-time ratio is noise.")
    cost = writer_cost_us()
    rate = args.nodes * args.steps / first_without
    print(f"the writer alone: {cost:.1f} µs per step event, in the process that starts the "
          f"run (beside the ranks): at the {args.sizes[0]} model's {rate:,.0f} events/s, "
          f"{cost * 1e-6 * rate * 100:.2f}% of one core")


if __name__ == "__main__":
    main()
