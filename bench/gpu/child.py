"""One measured run of ``bench.gpu``, in a process of its own:

    python -m bench.gpu.child --which ours --workload chargpt-bench --nodes 8 \\
        --mode stacked --processes 1 --device cuda --steps 100 --batch-size 16 --result r.json

``--which gym`` runs exo-explore/gym instead (whichever ``exogym`` comes first on
``PYTHONPATH``: run it from a folder other than the project root). Writes its
figures as JSON to ``--result``; a run ``fit`` refuses with a ``ValueError``
writes ``{"refused": the refusal's first line}``. The ranks note their
processes' peak CUDA memory in ``$BENCH_GPU_PEAK_DIR`` (:mod:`bench.gpu.peak`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu import MODES, QUICK, STRATEGY, WORKLOADS
from bench.harness import ROOT


def task_settings(workload: str, quick: bool) -> dict[str, Any]:
    """The task's settings of ``workload`` (tiny under ``quick``)."""
    spec = WORKLOADS[workload]
    settings = dict(spec["settings"])
    if quick:
        settings.update(QUICK["settings"])
        if spec["task"] == "gpt":
            settings.update(QUICK["gpt_settings"])
    return settings


def build_task(workload: str, quick: bool) -> tuple[Any, Any, Any]:
    """The model, training and validation sets of ``workload``."""
    settings = task_settings(workload, quick)
    if WORKLOADS[workload]["task"] == "chargpt":
        from distributed.tasks.builtin import chargpt_task

        return chargpt_task(**settings)
    from distributed.tasks.tokens import gpt_task

    return gpt_task(**settings)


def mode_arguments(mode: str, nodes: int, processes: int) -> dict[str, Any]:
    """``fit``'s arguments of ``mode`` (``alone``: one rank, none)."""
    if mode == "alone":
        return {}
    if mode == "process per rank":
        return {"processes": nodes}
    if mode == "packed":
        return {"processes": processes}
    return {"processes": processes, "stack": True}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train the workload as ``args`` say; its figures."""
    import torch

    from bench.gpu.peak import PEAK_DIR_ENV, PeakNotingDiLoCo, summed_peaks

    model, train, val = build_task(args.workload, args.quick)
    settings = task_settings(args.workload, args.quick)
    h = min(STRATEGY["H"], args.steps)
    common = dict(num_nodes=args.nodes, max_steps=args.steps, batch_size=args.batch_size,
                  minibatch_size=args.batch_size, val_size=args.batch_size,
                  val_interval=args.steps, autocast=args.autocast)
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "block_size": settings["block_size"], "n_layer": settings["n_layer"],
        "n_embd": settings["n_embd"], "samples": args.nodes * args.steps * args.batch_size}
    started = time.perf_counter()
    if args.which == "ours":
        from exogym import Trainer

        trainer = Trainer(model, train, val, device=args.device)
        strategy = PeakNotingDiLoCo(inner_optim="adamw", lr=STRATEGY["lr"], H=h)
        try:
            trainer.fit(strategy=strategy, logger=None, progress=False,
                        **mode_arguments(args.mode, args.nodes, args.processes), **common)
        except ValueError as exc:  # packing or stacking refused for these ranks
            lines = [line for line in str(exc).splitlines() if line.strip()]
            return {"refused": lines[0] if lines else type(exc).__name__}
        out.update(processes=trainer.summary.get("processes") or args.nodes,
                   stacked=bool(trainer.summary.get("stacked")),
                   train_s=trainer.summary.get("train_s"),
                   final_loss=trainer.history[-1]["train_loss"])
    else:
        import exogym
        from exogym import Trainer
        from exogym.strategy.optim import OptimSpec

        if Path(exogym.__file__).resolve().parents[1] == ROOT:
            raise SystemExit("--gym: this project's exogym was imported, not exo-explore/gym's")
        trainer = Trainer(model, train, val, device=args.device)
        strategy = PeakNotingDiLoCo(optim_spec=OptimSpec(torch.optim.AdamW, lr=STRATEGY["lr"]),
                                    H=h)
        trainer.fit(num_epochs=1, strategy=strategy, run_name="bench-gpu",
                    disable_logging=True, **common)
        out.update(processes=args.nodes, stacked=False)
    out["fit_s"] = time.perf_counter() - started
    out["peak_allocated_bytes"] = summed_peaks(Path(os.environ[PEAK_DIR_ENV])) \
        if os.environ.get(PEAK_DIR_ENV) else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.child",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--which", choices=["ours", "gym"], required=True)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--mode", choices=["alone", *MODES], required=True)
    parser.add_argument("--processes", type=int, default=1, help="packed and stacked modes")
    parser.add_argument("--device", required=True, help="cpu, cuda, cuda:N, mps")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--quick", action="store_true", help="the tiny model")
    parser.add_argument("--autocast", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--result", required=True, help="where the JSON figures go")
    args = parser.parse_args(argv)
    Path(args.result).write_text(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
