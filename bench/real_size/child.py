"""One measured run of ``bench.real_size``, in a process of its own:

    python -m bench.real_size.child sim --which ours --model 23m --nodes 4 --result r.json
    python -m bench.real_size.child budget --model 124m --result budget.json

``sim`` simulates the DiLoCo workload with this project or with exo-explore/gym
(whichever ``exogym`` comes first on ``PYTHONPATH``: run it from a folder other
than the project root, whose ``exogym`` would come first); ``budget`` accounts
what one rank across hosts holds. Each writes its figures as JSON to ``--result``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import ROOT
from bench.harness.machine import rss_bytes
from bench.real_size import HOSTS, MODELS, SIM


def simulated_run(args: argparse.Namespace) -> None:
    """One simulated run, by this project or by exo-explore/gym (``--which``)."""
    import torch

    from distributed.tasks.tokens import gpt_task

    runtime = rss_bytes()  # the interpreter and torch, before any model

    model, train, val = gpt_task(block_size=SIM["block_size"], tokens=SIM["tokens"],
                                 **MODELS[args.model])
    activations = 0
    if args.which == "ours":
        activations = activation_bytes(model, train, SIM["batch_size"])
    common = dict(max_steps=SIM["max_steps"], batch_size=SIM["batch_size"],
                  minibatch_size=SIM["batch_size"], val_size=SIM["batch_size"],
                  val_interval=SIM["max_steps"])
    out: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}
    started = time.perf_counter()
    if args.which == "ours":
        from exogym import Trainer
        from exogym.run.memory import RUNTIME_BYTES
        from exogym.strategy import DiLoCoStrategy

        trainer = Trainer(model, train, val, device="cpu")
        trainer.fit(strategy=DiLoCoStrategy(inner_optim="adamw", lr=SIM["lr"], H=SIM["H"]),
                    num_nodes=args.nodes, logger=None, progress=False, **common)
        state = trainer.state_bytes
        processes = trainer.summary.get("processes") or args.nodes
        per_process = -(-args.nodes // processes)
        # A process's ranks' state (one set of gradients: its ranks step in turn), one
        # forward and backward's activations, and the runtime measured here.
        budget = state.on_machine(per_process, 1) - RUNTIME_BYTES + activations + runtime
        out.update(state_bytes=state.per_rank, shared_bytes=state.shared,
                   peak_rss_bytes=trainer.summary.get("peak_rss_bytes_per_rank"),
                   processes=processes, activation_bytes=activations, runtime_bytes=runtime,
                   budget_bytes=budget, final_loss=trainer.history[-1]["train_loss"])
    else:
        import exogym
        from exogym import Trainer
        from exogym.strategy.diloco import DiLoCoStrategy
        from exogym.strategy.optim import OptimSpec

        if "gym" not in str(Path(exogym.__file__).resolve().parents[1]).lower() \
                and Path(exogym.__file__).resolve().parents[1] == ROOT:
            raise SystemExit("--gym: this project's exogym was imported, not exo-explore/gym's")
        trainer = Trainer(model, train, val, device="cpu")
        trainer.fit(num_epochs=1, num_nodes=args.nodes,
                    strategy=DiLoCoStrategy(optim_spec=OptimSpec(torch.optim.AdamW,
                                                                 lr=SIM["lr"]), H=SIM["H"]),
                    run_name="real-size", disable_logging=True, **common)
        out["processes"] = args.nodes
    out["fit_s"] = time.perf_counter() - started
    Path(args.result).write_text(json.dumps(out))


def activation_bytes(model: Any, train: Any, batch_size: int) -> int:
    """One forward and backward's activations: the peak of a step on a copy of ``model``
    (run first thing, in a heap with nothing freed in it yet) less the copy and its
    gradients."""
    import torch

    from exogym.run.memory import measure_peak

    batch = tuple(torch.stack(parts) for parts in zip(*(train[i] for i in range(batch_size))))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(0, measure_peak(model, batch, torch.device("cpu"), False) - 2 * params)


def budget(args: argparse.Namespace) -> None:
    """What one rank across hosts is accounted: its state (as ``fit`` accounts it), the
    runtime (this interpreter with torch, before any model) and one forward and
    backward's activations, measured here on the hosts' workload."""
    model_name, result = args.model, args.result

    from distributed.profiles.profile import load_profile
    from exogym.run.memory import account_state

    runtime = rss_bytes()
    overrides = {**MODELS[model_name], "block_size": HOSTS["block_size"],
                 "tokens": HOSTS["tokens"], "H": HOSTS["H"]}
    profile = load_profile("gpt-diloco", overrides=overrides)
    resolved = profile.resolved
    model, train, _ = resolved.task_fn(**resolved.task_kwargs)
    strategy = resolved.strategy_cls(**resolved.strategy_kwargs)
    state = account_state(model, strategy, 3)
    activations = activation_bytes(model, train, HOSTS["batch_size"])
    Path(result).write_text(json.dumps({
        "state_bytes": state.per_rank, "runtime_bytes": runtime,
        "activation_bytes": activations,
        "budget_bytes": state.per_rank + runtime + activations}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_size.child",
                                     description=__doc__.split("\n\n")[0])
    parts = parser.add_subparsers(dest="part", required=True)
    run = parts.add_parser("sim", help="one simulated run")
    run.add_argument("--which", choices=["ours", "gym"], required=True)
    run.add_argument("--nodes", type=int, required=True)
    accounted = parts.add_parser("budget", help="what one rank across hosts is accounted")
    for part in (run, accounted):
        part.add_argument("--model", required=True, choices=sorted(MODELS))
        part.add_argument("--result", required=True, help="where the JSON figures go")
    args = parser.parse_args(argv)
    (simulated_run if args.part == "sim" else budget)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
