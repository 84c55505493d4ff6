"""Simulation speed: a fixed workload per strategy, timed end to end.

Workload: an MLP 784-256-128-10 on 20,000 synthetic 28x28 samples, K=4 ranks,
batch 32 per rank, 200 steps, evaluation of 64 samples every 100 steps. Each
strategy runs in a fresh Python process, so the wall time includes importing
torch, starting the ranks and collecting the final model.

    python -m bench.sim_speed                 # all strategies
    python -m bench.sim_speed --strategies ddp diloco
    python -m bench.sim_speed --repeat 5      # median and best of 5 interleaved runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench.harness.tables import print_table
from bench.harness.timing import bench_command, timed_run


def workload():
    """A factory of the model (an MLP 784-256-128-10, 235k parameters) and 20,000 synthetic
    samples."""
    from bench.harness.workloads import SyntheticMLP, synthetic_digits

    return (lambda: SyntheticMLP(256, 128)), synthetic_digits(20000)


def one_run(name: str, nodes: int, steps: int) -> dict:
    """Body of the child process: train once and print the figures as JSON."""
    import torch

    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy, FedAvgStrategy, SimpleReduceStrategy

    make_model, data = workload()
    strategies = {
        "ddp": lambda: SimpleReduceStrategy(),
        "diloco": lambda: DiLoCoStrategy(H=20),
        "fedavg": lambda: FedAvgStrategy(H=20),
    }
    torch.manual_seed(0)
    trainer = Trainer(make_model(), data, data)
    trainer.fit(strategy=strategies[name](), num_nodes=nodes, max_steps=steps, batch_size=32,
                val_size=64, val_interval=100, logger=None, progress=False)
    return {"steps_per_s": trainer.summary["steps_per_s"],
            "peak_rss_mb": trainer.summary.get("peak_rss_bytes_per_rank", 0) / 2**20,
            "bytes_per_node": trainer.summary["bytes_per_node"]}


# What any script that builds a torch optimizer pays: Python, torch, torch._dynamo (imported by
# the first optimizer), and interpreter exit with the import's objects frozen as fit() leaves them.
FLOOR = "import gc, torch, torch._dynamo; gc.freeze()"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "diloco", "fedavg"])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per strategy, interleaved (the machine may be noisy)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.child, args.nodes, args.steps)))
        return
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")

    walls: dict[str, list[float]] = {name: [] for name in ["floor", *args.strategies]}
    figures: dict[str, list[dict]] = {name: [] for name in args.strategies}
    for _ in range(args.repeat):
        walls["floor"].append(timed_run([sys.executable, "-c", FLOOR]).wall_s)
        for name in args.strategies:
            run = timed_run(bench_command("bench.sim_speed", "--child", name, "--nodes",
                                          str(args.nodes), "--steps", str(args.steps)))
            walls[name].append(run.wall_s)
            figures[name].append(json.loads(run.stdout.strip().splitlines()[-1]))

    floor = statistics.median(walls["floor"])
    rows = [("[dim]floor[/]", f"{floor:.2f}", f"{min(walls['floor']):.2f}", "", "", "", "")]
    for name in args.strategies:
        runs = figures[name]
        median = statistics.median(walls[name])
        rows.append((name, f"{median:.2f}", f"{min(walls[name]):.2f}", f"{median - floor:.2f}",
                     f"{statistics.median(r['steps_per_s'] for r in runs):.1f}",
                     f"{max(r['peak_rss_mb'] for r in runs):.0f} MiB",
                     f"{runs[0]['bytes_per_node'] / 2**20:.1f} MiB"))
    print_table(f"simulation speed: MLP 784-256-128-10, K={args.nodes}, batch 32, "
                f"{args.steps} steps, {args.repeat} run(s) each",
                ("strategy", "wall s median", "wall s best", "over floor (median)",
                 "train steps/s (median)", "peak RSS per rank", "sent per node"), rows)
    print("Wall time is end to end: Python start, importing torch (and torch._dynamo, which "
          "torch imports when the first optimizer is built), the ranks, and interpreter exit. "
          f"floor: python -c '{FLOOR}' alone.")


if __name__ == "__main__":
    main()
