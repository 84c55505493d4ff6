"""Several simulated ranks in one process, run in turn: how a simulation scales past the cores.

A simulation of K ranks on a machine with C cores gains nothing from more than
C busy processes; K processes on C cores spend their time switching, each
with its own copy of torch in memory. So when K exceeds the cores (or when
ranks leave and rejoin, see :mod:`exogym.membership.simulated`), the trainer starts P
processes, and each runs its block of ranks as threads of which only one
runs at a time: the one holding the process's *baton*. A rank gives the baton
up only where it must wait: at a collective that some of its peers have not
reached yet, or asleep (a slow rank in ``speed_mode='wall'``). Between
collectives a rank therefore runs uninterrupted, its model hot in the cache,
and a round-based strategy (DiLoCo) runs each rank's H inner steps back to back.

Strategies do not change: each still sees one rank, and :mod:`exogym.comm`
routes its collectives here. A collective meets in two stages:

1. The group's members in this process meet in memory; the last of them to
   arrive acts for the process.
2. If the group has members in other processes too, that rank posts its
   process's ranks' tensors into shared memory (:mod:`exogym.comm.mailbox`),
   announced in the run's store under a key made of the group, the step and
   the collective's number within that step. Collectives of different groups
   therefore never need to meet in the same order, and a rank that was away
   (and so skipped collectives) meets its peers again at the right one. A
   large reduction is split into one slice per process, each reducing its
   slice over every rank's tensor and posting it for the others.

Every reduction adds the ranks' tensors one by one in rank order
(:func:`exogym.comm.protocol.reduce_rows`), the order shared memory between
unpacked processes uses too, so a run's result does not depend on how its
ranks are packed, and every rank gets bitwise the same result. Tensors of any
size pass, in windows of at most :data:`WINDOW_BYTES` per rank, and of at most
:data:`POST_BYTES` for all the ranks of a process together: a process with
many ranks posts its part in more, smaller windows, so the shared memory it
holds does not grow with its ranks (512 ranks of a 235k-parameter model post
64 KiB each per window, not all of their 0.9 MiB at once).

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
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from exogym.base.blas_buffers import release_thread_buffers
from exogym.comm.mailbox import Mailbox
from exogym.comm.protocol import (
    Collectives,
    PeerTimeoutError,
    ReduceOp,
    copy_back,
    divided,
    reduce_rows,
    to_cpu,
)
from exogym.comm.store import ControlStore

log = logging.getLogger(__name__)

#: The most of each rank's tensor one cross-process exchange carries.
WINDOW_BYTES = 4 << 20
#: The most one process posts for one window of an exchange, all its ranks together.
POST_BYTES = 32 << 20
#: The least of each rank's tensor one window carries, however many ranks a process has.
MIN_WINDOW_BYTES = 16 << 10
#: A process of up to this many ranks lets each rank's thread keep its BLAS buffers (about
#: 4 MiB each with MKL) while others run; with more, a rank gives them back whenever it
#: hands its turn on. A fit decides from the machine's free memory instead
#: (:func:`exogym.run.memory.scratch_plan`, :attr:`PackedWorld.releases_scratch`).
BUFFERS_KEPT_UP_TO = 32
#: A reduction whose parts (over every rank) reach this many bytes is split into one
#: slice per process; a smaller one is reduced whole by every process.
SPLIT_BYTES = 1 << 20


def window_elements(rows: int, itemsize: int) -> int:
    """Elements of each rank's tensor one cross-process window carries when a process
    posts ``rows`` rows of them: :data:`WINDOW_BYTES` at most, fewer where ``rows`` of
    them would exceed :data:`POST_BYTES`, never under :data:`MIN_WINDOW_BYTES`."""
    per_row = min(WINDOW_BYTES, max(MIN_WINDOW_BYTES, POST_BYTES // max(1, rows)))
    return max(1, per_row // itemsize)


def process_ranks(world_size: int, processes: int, index: int) -> range:
    """The ranks process ``index`` of ``processes`` runs: a contiguous block, sizes within one."""
    return range(index * world_size // processes, (index + 1) * world_size // processes)


def process_of(world_size: int, processes: int, rank: int) -> int:
    """The process of ``processes`` that runs rank ``rank`` (:func:`process_ranks`)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of {world_size}")
    # The last process whose block starts at or before the rank: i * world // processes
    # <= rank exactly when i < (rank + 1) * processes / world.
    return ((rank + 1) * processes - 1) // world_size


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
        self.rng: tuple[Any, Any, Any, Any] | None = None  # saved while another rank runs
        self.asked_at = 0.0  # when it last asked for the baton
        self.aside_s = 0.0  # seconds it has let the others run while it waited
        self.inner_s: list[float] = []  # per timed block it is in: its inner blocks' seconds


class PackedTally:
    """What a packed process spent besides its ranks' own steps: counts and seconds.

    Written by the rank holding the baton only, so nothing here needs a lock.

    - ``turns``: a rank took the baton (to start, or after a wait);
    - ``hand_overs``: a rank gave it up to wait (at a collective, asleep);
    - ``scratch_releases``: a rank gave MKL's scratch back as it handed over
      (:data:`PackedWorld.releases_scratch`);
    - ``collectives``: meetings of the process's ranks that completed;
    - ``running_s``: some rank held the baton;
    - ``hand_over_s``: the baton was free while a rank waited for it (the system waking
      that rank's thread);
    - ``idle_s``: the baton was free and no rank of the process could run (every one
      waiting for peers in other processes);
    - ``scratch_s``: giving MKL's scratch back;
    - ``phases_s``: seconds the ranks spent in named parts of their run (start-up,
      evaluation, ...; ``exchange``: the rank acting for the process posting, reading
      and reducing parts of collectives across processes), their waits for others
      not included, nor a part within another (:meth:`PackedWorld.timed`).
    """

    COUNTS = ("turns", "hand_overs", "scratch_releases", "collectives")
    SECONDS = ("running_s", "hand_over_s", "idle_s", "scratch_s")

    def __init__(self) -> None:
        for name in self.COUNTS:
            setattr(self, name, 0)
        for name in self.SECONDS:
            setattr(self, name, 0.0)
        self.phases_s: dict[str, float] = {}
        self.freed_at = time.perf_counter()  # when the baton was last given up
        self.taken_at = self.freed_at  # when it was last taken

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in self.COUNTS + self.SECONDS}
        out["phases_s"] = dict(self.phases_s)
        return out

    @staticmethod
    def total(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The sum of several processes' :meth:`as_dict`."""
        out: dict[str, Any] = {name: sum(p.get(name, 0) for p in parts)
                               for name in PackedTally.COUNTS + PackedTally.SECONDS}
        phases: dict[str, float] = {}
        for part in parts:
            for name, seconds in (part.get("phases_s") or {}).items():
                phases[name] = phases.get(name, 0.0) + seconds
        out["phases_s"] = phases
        return out


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


class PackedWorld(Collectives):
    """The ranks of one process of a packed simulation, and their collectives.

    Created once per process before its rank threads start; each rank thread
    calls :meth:`sit` first and :meth:`stand` last.

    Args:
        world_size: ranks in the whole run.
        processes: processes the ranks are packed into.
        index: this process, ``0 <= index < processes``.
        open_store: opens a client of the run's rendezvous store (one per
            concurrent cross-process exchange; they are pooled); None for one process.
        timeout_s: how long a rank waits for its peers at a collective.
        run_id: names the run's shared-memory segments
            (:func:`exogym.comm.mailbox.new_run_id`); needed with several processes.
        namespace: prefix of the store keys this run uses.
        device: the device the process's ranks train on (default the CPU): on CUDA or
            MPS each rank's random state there is kept apart too, as on the CPU.
    """

    name = "packed ranks"

    def __init__(self, world_size: int, processes: int, index: int,
                 open_store: Callable[[], ControlStore] | None, timeout_s: float = 1800.0,
                 run_id: str | None = None, namespace: str = "exogym/packed",
                 device: torch.device | None = None):
        if not 0 <= index < processes <= world_size:
            raise ValueError(f"process {index} of {processes} for {world_size} ranks")
        self._world_size = world_size
        self.device = device or torch.device("cpu")
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
        self._here_group = PackedGroup(range(world_size), "h")  # meet_here's
        self._mailbox = Mailbox(run_id, index, timeout_s) if run_id is not None else None
        self._held: dict[Any, Any] = {}  # state every rank of the process shares (held_once)
        #: A rank that hands its turn on gives its BLAS (MKL) scratch back, to be taken again
        #: from the allocator at its next product: memory kept by no rank that waits, for
        #: a call that costs microseconds (see :data:`BUFFERS_KEPT_UP_TO`).
        self.releases_scratch = len(self.here) > BUFFERS_KEPT_UP_TO
        self.tally = PackedTally()

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
        if self.releases_scratch:
            self._give_scratch_back()  # its thread ends soon: the others need it sooner
        self._free_baton()

    def _seat(self) -> _Seat:
        seat = getattr(self._local, "seat", None)
        if seat is None:
            raise RuntimeError("this thread is no rank of the packed world (sit() first)")
        return seat

    def _take_baton(self, seat: _Seat) -> None:
        seat.asked_at = time.perf_counter()
        if not self._baton.acquire(timeout=self.timeout_s):
            raise PeerTimeoutError(f"rank {seat.rank}: waited {self.timeout_s:.0f} s for its turn "
                                   "to run (another rank of its process never gave it up)")
        tally = self.tally
        now = time.perf_counter()
        wanted = max(tally.freed_at, seat.asked_at)  # from then on a rank waited for it
        tally.idle_s += wanted - tally.freed_at
        tally.hand_over_s += now - wanted
        tally.taken_at = now
        tally.turns += 1
        previous = self._holder
        if previous is not seat:
            # The globals hold the previous runner's random state: keep it, put ours back.
            if previous is not None:
                previous.rng = (torch.get_rng_state(), random.getstate(), np.random.get_state(),
                                _accelerator_rng(self.device))
            if seat.rng is not None:
                torch.set_rng_state(seat.rng[0])
                random.setstate(seat.rng[1])
                np.random.set_state(seat.rng[2])
                _set_accelerator_rng(self.device, seat.rng[3])
            self._holder = seat

    def _free_baton(self) -> None:
        tally = self.tally
        tally.freed_at = time.perf_counter()
        tally.running_s += tally.freed_at - tally.taken_at
        self._baton.release()

    def _give_scratch_back(self) -> None:
        start = time.perf_counter()
        release_thread_buffers()
        self.tally.scratch_s += time.perf_counter() - start
        self.tally.scratch_releases += 1

    @contextmanager
    def _aside(self):
        """Let the process's other ranks run while this one waits."""
        seat = self._seat()
        if self.releases_scratch:
            self._give_scratch_back()  # the ranks that run meanwhile need none kept for it
        self.tally.hand_overs += 1
        self._free_baton()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._take_baton(seat)
            seat.aside_s += time.perf_counter() - start

    @contextmanager
    def timed(self, phase: str):
        """Add the calling rank's seconds in the block to ``phase`` of :attr:`tally`: not
        its waits for others, nor its seconds in a timed block within (those count as
        that block's phase)."""
        seat = self._seat()
        start, aside = time.perf_counter(), seat.aside_s
        seat.inner_s.append(0.0)
        try:
            yield
        finally:
            own = time.perf_counter() - start - (seat.aside_s - aside)
            inner = seat.inner_s.pop()
            if seat.inner_s:
                seat.inner_s[-1] += own
            phases = self.tally.phases_s
            phases[phase] = phases.get(phase, 0.0) + own - inner

    def sleep(self, seconds: float) -> None:
        """Sleep without holding up the other ranks of this process."""
        with self._aside():
            time.sleep(seconds)

    # -- membership ---------------------------------------------------------------------

    def rank(self) -> int:
        """The calling thread's rank."""
        return self._seat().rank

    def enter_step(self, step: int, members: Sequence[int] | None,
                   epoch: int | None = None) -> None:
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
        if not members or not all(0 <= r < self._world_size for r in members):
            raise ValueError(f"a group's ranks must lie in 0..{self._world_size - 1}, got {ranks!r}")
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
                self.tally.collectives += 1
                meeting.done.set()
        return meeting

    def meet_here(self, payload: Any,
                  complete: Callable[[dict[int, Any]], dict[int, Any]]) -> Any:
        """Hand ``payload`` to a meeting of this process's ranks present at the calling
        rank's step; the last to arrive runs ``complete(parts by rank)`` (holding the
        baton) and each rank gets its own entry of what it returns. Nothing crosses
        processes: stacked ranks (:mod:`exogym.run.stack`) compute this way."""
        def done(meeting: _Meeting, key: tuple[str, int, int]) -> None:
            results = complete({r: meeting.parts[r] for r in meeting.here})
            meeting.parts = results

        meeting = self._arrive(self._here_group, payload, done)
        self._wait(meeting)
        return meeting.parts[self._seat().rank]

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

    # -- the Collectives protocol: who, where ----------------------------------------

    @property
    def active(self) -> bool:
        return True

    def world_size(self) -> int:
        return self._world_size

    def new_group(self, ranks: Sequence[int]) -> PackedGroup:
        return self.group(ranks)

    def group_ranks(self, group: PackedGroup | None = None) -> list[int]:
        return list(self.members(group))

    def group_size(self, group: PackedGroup | None = None) -> int:
        return self.size(group)

    def pause(self, seconds: float) -> None:
        if seconds > 0:
            self.sleep(seconds)

    def held_once(self, key: Any, make: Callable[[], Any]) -> Any:
        with self._lock:
            found = self._held.get(key)
            if found is None:
                found = self._held[key] = make()
        return found

    def ranks_here(self) -> int:
        return len(self.here)

    # -- across processes ----------------------------------------------------------------

    def _processes(self, ranks: Sequence[int]) -> list[int]:
        return sorted({self._owner[r] for r in ranks})

    @contextmanager
    def _store(self):
        """A client of the run's store for one exchange (pooled: exchanges may overlap)."""
        if self._open_store is None or self._mailbox is None:
            raise RuntimeError("a collective spans processes, but this packed world has no "
                               "store and shared memory to meet through")
        with self._lock:
            store = self._stores.pop() if self._stores else None
        if store is None:
            store = self._open_store()
        try:
            yield store
        finally:
            with self._lock:
                self._stores.append(store)

    def _post(self, store: ControlStore, name: str, nbytes: int, readers: int):
        """A segment for this process's part of exchange ``name``, announced once filled."""
        mine = f"{name}/{self.index}"
        with self._lock:
            self._mailbox.reclaim(store)
            return self._mailbox.take(max(nbytes, 1), f"{name}/read/{self.index}", readers,
                                      (mine, mine + "/done"))

    def _read(self, store: ControlStore, name: str, process: int, suffix: str = "") -> torch.Tensor:
        def what() -> str:
            ranks = process_ranks(self._world_size, self.processes, process)
            return (f"rank {self._seat().rank}: the part of ranks {ranks.start}..{ranks.stop - 1} "
                    f"(process {process}) of collective {name}{suffix}")

        if suffix:
            if not store.wait([f"{name}/{process}{suffix}"], self.timeout_s):
                raise RuntimeError(what() + f": not ready within {self.timeout_s:.0f} s")
        return self._mailbox.read(store, f"{name}/{process}", what, process)

    def _exchange_name(self, key: tuple[str, int, int], lo: int) -> str:
        return f"{self.namespace}/{key[0]}/{key[1]}/{key[2]}/{lo}"

    def _reduce_across(self, key: tuple[str, int, int], meeting: _Meeting,
                       rows_of: Callable[[int, int, int], list[torch.Tensor]],
                       total: int, dtype: torch.dtype, op: Any,
                       deliver: Callable[[int, int, torch.Tensor], None]) -> None:
        """Reduce ``total`` elements over the present ranks, in rank order, window by window.

        ``rows_of(r, lo, hi)`` gives rank ``r``'s elements ``lo..hi`` (of this process's
        ranks) as pieces in order; ``deliver(lo, hi, values)`` takes the result.
        """
        present, here = meeting.present, meeting.here
        procs = self._processes(present)
        itemsize = torch.empty((), dtype=dtype).element_size()
        split_possible = len(procs) > 1
        window = window_elements(len(here) + split_possible, itemsize)
        place = {r: i for p in procs for i, r in
                 enumerate(r for r in present if self._owner[r] == p)}
        with self.timed("exchange"), self._store() as store:
            for lo in range(0, total, window):
                hi = min(total, lo + window)
                n = hi - lo
                name = self._exchange_name(key, lo)
                split = n * itemsize * len(present) >= SPLIT_BYTES and len(procs) > 1
                segment = self._post(store, name, (len(here) + split) * n * itemsize,
                                     len(procs) - 1)
                block = segment.data[:(len(here) + split) * n * itemsize].view(dtype)
                for i, r in enumerate(here):
                    at = i * n
                    for piece in rows_of(r, lo, hi):
                        block[at:at + piece.numel()].copy_(piece)
                        at += piece.numel()
                Mailbox.announce(store, f"{name}/{self.index}", segment, 0,
                                 (len(here) + split) * n * itemsize)
                views = {}
                with self._aside():
                    for p in procs:
                        if p != self.index:
                            views[p] = self._read(store, name, p).view(dtype)

                def row(r: int, block: torch.Tensor = block, views: dict = views,
                        n: int = n) -> torch.Tensor:
                    p = self._owner[r]
                    base = block if p == self.index else views[p]
                    return base[place[r] * n:(place[r] + 1) * n]

                out = torch.empty(n, dtype=dtype)
                if split:
                    bounds = [n * i // len(procs) for i in range(len(procs) + 1)]
                    me = procs.index(self.index)
                    a, b = bounds[me], bounds[me + 1]
                    mine = block[len(here) * n:len(here) * n + n]
                    reduce_rows([row(r)[a:b] for r in present], mine[a:b], op)
                    store.set(f"{name}/{self.index}/done", "1")
                    out[a:b].copy_(mine[a:b])
                    with self._aside():
                        for i, p in enumerate(procs):
                            if p == self.index:
                                continue
                            theirs = self._read(store, name, p, "/done").view(dtype)
                            start = sum(1 for r in present if self._owner[r] == p) * n
                            out[bounds[i]:bounds[i + 1]].copy_(
                                theirs[start + bounds[i]:start + bounds[i + 1]])
                else:
                    reduce_rows([row(r) for r in present], out, op)
                for p in views:
                    store.add(f"{name}/read/{p}", 1)
                with self._lock:
                    Mailbox.release(segment)
                deliver(lo, hi, out)

    def _gather_across(self, key: tuple[str, int, int], meeting: _Meeting,
                       sources: dict[int, torch.Tensor], numel: int, dtype: torch.dtype,
                       only: int | None = None) -> dict[int, list[torch.Tensor]]:
        """Every present rank's elements (or rank ``only``'s), window by window: by rank,
        the views of each window (valid until the next exchange of the same process)."""
        present, here = meeting.present, meeting.here
        wanted = [only] if only is not None else list(present)
        procs = self._processes(present)
        sending = [r for r in here if r in wanted]
        readers = len(procs) - 1 if only is None or self._owner[only] == self.index else 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        window = window_elements(len(sending), itemsize)
        got: dict[int, list[torch.Tensor]] = {r: [] for r in wanted}
        with self.timed("exchange"), self._store() as store:
            for lo in range(0, numel, window):
                hi = min(numel, lo + window)
                n = hi - lo
                name = self._exchange_name(key, lo)
                if sending:
                    segment = self._post(store, name, len(sending) * n * itemsize, readers)
                    block = segment.data[:len(sending) * n * itemsize].view(dtype)
                    for i, r in enumerate(sending):
                        block[i * n:(i + 1) * n].copy_(sources[r].reshape(-1)[lo:hi])
                        got[r].append(sources[r].reshape(-1)[lo:hi])
                    Mailbox.announce(store, f"{name}/{self.index}", segment, 0,
                                     len(sending) * n * itemsize)
                with self._aside():
                    for p in procs:
                        theirs = [r for r in wanted if self._owner[r] == p]
                        if p == self.index or not theirs:
                            continue
                        view = self._read(store, name, p).view(dtype)
                        for i, r in enumerate(theirs):
                            got[r].append(view[i * n:(i + 1) * n].clone())
                        store.add(f"{name}/read/{p}", 1)
                if sending:
                    with self._lock:
                        Mailbox.release(segment)
        return got

    # -- collectives ----------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: PackedGroup | None = None,
                   async_op: bool = False):
        """Reduce ``tensor`` in place across the present members of ``group``."""
        return self.all_reduce_many([tensor], op, group, None, None, async_op)

    def all_reduce_many(self, tensors: Sequence[torch.Tensor], op: Any = None,
                        group: PackedGroup | None = None, divide_by: float | None = None,
                        wire_dtype: torch.dtype | None = None, async_op: bool = False):
        """Reduce each of ``tensors`` in place across the present members of ``group``, as
        one collective (a bucket of :func:`exogym.comm.all_reduce_tensors`), in
        ``wire_dtype`` if given, then divide by ``divide_by`` if given."""
        op = ReduceOp.SUM if op is None else op

        def complete(meeting: _Meeting, key: tuple[str, int, int]) -> None:
            lists = {r: [t.detach() for t in meeting.parts[r]] for r in meeting.here}
            like = lists[meeting.here[0]]
            own = like[0].dtype
            dtype = wire_dtype or own
            flats = {r: [t.reshape(-1) for t in ts] for r, ts in lists.items()}
            offsets = [0]
            for t in like:
                offsets.append(offsets[-1] + t.numel())

            def pieces(r: int, lo: int, hi: int) -> list[torch.Tensor]:
                out = []
                for j, flat in enumerate(flats[r]):
                    a, b = max(lo, offsets[j]), min(hi, offsets[j + 1])
                    if a < b:
                        out.append(flat[a - offsets[j]:b - offsets[j]])
                return out

            def deliver(lo: int, hi: int, values: torch.Tensor) -> None:
                if op == ReduceOp.AVG:
                    values = divided(values, len(meeting.present))
                if divide_by is not None:
                    if dtype == own:
                        values = divided(values, divide_by)
                    else:
                        values = divided(values.to(own), divide_by)
                for r in meeting.here:
                    at = 0
                    for j, target in enumerate(lists[r]):
                        a, b = max(lo, offsets[j]), min(hi, offsets[j + 1])
                        if a < b:
                            _write(target, a - offsets[j], values[at:at + b - a])
                            at += b - a

            if len(self._processes(meeting.present)) == 1:
                # Every rank here: reduce tensor by tensor, straight from the ranks' own.
                for j in range(len(like)):
                    values = torch.empty(like[j].numel(), dtype=dtype, device=like[j].device)
                    parts = [flats[r][j] if dtype == own else flats[r][j].to(dtype)
                             for r in meeting.present]
                    reduce_rows(parts, values, op)
                    deliver(offsets[j], offsets[j + 1], values)
                return
            self._reduce_across(key, meeting, pieces, offsets[-1], dtype, op, deliver)

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
            sources = {r: meeting.parts[r][1].detach() for r in meeting.here}
            like = sources[meeting.here[0]]
            if len(self._processes(meeting.present)) == 1:
                values = {r: [sources[r].reshape(-1)] for r in meeting.present}
            else:
                values = self._gather_across(key, meeting, sources, like.numel(), like.dtype)
            for r in meeting.here:
                for out, source_rank in zip(meeting.parts[r][0], meeting.present):
                    at = 0
                    for piece in values[source_rank]:
                        _write(out, at, piece)
                        at += piece.numel()

        return self._finish(self._arrive(group, (tensor_list, tensor), complete), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: PackedGroup | None = None,
                  async_op: bool = False):
        """Rank ``src``'s ``tensor`` into every present member's ``tensor``."""
        group = group or self.world
        if src not in self.members(group):
            raise ValueError(f"broadcast from rank {src}, which is not a present member of "
                             f"ranks {list(self.members(group))}")

        def complete(meeting: _Meeting, key: tuple[str, int, int]) -> None:
            if self._owner[src] == self.index:
                values = [meeting.parts[src].detach().reshape(-1)]
                if len(self._processes(meeting.present)) > 1:
                    self._gather_across(key, meeting, {src: meeting.parts[src].detach()},
                                        tensor.numel(), tensor.dtype, only=src)
            else:
                values = self._gather_across(key, meeting, {}, tensor.numel(), tensor.dtype,
                                             only=src)[src]
            for r in meeting.here:
                if r == src:
                    continue
                at = 0
                for piece in values:
                    _write(meeting.parts[r], at, piece)
                    at += piece.numel()

        return self._finish(self._arrive(group, tensor, complete), async_op)

    def barrier(self, group: PackedGroup | None = None) -> None:
        """Wait until every present member of ``group`` has reached this point."""
        self.all_reduce(torch.zeros(1), group=group or self.side)

    def latest(self, value: float, group: PackedGroup | None = None) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        self.all_reduce(t, ReduceOp.MAX, group)
        return float(t.item())

    # -- the side channel ------------------------------------------------------------------

    def side_size(self) -> int:
        return self.size(self.side)

    def side_all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        staged = to_cpu(tensor)
        self.all_reduce(staged, op, self.side)
        copy_back(tensor, staged)

    def side_broadcast(self, tensor: torch.Tensor, src: int,
                       ranks: Sequence[int] | None = None) -> None:
        staged = to_cpu(tensor)
        self.broadcast(staged, src, self.side if ranks is None else self.group(ranks, side=True))
        copy_back(tensor, staged)

    def side_all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
        staged_out = [to_cpu(t) for t in tensor_list]
        self.all_gather(staged_out, to_cpu(tensor), self.side)
        for target, staged in zip(tensor_list, staged_out):
            copy_back(target, staged)

    def side_barrier(self) -> None:
        self.barrier(self.side)

    def close(self) -> None:
        """Leave the world: once the other processes have read this one's last parts (up
        to the world's timeout), remove its shared memory."""
        if self._mailbox is None:
            return
        try:
            if self._open_store is not None and self._mailbox.busy:
                with self._store() as store:
                    unread = self._mailbox.drain(store, self.timeout_s)
                if unread:
                    log.warning("process %d leaves with parts not yet read by every peer "
                                "after %.0f s: %s", self.index, self.timeout_s,
                                ", ".join(unread[:4]))
        except (OSError, RuntimeError) as exc:  # the store is gone: nobody reads any more
            log.debug("process %d: no store to wait for readers on: %s", self.index, exc)
        finally:
            self._mailbox.close()


def _accelerator_rng(device: torch.device) -> torch.Tensor | None:
    """The random state of ``device`` when it is an accelerator (None on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    if device.type == "mps":
        return torch.mps.get_rng_state()
    return None


def _set_accelerator_rng(device: torch.device, state: torch.Tensor | None) -> None:
    if state is None:
        return
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    elif device.type == "mps":
        torch.mps.set_rng_state(state)


def _write(target: torch.Tensor, at: int, values: torch.Tensor) -> None:
    """Copy ``values`` into the flat elements ``at..`` of ``target`` (any layout)."""
    if target.is_contiguous():
        target.view(-1)[at:at + values.numel()].copy_(values)
    else:
        flat = target.reshape(-1)
        flat[at:at + values.numel()].copy_(values)
        target.copy_(flat.view_as(target))
