"""The protocol every transport of a rank's collectives implements, and what they share.

A backend carries tensors between ranks; it counts nothing and charges no
clock (:mod:`exogym.comm` does that before it calls one). One is chosen when a
rank starts (:func:`exogym.comm.use_backend`) and serves every collective of
the process until the rank ends:

- :class:`Collectives` itself: a world of one (no process group); nothing moves;
- :class:`exogym.comm.torch_group.TorchGroup`: ``torch.distributed`` (gloo, NCCL);
- :class:`exogym.comm.shared_memory.SharedMemoryBackend`: the processes of a local
  simulation, through shared memory;
- :class:`exogym.comm.packed.PackedWorld`: several ranks in one process, run in turn;
- :class:`exogym.comm.elastic_groups.ElasticGroups`: ranks on hosts that come and go;
- :class:`exogym.comm.mirror.Mirror`: every peer holds this rank's tensors (nothing moves).

The training collectives (``all_reduce``, ``all_reduce_many``, ``broadcast``,
``all_gather``) act on ``group`` (None: the world) and return None, or a handle
with ``wait()`` and ``is_completed()`` when ``async_op``. The side channel
(``side_*``) carries evaluation, averaging, agreement and hand-overs, never
counted. A backend where ranks come and go also follows :meth:`enter_step`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

#: The environment variable that chooses a simulation's transport (see :func:`collectives_mode`).
MODE_ENV = "EXOGYM_COLLECTIVES"
MODES = ("auto", "torch", "mirror")


def collectives_mode(environ: dict[str, str] | None = None) -> str:
    """``EXOGYM_COLLECTIVES`` checked: ``'auto'`` (unset), ``'torch'`` or ``'mirror'``.

    Raises:
        ValueError: for any other value, naming the accepted ones.
    """
    value = (os.environ if environ is None else environ).get(MODE_ENV, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r} is not one of {', '.join(MODES)}")
    return value


class DoneWork:
    """Handle of a collective that has completed already."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def done(async_op: bool) -> DoneWork | None:
    """What a collective that has completed returns."""
    return DoneWork() if async_op else None


class ThenWork:
    """Handle of a collective followed by local work (``then``) once it has completed."""

    def __init__(self, work: Any, then: Callable[[], None]):
        self._work = work
        self._then = then
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._then()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()


def finish(work: Any, async_op: bool) -> Any:
    """``work`` as a collective returns it: waited for unless ``async_op``."""
    if async_op:
        return work
    work.wait()
    return None


def split_into(flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``targets`` (shapes kept)."""
    offset = 0
    for t in targets:
        n = t.numel()
        t.detach().copy_(flat[offset:offset + n].view_as(t))
        offset += n


def divided(acc: torch.Tensor, by: float) -> torch.Tensor:
    """``acc / by`` in ``acc``'s dtype (floor division for integers, as an average of them)."""
    if acc.is_floating_point():
        return acc.div_(by)
    return acc.div(by, rounding_mode="floor").to(acc.dtype)


def combine(acc: torch.Tensor, other: torch.Tensor, op: Any) -> None:
    """``acc = op(acc, other)`` in place: one step of a reduction in rank order."""
    if acc.dtype == torch.bool:
        if op in (ReduceOp.MIN, ReduceOp.PRODUCT):
            acc.logical_and_(other)
        else:
            acc.logical_or_(other)
    elif op is None or op in (ReduceOp.SUM, ReduceOp.AVG):
        acc.add_(other)
    elif op == ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    elif op == ReduceOp.MIN:
        torch.minimum(acc, other, out=acc)
    elif op == ReduceOp.PRODUCT:
        acc.mul_(other)
    else:
        raise ValueError(f"a reduction here takes SUM, AVG, MAX, MIN or PRODUCT, not {op!r}")


_HALF = (torch.float16, torch.bfloat16)


def reduce_rows(parts: Sequence[torch.Tensor], out: torch.Tensor, op: Any) -> None:
    """``out`` = the reduction of ``parts`` in rank order: ``((p0 op p1) op p2) ...``.

    The one order every local transport reduces in (shared memory, packed ranks,
    in one process or across several), so that a simulation's result does not
    depend on how its ranks are spread over processes. A sum of 16-bit floats
    accumulates in float32 and is rounded once, as ``torch.sum`` does.
    """
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    if out.dtype in _HALF and (op is None or op in (ReduceOp.SUM, ReduceOp.AVG)):
        acc = parts[0].float()
        for part in parts[1:]:
            acc.add_(part)
        out.copy_(acc)
        return
    if out.data_ptr() != parts[0].data_ptr():
        out.copy_(parts[0])
    for part in parts[1:]:
        combine(out, part, op)


class Collectives:
    """A rank's transport for collectives; this base class is a world of one.

    Subclasses override what their transport carries. The base class gives
    :meth:`all_reduce_many` as one all-reduce of a flat copy of the tensors,
    which a transport that can reduce tensors in place overrides.
    """

    #: How logs and errors name this transport.
    name = "none"

    # -- who, where ------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True when there are peers to talk to (a process group or its stand-in)."""
        return False

    def rank(self) -> int:
        """The calling rank."""
        return 0

    def world_size(self) -> int:
        """Ranks in the world."""
        return 1

    def new_group(self, ranks: Sequence[int]) -> Any:
        """A group of ``ranks`` for training collectives (created by every rank, in order)."""
        return None

    def group_ranks(self, group: Any = None) -> list[int]:
        """The ranks of ``group`` (None: the world) present at the calling rank's step."""
        return [0]

    def group_size(self, group: Any = None) -> int:
        """How many ranks of ``group`` are present."""
        return len(self.group_ranks(group))

    def enter_step(self, step: int, members: Sequence[int] | None,
                   epoch: int | None = None) -> None:
        """The calling rank is at ``step``, where ``members`` are present (None: all), a
        membership that began at step ``epoch``."""
        if members is not None and len(set(members)) != self.world_size():
            raise RuntimeError(f"the {self.name} collectives cannot meet without some of their "
                               "ranks (rank_failures runs its ranks packed in processes; "
                               "hosts that come and go need min_nodes)")

    def pause(self, seconds: float) -> None:
        """Sleep without holding up ranks that share this process."""
        time.sleep(seconds)

    def held_once(self, key: Any, make: Callable[[], Any]) -> Any:
        """An object every rank of this process shares, made by the first that asks
        (``make()``); a backend with one rank per process makes one for each."""
        return make()

    def ranks_here(self) -> int:
        """How many ranks this process runs (they may all hold a collective's buffers at
        once: a packed process's ranks do); 1 for a backend of one rank per process."""
        return 1

    def timed(self, phase: str) -> contextlib.AbstractContextManager[None]:
        """Counts the calling rank's seconds in the block as ``phase`` where the backend
        keeps such an account (a packed process: :class:`exogym.comm.packed.PackedTally`);
        elsewhere nothing."""
        return contextlib.nullcontext()

    # -- training collectives (uncounted here) ---------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None,
                   async_op: bool = False) -> Any:
        """Reduce ``tensor`` in place across the group (default op: SUM)."""
        return done(async_op)

    def all_reduce_many(self, tensors: Sequence[torch.Tensor], op: Any = None,
                        group: Any = None, divide_by: float | None = None,
                        wire_dtype: torch.dtype | None = None, async_op: bool = False) -> Any:
        """Reduce each of ``tensors`` (one device and dtype) in place as one collective,
        in ``wire_dtype`` if given, then divide by ``divide_by`` if given."""
        members = list(tensors)
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        if wire_dtype is not None and flat.dtype != wire_dtype:
            flat = flat.to(wire_dtype)
        work = self.all_reduce(flat, op, group, async_op=True)

        def split() -> None:
            result = flat
            if divide_by is not None:
                if result.dtype != members[0].dtype:
                    result = result.to(members[0].dtype)
                result.div_(divide_by)
            split_into(result, members)

        return finish(ThenWork(work, split), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None,
                  async_op: bool = False) -> Any:
        """Rank ``src``'s ``tensor`` into every member's ``tensor``."""
        return done(async_op)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                   group: Any = None, async_op: bool = False) -> Any:
        """Every member's ``tensor`` into ``tensor_list``, in rank order."""
        tensor_list[0].copy_(tensor)
        return done(async_op)

    def latest(self, value: float, group: Any = None) -> float:
        """The largest ``value`` over the members of ``group`` (the simulated clock's
        meeting time); uncounted."""
        return value

    # -- the side channel ------------------------------------------------------------

    def side_size(self) -> int:
        """Ranks on the side channel (those present, where ranks come and go)."""
        return 1

    def side_all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        """All-reduce ``tensor`` in place (default op: SUM)."""

    def side_broadcast(self, tensor: torch.Tensor, src: int,
                       ranks: Sequence[int] | None = None) -> None:
        """Rank ``src``'s ``tensor`` into the others', among ``ranks`` (None: every rank)."""

    def side_all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Every rank's ``tensor`` into ``tensor_list``."""
        tensor_list[0].detach().copy_(tensor)

    def side_barrier(self) -> None:
        """Wait until every rank has reached this point."""

    # -- the end ---------------------------------------------------------------------

    def close(self) -> None:
        """Leave the transport (finish what runs in the background)."""


def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself on the CPU (without autograd), else a CPU copy of it."""
    return tensor.detach() if tensor.device.type == "cpu" else tensor.detach().to("cpu")


def copy_back(tensor: torch.Tensor, staged: torch.Tensor) -> None:
    """Copy ``staged`` into ``tensor`` unless they are the same memory."""
    if staged.data_ptr() != tensor.data_ptr():
        tensor.detach().copy_(staged)


class PeerTimeoutError(RuntimeError):
    """A peer did not reach a collective in time."""


class PeerLost(RuntimeError):
    """A collective that cannot do without a member lost it (a broadcast from it)."""


class RankDropped(RuntimeError):
    """This rank was declared lost while it ran (frozen, asleep or cut off): it must rejoin."""


def is_connection_error(exc: BaseException) -> bool:
    """True for an error a collective raised because a peer's connection failed."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("gloo", "Connection reset", "Connection closed", "NCCL"))
