"""Goodput under churn: DDP, DiLoCo and AsyncDiLoCo when every host fails once every 2 minutes.

Run from the project root::

    python -m bench.goodput                       # K=8 and K=16, 20 simulated minutes
    python -m bench.goodput --nodes 8 --minutes 5 --seed 2

Goodput is the share of the samples the hosts could have trained while up
that reached the final model (:mod:`exogym.report.goodput`,
``docs/simulated-clock.md#goodput``). Each run simulates ``K`` ranks on the
digits task (:mod:`exogym.data.digits`, an MLP of 4,810 parameters) with the
simulated clock: a fixed compute time per step (``--compute-s``, 1 s) and a
link per host (``--network``, 1 Mbit/s) on which DDP's all-reduce of every
step takes about a quarter of that step, as a 100M-parameter model's would
over some 20 Gbit/s; DiLoCo and AsyncDiLoCo meet once per ``--H`` steps.

The failures: each host fails on average once every ``--mtbf`` (120 s) of
simulated time and is down ``--down`` (30 s) each time
(:func:`exogym.membership.mtbf.draw_rank_failures`, from ``--seed``, the same
failure times in seconds for every strategy). A strategy's seconds per step
are measured first by a short fault-free run (its goodput is printed too: what
communication alone costs), then the run under failures lasts ``--minutes``
of simulated time.

Targets: AsyncDiLoCo >= 0.85, DiLoCo >= 0.75; DDP is reported as measured.
Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
from typing import Any

#: The strategies compared, by the names the table gives them.
STRATEGIES = ("DDP", "DiLoCo", "AsyncDiLoCo")
#: The goodput each strategy is expected to reach (None: reported as measured).
TARGETS = {"DDP": None, "DiLoCo": 0.75, "AsyncDiLoCo": 0.85}


def make_strategy(name: str, args: argparse.Namespace) -> Any:
    """A fresh strategy of the table's ``name``."""
    from exogym.strategy import AsyncDiLoCoStrategy, DiLoCoStrategy, SimpleReduceStrategy

    if name == "DDP":
        return SimpleReduceStrategy(lr=args.lr)
    if name == "DiLoCo":
        return DiLoCoStrategy(lr=args.lr, H=args.H)
    return AsyncDiLoCoStrategy(lr=args.lr, H=args.H, quorum=args.quorum)


def fit(name: str, nodes: int, steps: int, args: argparse.Namespace,
        failures: list[tuple[int, int, int | None]] | None = None) -> dict[str, Any]:
    """One simulated run; its summary."""
    import torch

    from exogym import Trainer
    from exogym.data.digits import DigitsMLP, digits_datasets

    train, val = digits_datasets()
    torch.manual_seed(args.seed)
    trainer = Trainer(DigitsMLP(), train, val)
    trainer.fit(strategy=make_strategy(name, args), num_nodes=nodes, max_steps=steps,
                batch_size=args.batch_size, val_size=0, compute_time_s=args.compute_s,
                network=args.network, rank_failures=failures, seed=args.seed, logger=None,
                progress=False)
    return trainer.summary


def measure(name: str, nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    """A strategy at ``nodes`` ranks: fault-free (its step time), then under failures."""
    from exogym.membership.mtbf import draw_rank_failures

    calibration = fit(name, nodes, 4 * args.H, args)
    step_s = calibration["sim_time_per_step_s"]
    steps = max(args.H, round(args.minutes * 60 / step_s / args.H) * args.H)
    failures = draw_rank_failures(nodes, steps, mtbf=args.mtbf, down=args.down,
                                  seed=args.seed, step_s=step_s,
                                  round_steps=make_strategy(name, args).round_steps)
    summary = fit(name, nodes, steps, args, failures)
    goodput = summary["goodput"]
    changes = goodput["changes"]
    return {"name": name, "nodes": nodes, "step_s": step_s, "steps": steps,
            "failures": len(failures), "fault_free": calibration["goodput"]["goodput"],
            "goodput": goodput["goodput"], "sim_s": summary["sim_time_s"],
            "down_s": goodput["down_s"], "up_s": goodput["up_s"],
            "dropped": goodput["dropped_samples"], "useful": goodput["useful_samples"],
            "wait_s": sum(r["wait_s"] for r in goodput["ranks"]),
            "idle_s": sum(r["idle_s"] for r in goodput["ranks"]),
            "dropped_s": sum(c["dropped_s"] for c in changes),
            "rejoin_s": sum(c["rejoin_wait_s"] for c in changes)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--minutes", type=float, default=20.0,
                        help="simulated minutes of each run under failures")
    parser.add_argument("--mtbf", type=float, default=120.0,
                        help="each host's mean time between failures, simulated seconds")
    parser.add_argument("--down", type=float, default=30.0,
                        help="how long a failure keeps its host down, simulated seconds")
    parser.add_argument("--compute-s", type=float, default=1.0,
                        help="simulated compute seconds of a step")
    parser.add_argument("--network", default="1mbit")
    parser.add_argument("--H", type=int, default=10, help="inner steps per round")
    parser.add_argument("--quorum", type=float, default=0.5, help="AsyncDiLoCo's quorum")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    from bench.harness.tables import print_table

    results = [measure(name, nodes, args) for nodes in args.nodes for name in STRATEGIES]
    rows = []
    for r in results:
        target = TARGETS[r["name"]]
        verdict = "as measured" if target is None else (
            f">= {target:.2f}: {'met' if r['goodput'] >= target else 'missed'}")
        rows.append([str(r["nodes"]), r["name"], f"{r['step_s']:.3f} s", str(r["steps"]),
                     str(r["failures"]), f"{r['down_s'] / max(r['up_s'] + r['down_s'], 1e-9):.1%}",
                     f"{r['fault_free']:.3f}", f"{r['goodput']:.3f}", str(r["dropped"]),
                     f"{r['dropped_s']:.0f} s", f"{r['rejoin_s']:.0f} s", f"{r['wait_s']:.0f} s",
                     f"{r['idle_s']:.0f} s", verdict])
    print_table(f"Goodput, each host failing once per {args.mtbf:g} s and down {args.down:g} s "
                f"({args.minutes:g} simulated minutes, {args.network}, "
                f"{args.compute_s:g} s of compute a step, H={args.H}, seed {args.seed})",
                ["K", "strategy", "s/step", "steps", "failures", "time down",
                 "goodput fault-free", "goodput", "samples dropped", "dropped (host-s)",
                 "waiting to rejoin", "in collectives", "idle", "target"], rows,
                left=("strategy", "target"), width=220)


if __name__ == "__main__":
    main()
