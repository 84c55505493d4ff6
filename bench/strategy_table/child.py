"""One run of the table, in a worker process: train, then read the figures off the history.

What a run measures (every figure per rank is the mean over the K ranks):

- ``val_loss``: the final validation loss of the ranks' averaged model
  (``final_val_global_loss``), on the same ``val_size`` windows for every run;
- ``bytes``: what one rank handed to collectives over the run (``comm_bytes``,
  the comm module's counters), and ``stated_bytes``: the same from the
  strategy's own statement (``Strategy.traffic``, per step on average, times the
  steps), None when the strategy states none;
- ``wall_s``: the wall time of ``fit``, start to end (other runs share the machine
  under ``--jobs``);
- ``sim_s``: the simulated end of the run on its network (``summary['sim_time_s']``,
  the last rank's clock);
- ``network_s``: the network's share of that time: per step, the least
  ``sim_comm_s`` among the ranks, summed. A collective starts when the last rank
  arrives and ends at the same time for all, so the last to arrive waits for
  nothing and what it is charged is the transfer alone; later collectives of the
  same step find every rank already together.
"""

from __future__ import annotations

import time
from typing import Any

_THREADS_SET = False


def _build(spec: dict[str, Any]) -> Any:
    from bench.strategy_table.grid import BY_NAME, strategy_class

    cls = strategy_class(BY_NAME[spec["strategy"]])
    return cls(lr=spec["lr"], warmup_steps=spec["warmup_steps"], **spec["settings"])


def stated_bytes_per_step(strategy: Any, model: Any, num_nodes: int) -> float | None:
    """Bytes one rank hands to collectives per step, by the strategy's own statement."""
    from exogym.comm.wire import ModelFacts
    from exogym.sim.network import traffic_cost

    try:
        traffic = strategy.traffic(ModelFacts.of(model), num_nodes)
    except NotImplementedError:
        return None
    return traffic_cost(traffic, num_nodes).payload


def network_seconds(history: list[dict[str, Any]]) -> float:
    """The network's share of the simulated time (see the module docstring)."""
    least: dict[int, float] = {}
    for row in history:
        if row.get("event", "step") == "step" and "sim_comm_s" in row:
            step = int(row["step"])
            least[step] = min(least.get(step, float("inf")), float(row["sim_comm_s"]))
    return sum(least.values())


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one run (:func:`bench.strategy_table.grid.run_spec`) and return its figures,
    or ``{"status": "failed", "error": ...}``; never raises for a failed run."""
    global _THREADS_SET
    started = time.perf_counter()
    try:
        import torch

        from distributed.tasks.builtin import chargpt_task
        from exogym import Trainer
        from exogym.sim.network import Network

        if not _THREADS_SET:
            torch.set_num_threads(1)
            _THREADS_SET = True
        model, train, val = chargpt_task(seed=spec["seed"], **spec["model"])
        strategy = _build(spec)
        stated = stated_bytes_per_step(strategy, model, spec["num_nodes"])
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        trainer = Trainer(model, train, val)
        fit_started = time.perf_counter()
        trainer.fit(strategy=strategy, num_nodes=spec["num_nodes"], max_steps=spec["steps"],
                    batch_size=spec["batch_size"], val_size=spec["val_size"],
                    val_interval=spec["steps"], seed=spec["seed"], logger=None,
                    progress=False, network=Network(spec["network"]), device=spec["device"],
                    num_threads=1, timeout_s=600.0)
        wall = time.perf_counter() - fit_started
        summary = trainer.summary
        last: dict[int, dict[str, Any]] = {}
        for row in trainer.history:
            if "comm_bytes" in row:
                last[int(row["rank"])] = row
        loss = summary.get("final_val_global_loss", summary.get("final_val_loss"))
        if loss is None or len(last) != spec["num_nodes"]:
            raise RuntimeError(f"the run reported no final validation loss or not every rank "
                               f"(ranks {sorted(last)})")
        return {
            "status": "ok", "val_loss": float(loss),
            "train_loss": float(summary.get("final_train_loss", float("nan"))),
            "bytes": sum(r["comm_bytes"] for r in last.values()) / len(last),
            "stated_bytes": None if stated is None else stated * spec["steps"],
            "wall_s": wall, "sim_s": float(summary["sim_time_s"]),
            "network_s": network_seconds(trainer.history), "num_params": params,
            "samples": sum(r["samples"] for r in last.values()),
        }
    except Exception as exc:  # a failed run is a row of the table, not the end of the sweep
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:2000],
                "wall_s": time.perf_counter() - started}
