"""Federated learning on non-IID clients: FedAvg with islands and client sampling vs DiLoCo and DDP.

The training digits are split across 16 simulated clients with label skew
drawn from a Dirichlet distribution (``fit(partition="dirichlet:ALPHA")``):
with a small ``alpha`` each client sees mostly a few classes, as phones or
hospitals would. A client only ever reads its own share.

Compared, all with AdamW on every client:

- DDP: gradients averaged every step (the upper bound, the most bytes);
- DiLoCo: ``H`` local steps, then an outer Nesterov step on the averaged change;
- FedAvg: ``H`` local steps, then model averaging over all clients;
- FedAvg with islands of 4 clients, redrawn every round, where half of each
  island takes part: less traffic per round, slower mixing.

    python examples/federated.py
    python examples/federated.py --alpha 0.1 --steps 200
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from exogym import Trainer
from exogym.data.digits import DigitsMLP, digits_datasets, evaluate
from exogym.data.partition import dataset_labels, label_histogram, split_by_label
from exogym.report.summary import human_bytes
from exogym.strategy import DiLoCoStrategy, FedAvgStrategy, SimpleReduceStrategy, Strategy

LR = 3e-3


def strategies(h: int) -> dict[str, tuple[str, Callable[[], Strategy]]]:
    return {
        "DDP": ("every step", lambda: SimpleReduceStrategy(optim_spec="adamw", lr=LR)),
        "DiLoCo": (f"H={h}", lambda: DiLoCoStrategy(inner_optim="adamw", lr=LR, H=h)),
        "FedAvg": (f"H={h}", lambda: FedAvgStrategy(optim_spec="adamw", lr=LR, H=h)),
        "FedAvg islands": (f"H={h}, 4/island, 50%",
                           lambda: FedAvgStrategy(optim_spec="adamw", lr=LR, H=h, island_size=4,
                                                  client_sampling=0.5)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16, help="simulated clients (default 16)")
    parser.add_argument("--alpha", type=float, default=0.3,
                        help="Dirichlet concentration of the label skew (default 0.3)")
    parser.add_argument("--steps", type=int, default=120, help="steps per client (default 120)")
    parser.add_argument("--H", type=int, default=10, help="local steps per round (default 10)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per client per step")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data split")
    args = parser.parse_args()

    console = Console()
    train, val = digits_datasets(seed=args.seed)
    partition = f"dirichlet:{args.alpha}"
    labels = dataset_labels(train)
    try:
        parts = split_by_label(labels, partition, args.clients, args.seed)
    except ValueError as exc:
        parser.error(f"{exc} (--alpha, --clients, --seed)")
    sizes = sorted(len(p) for p in parts)
    classes = [sum(c >= 0.05 * len(p) for c in label_histogram(labels, p)) for p in parts]
    console.print(
        f"{args.clients} clients, Dirichlet alpha={args.alpha}: {sizes[0]}-{sizes[-1]} images "
        f"per client (median {sizes[len(sizes) // 2]}), {sum(classes) / len(classes):.1f} of 10 "
        "classes per client on average (a class counts from 5% of a client's images)")

    table = Table(title=f"Non-IID digits, {args.clients} clients x {args.steps} steps")
    table.add_column("strategy")
    table.add_column("settings")
    for column in ("val loss", "accuracy", "sent/client", "wall time"):
        table.add_column(column, justify="right", no_wrap=True)
    for name, (settings, build) in strategies(args.H).items():
        torch.manual_seed(0)
        trainer = Trainer(DigitsMLP(), train, val)
        started = time.perf_counter()
        final = trainer.fit(strategy=build(), num_nodes=args.clients, max_steps=args.steps,
                            batch_size=args.batch_size, partition=partition, seed=args.seed,
                            val_size=0, logger=None, progress=False)
        wall = time.perf_counter() - started
        loss, acc = evaluate(final, val)
        table.add_row(name, settings, f"{loss:.3f}", f"{acc:.1%}",
                      human_bytes(trainer.summary["bytes_per_node"]), f"{wall:.1f} s")
        console.print(f"  {name:<15} done in {wall:5.1f} s: accuracy {acc:.1%}")
    console.print(table)


if __name__ == "__main__":
    main()
