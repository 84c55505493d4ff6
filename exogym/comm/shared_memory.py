"""Collectives through shared memory, for the rank processes of one machine.

In a local simulation every rank is a process on this machine, so a collective
need not cross a socket: each rank copies its contribution into its own slot
of a shared buffer and meets the others; the last rank to arrive reduces every
slot into a result row (in rank order, :func:`exogym.comm.protocol.reduce_rows`,
so every rank gets bitwise the same result, the same as packed ranks get),
then wakes the others, who copy the result out. Large tensors, or many
tensors of an all-reduce bucket, pass in chunks of one slot.

One meeting per chunk is all a collective costs. A second meeting (so that no
rank overwrites a slot a slower peer is still reading) is not needed because
the buffer has two halves used in turn: a rank can only write a half again
after the next meeting, which no rank passes before every rank has finished
reading the previous one. On a machine with fewer cores than ranks each
meeting means putting sleeping processes back on a core, so halving the
meetings is what makes lockstep strategies (DDP) fast here.

The meeting: an arrival counter under a lock; a rank that is not the last
waits on its own semaphore, which the last rank posts once the reduction is
done. Posts never mix between meetings: a rank waits at most once per meeting.

:class:`SharedMemoryBackend` is the rank's transport: a collective of the whole
world on CPU tensors goes through shared memory (asynchronous ones on a thread
of their own, in the order they were started); anything else (a subgroup, a
GPU tensor under NCCL, an unusual reduce op) goes to ``torch.distributed``.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from exogym.comm.protocol import (
    Collectives,
    DoneWork,
    PeerTimeoutError,
    ReduceOp,
    collectives_mode,
    copy_back,
    done,
    reduce_rows,
)
from exogym.comm.torch_group import TorchGroup

TOTAL_BYTES = 32 * 1024 * 1024
MIN_SLOT_BYTES = 64 * 1024
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
           torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _op_kind(op: Any) -> str | None:
    if op is None:
        return "sum"
    for name in ("SUM", "AVG", "MAX", "MIN"):
        if op == getattr(ReduceOp, name):
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
        ctx: the multiprocessing context the ranks are started with (its locks, semaphores).
        timeout_s: how long a rank waits for its peers at a meeting before failing.
    """

    def __init__(self, world_size: int, slot_bytes: int, ctx: Any, timeout_s: float = 1800.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.slot_bytes = max(64, -(-int(slot_bytes) // 64) * 64)
        self.timeout_s = float(timeout_s)
        # Two halves of (world_size contribution slots + 1 result row), used in turn.
        self._buffer = torch.zeros((2, world_size + 1, self.slot_bytes),
                                   dtype=torch.uint8).share_memory_()
        self._arrived = ctx.RawValue("l", 0)
        self._lock = ctx.Lock()
        self._wake = [ctx.Semaphore(0) for _ in range(world_size)]
        self._turn = 0  # which half the next chunk uses; advances identically on every rank
        self.rank: int | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, world_size: int, ctx: Any,
                  timeout_s: float = 1800.0) -> SharedMemoryCollectives | None:
        """Sized for ``model``'s parameters and buffers within a fixed memory budget.

        None when one rank is all there is, when ``EXOGYM_COLLECTIVES`` asks for
        torch.distributed or for mirrored collectives, or when the shared-memory file
        system lacks the room.
        """
        if collectives_mode() != "auto" or world_size < 2:
            return None
        model_bytes = sum(t.numel() * t.element_size()
                          for t in list(model.parameters()) + list(model.buffers()))
        slot = min(max(model_bytes, MIN_SLOT_BYTES), TOTAL_BYTES // (2 * (world_size + 1)))
        slot = max(64, slot // 64 * 64)
        if not _room_for(2 * (world_size + 1) * slot):
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

    # -- the meeting ----------------------------------------------------------------

    def _meet(self, last_work: Callable[[], None] | None = None) -> None:
        """Wait until every rank has arrived; the last to arrive runs ``last_work`` first."""
        me = self.rank
        if not self._lock.acquire(timeout=self.timeout_s):
            raise PeerTimeoutError(f"rank {me}: the collectives' lock was not released within "
                                   f"{self.timeout_s:.0f} s (a peer stopped inside it)")
        try:
            self._arrived.value += 1
            last = self._arrived.value == self.world_size
            if last:
                self._arrived.value = 0
        finally:
            self._lock.release()
        if last:
            try:
                if last_work is not None:
                    last_work()
            finally:
                for r, wake in enumerate(self._wake):
                    if r != me:
                        wake.release()
        elif not self._wake[me].acquire(timeout=self.timeout_s):
            raise PeerTimeoutError(
                f"rank {me}: a peer did not reach the collective within {self.timeout_s:.0f} s "
                "(it failed or stopped)")

    # -- collectives ----------------------------------------------------------------

    def _next_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """The half of the buffer for the next chunk, as ``world_size + 1`` rows of ``dtype``."""
        half = self._buffer[self._turn]
        self._turn ^= 1
        return half.view(dtype)

    def _per_chunk(self, dtype: torch.dtype) -> int:
        return self.slot_bytes // torch.empty((), dtype=dtype).element_size()

    def _chunks(self, numel: int, dtype: torch.dtype) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(lo, hi, rows)`` per slot-sized chunk of ``numel`` elements (one for an empty tensor)."""
        per = self._per_chunk(dtype)
        for lo in range(0, max(numel, 1), per):
            yield lo, min(numel, lo + per), self._next_rows(dtype)

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        """Reduce ``tensor`` in place across ranks (SUM, AVG, MAX or MIN)."""
        self.all_reduce_many([tensor], op)

    def all_reduce_many(self, tensors: Sequence[torch.Tensor], op: Any = None,
                        wire_dtype: torch.dtype | None = None,
                        divide_by: float | None = None) -> None:
        """Reduce every tensor in place across ranks, packed into as few chunks as fit.

        Args:
            tensors: tensors of one dtype, reduced in place.
            op: SUM (default), AVG, MAX or MIN.
            wire_dtype: the type values are reduced in (e.g. bfloat16); default theirs.
            divide_by: divide each result by this afterwards (an average), in the
                tensors' own type, as a flat buffer would be after a reduce.
        """
        if not any(t.numel() for t in tensors):
            return  # every rank holds the same shapes, so every rank returns here
        kind = _op_kind(op)
        own_dtype = tensors[0].dtype
        dtype = wire_dtype or own_dtype
        k, me = self.world_size, self.rank
        per = self._per_chunk(dtype)
        flats = [t.detach().view(-1) if t.is_contiguous() else t.detach().reshape(-1)
                 for t in tensors]
        # The divide happens in the result row when the wire type is the tensors' own.
        divide_in_row = divide_by is not None and dtype == own_dtype

        def flush(rows: torch.Tensor, n: int, pieces: list[tuple[int, int, int, int]]) -> None:
            def reduce_all() -> None:
                _reduce(kind, rows[:k, :n], rows[k, :n], k)
                if divide_in_row:
                    rows[k, :n].div_(divide_by)

            self._meet(reduce_all)
            for i, lo, at, m in pieces:
                out = flats[i][lo:lo + m]
                out.copy_(rows[k, at:at + m])
                if divide_by is not None and not divide_in_row:
                    out.div_(divide_by)

        rows = self._next_rows(dtype)
        n, pieces = 0, []
        for i, flat in enumerate(flats):
            lo, size = 0, flat.numel()
            while lo < size:
                if n == per:
                    flush(rows, n, pieces)
                    rows, n, pieces = self._next_rows(dtype), 0, []
                m = min(size - lo, per - n)
                rows[me, n:n + m].copy_(flat[lo:lo + m])
                pieces.append((i, lo, n, m))
                n += m
                lo += m
        flush(rows, n, pieces)
        for tensor, flat in zip(tensors, flats):
            if not tensor.is_contiguous():
                tensor.copy_(flat.view_as(tensor))

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Every rank's ``tensor`` into ``tensor_list`` (one entry per rank, same size)."""
        flat = tensor.detach().reshape(-1)
        outs = [t.view(-1) if t.is_contiguous() else t.reshape(-1) for t in tensor_list]
        for lo, hi, rows in self._chunks(flat.numel(), tensor.dtype):
            rows[self.rank, :hi - lo].copy_(flat[lo:hi])
            self._meet()
            for r, out in enumerate(outs):
                out[lo:hi].copy_(rows[r, :hi - lo])
        for target, out in zip(tensor_list, outs):
            if not target.is_contiguous():
                target.copy_(out.view_as(target))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Rank ``src``'s ``tensor`` into every rank's ``tensor``."""
        flat = tensor.detach().reshape(-1)
        for lo, hi, rows in self._chunks(flat.numel(), tensor.dtype):
            if self.rank == src:
                rows[src, :hi - lo].copy_(flat[lo:hi])
            self._meet()
            if self.rank != src:
                flat[lo:hi].copy_(rows[src, :hi - lo])
        if self.rank != src and not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))


def _reduce(kind: str, parts: torch.Tensor, out: torch.Tensor, k: int) -> None:
    """``out`` = the reduction over the first dimension of ``parts`` (``k`` rows), in rank order."""
    if kind in ("sum", "avg"):
        reduce_rows(list(parts), out, ReduceOp.SUM)
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


class _Future:
    """A collective the background thread runs; ``wait()`` returns once it has run."""

    def __init__(self):
        self._event = threading.Event()
        self._error: BaseException | None = None

    def wait(self, timeout: Any = None) -> bool:
        self._event.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()


class _Background:
    """One thread that runs shared-memory collectives in the order they were started."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="exogym-collectives", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> _Future:
        future = _Future()
        self._jobs.put((future, job))
        return future

    def _run(self) -> None:
        while True:
            future, job = self._jobs.get()
            try:
                job()
            except BaseException as exc:  # handed to whoever waits on it
                future._error = exc
            finally:
                future._event.set()


class SharedMemoryBackend(Collectives):
    """A simulated rank's transport: shared memory for the world's CPU collectives,
    ``torch.distributed`` (``fallback``) for the rest.

    Asynchronous collectives through shared memory run on one background thread
    in the order they were started (every rank starts them in the same order, so
    they meet); a blocking one first waits for those still running.

    Args:
        shm: the shared buffers, bound to this rank.
        fallback: the process group, for what shared memory does not carry.
    """

    name = "shared memory"

    def __init__(self, shm: SharedMemoryCollectives, fallback: TorchGroup):
        self.shm = shm
        self.fallback = fallback
        self._background: _Background | None = None
        self._last_started: _Future | None = None

    # -- who, where: the process group's ---------------------------------------------

    @property
    def active(self) -> bool:
        return self.fallback.active

    def rank(self) -> int:
        return self.fallback.rank()

    def world_size(self) -> int:
        return self.fallback.world_size()

    def new_group(self, ranks: Sequence[int]) -> Any:
        return self.fallback.new_group(ranks)

    def group_ranks(self, group: Any = None) -> list[int]:
        return self.fallback.group_ranks(group)

    def group_size(self, group: Any = None) -> int:
        return self.fallback.group_size(group)

    # -- which path ----------------------------------------------------------------------

    def _carries(self, tensor: torch.Tensor, group: Any, op: Any = None) -> bool:
        import torch.distributed as dist

        return (group is None or group is dist.group.WORLD) and self.shm.supports(tensor, op)

    def _start(self, job: Callable[[], None]) -> _Future:
        if self._background is None:
            self._background = _Background()
        self._last_started = self._background.submit(job)
        return self._last_started

    def drain(self, raise_errors: bool = True) -> None:
        """Wait until every collective started in the background has run."""
        last, self._last_started = self._last_started, None
        if last is not None:
            try:
                last.wait()
            except BaseException:
                if raise_errors:
                    raise

    def _staged(self, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        """``tensor``, or its CPU copy where the process group would stage it."""
        return tensor.detach().to("cpu") if self.fallback.needs_staging(tensor, group) else tensor

    def _run(self, job: Callable[[], None], async_op: bool) -> Any:
        if async_op:
            return self._start(job)
        self.drain()
        job()
        return None

    # -- training collectives ------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None,
                   async_op: bool = False) -> Any:
        staged = self._staged(tensor, group)
        if not self._carries(staged, group, op):
            return self.fallback.all_reduce(tensor, op, group, async_op)
        self.drain()
        self.shm.all_reduce(staged, op)
        copy_back(tensor, staged)
        return done(async_op)

    def all_reduce_many(self, tensors: Sequence[torch.Tensor], op: Any = None,
                        group: Any = None, divide_by: float | None = None,
                        wire_dtype: torch.dtype | None = None, async_op: bool = False) -> Any:
        members = list(tensors)
        if not self._carries(members[0], group, op):
            return super().all_reduce_many(members, op, group, divide_by, wire_dtype, async_op)

        def reduce_in_place() -> None:
            self.shm.all_reduce_many(members, op, wire_dtype=wire_dtype, divide_by=divide_by)

        return self._run(reduce_in_place, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None,
                  async_op: bool = False) -> Any:
        staged = self._staged(tensor, group)
        if not self._carries(staged, group):
            return self.fallback.broadcast(tensor, src, group, async_op)
        self.drain()
        self.shm.broadcast(staged, src)
        copy_back(tensor, staged)
        return done(async_op)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                   group: Any = None, async_op: bool = False) -> Any:
        if not (self._carries(tensor, group) and all(t.device.type == "cpu" for t in tensor_list)):
            return self.fallback.all_gather(tensor_list, tensor, group, async_op)
        return self._run(lambda: self.shm.all_gather(tensor_list, tensor), async_op)

    def latest(self, value: float, group: Any = None) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        if not self._carries(t, group, ReduceOp.MAX):
            return self.fallback.latest(value, group)
        self.drain()
        self.shm.all_reduce(t, op=ReduceOp.MAX)
        return float(t.item())

    # -- the side channel: the process group's own gloo group --------------------------

    def side_size(self) -> int:
        return self.fallback.side_size()

    def side_all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        self.fallback.side_all_reduce(tensor, op)

    def side_broadcast(self, tensor: torch.Tensor, src: int,
                       ranks: Sequence[int] | None = None) -> None:
        self.fallback.side_broadcast(tensor, src, ranks)

    def side_all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.fallback.side_all_gather(tensor_list, tensor)

    def side_barrier(self) -> None:
        self.fallback.side_barrier()

    def close(self) -> None:
        self.drain(raise_errors=False)
        self.fallback.close()


__all__ = ["DoneWork", "PeerTimeoutError", "SharedMemoryBackend", "SharedMemoryCollectives"]
