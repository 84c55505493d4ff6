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
- the same ratio in CPU time: the CPU seconds of the fit's processes (the child
  and every rank process) over ``K * steps`` times a step's CPU seconds. Where
  other work shares the machine, the wall-clock floor (a loop of half a second)
  and the fit get different shares of it; their CPU time moves much less;
- where the rest goes: the fixed cost of a fit (start-up, the evaluation, the
  final collection: a fit of one step) and the cost per step beyond the
  floor's (``(fit - fixed) / (steps - 1)`` against ``K * t_step / cores``);
- the processes the ranks ran in (more ranks than cores are packed several to
  a process, :mod:`exogym.comm.packed`);
- peak memory: the most memory the machine had in use during the run, above
  what it used before (``MemTotal - MemAvailable``, every process included),
  and the peak of the run's own processes (their summed PSS, shared pages split
  among those sharing them, sampled every 0.5 s), which other work on the
  machine does not move.

A second table says where the median fit's time beyond the floor went, from the
accounts of its packed processes (``trainer.summary['packed']``,
:class:`exogym.comm.packed.PackedTally`), in seconds of one process (the
processes' sums over their number, as the fit's time is):

- start-up: a rank building its model, data and strategy before its first step;
- evaluation; end (the final state's digest, the last barrier);
- hand-overs: how many times per rank-step a rank handed its process's turn on
  to wait, and the seconds the turn took to reach the next rank (the system
  waking its thread);
- scratch: how many times per rank-step a rank gave its BLAS scratch back (only
  where memory is short, :func:`exogym.run.memory.scratch_plan`; the run's note
  says which), and those seconds with taking it again, at the cost measured
  here per time;
- collectives: the rank acting for a process posting, reading and reducing its
  ranks' parts across processes, and the seconds no rank of a process could run
  (all waiting for peers in the other processes);
- steps: the rest of the ranks' time, their training steps, less the floor;
- outside: the fit's time when no rank ran (processes starting, the final
  average, the run's summary).

And the run's notes (``trainer.summary['notes']``).

    python -m bench.sim_scale
    python -m bench.sim_scale --ks 4 16 64 --steps 50
    python -m bench.sim_scale --ks 64 1024 --steps 20 --repeat 1
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
from bench.harness.machine import PeakPss, used_memory_bytes
from bench.harness.tables import print_table
from bench.harness.timing import bench_command, timed_run
from bench.sim_speed import workload  # the same model and data as the speed bench


def step_seconds(steps: int = 500, start_at: float = 0.0) -> tuple[float, float]:
    """One rank's step on one thread (median of ``steps``): gather a shuffled batch, forward,
    backward, AdamW built as the trainer builds it (fused kernel and all); in wall-clock
    seconds and in seconds of CPU time.

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
    times, cpu_times = [], []
    while time.time() < start_at:
        time.sleep(0.001)
    for i in range(steps + 20):
        start, cpu = time.perf_counter(), time.thread_time()
        idx = order[i * 32 % 19968:][:32]
        batch = (x.index_select(0, idx), y.index_select(0, idx))
        opt.zero_grad()
        model(batch).backward()
        opt.step()
        if i >= 20:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.thread_time() - cpu)
    return sorted(times)[len(times) // 2], sorted(cpu_times)[len(cpu_times) // 2]


def _cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for (a fit's ranks)."""
    import resource

    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                          resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


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
    start, cpu = time.perf_counter(), _cpu_s()
    trainer.fit(strategy=DiLoCoStrategy(H=20), num_nodes=nodes, max_steps=steps, batch_size=32,
                val_size=64, val_interval=steps, logger=None, progress=False, stack=stack)
    return {"fit_s": time.perf_counter() - start, "fit_cpu_s": _cpu_s() - cpu,
            "processes": trainer.summary.get("processes", nodes),
            "final_val_loss": trainer.summary.get("final_val_loss"),
            "packed": trainer.summary.get("packed"),
            "notes": trainer.summary.get("notes") or []}


def retake_seconds(products: int = 400) -> float:
    """Seconds one give-back of the BLAS scratch costs with taking it again: a step's
    matrix products of the workload's model on one thread, each after a give-back,
    against the same without (the median of seven pairs, never below zero)."""
    import torch

    from exogym.base.blas_buffers import release_thread_buffers

    torch.set_num_threads(1)
    a, b, g = torch.randn(32, 784), torch.randn(784, 256), torch.randn(32, 256)

    def block(release: bool) -> float:
        start = time.thread_time()
        for _ in range(products):
            a @ b
            g.t() @ a
            if release:
                release_thread_buffers()
        return (time.thread_time() - start) / products

    block(False)
    extra = sorted(block(True) - block(False) for _ in range(7))
    return max(0.0, extra[3])


def breakdown(run: dict, steps: int, retake_s: float) -> tuple | None:
    """One row of where a fit's time beyond its floor went (None: no packed account)."""
    packed = run.get("packed")
    if not packed:
        return None
    processes = run["processes"]

    def each(seconds: float) -> float:  # the processes ran side by side: one's share
        return seconds / processes

    phases = packed.get("phases_s") or {}
    start_up, evaluation, end, exchange = (each(phases.get(name, 0.0)) for name in
                                           ("start-up", "evaluation", "end", "exchange"))
    scratch = each(packed["scratch_s"] + packed["scratch_releases"] * retake_s)
    idle, hand_over = each(packed["idle_s"]), each(packed["hand_over_s"])
    running = each(packed["running_s"])
    stepping = running - each(sum(phases.values())) - each(packed["scratch_s"])
    outside = run["fit"] - running - hand_over - idle
    ranks = run["k"]
    return (ranks, f"{run['fit'] - run['floor']:+.1f}", f"{start_up:.1f}", f"{evaluation:.1f}",
            f"{end:.1f}",
            f"{packed['hand_overs'] / (ranks * steps):.2f} ({hand_over:.2f} s)",
            f"{packed['scratch_releases'] / (ranks * steps):.2f} ({scratch:.2f} s)",
            f"{exchange:.2f} + {idle:.2f}", f"{stepping - run['floor']:+.1f}",
            f"{outside:.1f}")


def _timed_child(args: list[str]) -> tuple[float, int, int, str]:
    """Run this bench as a child; its wall time, the peak memory in use above the start
    (sampled every 0.05 s), the peak PSS of its processes (every 0.5 s), its stdout."""
    base = used_memory_bytes()
    peak = [base]
    own = PeakPss()
    samples = [0]

    def sample(pid: int) -> None:
        peak[0] = max(peak[0], used_memory_bytes())
        if samples[0] % 10 == 0:  # reading every process's maps takes a core's while
            own(pid)
        samples[0] += 1

    run = timed_run(bench_command("bench.sim_scale", *args), sample=sample, every=0.05)
    return run.wall_s, peak[0] - base, own.summed, run.stdout


def _busy_step(result_path: str, start_at: float) -> None:
    Path(result_path).write_text(" ".join(map(str, step_seconds(start_at=start_at))))


def floor_step(cores: int) -> tuple[float, float]:
    """One rank-step's seconds, wall-clock and CPU, with every core running one step loop at
    once (their medians)."""
    start_at = time.time() + 5.0  # after every child has imported torch
    with tempfile.TemporaryDirectory() as tmp:
        paths = [str(Path(tmp) / f"step{i}") for i in range(cores)]
        procs = [subprocess.Popen(bench_command("bench.sim_scale", "--step-child", p,
                                                "--start-at", str(start_at)), cwd=ROOT)
                 for p in paths]
        for p in procs:
            p.wait()
        read = [tuple(map(float, Path(p).read_text().split())) for p in paths]
        return (sorted(wall for wall, _ in read)[cores // 2],
                sorted(cpu for _, cpu in read)[cores // 2])


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
    retake_s = retake_seconds()
    rows, where, notes = [], [], {}
    for k in args.ks:
        # floor, fit, floor, fit, ..., floor: each fit against the floors on either side.
        floors = [floor_step(cores)]
        runs = []
        for _ in range(args.repeat):
            wall, peak, pss, stdout = _timed_child(["--child", str(k), "--steps",
                                                    str(args.steps), *stack])
            result = json.loads(stdout.strip().splitlines()[-1])
            floors.append(floor_step(cores))
            t_step = (floors[-2][0] + floors[-1][0]) / 2
            floor = k * args.steps * t_step / cores
            cpu_floor = k * args.steps * (floors[-2][1] + floors[-1][1]) / 2
            runs.append({"k": k, "wall": wall, "peak": peak, "pss": pss, "fit": result["fit_s"],
                         "t_step": t_step, "floor": floor, "ratio": result["fit_s"] / floor,
                         "cpu_ratio": result["fit_cpu_s"] / cpu_floor,
                         "processes": result["processes"], "loss": result["final_val_loss"],
                         "packed": result["packed"], "notes": result["notes"]})
        _, _, _, one = _timed_child(["--child", str(k), "--steps", "1", *stack])
        fixed = json.loads(one.strip().splitlines()[-1])["fit_s"]
        ratios = sorted(r["ratio"] for r in runs)
        mid = sorted(runs, key=lambda r: r["ratio"])[len(runs) // 2]
        peak = max(r["peak"] for r in runs)
        pss = max(r["pss"] for r in runs)
        t_step = mid["t_step"]
        per_step = (mid["fit"] - fixed) / max(1, args.steps - 1) / (k * t_step / cores)
        spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}x"
        rows.append((k, mid["processes"], f"{t_step * 1e3:.2f}", f"{mid['wall']:.1f}",
                     f"{mid['fit']:.1f}", f"{mid['floor']:.1f}", f"{mid['ratio']:.2f}x",
                     spread, f"{mid['cpu_ratio']:.2f}x", f"{fixed:.1f}", f"{per_step:.2f}x",
                     f"{peak / 2**30:.2f} GiB", f"{pss / 2**30:.2f} GiB"))
        print(f"K={k}: {mid['processes']} processes, rank-step {t_step * 1e3:.2f} ms, "
              f"wall {mid['wall']:.1f} s, fit {mid['fit']:.1f} s, floor {mid['floor']:.1f} s, "
              f"{mid['ratio']:.2f}x (fits: {', '.join(f'{r:.2f}x' for r in ratios)}; in CPU "
              f"time {mid['cpu_ratio']:.2f}x), "
              f"fixed {fixed:.1f} s, per step {per_step:.2f}x the floor's, "
              f"peak {peak / 2**30:.2f} GiB (its processes' PSS {pss / 2**30:.2f} GiB), "
              f"final val loss {mid['loss']:.4f}", flush=True)
        row = breakdown(mid, args.steps, retake_s)
        if row is not None:
            where.append(row)
        if mid["notes"]:
            notes[k] = mid["notes"]
    print_table(f"simulation at scale{' (stacked ranks)' if args.stack else ''}: DiLoCo H=20, "
                f"MLP 235k parameters, batch 32, "
                f"{args.steps} steps per rank, {cores} cores, median of {args.repeat} fits per K",
                ("K", "processes", "rank-step ms", "wall s", "fit s", "compute floor s",
                 "fit / floor", "range", "CPU: fit / floor", "fixed s", "per step / floor's",
                 "peak memory",
                 "its processes' peak"), rows,
                width=200)
    if where:
        print_table("where the median fit's time beyond the floor went, seconds of one process "
                    f"(scratch taken again: {retake_s * 1e6:.1f} us a time, measured here)",
                    ("K", "fit - floor s", "start-up s", "evaluation s", "end s",
                     "hand-overs per rank-step", "scratch releases per rank-step",
                     "collectives: exchange + waits s", "steps - floor s", "outside s"),
                    where, width=200)
    for k, said in notes.items():
        for note in said:
            print(f"K={k} note: {note}")


if __name__ == "__main__":
    main()
