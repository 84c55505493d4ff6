"""Stacked ranks against packed ranks on this machine's CPU: speed, and the same result.

Workload: chargpt-bench's model (``chargpt_task(block_size=64, n_layer=4,
n_head=4, n_embd=256)``, 3.3M parameters), DiLoCo (H=5, AdamW inside, lr
1e-3), batch 16 per rank, one thread per rank, no evaluation. The same run of K
ranks (``--nodes``, 16) in ``--processes`` processes (2), first packed
(``fit(processes=P)``), then stacked (``fit(processes=P, stack=True)``), each
``--repeat`` times (1) in this process. It prints the fit time and samples per
second of each (the median), their ratio, and the largest difference between
the two final models' tensors.

    python -m bench.stacked
    python -m bench.stacked --nodes 8 --steps 5 --repeat 3
"""

from __future__ import annotations

import argparse
import time
import warnings

from bench.harness.tables import print_table


def fit_once(nodes: int, processes: int, steps: int, stack: bool) -> tuple[float, dict]:
    """One fit: its seconds and its final model's state."""
    from distributed.tasks.builtin import chargpt_task
    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy

    model, train, val = chargpt_task(block_size=64, n_layer=4, n_head=4, n_embd=256)
    trainer = Trainer(model, train, val)
    start = time.perf_counter()
    final = trainer.fit(strategy=DiLoCoStrategy(H=5, inner_optim="adamw", lr=1e-3),
                        num_nodes=nodes, max_steps=steps, batch_size=16, val_size=0,
                        num_threads=1, processes=processes, stack=stack, logger=None,
                        progress=False)
    return time.perf_counter() - start, final.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stacked",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    if min(args.nodes, args.processes, args.steps, args.repeat) < 1 \
            or args.processes > args.nodes:
        parser.error("--nodes, --processes, --steps and --repeat must be >= 1, "
                     "--processes at most --nodes")
    warnings.filterwarnings("ignore", message=".*batching rule.*")  # vmap's fallbacks
    samples = args.nodes * args.steps * 16
    seconds: dict[bool, list[float]] = {False: [], True: []}
    finals = {}
    for _ in range(args.repeat):
        for stack in (False, True):
            took, finals[stack] = fit_once(args.nodes, args.processes, args.steps, stack)
            seconds[stack].append(took)
    median = {stack: sorted(s)[len(s) // 2] for stack, s in seconds.items()}
    difference = max((finals[True][k].float() - finals[False][k].float()).abs().max().item()
                     for k in finals[True])
    rows = [("packed" if not stack else "stacked", f"{median[stack]:.1f}",
             f"{samples / median[stack]:.1f}") for stack in (False, True)]
    print_table(f"chargpt-bench, DiLoCo H=5: K={args.nodes} ranks in {args.processes} "
                f"processes, {args.steps} steps of batch 16, median of {args.repeat}",
                ("ranks", "fit s", "samples/s"), rows)
    print(f"stacked / packed samples/s: {median[False] / median[True]:.2f}x; "
          f"largest difference between the final models: {difference:.2e}")


if __name__ == "__main__":
    main()
