"""Compare DDP, DiLoCo, Streaming DiLoCo, SPARTA, FedAvg, DeMo and SparseLoCo on real data, offline.

Four simulated nodes train the same small network on scikit-learn's
handwritten digits with each strategy in turn. The table shows what each
strategy buys and what it costs: final validation loss and accuracy of the
averaged model, bytes each node sent, those bytes relative to DDP, and wall
time. A PNG plots validation loss against steps and against bytes sent.

    python examples/compare_strategies.py                 # plot in runs/compare_strategies/
    python examples/compare_strategies.py --steps 400 --out runs/compare.png
"""

from __future__ import annotations

import argparse
import io
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from exogym import Trainer
from exogym.base.io import atomic_write_bytes
from exogym.data.digits import DigitsMLP, digits_datasets, evaluate
from exogym.report.summary import human_bytes
from exogym.strategy import (
    DeMoStrategy,
    DiLoCoStrategy,
    FedAvgStrategy,
    SimpleReduceStrategy,
    SparseLoCoStrategy,
    SPARTAStrategy,
    Strategy,
    StreamingDiLoCoStrategy,
)

LR = 3e-3
DEFAULT_OUT = Path("runs") / "compare_strategies" / "compare.png"

# name -> (settings shown in the table, how to build the strategy). Every strategy
# trains with AdamW at the same learning rate, except DeMo, which is its own
# optimizer (sign steps); DiLoCo's outer optimizer is SGD 0.7 with Nesterov 0.9.
STRATEGIES: dict[str, tuple[str, Callable[[], Strategy]]] = {
    "DDP": ("",
            lambda: SimpleReduceStrategy(optim_spec="adamw", lr=LR)),
    "DiLoCo": ("H=20",
               lambda: DiLoCoStrategy(inner_optim="adamw", lr=LR, H=20)),
    "Streaming DiLoCo": ("H=20, 2 fragments, delay 1",
                         lambda: StreamingDiLoCoStrategy(inner_optim="adamw", lr=LR, H=20,
                                                         num_fragments=2, fragment_delay=1)),
    "SPARTA": ("p=0.005",
               lambda: SPARTAStrategy(optim_spec="adamw", lr=LR, p_sparta=0.005)),
    "FedAvg": ("H=10",
               lambda: FedAvgStrategy(optim_spec="adamw", lr=LR, H=10)),
    "DeMo": ("top-32/64",
             lambda: DeMoStrategy(lr=LR, compression_topk=32, compression_chunk=64)),
    "SparseLoCo": ("H=20, top-32/1024, 2-bit",
                   lambda: SparseLoCoStrategy(inner_optim="adamw", lr=LR, H=20, topk=32,
                                              chunk=1024, quant_bits=2)),
}


def save_figure_atomically(fig, path: Path) -> None:
    """Render the figure, then write it through a temporary file and a rename (with the
    user's usual file mode)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    atomic_write_bytes(path, buffer.getvalue())


def plot(curves: dict[str, list[tuple[int, float, float]]], accuracy: dict[str, float],
         path: Path, nodes: int) -> None:
    """Validation loss against step and against bytes sent, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, points in curves.items():
        steps, sent, losses = zip(*points)
        label = f"{name} ({accuracy[name]:.0%} acc.)"
        by_step.plot(steps, losses, marker="o", markersize=3, label=label)
        by_bytes.plot(sent, losses, marker="o", markersize=3, label=label)  # 0 stays 0
    by_step.set(xlabel="step", ylabel="validation loss (averaged model)",
                title=f"Digits, {nodes} nodes: loss per step")
    # Symmetric log, linear from 0 to the smallest decade sent: a point before anything was
    # sent (DiLoCo's first rounds) sits at 0 rather than at a made-up 1 byte.
    sent_counts = [b for points in curves.values() for _, b, _ in points if b > 0]
    linear_below = 10.0 ** math.floor(math.log10(min(sent_counts))) if sent_counts else 1.0
    by_bytes.set_xscale("symlog", linthresh=linear_below)
    by_bytes.set_xlim(left=-0.15 * linear_below)
    by_bytes.set(xlabel=f"bytes sent per node (symlog, linear below {linear_below:g} B: "
                        "0 means nothing sent yet)", title="loss per byte sent")
    for ax in (by_step, by_bytes):
        ax.axhline(math.log(10), color="grey", linestyle="--", linewidth=1,
                   label="chance (ln 10)")
        ax.grid(alpha=0.3)
    by_step.legend()  # one legend: the right panel's lines are the same strategies
    fig.tight_layout()
    save_figure_atomically(fig, path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes (default 4)")
    parser.add_argument("--steps", type=int, default=200, help="steps per node (default 200)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per node per step")
    parser.add_argument("--eval-every", type=int, default=20, help="steps between evaluations")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help=f"comma-separated subset of {','.join(STRATEGIES)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"where the plot goes (PNG; default {DEFAULT_OUT})")
    args = parser.parse_args()
    chosen = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")

    console = Console()
    train, val = digits_datasets()
    console.print(f"digits: {len(train)} training and {len(val)} validation images, "
                  f"{args.nodes} nodes, {args.steps} steps of {args.batch_size} per node")
    rows, curves = [], {}
    total_start = time.perf_counter()
    for name in chosen:
        settings, build = STRATEGIES[name]
        torch.manual_seed(0)
        model = DigitsMLP()
        trainer = Trainer(model, train, val)
        started = time.perf_counter()
        final = trainer.fit(strategy=build(), num_nodes=args.nodes, max_steps=args.steps,
                            batch_size=args.batch_size, val_size=len(val),
                            val_interval=args.eval_every, logger=None, progress=False)
        wall = time.perf_counter() - started
        loss, acc = evaluate(final, val)
        sent = trainer.summary["bytes_per_node"]
        curves[name] = [(r["step"], r["comm_bytes"], r["val_global_loss"])
                        for r in trainer.history if r["rank"] == 0 and "val_global_loss" in r]
        rows.append((name, settings, loss, acc, sent, wall))
        console.print(f"  {name:<10} done in {wall:5.1f} s: accuracy {acc:.1%}")

    ddp_bytes = next((r[4] for r in rows if r[0] == "DDP"), None)
    table = Table(title=f"Digits, {args.nodes} nodes x {args.steps} steps")
    table.add_column("strategy")
    for column in ("val loss", "accuracy", "sent/node", "vs DDP", "wall time"):
        table.add_column(column, justify="right", no_wrap=True)
    for name, settings, loss, acc, sent, wall in rows:
        ratio = "-" if not ddp_bytes else f"{sent / ddp_bytes:.2%}"
        table.add_row(f"{name} {settings}".strip(), f"{loss:.3f}", f"{acc:.1%}",
                      human_bytes(sent), ratio, f"{wall:.1f} s")
    console.print(table)
    plot(curves, {r[0]: r[3] for r in rows}, args.out, args.nodes)
    console.print(f"plot written to {args.out} (total {time.perf_counter() - total_start:.0f} s)")


if __name__ == "__main__":
    main()
