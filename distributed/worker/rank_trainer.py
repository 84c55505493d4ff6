"""RankTrainer: one rank of a network run, started with the rank variables set.

``fit()`` trains this process's rank through :func:`exogym.run.run_rank.run_rank`, the
per-rank code path the simulation runs: ``init_process_group`` over
``tcp://MASTER_ADDR:MASTER_PORT`` (gloo on CPU and MPS, nccl on CUDA),
``GLOO_SOCKET_IFNAME`` set to the interface that routes to the master, rank 0's
initial weights broadcast before the first step. Every rank returns the
average of all ranks' final models; rank 0 also leaves it in the launcher's run
folder (``EXOGYM_RUN_DIR``) as ``model.safetensors`` for the driver to fetch.
Metric events go to stdout as JSON lines, where the launcher reads them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from exogym.base.io import atomic_save_safetensors
from exogym.config.fit_args import refuse_simulation_only
from exogym.report.metrics import encode_event
from exogym.run.memory import StateBytes, check_memory
from exogym.run.run_rank import Rendezvous, run_rank
from exogym.run.spec import Placement, RunSpec
from exogym.run.trainer import Trainer

from .environment import (
    DEVICE_VARIABLE,
    FINAL_MODEL,
    RUN_DIR_VARIABLE,
    RankEnvironment,
    choose_interface,
)
from .throttle import throttle_from_environment


class RankTrainer(Trainer):
    """Trains the one rank this process was started as.

    Args:
        environment: this process's rank variables (``rank_environment()``).
        model, train_dataset, val_dataset: as for :class:`exogym.Trainer`.
        **trainer_kwargs: ``start_port``, ``device``, ``devices``; ``device``
            defaults to the host's ``device`` from the hosts file.
    """

    #: Rank 0's worker says what the data and the batch size do (once for the run).
    checks_data = False

    def __init__(self, environment: RankEnvironment, model: torch.nn.Module, train_dataset: Any,
                 val_dataset: Any = None, **trainer_kwargs: Any):
        if trainer_kwargs.get("device") is None:
            trainer_kwargs["device"] = os.environ.get(DEVICE_VARIABLE) or None
        super().__init__(model, train_dataset, val_dataset, **trainer_kwargs)
        self.environment = environment
        #: Whether this rank writes the run's final model and summary: rank 0, or where
        #: ranks come and go (``min_nodes``), one of those that ended the run with the
        #: final model (the lowest never lost, if any: ``ElasticMembership.finish``).
        self.writes_outputs = environment.rank == 0
        #: Every change of membership (``min_nodes`` runs): ``{"step", "ranks", "hosts", "reason"}``.
        self.membership: list[dict[str, Any]] | None = None
        #: A trace this rank writes holds its own events only (the launcher's holds every rank's).
        self.trace_source = "rank"

    def fit(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        """Same arguments as :meth:`exogym.Trainer.fit`; ``num_nodes`` defaults to the world size."""
        env = self.environment
        asked = kwargs.setdefault("num_nodes", env.world_size)
        if asked != env.world_size:
            raise ValueError(f"fit(num_nodes={asked}) but WORLD_SIZE={env.world_size}: a "
                             "network run has one rank per started process")
        if env.rank != 0:  # rank 0 writes the run's logs, to a tracker too
            kwargs["logger"] = None
            kwargs["wandb_project"] = None
            kwargs["trace"] = None  # and a trace= asked for: of its own steps only
        final = super().fit(*args, **kwargs)
        if self.membership is not None:
            self.summary["membership"] = self.membership
        return final

    def _goodput(self, spec: RunSpec) -> None:
        """Not measured by a rank: it sees its own events only. The launcher, which
        receives every rank's, measures the run's goodput and adds it to summary.json."""
        return None

    def _packing(self, spec: RunSpec, placement: Placement, processes: int | None) -> None:
        """A host runs its own rank: nothing is packed, and nothing simulated is honoured."""
        refuse_simulation_only({"processes": processes, "rank_failures": spec.rank_failures},
                               "a run across hosts")
        return None

    def _stacking(self, spec: RunSpec, placement: Placement, stack: bool | str,
                  processes: int | None) -> tuple[None, Placement]:
        """A host's rank computes alone: ranks are stacked only in a simulation."""
        refuse_simulation_only({"stack": stack}, "a run across hosts")
        return None, placement

    def _check_memory(self, spec: RunSpec, placement: Placement) -> StateBytes:
        """Refuse a rank whose training state, with this host's other ranks, does not fit."""
        ranks = self.environment.local_world_size
        return check_memory(spec, ranks, ranks)

    def _placement(self, spec: RunSpec) -> Placement:
        """This host's ranks: by local rank on its GPUs, nccl on CUDA, rank 0's weights broadcast."""
        env = self.environment
        devices = spec.devices
        if spec.device_type == "cuda" and devices is not None:
            # Ranks on one machine take its GPUs by local rank, not by global rank.
            devices = [devices[env.local_rank % len(devices)]]
        return Placement(ranks_per_machine=env.local_world_size, devices=devices,
                         backend="nccl" if spec.device_type == "cuda" else None,
                         broadcast_init=True, throttle=throttle_from_environment(env.rank))

    def _execute(self, spec: RunSpec, placement: Placement,
                 on_event: Callable[[dict[str, Any]], None]) -> list[dict[str, torch.Tensor]]:
        env = self.environment
        iface = choose_interface(env.master_addr)
        print(f"rank {env.rank}/{env.world_size}: master {env.master_addr}:{env.master_port}, "
              f"interface {iface or 'chosen by gloo'}", file=sys.stderr, flush=True)

        def emit(event: dict[str, Any]) -> None:
            # "sent": this host's clock when the event left the rank (the launcher may read
            # it seconds later on a busy machine).
            print(encode_event({**event, "sent": round(time.time(), 4)}), flush=True)
            if event.get("event") == "beat":
                return  # a sign of life for the launcher alone
            if event.get("event") == "final_membership":
                # Ranks came and went: one that ended the run with the final model
                # writes the outputs.
                self.membership = event["changes"]
                present = event["present"]
                self.writes_outputs = event.get("writer") == env.rank
                if env.rank not in present:
                    self.summary_title = f"rank {env.rank}'s own steps (not the run's)"
                    print(f"rank {env.rank}: the run ended while this rank was away (it was "
                          f"dropped and not yet back); ranks {', '.join(map(str, present))} "
                          f"finished it, and rank {event.get('writer')} wrote the final model "
                          "and summary", file=sys.stderr, flush=True)
            on_event(event)

        elastic = env.min_nodes is not None
        rendezvous = Rendezvous(env.master_addr, env.master_port,
                                store_on_rank0=not env.agent_store and not elastic,
                                watch_peers=True, min_nodes=env.min_nodes,
                                lost_after=env.lost_after, key=env.store_key)
        state = run_rank(spec, placement, env.rank, rendezvous, emit, average_final=True)
        if state is None:  # away at the end of a run whose ranks come and go
            self.writes_outputs = False
            return []
        run_dir = os.environ.get(RUN_DIR_VARIABLE)
        if self.writes_outputs and run_dir:
            atomic_save_safetensors(state, Path(run_dir) / FINAL_MODEL,
                                    {"config": json.dumps(spec.config(), default=repr)})
        return [state]
