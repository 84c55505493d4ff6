"""What ``fit(balance=...)`` buys when one rank is half as fast: time and loss, with and without.

Run from the project root::

    python -m bench.balance_sim                  # 200 steps of each run
    python -m bench.balance_sim --steps 100 --repeat 3

Two simulated ranks on the digits task (:mod:`exogym.data.digits`, a small CNN),
``rank_speeds=[1.0, 0.5]`` with ``speed_mode='wall'``: the slow rank really
takes twice as long, sleeping off its extra time after each step. Four runs:

- DiLoCo (``H`` inner steps per round), ``balance='none'`` and ``'steps'``;
- AllReduce (DDP), ``balance='none'`` and ``'batch'``.

For each: the training loop's wall time (the slowest rank's, process start
aside), the validation loss of the averaged model at the end, the samples each
rank trained and the final shares. Then the speedup of each balanced run over
its unbalanced twin, as the ratio of wall times of two runs made back to back
(so both see the same load on this machine). With ``--repeat`` each pair runs
that many times: medians, and the range of the speedups. Prints figures;
asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from bench.harness.tables import print_table
from bench.harness.timing import with_medians
from exogym import Trainer
from exogym.data.digits import DigitsCNN, digits_datasets
from exogym.strategy import DiLoCoStrategy, SimpleReduceStrategy

SPEEDS = [1.0, 0.5]


def one_run(strategy_name: str, balance: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train once; return the loop's wall time, the final validation loss and the shares."""
    train, val = digits_datasets()
    torch.manual_seed(0)
    model = DigitsCNN(channels=args.channels)
    if strategy_name == "diloco":
        strategy = DiLoCoStrategy(inner_optim="adamw", lr=args.lr, H=args.H)
    else:
        strategy = SimpleReduceStrategy(optim_spec="adamw", lr=args.lr)
    trainer = Trainer(model, train, val)
    trainer.fit(strategy=strategy, num_nodes=2, max_steps=args.steps,
                batch_size=args.batch_size, val_size=256, val_interval=args.steps,
                rank_speeds=SPEEDS, speed_mode="wall", balance=balance, device="cpu",
                progress=False, logger=None)
    last = {row["rank"]: row for row in trainer.history}
    summary = trainer.summary
    shares = summary.get("balance", {}).get("ranks", [])
    share_key = "batch_size" if strategy_name == "ddp" else "inner_steps"
    return {
        "wall_s": max(row["wall_s"] for row in last.values()),
        "val_loss": summary.get("final_val_global_loss"),
        "samples": [last[rank]["samples"] for rank in sorted(last)],
        "shares": [r[share_key] for r in shares] or None,
        "speeds": [r["speed"] for r in shares] or None,
    }


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of the wall time and loss over ``runs``, the last run's shares."""
    return with_medians(runs[-1], runs, ("wall_s", "val_loss"))


CASES = (("diloco", "steps"), ("ddp", "batch"))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.balance_sim",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of each run")
    parser.add_argument("--H", type=int, default=20, help="DiLoCo's inner steps per round")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--channels", type=int, default=32, help="the CNN's first channels")
    parser.add_argument("--lr", type=float, default=1e-3, help="inner learning rate")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each configuration")
    args = parser.parse_args()

    print(f"2 ranks, rank_speeds={SPEEDS} (speed_mode='wall'), digits CNN "
          f"(channels {args.channels}), batch {args.batch_size}, {args.steps} steps, "
          f"DiLoCo H={args.H}, median of {args.repeat} run(s)\n")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    ratios: dict[str, list[float]] = {name: [] for name, _ in CASES}
    for _ in range(args.repeat):  # each balanced run right after its twin: the same load
        for strategy_name, balanced in CASES:
            before = one_run(strategy_name, "none", args)
            after = one_run(strategy_name, balanced, args)
            runs.setdefault((strategy_name, "none"), []).append(before)
            runs.setdefault((strategy_name, balanced), []).append(after)
            ratios[strategy_name].append(before["wall_s"] / after["wall_s"])

    results = {key: summarize_runs(value) for key, value in runs.items()}
    rows = []
    for (strategy_name, balance), r in results.items():
        shares = "-" if r["shares"] is None else "/".join(map(str, r["shares"]))
        speeds = "-" if r["speeds"] is None else "/".join(f"{s:.2f}" for s in r["speeds"])
        rows.append((strategy_name, balance, f"{r['wall_s']:.2f}", f"{r['val_loss']:.4f}",
                     "/".join(map(str, r["samples"])), shares, speeds))
    print_table("two ranks, one half as fast",
                ("strategy", "balance", "wall s", "val loss", "samples by rank", "shares",
                 "measured speeds"), rows, left=("strategy", "balance"))
    print()
    for strategy_name, balanced in CASES:
        before, after = results[strategy_name, "none"], results[strategy_name, balanced]
        spread = ratios[strategy_name]
        print(f"{strategy_name}: balance={balanced} speedup over balance=none "
              f"{statistics.median(spread):.2f}x (wall-time ratio of each pair of runs; "
              f"range {min(spread):.2f}-{max(spread):.2f}x); val loss "
              f"{before['val_loss']:.4f} -> {after['val_loss']:.4f}")


if __name__ == "__main__":
    main()
