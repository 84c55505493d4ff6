"""MuLoCo against DiLoCo on real data, offline: the bytes each sends and the loss each reaches.

Simulated nodes train the same small network on scikit-learn's handwritten
digits three times, each with DiLoCo's rounds every ``H`` steps:

- DiLoCo as published: AdamW inner steps, the model's change sent in float32;
- DiLoCo with AdamW, the change sent in 4 bits with error feedback;
- MuLoCo (Thérien et al. 2025): Muon inner steps, 4 bits with error feedback.

The table shows the final validation loss and accuracy of the averaged model,
the bytes each node sent and those bytes against DiLoCo's float32 rounds. Muon's
orthogonalization runs in bfloat16, slow on most CPUs: expect MuLoCo to take
longer than the other two here.

    python examples/muloco.py
    python examples/muloco.py --steps 400 --nodes 4 --comm-dtype int2
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from exogym import Trainer
from exogym.data.digits import DigitsMLP, digits_datasets, evaluate
from exogym.report.summary import human_bytes
from exogym.strategy import DiLoCoStrategy, MuLoCoStrategy

LR = 3e-3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    parser.add_argument("--steps", type=int, default=200, help="steps per node (default 200)")
    parser.add_argument("--H", type=int, default=20, help="inner steps per round (default 20)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per node per step")
    parser.add_argument("--comm-dtype", default="int4", choices=("int8", "int4", "int2"),
                        help="type the quantized rounds travel in (default int4)")
    args = parser.parse_args()

    quantized = f"{args.comm_dtype} + EF"
    # (strategy, inner optimizer, what a round sends, how to build it)
    runs = [
        ("DiLoCo", "AdamW", "float32",
         lambda: DiLoCoStrategy(inner_optim="adamw", lr=LR, H=args.H)),
        ("DiLoCo", "AdamW", quantized,
         lambda: DiLoCoStrategy(inner_optim="adamw", lr=LR, H=args.H,
                                comm_dtype=args.comm_dtype, error_feedback=True)),
        ("MuLoCo", "Muon", quantized,
         lambda: MuLoCoStrategy(lr=LR, H=args.H, comm_dtype=args.comm_dtype)),
    ]
    console = Console()
    train, val = digits_datasets()
    console.print(f"digits: {len(train)} training and {len(val)} validation images, "
                  f"{args.nodes} nodes, {args.steps} steps of {args.batch_size} per node, "
                  f"a round every {args.H} steps")
    rows = []
    for name, inner, sent_as, build in runs:
        torch.manual_seed(0)
        trainer = Trainer(DigitsMLP(), train, val)
        started = time.perf_counter()
        final = trainer.fit(strategy=build(), num_nodes=args.nodes, max_steps=args.steps,
                            batch_size=args.batch_size, val_size=0, logger=None,
                            progress=False)
        wall = time.perf_counter() - started
        loss, accuracy = evaluate(final, val)
        rows.append((name, inner, sent_as, loss, accuracy, trainer.summary["bytes_per_node"]))
        console.print(f"  {name} ({inner}, {sent_as}): done in {wall:.1f} s")

    baseline = rows[0][5]
    table = Table(title=f"Digits, {args.nodes} nodes x {args.steps} steps, H={args.H} "
                        "(EF: error feedback)")
    for column in ("strategy", "inner", "sent as"):
        table.add_column(column, no_wrap=True)
    for column in ("val loss", "accuracy", "sent/node", "vs DiLoCo"):
        table.add_column(column, justify="right", no_wrap=True)
    for name, inner, sent_as, loss, accuracy, sent in rows:
        table.add_row(name, inner, sent_as, f"{loss:.3f}", f"{accuracy:.1%}", human_bytes(sent),
                      f"{sent / baseline:.1%}" if baseline else "-")
    console.print(table)

if __name__ == "__main__":
    main()
