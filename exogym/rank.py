"""run_rank: the one function every rank runs, simulated or on a real host.

Simulation and a real multi-host run differ only in how the process group is
joined (``Rendezvous``) and how the ``RunSpec`` arrived. Everything after
that — threads, device, seeding, the training loop, the final state — is this
function, so a strategy that runs in simulation runs unchanged across hosts.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from exogym import comm
from exogym.devices import backend_for, rank_device
from exogym.spec import RunSpec
from exogym.train_node import TrainNode


@dataclass(frozen=True)
class Rendezvous:
    """How ranks find each other: a TCP store at ``addr:port``.

    Args:
        addr: address of the store (the master).
        port: its port.
        store_on_rank0: rank 0 hosts the store (multi-host); otherwise the store
            already exists, hosted by the parent of a local simulation.
    """

    addr: str
    port: int
    store_on_rank0: bool = True


def init_process_groups(spec: RunSpec, rank: int, rendezvous: Rendezvous,
                        device: torch.device):
    """Join the training process group; return the side group (None for one rank)."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(
        rendezvous.addr, rendezvous.port, spec.num_nodes,
        is_master=rendezvous.store_on_rank0 and rank == 0,
        timeout=timeout, wait_for_workers=False,
    )
    backend = backend_for(spec.device_type, spec.devices, spec.num_nodes)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.num_nodes,
                            timeout=timeout, **kwargs)
    if spec.num_nodes == 1:
        return None
    # Evaluation and metric traffic goes over its own group, never the training one.
    return dist.new_group(backend="gloo", timeout=timeout)


def run_rank(spec: RunSpec, rank: int, rendezvous: Rendezvous,
             emit: Callable[[dict[str, Any]], None],
             checkpoint_root: str | None = None) -> dict[str, torch.Tensor]:
    """Train rank ``rank`` of ``spec`` to the end; returns its final model state (CPU).

    Args:
        spec: the run; ``spec.minibatch_size`` must be resolved (not 'auto').
        rank: this rank, ``0 <= rank < spec.num_nodes``.
        rendezvous: where the ranks meet.
        emit: receives every metric event of this rank.
        checkpoint_root: folder for checkpoints (default ``save_dir/run_name``).
    """
    torch.set_num_threads(spec.num_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.num_threads))
    device = rank_device(spec.device_type, spec.devices, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    side_group = init_process_groups(spec, rank, rendezvous, device)
    try:
        comm.reset_counters()
        node = TrainNode(spec, rank, device, emit, side_group=side_group,
                         checkpoint_root=checkpoint_root)
        state = node.train()
        if side_group is not None:
            dist.barrier(group=side_group)  # nobody leaves while a peer still needs it
        emit({"event": "done", "rank": rank, "step": node.step,
              "comm_bytes": comm.comm_bytes(), "comm_calls": comm.comm_calls()})
        return state
    finally:
        dist.destroy_process_group()
