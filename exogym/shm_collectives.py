"""Collectives through shared memory, for ranks that share one machine.

In a local simulation every rank is a process on this machine, so a collective
need not cross a socket: each rank copies its contribution into its own slot
of one shared buffer, and after a barrier every rank reduces its 1/K share of
the elements across all slots into a result row that everyone then copies out.
Every element is reduced by exactly one rank, in rank order, so all ranks get
bitwise the same result. Large tensors pass in chunks of one slot.

The barrier is K counting semaphores: arriving, a rank posts every other
rank's semaphore once and then takes K-1 posts from its own. A rank can only
post for the next barrier after everyone has posted for this one, so posts
never mix between barriers.

:mod:`exogym.comm` sends a collective here when the tensor is on the CPU, the
group is the whole world and the operation is supported; anything else (a
subgroup, a GPU tensor under NCCL, an unusual reduce op) goes to
``torch.distributed`` as before. Byte counts do not change: the comm module
counts the payload before choosing the path.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

DISABLE_ENV = "EXOGYM_COLLECTIVES"
"""Set to ``torch`` to make a simulation use torch.distributed for every collective."""

TOTAL_BYTES = 32 * 1024 * 1024
MIN_SLOT_BYTES = 64 * 1024
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
           torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


class PeerTimeoutError(RuntimeError):
    """A peer did not reach a shared-memory collective in time."""


def _op_kind(op: Any) -> str | None:
    if op is None:
        return "sum"
    for name in ("SUM", "AVG", "MAX", "MIN"):
        if op == getattr(dist.ReduceOp, name):
            return name.lower()
    return None


class SharedMemoryCollectives:
    """All-reduce, all-gather and broadcast among local rank processes, through shared memory.

    Created by the parent before it starts the ranks; each rank then calls
    :meth:`bind` with its rank and installs it with
    :func:`exogym.comm.use_local_collectives`.

    Args:
        world_size: number of ranks.
        slot_bytes: bytes one rank contributes per pass (a multiple of 64 is used);
            larger tensors are processed in chunks.
        ctx: the multiprocessing context the ranks are started with (its semaphores).
        timeout_s: how long a rank waits for its peers at a barrier before failing.
    """

    def __init__(self, world_size: int, slot_bytes: int, ctx: Any, timeout_s: float = 1800.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.slot_bytes = max(64, -(-int(slot_bytes) // 64) * 64)
        self.timeout_s = float(timeout_s)
        self._buffer = torch.zeros((world_size + 1) * self.slot_bytes,
                                   dtype=torch.uint8).share_memory_()
        self._arrivals = [ctx.Semaphore(0) for _ in range(world_size)]
        self.rank: int | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, world_size: int, ctx: Any,
                  timeout_s: float = 1800.0) -> SharedMemoryCollectives | None:
        """Sized for ``model``'s parameters and buffers within a fixed memory budget.

        None when one rank is all there is, when ``EXOGYM_COLLECTIVES=torch`` asks for
        torch.distributed, or when the shared-memory file system lacks the room.
        """
        if world_size < 2 or os.environ.get(DISABLE_ENV, "").lower() == "torch":
            return None
        model_bytes = sum(t.numel() * t.element_size()
                          for t in list(model.parameters()) + list(model.buffers()))
        slot = min(max(model_bytes, MIN_SLOT_BYTES), TOTAL_BYTES // (world_size + 1))
        slot = max(64, slot // 64 * 64)
        if not _room_for((world_size + 1) * slot):
            return None
        return cls(world_size, slot, ctx, timeout_s)

    def bind(self, rank: int) -> SharedMemoryCollectives:
        """This process is ``rank``; returns self."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        self.rank = rank
        return self

    # -- support --------------------------------------------------------------------

    def supports(self, tensor: torch.Tensor, op: Any = None) -> bool:
        """True when ``tensor`` (and ``op``, for a reduction) can go through shared memory."""
        if self.rank is None or tensor.device.type != "cpu" or tensor.dtype not in _DTYPES:
            return False
        kind = _op_kind(op)
        return kind is not None and not (kind == "avg" and not tensor.is_floating_point())

    # -- the barrier ----------------------------------------------------------------

    def barrier(self) -> None:
        """Wait until every rank has arrived."""
        me = self.rank
        for r, sem in enumerate(self._arrivals):
            if r != me:
                sem.release()
        mine = self._arrivals[me]
        for _ in range(self.world_size - 1):
            if not mine.acquire(timeout=self.timeout_s):
                raise PeerTimeoutError(
                    f"rank {me}: a peer did not reach the collective within {self.timeout_s:.0f} s "
                    "(it failed or stopped)")

    # -- collectives ----------------------------------------------------------------

    def _rows(self, dtype: torch.dtype) -> torch.Tensor:
        return self._buffer.view(dtype).view(self.world_size + 1, -1)

    def _chunks(self, numel: int, dtype: torch.dtype):
        per = self.slot_bytes // torch.empty((), dtype=dtype).element_size()
        for lo in range(0, numel, per):
            yield lo, min(numel, lo + per)

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        """Reduce ``tensor`` in place across ranks (SUM, AVG, MAX or MIN)."""
        kind = _op_kind(op)
        flat = tensor.detach().reshape(-1)
        contiguous = tensor.is_contiguous()
        rows = self._rows(tensor.dtype)
        k, me = self.world_size, self.rank
        for lo, hi in self._chunks(flat.numel(), tensor.dtype):
            n = hi - lo
            rows[me, :n].copy_(flat[lo:hi])
            self.barrier()
            a, b = me * n // k, (me + 1) * n // k
            if b > a:
                _reduce(kind, rows[:k, a:b], rows[k, a:b], k)
            self.barrier()
            flat[lo:hi].copy_(rows[k, :n])
        if not contiguous:
            tensor.copy_(flat.view_as(tensor))

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Every rank's ``tensor`` into ``tensor_list`` (one entry per rank, same size)."""
        flat = tensor.detach().reshape(-1)
        outs = [t.view(-1) if t.is_contiguous() else t.reshape(-1) for t in tensor_list]
        rows = self._rows(tensor.dtype)
        for lo, hi in self._chunks(flat.numel(), tensor.dtype):
            n = hi - lo
            rows[self.rank, :n].copy_(flat[lo:hi])
            self.barrier()
            for r, out in enumerate(outs):
                out[lo:hi].copy_(rows[r, :n])
            self.barrier()
        for target, out in zip(tensor_list, outs):
            if not target.is_contiguous():
                target.copy_(out.view_as(target))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Rank ``src``'s ``tensor`` into every rank's ``tensor``."""
        flat = tensor.detach().reshape(-1)
        rows = self._rows(tensor.dtype)
        for lo, hi in self._chunks(flat.numel(), tensor.dtype):
            n = hi - lo
            if self.rank == src:
                rows[src, :n].copy_(flat[lo:hi])
            self.barrier()
            if self.rank != src:
                flat[lo:hi].copy_(rows[src, :n])
            self.barrier()
        if self.rank != src and not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))


def _reduce(kind: str, parts: torch.Tensor, out: torch.Tensor, k: int) -> None:
    """``out`` = the reduction over the first dimension of ``parts`` (``k`` rows)."""
    if kind in ("sum", "avg"):
        torch.sum(parts, dim=0, out=out)
        if kind == "avg":
            out.div_(k)
    elif kind == "max":
        torch.amax(parts, dim=0, out=out)
    else:
        torch.amin(parts, dim=0, out=out)


def _room_for(nbytes: int) -> bool:
    """True when the shared-memory file system can hold ``nbytes`` more."""
    try:
        stat = os.statvfs("/dev/shm")
    except (OSError, AttributeError):
        return True  # no /dev/shm to measure (macOS): torch maps memory another way
    return stat.f_bavail * stat.f_frsize > 2 * nbytes
