"""Asynchronous DiLoCo against synchronous DiLoCo when one rank is slow, and when one is away.

Run from the project root::

    python -m bench.async_sim                 # 3 seeds
    python -m bench.async_sim --seeds 1 --steps 200

Four simulated ranks on the digits task (:mod:`exogym.data.digits`, an MLP),
``rank_speeds=[1, 1, 1, 0.25]``, the simulated clock with a fixed compute time
per step (``--compute-s``, 0.05 s) and a 100 Mbit/s network: simulated time is
exact and repeatable. Every run evaluates the global model every ``H`` steps.

**Slow rank.** The target loss is the final validation loss of DiLoCo with
equal speeds after ``--steps`` steps (every rank trains every step). Then, with
the slow rank, the simulated time at which each run's validation loss first
reaches it: synchronous DiLoCo (the same steps and samples as the target run),
DiLoCo with ``balance='steps'`` and AsyncDiLoCo (``quorum=0.5``; with rounds of
``H`` steps, and with ``adaptive_H``: rounds as long as each rank's speed
allows), all but the first given twice the steps (a slow rank trains fewer of
them). Targets: AsyncDiLoCo at
most 0.75x the time of synchronous DiLoCo, and no later than DiLoCo with
``balance='steps'``.

**A rank away.** AsyncDiLoCo with the slow rank, and the same run with rank 1
away for 30% of the steps (from 35% of the run, mid-round, back at 65%): every
step any rank trained is merged or counted as dropped (checked), and the final
loss of the run with the absence is compared with the loss of the run without
it at the same number of samples trained (interpolated between evaluations).
Target: within 2%.

``--workload teacher`` trains an MLP of 1.86M parameters (``--width 1024``) on
inputs labelled by a fixed random teacher network (60,000 of them, so no run
sees a sample twice per rank), whose merges at 100 Mbit/s take longer than a
round's compute: there ``--merge-delay`` lets AsyncDiLoCo train through them
(``--lr 1e-3`` suits it).

Prints figures (per seed and medians); asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

SPEEDS = [1.0, 1.0, 1.0, 0.25]


def _run(strategy: Any, args: argparse.Namespace, seed: int, steps: int,
         speeds: list[float] | None = None, **extra: Any) -> dict[str, Any]:

    from exogym import Trainer

    train, val, model = _workload(args, seed)
    trainer = Trainer(model, train, val)
    trainer.fit(strategy=strategy, num_nodes=4, max_steps=steps, batch_size=args.batch_size,
                val_size=min(len(val), 1000), val_interval=args.H, rank_speeds=speeds, speed_mode="clock",
                compute_time_s=args.compute_s, network=args.network, seed=seed, logger=None,
                progress=False, **extra)
    rows = [r for r in trainer.history if r.get("event", "step") == "step" and "samples" in r]
    evals = [(r["sim_time_s"], r["val_global_loss"]) for r in rows
             if r["rank"] == 0 and "val_global_loss" in r]
    samples_at: dict[int, int] = {}
    for r in rows:
        samples_at[r["step"]] = samples_at.get(r["step"], 0) + r["samples"]
    # samples all ranks had trained when each evaluation ran (a rank away counts what it had)
    last: dict[int, int] = {}
    by_eval = []
    eval_steps = {r["step"] for r in rows if r["rank"] == 0 and "val_global_loss" in r}
    for step in sorted({r["step"] for r in rows}):
        for r in rows:
            if r["step"] == step:
                last[r["rank"]] = r["samples"]
        if step in eval_steps:
            by_eval.append(sum(last.values()))
    return {"evals": evals, "samples": by_eval, "summary": trainer.summary,
            "trained_steps": sum(not r.get("idle") for r in rows)}


def _workload(args: argparse.Namespace, seed: int) -> tuple[Any, Any, Any]:
    """The training and validation data and a fresh model (seeded) of ``--workload``."""
    import torch

    if args.workload == "digits":
        from exogym.data.digits import DigitsMLP, digits_datasets

        train, val = digits_datasets()
        torch.manual_seed(seed)
        return train, val, DigitsMLP()
    from bench.harness.workloads import SyntheticMLP, teacher_digits

    train, val = teacher_digits(60_000, seed=1), teacher_digits(2_000, seed=2)
    torch.manual_seed(seed)
    return train, val, SyntheticMLP(args.width, args.width)


def _reached(evals: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, loss in evals if loss <= target), None)


def _loss_at_samples(run: dict[str, Any], samples: float) -> float:
    """The run's validation loss at ``samples`` trained, linear between evaluations."""
    points = list(zip(run["samples"], (loss for _, loss in run["evals"])))
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if s0 <= samples <= s1:
            return l0 + (l1 - l0) * (samples - s0) / max(1, s1 - s0)
    return points[-1][1]


def slow_rank(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Time to the target loss of each run with the slow rank (one seed)."""
    from exogym.strategy import AsyncDiLoCoStrategy, DiLoCoStrategy

    def diloco() -> DiLoCoStrategy:
        return DiLoCoStrategy(lr=args.lr, H=args.H)

    target = _run(diloco(), args, seed, args.steps)["evals"][-1][1]
    sync = _run(diloco(), args, seed, args.steps, SPEEDS)
    balanced = _run(diloco(), args, seed, 2 * args.steps, SPEEDS, balance="steps")
    ours = _run(AsyncDiLoCoStrategy(lr=args.lr, H=args.H, quorum=args.quorum,
                                    merge_delay=args.merge_delay), args, seed,
                2 * args.steps, SPEEDS)
    adaptive = _run(AsyncDiLoCoStrategy(lr=args.lr, H=args.H, quorum=args.quorum,
                                        merge_delay=args.merge_delay, adaptive_H=True),
                    args, seed, 2 * args.steps, SPEEDS)
    return {"target": target, "sync": _reached(sync["evals"], target),
            "balance": _reached(balanced["evals"], target),
            "async": _reached(ours["evals"], target),
            "adaptive": _reached(adaptive["evals"], target), "merges": ours["summary"]["merges"]}


def away(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """AsyncDiLoCo with and without rank 1 away for 30% of the run (one seed)."""
    from exogym.strategy import AsyncDiLoCoStrategy

    def strategy() -> AsyncDiLoCoStrategy:
        return AsyncDiLoCoStrategy(lr=args.lr, H=args.H, quorum=args.quorum,
                                   merge_delay=args.merge_delay)

    steps = 2 * args.steps
    leave = int(0.35 * steps) + args.H // 2  # mid-round
    back = leave + int(0.3 * steps)
    present = _run(strategy(), args, seed, steps, SPEEDS)
    absent = _run(strategy(), args, seed, steps, SPEEDS, rank_failures=[(1, leave, back)])
    merges = absent["summary"]["merges"]
    accounted = merges["steps"] + merges["dropped_steps"]
    final_samples = absent["samples"][-1]
    reference = _loss_at_samples(present, final_samples)
    final = absent["evals"][-1][1]
    return {"leave": leave, "back": back, "trained": absent["trained_steps"],
            "accounted": accounted, "dropped_steps": merges["dropped_steps"],
            "final": final, "reference": reference, "samples": final_samples,
            "ratio": final / reference}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200,
                        help="steps of the equal-speed target run (the others run twice as many)")
    parser.add_argument("--H", type=int, default=10, help="inner steps per round")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--quorum", type=float, default=0.5)
    parser.add_argument("--compute-s", type=float, default=0.05,
                        help="simulated compute seconds of a step at full speed")
    parser.add_argument("--network", default="100mbit")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workload", choices=("digits", "teacher"), default="digits",
                        help="digits (4,810 parameters: compute-bound) or an MLP of --width "
                             "on a teacher's labels (1.86M parameters at 1024: the merges "
                             "take longer than a round's compute at 100 Mbit/s)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--merge-delay", type=int, default=0,
                        help="AsyncDiLoCo's steps trained while a merge travels")
    args = parser.parse_args(argv)

    from bench.harness.tables import print_table

    slow = [slow_rank(args, seed) for seed in range(args.seeds)]
    rows = []
    for seed, r in enumerate(slow):
        rows.append([str(seed), f"{r['target']:.4f}", _s(r["sync"]), _s(r["balance"]),
                     _s(r["async"]), _s(r["adaptive"]), _ratio(r["async"], r["sync"]),
                     _ratio(r["async"], r["balance"]), _ratio(r["adaptive"], r["sync"]),
                     _ratio(r["adaptive"], r["balance"]),
                     f"{r['merges']['staleness_mean']:.2f}"])
    print_table(f"Simulated time to DiLoCo's loss with equal speeds, speeds {SPEEDS}, "
                f"{args.network}, H={args.H}",
                ["seed", "target loss", "DiLoCo", "DiLoCo balance=steps", "AsyncDiLoCo",
                 "AsyncDiLoCo adaptive_H", "async/sync (<=0.75)", "async/balance (<=1)",
                 "adaptive/sync", "adaptive/balance", "mean staleness"], rows)
    for key in ("async", "adaptive"):
        ratios = [r[key] / r["sync"] for r in slow if r[key] and r["sync"]]
        versus = [r[key] / r["balance"] for r in slow if r[key] and r["balance"]]
        if ratios and versus:
            print(f"{key}: median /sync {statistics.median(ratios):.3f} (max "
                  f"{max(ratios):.3f}); median /balance {statistics.median(versus):.3f} "
                  f"(max {max(versus):.3f})")

    gone = [away(args, seed) for seed in range(args.seeds)]
    rows = [[str(seed), f"{g['leave']}-{g['back']}", str(g["trained"]), str(g["accounted"]),
             str(g["dropped_steps"]), str(g["samples"]), f"{g['final']:.4f}",
             f"{g['reference']:.4f}", f"{g['ratio']:.3f}"] for seed, g in enumerate(gone)]
    print_table("AsyncDiLoCo with rank 1 away for 30% of the steps (target: ratio within 2%)",
                ["seed", "away (steps)", "steps trained", "merged + dropped", "dropped",
                 "samples", "final loss", "without absence, same samples", "ratio"], rows)
    print(f"median ratio {statistics.median(g['ratio'] for g in gone):.3f}; every trained "
          f"step accounted for: {all(g['trained'] == g['accounted'] for g in gone)}")


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.2f} s"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.3f}"


if __name__ == "__main__":
    main()
