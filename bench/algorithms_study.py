"""Loss against bytes on chargpt: DiLoCo in float32 and int8, Streaming DiLoCo, SparseLoCo.

Every row trains the same character-level GPT (``distributed.tasks.builtin.chargpt_task``)
from the same initial weights on the same data, with the same inner optimizer
and the same number of inner steps on the same number of simulated ranks; only
the outer round differs. The table gives, per strategy, the final validation
loss of the ranks' averaged model, the bytes one rank sent in total, the most
it sent in one synchronisation (the largest step-to-step rise of its byte
counter), and both as ratios to DiLoCo in float32, with the targets of each row:

- DiLoCo, int8 deltas: loss within 1% of float32;
- Streaming DiLoCo (4 fragments, delay 1, int4): loss within 3% of DiLoCo, at least
  4x lower peak bytes per sync and at least 8x fewer bytes in total;
- SparseLoCo (top-k at 1-3% density, 2-bit values): loss within 5% of DiLoCo with at
  most 5% of its bytes.

Streaming DiLoCo and SparseLoCo rows appear when ``exogym.strategy`` provides them.
Run from the project root (the default takes a few minutes on two idle cores):

    python -m bench.algorithms_study
    python -m bench.algorithms_study --steps 600 --nodes 4 --H 50
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.console import Console

import exogym.strategy as strategies
from bench.harness.tables import print_table
from distributed.tasks.builtin import chargpt_task
from exogym import Trainer
from exogym.report.summary import human_bytes
from exogym.strategy import DiLoCoStrategy, Strategy


@dataclass
class Row:
    """One strategy of the study and the targets it is held to against DiLoCo float32.

    Args:
        name: what the table calls it.
        build: a fresh strategy.
        max_loss_ratio: its validation loss may be at most this times DiLoCo's.
        max_bytes_ratio: its total bytes may be at most this share of DiLoCo's.
        max_peak_ratio: its peak bytes per sync may be at most this share of DiLoCo's.
    """

    name: str
    build: Callable[[], Strategy]
    max_loss_ratio: float | None = None
    max_bytes_ratio: float | None = None
    max_peak_ratio: float | None = None


@dataclass
class Result:
    """What one run measured."""

    val_loss: float
    total_bytes: float
    peak_bytes: float
    wall_s: float


def rows(args: argparse.Namespace) -> list[Row]:
    inner = dict(inner_optim="adamw", lr=args.lr, warmup_steps=args.warmup)
    found = [
        Row("DiLoCo float32", lambda: DiLoCoStrategy(H=args.H, **inner)),
        Row("DiLoCo int8", lambda: DiLoCoStrategy(H=args.H, comm_dtype="int8", **inner),
            max_loss_ratio=1.01),
    ]
    streaming = getattr(strategies, "StreamingDiLoCoStrategy", None)
    if streaming is not None:
        found.append(Row(
            "Streaming DiLoCo 4 fragments, delay 1, int4",
            lambda: streaming(H=args.H, num_fragments=4, fragment_delay=1, comm_dtype="int4",
                              **inner),
            max_loss_ratio=1.03, max_bytes_ratio=1 / 8, max_peak_ratio=1 / 4))
    sparseloco = getattr(strategies, "SparseLoCoStrategy", None)
    if sparseloco is not None:
        density = args.topk / args.chunk
        found.append(Row(
            f"SparseLoCo top-{args.topk}/{args.chunk} ({density:.1%}), 2-bit",
            lambda: sparseloco(H=args.H, topk=args.topk, chunk=args.chunk, quant_bits=2,
                               **inner),
            max_loss_ratio=1.05, max_bytes_ratio=0.05))
    return found


def measure(row: Row, task, args: argparse.Namespace) -> Result:
    model, train, val = task
    started = time.perf_counter()
    trainer = Trainer(model, train, val)
    trainer.fit(strategy=row.build(), num_nodes=args.nodes, max_steps=args.steps,
                batch_size=args.batch_size, val_size=args.val_size, val_interval=args.steps,
                seed=0, logger=None, progress=False)
    by_rank: dict[int, list[tuple[int, int]]] = {}
    for r in trainer.history:
        if "comm_bytes" in r:
            by_rank.setdefault(r["rank"], []).append((r["step"], r["comm_bytes"]))
    peak, total = 0, 0
    for points in by_rank.values():
        points.sort()
        counts = [0] + [b for _, b in points]
        peak = max(peak, max(b - a for a, b in zip(counts, counts[1:])))
        total = max(total, counts[-1])
    loss = trainer.summary.get("final_val_global_loss") or trainer.summary["final_val_loss"]
    return Result(float(loss), float(total), float(peak), time.perf_counter() - started)


def verdict(row: Row, loss_ratio: float, bytes_ratio: float, peak_ratio: float) -> str:
    checks = []
    if row.max_loss_ratio is not None:
        ok = loss_ratio <= row.max_loss_ratio
        checks.append(f"loss ≤{row.max_loss_ratio - 1:.0%} {'yes' if ok else 'NO'}")
    if row.max_bytes_ratio is not None:
        ok = bytes_ratio <= row.max_bytes_ratio
        checks.append(f"bytes ≤{row.max_bytes_ratio:.1%} {'yes' if ok else 'NO'}")
    if row.max_peak_ratio is not None:
        ok = peak_ratio <= row.max_peak_ratio
        checks.append(f"peak ≤{row.max_peak_ratio:.0%} {'yes' if ok else 'NO'}")
    return ", ".join(checks) or "reference"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.algorithms_study",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=240, help="inner steps per rank (240)")
    parser.add_argument("--nodes", type=int, default=2, help="simulated ranks, 2 to 4 (2)")
    parser.add_argument("--H", type=int, default=40, help="inner steps per outer round (40)")
    parser.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="inner warm-up steps (20)")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank (16)")
    parser.add_argument("--val-size", type=int, default=256, help="validation windows (256)")
    parser.add_argument("--n-layer", type=int, default=2, help="GPT blocks (2)")
    parser.add_argument("--n-embd", type=int, default=128, help="GPT width (128)")
    parser.add_argument("--topk", type=int, default=64, help="SparseLoCo values kept per chunk")
    parser.add_argument("--chunk", type=int, default=4096, help="SparseLoCo chunk (4096)")
    parser.add_argument("--only", nargs="*", help="run only rows whose name contains one of these")
    args = parser.parse_args()
    if not 1 <= args.nodes <= 64 or args.steps < args.H:
        parser.error(f"need --nodes >= 1 and --steps >= --H, got nodes={args.nodes}, "
                     f"steps={args.steps}, H={args.H}")

    console = Console(width=max(Console().width, 150))
    torch.set_num_threads(1)
    task = chargpt_task(n_layer=args.n_layer, n_embd=args.n_embd, seed=0)
    params = sum(p.numel() for p in task[0].parameters() if p.requires_grad)
    console.print(f"chargpt: {params:,} parameters; {args.nodes} ranks, {args.steps} inner "
                  f"steps of batch {args.batch_size}, H={args.H}")
    chosen = [r for r in rows(args)
              if not args.only or r.name.startswith("DiLoCo float32")
              or any(word.lower() in r.name.lower() for word in args.only)]
    results: dict[str, Result] = {}
    for row in chosen:
        results[row.name] = measure(row, task, args)
        got = results[row.name]
        console.print(f"  {row.name}: val loss {got.val_loss:.6f}, "
                      f"{human_bytes(got.total_bytes)} sent ({got.wall_s:.0f} s)")

    base = results[chosen[0].name]
    table = []
    for row in chosen:
        got = results[row.name]
        loss_ratio = got.val_loss / base.val_loss
        bytes_ratio = got.total_bytes / base.total_bytes
        peak_ratio = got.peak_bytes / base.peak_bytes
        table.append((row.name, f"{got.val_loss:.5f}", human_bytes(got.total_bytes),
                      human_bytes(got.peak_bytes), f"{loss_ratio:.4f}", f"{bytes_ratio:.4f}",
                      f"{peak_ratio:.4f}", verdict(row, loss_ratio, bytes_ratio, peak_ratio)))
    print_table(f"chargpt, {args.nodes} ranks, {args.steps} steps, H={args.H}",
                ("strategy", "val loss", "total bytes", "peak bytes / sync", "loss ×",
                 "bytes ×", "peak ×", "targets met"), table,
                left=("strategy", "targets met"), no_wrap=True, console=console)


if __name__ == "__main__":
    main()
