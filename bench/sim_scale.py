"""How the simulator scales with the number of ranks K on this machine.

Workload: DiLoCo (H=20), 100 steps per rank of an MLP 784-256-128-10 (235k
parameters) on synthetic 28x28 samples, batch 32 per rank, one evaluation of
64 samples at the end. For K = 4, 16, 64, 256 (``--ks``), each in a fresh
Python process, it prints:

- wall time: the process end to end (Python, torch, the ranks, exit);
- fit time: ``Trainer.fit`` alone (the child has built a torch optimizer first,
  as any training script does: torch._dynamo's one-time import is wall time);
- compute floor: ``K * steps * t_step / cores``, where ``t_step`` is one rank's
  training step (gathering a shuffled batch, forward, backward, AdamW built as
  the trainer builds it) on one thread, timed with every core busy with one
  such loop (the ranks' conditions at best);
- fit time over the floor. This machine's speed drifts by tens of percent from
  minute to minute, so each K is fitted ``--repeat`` times (3) with the floor
  timed between the fits, each fit is set against the mean of the floors right
  before and right after it, and the table shows the median fit and the range;
- where the rest goes: the fixed cost of a fit (start-up, the evaluation, the
  final collection: a fit of one step) and the cost per step beyond the
  floor's (``(fit - fixed) / (steps - 1)`` against ``K * t_step / cores``);
- the processes the ranks ran in (more ranks than cores are packed several to
  a process, :mod:`exogym.comm.packed`);
- peak memory: the most memory the machine had in use during the run, above
  what it used before (``MemTotal - MemAvailable``, every process included).

    python -m bench.sim_scale
    python -m bench.sim_scale --ks 4 16 64 --steps 50
    python -m bench.sim_scale --ks 1024 --stack   # the ranks of a process as one batched model
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench.harness import ROOT
from bench.harness.machine import used_memory_bytes
from bench.harness.tables import print_table
from bench.harness.timing import bench_command, timed_run
from bench.sim_speed import workload  # the same model and data as the speed bench


def step_seconds(steps: int = 500, start_at: float = 0.0) -> float:
    """One rank's step on one thread (median of ``steps``): gather a shuffled batch, forward,
    backward, AdamW built as the trainer builds it (fused kernel and all).

    Starts at the wall-clock time ``start_at``, so that loops in several processes overlap.
    """
    import torch

    from exogym.strategy import OptimSpec

    torch.set_num_threads(1)
    mlp, data = workload()
    model = mlp()
    opt = OptimSpec(torch.optim.AdamW).build(model)
    x, y = data.tensors
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    times = []
    while time.time() < start_at:
        time.sleep(0.001)
    for i in range(steps + 20):
        start = time.perf_counter()
        idx = order[i * 32 % 19968:][:32]
        batch = (x.index_select(0, idx), y.index_select(0, idx))
        opt.zero_grad()
        model(batch).backward()
        opt.step()
        if i >= 20:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def fit_once(nodes: int, steps: int, stack: bool = False) -> dict:
    """Body of a child process: one fit, its time and the processes its ranks ran in.

    Like any training script, the child has built a torch optimizer before it
    trains, which imports torch._dynamo once (about a second here): that import
    is in the wall time, not in the fit time.
    """
    import torch

    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy

    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())
    mlp, data = workload()
    torch.manual_seed(0)
    trainer = Trainer(mlp(), data, data)
    start = time.perf_counter()
    trainer.fit(strategy=DiLoCoStrategy(H=20), num_nodes=nodes, max_steps=steps, batch_size=32,
                val_size=64, val_interval=steps, logger=None, progress=False, stack=stack)
    return {"fit_s": time.perf_counter() - start,
            "processes": trainer.summary.get("processes", nodes),
            "final_val_loss": trainer.summary.get("final_val_loss")}


def _timed_child(args: list[str]) -> tuple[float, int, str]:
    """Run this bench as a child; its wall time, the peak memory in use above the start
    (sampled every 0.05 s), its stdout."""
    base = used_memory_bytes()
    peak = [base]

    def sample(pid: int) -> None:
        peak[0] = max(peak[0], used_memory_bytes())

    run = timed_run(bench_command("bench.sim_scale", *args), sample=sample, every=0.05)
    return run.wall_s, peak[0] - base, run.stdout


def _busy_step(result_path: str, start_at: float) -> None:
    Path(result_path).write_text(str(step_seconds(start_at=start_at)))


def floor_step(cores: int) -> float:
    """One rank-step's seconds with every core running one step loop at once (their median)."""
    start_at = time.time() + 5.0  # after every child has imported torch
    with tempfile.TemporaryDirectory() as tmp:
        paths = [str(Path(tmp) / f"step{i}") for i in range(cores)]
        procs = [subprocess.Popen(bench_command("bench.sim_scale", "--step-child", p,
                                                "--start-at", str(start_at)), cwd=ROOT)
                 for p in paths]
        for p in procs:
            p.wait()
        return sorted(float(Path(p).read_text()) for p in paths)[cores // 2]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_scale",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3,
                        help="fits per K; the table shows the median one (default 3)")
    parser.add_argument("--stack", action="store_true",
                        help="compute each process's ranks as one batched model (fit(stack=True))")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--step-child", help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step_child:
        _busy_step(args.step_child, args.start_at)
        return
    if args.child:
        print(json.dumps(fit_once(args.child, args.steps, args.stack)))
        return
    if min(args.ks) < 1 or args.steps < 1 or args.repeat < 1:
        parser.error("--ks, --steps and --repeat must be >= 1")

    cores = os.cpu_count() or 1
    stack = ["--stack"] if args.stack else []
    rows = []
    for k in args.ks:
        # floor, fit, floor, fit, ..., floor: each fit against the floors on either side.
        floors = [floor_step(cores)]
        runs = []
        for _ in range(args.repeat):
            wall, peak, stdout = _timed_child(["--child", str(k), "--steps", str(args.steps),
                                               *stack])
            result = json.loads(stdout.strip().splitlines()[-1])
            floors.append(floor_step(cores))
            t_step = (floors[-2] + floors[-1]) / 2
            floor = k * args.steps * t_step / cores
            runs.append({"wall": wall, "peak": peak, "fit": result["fit_s"], "t_step": t_step,
                         "floor": floor, "ratio": result["fit_s"] / floor,
                         "processes": result["processes"], "loss": result["final_val_loss"]})
        _, _, one = _timed_child(["--child", str(k), "--steps", "1", *stack])
        fixed = json.loads(one.strip().splitlines()[-1])["fit_s"]
        ratios = sorted(r["ratio"] for r in runs)
        mid = sorted(runs, key=lambda r: r["ratio"])[len(runs) // 2]
        peak = max(r["peak"] for r in runs)
        t_step = mid["t_step"]
        per_step = (mid["fit"] - fixed) / max(1, args.steps - 1) / (k * t_step / cores)
        spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}x"
        rows.append((k, mid["processes"], f"{t_step * 1e3:.2f}", f"{mid['wall']:.1f}",
                     f"{mid['fit']:.1f}", f"{mid['floor']:.1f}", f"{mid['ratio']:.2f}x",
                     spread, f"{fixed:.1f}", f"{per_step:.2f}x", f"{peak / 2**30:.2f} GiB"))
        print(f"K={k}: {mid['processes']} processes, rank-step {t_step * 1e3:.2f} ms, "
              f"wall {mid['wall']:.1f} s, fit {mid['fit']:.1f} s, floor {mid['floor']:.1f} s, "
              f"{mid['ratio']:.2f}x (fits: {', '.join(f'{r:.2f}x' for r in ratios)}), "
              f"fixed {fixed:.1f} s, per step {per_step:.2f}x the floor's, "
              f"peak {peak / 2**30:.2f} GiB, final val loss {mid['loss']:.4f}", flush=True)
    print_table(f"simulation at scale{' (stacked ranks)' if args.stack else ''}: DiLoCo H=20, "
                f"MLP 235k parameters, batch 32, "
                f"{args.steps} steps per rank, {cores} cores, median of {args.repeat} fits per K",
                ("K", "processes", "rank-step ms", "wall s", "fit s", "compute floor s",
                 "fit / floor", "range", "fixed s", "per step / floor's", "peak memory"), rows)


if __name__ == "__main__":
    main()
