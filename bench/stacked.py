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

from bench.gpu.flops import flops_per_token
from bench.harness.tables import print_table

SHAPE = dict(block_size=64, n_layer=4, n_head=4, n_embd=256)
BATCH = 16


def fit_once(nodes: int, processes: int, steps: int, stack: bool) -> tuple[float, dict]:
    """One fit: its seconds and its final model's state."""
    from distributed.tasks.builtin import chargpt_task
    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy

    model, train, val = chargpt_task(**SHAPE)
    trainer = Trainer(model, train, val)
    start = time.perf_counter()
    final = trainer.fit(strategy=DiLoCoStrategy(H=5, inner_optim="adamw", lr=1e-3),
                        num_nodes=nodes, max_steps=steps, batch_size=BATCH, val_size=0,
                        num_threads=1, processes=processes, stack=stack, logger=None,
                        progress=False)
    return time.perf_counter() - start, final.state_dict()


def _best_seconds(work, repeat: int) -> float:
    work()  # warm: the first call allocates and builds what the others reuse
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def compute_bound(repeat: int = 5) -> tuple[float, float]:
    """GFLOP/s of one rank's forward and backward (model FLOPs) and of a 1024^3 matrix
    product, each on one thread of this process, the best of ``repeat`` after a warm one."""
    import torch
    from torch.utils.data import default_collate

    from distributed.tasks.builtin import chargpt_task

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, train, _ = chargpt_task(**SHAPE)
        batch = default_collate([train[i] for i in range(BATCH)])
        params = [p for p in model.parameters() if p.requires_grad]
        step_s = _best_seconds(lambda: torch.autograd.grad(model(batch), params), repeat)
        flops = flops_per_token(sum(p.numel() for p in params), SHAPE["n_layer"],
                                SHAPE["block_size"], SHAPE["n_embd"])
        tokens = BATCH * SHAPE["block_size"]
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        mm_s = _best_seconds(lambda: torch.mm(a, b), repeat)
    finally:
        torch.set_num_threads(threads)
    return flops * tokens / step_s / 1e9, 2 * 1024**3 / mm_s / 1e9


def attention_seconds(ranks: int, repeat: int = 3) -> tuple[float, float]:
    """Seconds of one forward and backward of ``ranks`` stacked chargpt ranks on one
    thread: with ``vmap``'s own attention, and with the ranks' attention in one call."""
    import torch
    from torch.func import functional_call, vmap
    from torch.utils.data import default_collate

    from distributed.tasks.builtin import chargpt_task
    from exogym.run.stack_attention import batched_attention

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, train, _ = chargpt_task(**SHAPE)
        params = {n: torch.stack([p.detach()] * ranks).requires_grad_()
                  for n, p in model.named_parameters()}
        buffers = {n: torch.stack([b] * ranks) for n, b in model.named_buffers()}
        batch = [t.unflatten(0, (ranks, BATCH)) for t in
                 default_collate([train[i] for i in range(BATCH * ranks)])]
        losses = vmap(lambda p, b, x: functional_call(model, (p, b), (x,)),
                      randomness="different")

        def step(batched: bool) -> None:
            if batched:
                with batched_attention():
                    loss = losses(params, buffers, batch).sum()
            else:
                loss = losses(params, buffers, batch).sum()
            torch.autograd.grad(loss, list(params.values()))

        return (_best_seconds(lambda: step(False), repeat),
                _best_seconds(lambda: step(True), repeat))
    finally:
        torch.set_num_threads(threads)


def compare(args: argparse.Namespace) -> None:
    """Packed then stacked, ``--repeat`` times: the table, the ratio, the difference."""
    samples = args.nodes * args.steps * BATCH
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
                f"processes, {args.steps} steps of batch {BATCH}, median of {args.repeat}",
                ("ranks", "fit s", "samples/s"), rows)
    print(f"stacked / packed samples/s: {median[False] / median[True]:.2f}x; "
          f"largest difference between the final models: {difference:.2e}", flush=True)


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
    compare(args)
    step, peak = compute_bound()
    print(f"one rank's forward and backward on one thread: {step:.1f} GFLOP/s of model FLOPs; "
          f"a 1024^3 matrix product on one thread: {peak:.1f} GFLOP/s. Stacking computes the "
          f"same FLOPs, so it can compute at most {peak / step:.2f}x as fast as ranks one "
          "after another on this CPU")
    ranks = args.nodes // args.processes
    alone, batched = attention_seconds(ranks)
    print(f"{ranks} stacked ranks' forward and backward on one thread: {alone:.2f} s with "
          f"vmap's own attention, {batched:.2f} s with the ranks' attention in one call "
          f"({alone / batched:.2f}x)")


if __name__ == "__main__":
    main()
