"""Bytes each node sends per step, for every strategy: counted in a real run vs the formula.

For a model (default: the digits MLP), every strategy trains for a few steps
on simulated nodes; the comm module's counters give the bytes a node sent,
divided by the steps. Next to it, the same figure from the strategy's
formula, so a mismatch (a strategy sending more than it should, or a formula
that is wrong) shows at once.

Run from the project root:

    python -m bench.comm_bytes
    python -m bench.comm_bytes --model cnn --p 0.01 --topk 16
    python -m bench.comm_bytes --model mlp-large --steps 40
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import torch
from rich.console import Console

from bench.harness.tables import print_table
from exogym import Trainer
from exogym.comm.quantize import payload_bytes
from exogym.data.digits import DigitsCNN, DigitsMLP, digits_datasets
from exogym.report.summary import human_bytes
from exogym.strategy import (
    DeMoStrategy,
    DiLoCoStrategy,
    FedAvgStrategy,
    SimpleReduceStrategy,
    SparseLoCoStrategy,
    SPARTADiLoCoStrategy,
    SPARTAStrategy,
    Strategy,
    StreamingDiLoCoStrategy,
)
from exogym.strategy.demo import ChunkPlan
from exogym.strategy.facts import (
    QUANTIZED_BITS,
    fragment_offset,
    sparseloco_payload_bytes,
    streaming_sync_bytes,
)
from exogym.strategy.streaming_diloco import model_layers

MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "mlp": lambda: DigitsMLP(hidden=64),
    "mlp-large": lambda: DigitsMLP(hidden=1024),
    "cnn": lambda: DigitsCNN(channels=16),
}


@dataclass
class Case:
    """One row: a strategy, its formula as text, and bytes per step by that formula."""

    name: str
    build: Callable[[], Strategy]
    formula: str
    per_step: float


def sparta_entries(sizes: list[int], p: float, rounds: range) -> int:
    """Entries SPARTA averages in ``rounds``: floor((r+1)·p·n) − floor(r·p·n) per tensor and round.

    Over rounds 0..R-1 that is floor(R·p·n) per tensor (p taken as the exact decimal).
    """
    fraction = Fraction(str(p))
    return sum(math.floor(fraction * n * (r + 1)) - math.floor(fraction * n * r)
               for r in rounds for n in sizes)


def streaming_bytes(model: torch.nn.Module, H: int, fragments: int, steps: int,
                    comm_dtype: str) -> int:
    """Bytes Streaming DiLoCo sends in ``steps`` steps: a fragment's sync where its offset falls."""
    layers = model_layers(model)
    sizes = [sum(t.numel() for params, buffers in layers[f::fragments] for t in params + buffers)
             for f in range(fragments)]
    return sum(streaming_sync_bytes(sizes[f], comm_dtype)
               for s in range(1, steps + 1) for f in range(fragments)
               if s % H == fragment_offset(f, H, fragments))


def cases(model: torch.nn.Module, args: argparse.Namespace) -> list[Case]:
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    P = sum(sizes)
    B = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    steps, H, p, k = args.steps, args.H, args.p, args.topk
    demo = sum(ChunkPlan.for_shape(t.shape, args.chunk, k).bytes_per_step(4)
               for t in model.parameters() if t.requires_grad)
    interval = args.sparta_interval
    # SPARTA-DiLoCo: round s // interval - 1 after step s, left out where a DiLoCo round runs.
    sparse_rounds = [s // interval - 1 for s in range(1, steps + 1)
                     if s % interval == 0 and s % H != 0]
    sparse_entries = sparta_entries(sizes, p, sparse_rounds)
    adamw = dict(optim_spec="adamw", lr=1e-3)
    return [
        Case("DDP", lambda: SimpleReduceStrategy(**adamw), "4·P", 4 * P),
        Case(f"DiLoCo H={H}", lambda: DiLoCoStrategy(H=H, **adamw), "4·(P+B)/H",
             4 * (P + B) * (steps // H) / steps),
        Case(f"DiLoCo H={H} bf16", lambda: DiLoCoStrategy(H=H, comm_dtype="bfloat16", **adamw),
             "2·(P+B)/H", 2 * (P + B) * (steps // H) / steps),
        *[Case(f"DiLoCo H={H} {dtype}",
               lambda dtype=dtype: DiLoCoStrategy(H=H, comm_dtype=dtype, **adamw),
               f"(⌈{bits}·(P+B)/8⌉ + 4·⌈(P+B)/64⌉)/H",
               payload_bytes(P + B, dtype) * (steps // H) / steps)
          for dtype, bits in QUANTIZED_BITS.items()],
        Case(f"FedAvg H={H}", lambda: FedAvgStrategy(H=H, **adamw), "4·(P+B)/H",
             4 * (P + B) * (steps // H) / steps),
        Case(f"SPARTA p={p}", lambda: SPARTAStrategy(p_sparta=p, **adamw),
             "4·Σ⌊R·p·n⌋/R ≈ 4·p·P", 4 * sparta_entries(sizes, p, range(steps)) / steps),
        Case(f"SPARTA p={p} bf16",
             lambda: SPARTAStrategy(p_sparta=p, comm_dtype="bfloat16", **adamw),
             "2·Σ⌊R·p·n⌋/R ≈ 2·p·P", 2 * sparta_entries(sizes, p, range(steps)) / steps),
        Case(f"SPARTA-DiLoCo every {interval}, H={H}",
             lambda: SPARTADiLoCoStrategy(H=H, p_sparta=p, sparta_interval=interval, **adamw),
             "sparse rounds + 4·(P+B)/H",
             (4 * sparse_entries + 4 * (P + B) * (steps // H)) / steps),
        *[Case(f"Streaming DiLoCo H={H}, 2 fragments, delay 1, {dtype}",
               lambda dtype=dtype: StreamingDiLoCoStrategy(H=H, num_fragments=2, fragment_delay=1,
                                                           comm_dtype=dtype, **adamw),
               "Σ fragment syncs·their bytes/R",
               streaming_bytes(model, H, 2, steps, dtype) / steps)
          for dtype in ("float32", "int4")],
        Case(f"DeMo top-{k}, chunk {args.chunk}",
             lambda: DeMoStrategy(lr=1e-3, compression_topk=k, compression_chunk=args.chunk),
             "Σ chunks·k·(4 + index bytes)", demo),
        *(sparseloco_case(sizes, B, steps, H, args.sl_topk, args.sl_chunk, bits, adamw)
          for bits in (2, 4, None)),
    ]


def sparseloco_case(sizes: list[int], B: int, steps: int, H: int, topk: int, chunk: int,
                    bits: int | None, adamw: dict) -> Case:
    """SparseLoCo's row: packed indices, values and per-chunk ranges per round, plus 4·B."""
    per_round = sparseloco_payload_bytes(sizes, chunk=chunk, topk=topk, quant_bits=bits) + 4 * B
    return Case(f"SparseLoCo H={H} top-{topk}/{chunk} {f'{bits}-bit' if bits else 'fp32'}",
                lambda: SparseLoCoStrategy(H=H, topk=topk, chunk=chunk, quant_bits=bits, **adamw),
                "(idx+values+ranges+4·B)/H", per_round * (steps // H) / steps)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.comm_bytes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    parser.add_argument("--steps", type=int, default=20,
                        help="steps per run R (default 20; a multiple of H gives whole rounds)")
    parser.add_argument("--H", type=int, default=10, help="DiLoCo/FedAvg round length")
    parser.add_argument("--p", type=float, default=0.005, help="SPARTA fraction")
    parser.add_argument("--sparta-interval", type=int, default=2,
                        help="SPARTA-DiLoCo's steps between sparse rounds")
    parser.add_argument("--topk", type=int, default=32, help="DeMo coefficients per chunk")
    parser.add_argument("--chunk", type=int, default=64, help="DeMo chunk size per dimension")
    parser.add_argument("--sl-topk", type=int, default=32, help="SparseLoCo values per chunk")
    parser.add_argument("--sl-chunk", type=int, default=1024, help="SparseLoCo chunk size")
    args = parser.parse_args()

    console = Console()
    train, _ = digits_datasets()
    torch.manual_seed(0)
    model = MODELS[args.model]()
    P = sum(p.numel() for p in model.parameters() if p.requires_grad)
    console.print(f"model {args.model}: P = {P:,} trainable entries in "
                  f"{sum(1 for p in model.parameters() if p.requires_grad)} tensors; "
                  f"{args.nodes} nodes, R = {args.steps} steps")
    rows = []
    ddp = None
    for case in cases(model, args):
        started = time.perf_counter()
        trainer = Trainer(model, train, None)
        trainer.fit(strategy=case.build(), num_nodes=args.nodes, max_steps=args.steps,
                    batch_size=32, val_size=0, logger=None, progress=False)
        last = [r for r in trainer.history if r["step"] == args.steps]
        measured = sum(r["comm_bytes"] for r in last) / len(last) / args.steps
        ddp = ddp or measured
        match = "yes" if math.isclose(measured, case.per_step, rel_tol=1e-9) else "NO"
        rows.append((case.name, f"{measured:,.1f} B", case.formula, f"{case.per_step:,.1f} B",
                     f"{measured / ddp:.2%}", match))
        console.print(f"  {case.name}: {human_bytes(measured)} per step "
                      f"({time.perf_counter() - started:.1f} s)")
    figures = ("measured", "by formula", "vs DDP", "match")
    print_table("Bytes sent per node per step",
                ("strategy", "measured", "formula", "by formula", "vs DDP", "match"), rows,
                left=("strategy", "formula"), no_wrap=figures, console=console)


if __name__ == "__main__":
    main()
