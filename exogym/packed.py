"""Several simulated ranks in one process, run in turn: how a simulation scales past the cores.

A simulation of K ranks on a machine with C cores gains nothing from more than
C busy processes; K processes on C cores spend their time switching, each
with its own copy of torch in memory. So when K exceeds the cores (or when
ranks leave and rejoin, see :mod:`exogym.membership`), the trainer starts P
processes, and each runs its block of ranks as threads of which only one
runs at a time: the one holding the process's *baton*. A rank gives the baton
up only where it must wait: at a collective that some of its peers have not
reached yet, or asleep (a slow rank in ``speed_mode='wall'``). Between
collectives a rank therefore runs uninterrupted, its model hot in the cache,
and a round-based strategy (DiLoCo) runs each rank's H inner steps back to back.

Strategies do not change: each still sees one rank, and :mod:`exogym.comm`
routes its collectives here. A collective meets in two stages:

1. The group's members in this process meet in memory. The last of them to
   arrive reduces their tensors in rank order.
2. If the group has members in other processes too, that last rank exchanges
   its process's partial result with theirs through the run's rendezvous
   store (hosted by the trainer), under a key made of the group, the step and
   the collective's number within that step. Collectives of different groups
   therefore never need to meet in the same order, and a rank that was away
   (and so skipped collectives) meets its peers again at the right one.
   Partial results are combined in process order: every rank gets bitwise
   the same result.

Process-wide state a rank uses is swapped when the baton changes hands:
torch's, Python's and NumPy's global random generators (dropout, user code).
The comm module's counters and the simulated clock are thread-local already.

User code that asks torch.distributed who it is keeps working: in a packed
process ``torch.distributed.get_rank()``, ``get_world_size()`` and
``is_initialized()`` answer for the calling rank (:func:`exogym.comm.use_packed_world`).
Its collectives are not there; a model or strategy communicates through
:mod:`exogym.comm`, whose collectives are counted.

Membership: a rank announces the step it is at and which ranks are present
at that step (:meth:`PackedWorld.enter_step`); a collective then meets among
the present members of its group, and sizes and averages count only them.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from exogym.comm import ReduceOp
from exogym.shm_collectives import PeerTimeoutError


def process_ranks(world_size: int, processes: int, index: int) -> range:
    """The ranks process ``index`` of ``processes`` runs: a contiguous block, sizes within one."""
    return range(index * world_size // processes, (index + 1) * world_size // processes)


class PackedGroup:
    """A group of ranks in a packed world: what :func:`exogym.comm.new_group` returns there.

    Args:
        ranks: the global ranks of the group.
        tag: names the group in meeting keys; the same on every process.
    """

    def __init__(self, ranks: Sequence[int], tag: str):
        self.ranks = tuple(sorted(ranks))
        self.tag = tag


class _Seat:
    """One rank's place in the world: its thread-local state."""

    def __init__(self, rank: int):
        self.rank = rank
        self.step = 0
        self.members: frozenset[int] | None = None  # None: every rank is present
        self.counts: dict[str, int] = {}  # collectives per group in the current step
        self.present: dict[str, tuple[int, ...]] = {}  # a group's present members, cached
        self.rng: tuple[Any, Any, Any] | None = None  # saved while another rank runs


class _Meeting:
    """The ranks of this process that take part in one collective, and its outcome."""

    __slots__ = ("present", "here", "parts", "done", "error")

    def __init__(self, present: tuple[int, ...], here: tuple[int, ...]):
        self.present = present
        self.here = here
        self.parts: dict[int, Any] = {}
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Pending:
    """Handle of an asynchronous collective: ``wait()`` returns once it has completed."""

    def __init__(self, world: PackedWorld, meeting: _Meeting):
        self._world = world
        self._meeting = meeting

    def wait(self, timeout: float | None = None) -> bool:
        self._world._wait(self._meeting)
        return True

    def is_completed(self) -> bool:
        return self._meeting.done.is_set()


def _to_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1).contiguous()
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _from_bytes(data: bytes, like: torch.Tensor, count: int = 1) -> torch.Tensor:
    """``count`` tensors shaped like ``like``, stacked, from their bytes."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return raw.view(like.dtype).view(count, *like.shape)


def _combine(acc: torch.Tensor, other: torch.Tensor, op: Any) -> None:
    """``acc`` = op(acc, other), in place."""
    if acc.dtype == torch.bool:
        if op in (ReduceOp.MIN, ReduceOp.PRODUCT):
            acc.logical_and_(other)
        else:
            acc.logical_or_(other)
    elif op in (ReduceOp.SUM, ReduceOp.AVG):
        acc.add_(other)
    elif op == ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    elif op == ReduceOp.MIN:
        torch.minimum(acc, other, out=acc)
    elif op == ReduceOp.PRODUCT:
        acc.mul_(other)
    else:
        raise ValueError(f"ranks packed in one process reduce with SUM, AVG, MAX, MIN or "
                         f"PRODUCT, not {op!r}")


def _divided(acc: torch.Tensor, by: float) -> torch.Tensor:
    """``acc / by`` in ``acc``'s dtype (floor division for integers, as an average of them)."""
    if acc.is_floating_point():
        return acc.div_(by)
    return acc.div(by, rounding_mode="floor").to(acc.dtype)


class PackedWorld:
    """The ranks of one process of a packed simulation, and their collectives.

    Created once per process before its rank threads start; each rank thread
    calls :meth:`sit` first and :meth:`stand` last.

    Args:
        world_size: ranks in the whole run.
        processes: processes the ranks are packed into.
        index: this process, ``0 <= index < processes``.
        open_store: opens a client of the run's rendezvous store (one per
            concurrent cross-process exchange; they are pooled).
        timeout_s: how long a rank waits for its peers at a collective.
        namespace: prefix of the store keys this run uses.
    """

    def __init__(self, world_size: int, processes: int, index: int,
                 open_store: Callable[[], Any] | None, timeout_s: float = 1800.0,
                 namespace: str = "exogym/packed"):
        if not 0 <= index < processes <= world_size:
            raise ValueError(f"process {index} of {processes} for {world_size} ranks")
        self.world_size = world_size
        self.processes = processes
        self.index = index
        self.timeout_s = float(timeout_s)
        self.namespace = namespace
        self.here = process_ranks(world_size, processes, index)
        self._owner = [p for p in range(processes)
                       for _ in process_ranks(world_size, processes, p)]
        self._open_store = open_store
        self._stores: list[Any] = []
        self._lock = threading.Lock()  # guards the meetings, groups and store pool
        self._meetings: dict[tuple[str, int, int], _Meeting] = {}
        self._groups: dict[tuple[bool, tuple[int, ...]], PackedGroup] = {}  # by (side, ranks)
        self._baton = threading.Lock()
        self._holder: _Seat | None = None  # whose random state the globals hold
        self._local = threading.local()
        self.world = PackedGroup(range(world_size), "w")
        self.side = PackedGroup(range(world_size), "s")

    # -- seats and the baton ------------------------------------------------------------

    def sit(self, rank: int) -> None:
        """The calling thread is ``rank`` from now on; it waits for the baton."""
        if rank not in self.here:
            raise ValueError(f"rank {rank} does not run in process {self.index} "
                             f"(ranks {self.here.start}..{self.here.stop - 1})")
        seat = _Seat(rank)
        self._local.seat = seat
        self._take_baton(seat)

    def stand(self) -> None:
        """The calling rank is done: it hands the baton on."""
        seat = self._seat()
        if self._holder is seat:
            self._holder = None  # nobody needs its random state any more
        self._baton.release()

    def _seat(self) -> _Seat:
        seat = getattr(self._local, "seat", None)
        if seat is None:
            raise RuntimeError("this thread is no rank of the packed world (sit() first)")
        return seat

    def _take_baton(self, seat: _Seat) -> None:
        if not self._baton.acquire(timeout=self.timeout_s):
            raise PeerTimeoutError(f"rank {seat.rank}: waited {self.timeout_s:.0f} s for its turn "
                                   "to run (another rank of its process never gave it up)")
        previous = self._holder
        if previous is not seat:
            # The globals hold the previous runner's random state: keep it, put ours back.
            if previous is not None:
                previous.rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
            if seat.rng is not None:
                torch.set_rng_state(seat.rng[0])
                random.setstate(seat.rng[1])
                np.random.set_state(seat.rng[2])
            self._holder = seat

    @contextmanager
    def _aside(self):
        """Let the process's other ranks run while this one waits."""
        seat = self._seat()
        self._baton.release()
        try:
            yield
        finally:
            self._take_baton(seat)

    def sleep(self, seconds: float) -> None:
        """Sleep without holding up the other ranks of this process."""
        with self._aside():
            time.sleep(seconds)

    # -- membership ---------------------------------------------------------------------

    def rank(self) -> int:
        """The calling thread's rank."""
        return self._seat().rank

    def enter_step(self, step: int, members: Sequence[int] | None) -> None:
        """The calling rank is at ``step``; ``members`` are the ranks present there (None: all)."""
        seat = self._seat()
        if step != seat.step:
            seat.step = step
            seat.counts = {}
        present = None if members is None else frozenset(members)
        if present != seat.members:
            seat.members = present
            seat.present = {}

    def group(self, ranks: Sequence[int], side: bool = False) -> PackedGroup:
        """The group of ``ranks`` (training traffic, or the side channel's with ``side``)."""
        members = tuple(sorted(set(ranks)))
        if not members or not all(0 <= r < self.world_size for r in members):
            raise ValueError(f"a group's ranks must lie in 0..{self.world_size - 1}, got {ranks!r}")
        key = (side, members)
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                digest = hashlib.blake2b(repr(members).encode(), digest_size=8).hexdigest()
                group = self._groups[key] = PackedGroup(members, ("s" if side else "g") + digest)
        return group

    def members(self, group: PackedGroup | None = None) -> tuple[int, ...]:
        """The ranks of ``group`` (default: the world) present at the calling rank's step."""
        group = group or self.world
        seat = self._seat()
        present = seat.present.get(group.tag)
        if present is None:
            present = group.ranks if seat.members is None else tuple(
                r for r in group.ranks if r in seat.members)
            seat.present[group.tag] = present
        return present

    def size(self, group: PackedGroup | None = None) -> int:
        """How many ranks of ``group`` are present."""
        return len(self.members(group))

    # -- meetings -----------------------------------------------------------------------

    def _arrive(self, group: PackedGroup, payload: Any,
                complete: Callable[[_Meeting, tuple[str, int, int]], None]) -> _Meeting:
        seat = self._seat()
        present = self.members(group)
        if seat.rank not in present:
            raise RuntimeError(f"rank {seat.rank} called a collective of ranks {list(present)} "
                               f"at step {seat.step}, where it is not present")
        number = seat.counts.get(group.tag, 0)
        seat.counts[group.tag] = number + 1
        key = (group.tag, seat.step, number)
        with self._lock:
            meeting = self._meetings.get(key)
            if meeting is None:
                here = tuple(r for r in present if self._owner[r] == self.index)
                meeting = self._meetings[key] = _Meeting(present, here)
            meeting.parts[seat.rank] = payload
            last = len(meeting.parts) == len(meeting.here)
            if last:
                del self._meetings[key]
        if last:
            try:
                complete(meeting, key)
            except BaseException as exc:
                meeting.error = exc
                raise
            finally:
                meeting.done.set()
        return meeting

    def _wait(self, meeting: _Meeting) -> None:
        if not meeting.done.is_set():
            with self._aside():
                if not meeting.done.wait(self.timeout_s):
                    raise PeerTimeoutError(
                        f"rank {self._seat().rank}: a peer did not reach the collective within "
                        f"{self.timeout_s:.0f} s (it failed or stopped)")
        if meeting.error is not None:
            raise RuntimeError(f"a collective of ranks {list(meeting.present)} failed: "
                               f"{meeting.error}") from meeting.error

    def _finish(self, meeting: _Meeting, async_op: bool):
        if async_op:
            return _Pending(self, meeting)
        self._wait(meeting)
        return None

    def _processes(self, ranks: Sequence[int]) -> list[int]:
        return sorted({self._owner[r] for r in ranks})

    def _exchange(self, key: tuple[str, int, int], procs: list[int], mine: bytes | None,
                  read: list[int], partial_ok: bool = False) -> dict[int, bytes]:
        """Post this process's part (if any) and read the parts of ``read`` through the store.

        Every process in ``procs`` calls this once per key; the last to finish
        deletes the key's entries. ``partial_ok``: the caller can do without the
        parts of processes that are gone (a subclass's business, :mod:`exogym.elastic`).
        """
        if self._open_store is None:
            raise RuntimeError("a collective spans processes, but this packed world has no store")
        name = f"{self.namespace}/{key[0]}/{key[1]}/{key[2]}"
        with self._lock:
            store = self._stores.pop() if self._stores else None
        with self._aside():
            if store is None:
                store = self._open_store()
            try:
                if mine is not None:
                    store.set(f"{name}/{self.index}", mine)
                got = {p: store.get(f"{name}/{p}") for p in read if p != self.index}
                if store.add(f"{name}/n", 1) == len(procs):
                    for p in read:
                        store.delete_key(f"{name}/{p}")
                    store.delete_key(f"{name}/n")
            finally:
                with self._lock:
                    self._stores.append(store)
        return got

    # -- collectives --------------------------------------------------------------------

    def _across_processes(self, key: tuple[str, int, int], present: tuple[int, ...],
                          acc: torch.Tensor, op: Any) -> tuple[torch.Tensor, int]:
        """This process's partial result combined with the other processes' (in process
        order, so that every process computes bitwise the same result), and how many
        ranks the result covers."""
        procs = self._processes(present)
        if len(procs) == 1:
            return acc, len(present)
        got = self._exchange(key, procs, _to_bytes(acc), procs, partial_ok=True)
        total = None
        for p in procs:
            if p != self.index and p not in got:
                continue  # a process whose ranks were lost meanwhile (exogym.elastic)
            part = acc if p == self.index else _from_bytes(got[p], acc)[0]
            if total is None:
                total = part.clone()
            else:
                _combine(total, part, op)
        return total, sum(1 for r in present if self._owner[r] == self.index or
                          self._owner[r] in got)

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: PackedGroup | None = None,
                   async_op: bool = False):
        """Reduce ``tensor`` in place across the present members of ``group``."""
        return self.all_reduce_many([tensor], op, group, None, async_op)

    def all_reduce_many(self, tensors: Sequence[torch.Tensor], op: Any = None,
                        group: PackedGroup | None = None, divide_by: float | None = None,
                        async_op: bool = False):
        """Reduce each of ``tensors`` in place across the present members of ``group``, as
        one collective (a bucket of :func:`exogym.comm.all_reduce_tensors`), then divide
        by ``divide_by`` if given; the same result as one reduction of their concatenation."""
        op = ReduceOp.SUM if op is None else op

        def complete(meeting: _Meeting, key: tuple[str, int, int]) -> None:
            lists = [meeting.parts[r] for r in meeting.here]
            acc = torch.cat([t.detach().reshape(-1) for t in lists[0]])
            for others in lists[1:]:
                offset = 0
                for t in others:
                    n = t.numel()
                    _combine(acc[offset:offset + n], t.detach().reshape(-1), op)
                    offset += n
            acc, counted = self._across_processes(key, meeting.present, acc, op)
            if op == ReduceOp.AVG:
                acc = _divided(acc, counted)
            if divide_by is not None:
                # An average asked of the present ranks is over those that took part.
                acc = _divided(acc, counted if divide_by == len(meeting.present) else divide_by)
            for members in lists:
                offset = 0
                for t in members:
                    n = t.numel()
                    t.detach().copy_(acc[offset:offset + n].view_as(t))
                    offset += n

        return self._finish(self._arrive(group or self.world, list(tensors), complete), async_op)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                   group: PackedGroup | None = None, async_op: bool = False):
        """Every present member's ``tensor`` into ``tensor_list``, in rank order."""
        group = group or self.world
        present = self.members(group)
        if len(tensor_list) != len(present):
            raise ValueError(f"all_gather needs one output tensor per present rank of the group "
                             f"({len(present)}), got {len(tensor_list)}")

        def complete(meeting: _Meeting, key: tuple[str, int, int]) -> None:
            sources = {r: meeting.parts[r][1] for r in meeting.here}
            procs = self._processes(meeting.present)
            if len(procs) > 1:
                like = sources[meeting.here[0]]
                mine = b"".join(_to_bytes(sources[r]) for r in meeting.here)
                got = self._exchange(key, procs, mine, procs, partial_ok=True)
                for p in procs:
                    if p == self.index:
                        continue
                    theirs = [r for r in meeting.present if self._owner[r] == p]
                    if p not in got:
                        # Lost meanwhile (exogym.elastic): its part reads as all bits set,
                        # NaN in a floating tensor, which a strategy skips as an absent part.
                        raw = torch.full((like.numel() * like.element_size(),), 255,
                                         dtype=torch.uint8)
                        absent = raw.view(like.dtype).view(like.shape)
                        sources.update((r, absent) for r in theirs)
                        continue
                    stacked = _from_bytes(got[p], like, len(theirs))
                    sources.update(zip(theirs, stacked))
            for r in meeting.here:
                for out, source_rank in zip(meeting.parts[r][0], meeting.present):
                    out.copy_(sources[source_rank].reshape(out.shape))

        return self._finish(self._arrive(group, (tensor_list, tensor), complete), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: PackedGroup | None = None,
                  async_op: bool = False):
        """Rank ``src``'s ``tensor`` into every present member's ``tensor``."""
        group = group or self.world
        if src not in self.members(group):
            raise ValueError(f"broadcast from rank {src}, which is not a present member of "
                             f"ranks {list(self.members(group))}")

        def complete(meeting: _Meeting, key: tuple[str, int, int]) -> None:
            procs = self._processes(meeting.present)
            owner = self._owner[src]
            if owner == self.index:
                value = meeting.parts[src]
                if len(procs) > 1:
                    self._exchange(key, procs, _to_bytes(value), [owner])
            else:
                got = self._exchange(key, procs, None, [owner])
                value = _from_bytes(got[owner], tensor)[0]
            for r in meeting.here:
                if r != src:
                    meeting.parts[r].copy_(value)

        return self._finish(self._arrive(group, tensor, complete), async_op)

    def barrier(self, group: PackedGroup | None = None) -> None:
        """Wait until every present member of ``group`` has reached this point."""
        self.all_reduce(torch.zeros(1), group=group or self.side)
