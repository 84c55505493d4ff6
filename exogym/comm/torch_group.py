"""Collectives over ``torch.distributed``: a process group of gloo or NCCL.

What a run across hosts without ``min_nodes`` uses (and a simulation for what
shared memory does not carry). The training collectives travel over the
default group; the side channel over a gloo group of its own, so evaluation
and barriers never mix with training traffic.

**Staging.** gloo works on CPU tensors: a tensor on MPS (or on CUDA when the
group is gloo) is copied to the CPU, reduced, and copied back. For an
asynchronous call the copy back happens in the handle's ``wait()``, never
before the collective has finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from exogym.comm.protocol import Collectives, DoneWork, ReduceOp, copy_back, done, to_cpu
from exogym.comm.store import ControlStore


class StagedWork:
    """Handle of an asynchronous collective on staged copies; ``wait()`` copies back."""

    def __init__(self, work: Any, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        self._work = work
        self._pairs = pairs
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
            for target, staged in self._pairs:
                target.copy_(staged)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()


class TorchGroup(Collectives):
    """This process's rank of a ``torch.distributed`` process group.

    Joins the group through ``store`` when created, and leaves it in :meth:`close`.

    Args:
        store: the rendezvous store.
        rank, world_size: this rank and the number of ranks.
        backend: ``'gloo'`` or ``'nccl'``.
        timeout_s: how long a collective waits for a peer.
        device: this rank's GPU (nccl binds to it).
    """

    name = "torch.distributed"

    def __init__(self, store: ControlStore, rank: int, world_size: int, backend: str,
                 timeout_s: float, device: torch.device | None = None):
        timeout = timedelta(seconds=timeout_s)
        kwargs = {"device_id": device} if backend == "nccl" and device is not None else {}
        # The group holds the store's C++ side only: a signed store's Python side (and the
        # store it wraps, the server itself on rank 0) must live as long as the group.
        self._store = store
        dist.init_process_group(backend, store=store.raw, rank=rank, world_size=world_size,
                                timeout=timeout, **kwargs)
        self._backend_by_group: dict[Any, str] = {}
        self._side = dist.new_group(backend="gloo", timeout=timeout) if world_size > 1 else None

    @property
    def active(self) -> bool:
        return dist.is_initialized()

    def rank(self) -> int:
        return dist.get_rank()

    def world_size(self) -> int:
        return dist.get_world_size()

    def new_group(self, ranks: Sequence[int]) -> Any:
        return dist.new_group(ranks=list(ranks))

    def group_ranks(self, group: Any = None) -> list[int]:
        if group is None or group is dist.group.WORLD:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(group))

    def group_size(self, group: Any = None) -> int:
        return dist.get_world_size(group)

    # -- staging -----------------------------------------------------------------------

    def backend_of(self, group: Any) -> str:
        """``'gloo'`` or ``'nccl'``: the backend of ``group`` (None: the world)."""
        key = group if group is not None else "__world__"
        found = self._backend_by_group.get(key)
        if found is None:
            found = self._backend_by_group[key] = str(dist.get_backend(group))
        return found

    def needs_staging(self, tensor: torch.Tensor, group: Any) -> bool:
        """True when ``tensor`` must pass through the CPU for ``group``'s backend."""
        if tensor.device.type == "cpu":
            return False
        if tensor.device.type == "mps":
            return True
        return self.backend_of(group) == "gloo"

    def _in_place(self, collective: Any, tensor: torch.Tensor, group: Any, async_op: bool,
                  **kwargs: Any) -> Any:
        if not self.needs_staging(tensor, group):
            return collective(tensor, group=group, async_op=async_op, **kwargs)
        staged = tensor.detach().to("cpu")
        work = collective(staged, group=group, async_op=async_op, **kwargs)
        handle = StagedWork(work if async_op else DoneWork(), [(tensor, staged)])
        if async_op:
            return handle
        handle.wait()
        return None

    # -- training collectives ----------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None,
                   async_op: bool = False) -> Any:
        return self._in_place(dist.all_reduce, tensor, group, async_op,
                              op=ReduceOp.SUM if op is None else op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None,
                  async_op: bool = False) -> Any:
        return self._in_place(dist.broadcast, tensor, group, async_op, src=src)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                   group: Any = None, async_op: bool = False) -> Any:
        if not self.needs_staging(tensor, group):
            return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        staged_in = tensor.detach().to("cpu")
        staged_out = [torch.empty_like(t, device="cpu") for t in tensor_list]
        work = dist.all_gather(staged_out, staged_in, group=group, async_op=async_op)
        handle = StagedWork(work if async_op else DoneWork(), list(zip(tensor_list, staged_out)))
        if async_op:
            return handle
        handle.wait()
        return None

    def latest(self, value: float, group: Any = None) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        if group is None or group is dist.group.WORLD:
            dist.all_reduce(t, op=ReduceOp.MAX, group=self._side)
        else:
            if self.backend_of(group) == "nccl":
                t = t.cuda()
            dist.all_reduce(t, op=ReduceOp.MAX, group=group)
        return float(t.item())

    # -- the side channel --------------------------------------------------------------

    def side_size(self) -> int:
        return 1 if self._side is None else dist.get_world_size(self._side)

    def side_all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        if self._side is None:
            return
        staged = to_cpu(tensor)
        dist.all_reduce(staged, op=ReduceOp.SUM if op is None else op, group=self._side)
        copy_back(tensor, staged)

    def side_broadcast(self, tensor: torch.Tensor, src: int,
                       ranks: Sequence[int] | None = None) -> None:
        if ranks is not None and len(set(ranks)) != dist.get_world_size():
            raise RuntimeError("a broadcast among some ranks needs them packed in a process "
                               "(exogym.comm.packed) or hosts that come and go (min_nodes)")
        if self._side is None:
            return
        staged = to_cpu(tensor)
        dist.broadcast(staged, src=src, group=self._side)
        copy_back(tensor, staged)

    def side_all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
        if self._side is None:
            tensor_list[0].detach().copy_(tensor)
            return
        staged_out = [to_cpu(t) for t in tensor_list]
        dist.all_gather(staged_out, to_cpu(tensor), group=self._side)
        for target, staged in zip(tensor_list, staged_out):
            copy_back(target, staged)

    def side_barrier(self) -> None:
        if self._side is not None:
            dist.barrier(group=self._side)

    def close(self) -> None:
        self._side = None
        self._backend_by_group.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["StagedWork", "TorchGroup", "done"]
