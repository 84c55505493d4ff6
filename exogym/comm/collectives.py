"""Collectives for training traffic, with byte counters, and the side channel.

Every byte a strategy sends goes through this module, so its counters are the
ground truth for ``comm_bytes``. A rank "sends" the payload it passes to a
collective: ``numel * element_size`` of its tensor (for ``all_gather``, of its
own contribution). Protocol overhead is not counted.

The tensors travel on one **backend** (:mod:`exogym.comm.protocol`), chosen once
when a rank starts (:func:`use_backend`): ``torch.distributed`` across hosts,
shared memory between the processes of a simulation, several ranks packed in
one process, groups re-formed as hosts come and go, or mirrored collectives
that send nothing. This module counts, charges the simulated clock, buckets
and quantizes; the backend only moves tensors. Only the backends call
``torch.distributed``; the rendezvous store carries control messages only
(:mod:`exogym.comm.store`).

What happens here so that strategies need not care:

- **Bucketing.** :func:`all_reduce_tensors` groups many small tensors into a few
  buckets, so a model with hundreds of tensors costs a few calls.
- **Precision.** ``dtype=`` makes values travel in a narrower type (bf16, fp16);
  bytes are counted in that type while the model keeps its own precision.
- **Quantization.** ``dtype='int8'``, ``'float8_e4m3fn'``, ``'int4'`` or ``'int2'``
  quantizes each bucket with a float32 scale per chunk (:mod:`exogym.comm.quantize`);
  the packed payloads are all-gathered and every rank dequantizes and sums them
  in float32, in rank order, so every rank ends with bitwise the same result.
- **Asynchrony.** ``all_reduce_tensors(..., async_op=True)`` returns a handle at
  once; its ``wait()`` leaves the result in the tensors. Bytes are counted when
  a collective starts.
- **Progress.** Each rank's collective in flight (its payload, the bytes of it done
  so far, since when) is readable from another thread (:func:`link_progress`,
  :mod:`exogym.comm.in_flight`): it advances as each bucket completes.

When no process group is joined (a strategy used outside a trainer) the
collectives act as a world of one: nothing moves and nothing is counted.

**The side channel** (``side_all_reduce``, ``side_broadcast``,
``side_all_gather``, ``side_barrier``) carries what is not training:
evaluation, model averaging, agreement between ranks, barriers, the state
handed to a rank that rejoins. It is never counted, so ``comm_bytes`` stays the
strategy's own traffic. Outside a process group, or with one rank, it acts as
a world of one.

``EXOGYM_COLLECTIVES`` chooses how a simulation's training collectives
travel: unset (or ``auto``), its CPU ranks meet in shared memory; ``torch``
sends everything through ``torch.distributed``; ``mirror`` sends nothing
(:mod:`exogym.comm.mirror`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from exogym.comm import quantize as quant
from exogym.comm.in_flight import LinkProgress
from exogym.comm.mirror import Mirror
from exogym.comm.protocol import (
    MODE_ENV as MODE_ENV,
)
from exogym.comm.protocol import (
    MODES as MODES,
)
from exogym.comm.protocol import (
    Collectives,
    DoneWork,
    ThenWork,
)
from exogym.comm.protocol import (
    PeerLost as PeerLost,
)
from exogym.comm.protocol import (
    PeerTimeoutError as PeerTimeoutError,
)
from exogym.comm.protocol import (
    RankDropped as RankDropped,
)
from exogym.comm.protocol import (
    ReduceOp as ReduceOp,
)
from exogym.comm.protocol import (
    collectives_mode as collectives_mode,
)
from exogym.comm.protocol import (
    is_connection_error as is_connection_error,
)
from exogym.comm.store import (
    MAX_VALUE_BYTES as MAX_VALUE_BYTES,
)
from exogym.comm.store import (
    ControlStore,
)
from exogym.comm.store import (
    ControlValueTooLarge as ControlValueTooLarge,
)
from exogym.comm.store import (
    beat_news as beat_news,
)
from exogym.comm.store import (
    next_beat as next_beat,
)
from exogym.comm.store import (
    open_store as open_store,
)
from exogym.comm.store import (
    read_beat as read_beat,
)
from exogym.comm.store import (
    store_round_trips as store_round_trips,
)
from exogym.comm.wire import (  # the planner reads the same numbers
    BUCKET_BYTES,
    QUANT_CHUNK,
    is_quantized,
    quantized_payload_bytes,
)

# The public names are listed once, in exogym.comm's __all__; the names imported above
# ``as`` themselves are re-exported there.

_backend: Collectives = Collectives()  # a world of one until a rank joins its transport
_torch_identity = (dist.get_rank, dist.get_world_size, dist.is_initialized)


class _RankState(threading.local):
    """What belongs to one rank rather than to the process: its counters and clock.

    Thread-local, so that the ranks a packed process runs as threads each keep
    their own; a process with one rank has one.

    ``clock`` is the simulated clock (``fit(network=...)``), ``clock_batch`` the
    collectives of one ``all_reduce_tensors`` call charged together,
    ``wall_s``/``cpu_s`` the time spent inside counted collectives (wall, and
    this thread's CPU), which a step's compute time leaves out, and ``progress``
    the collectives in flight, for another thread to read (:func:`link_progress`).
    """

    bytes_sent = 0
    calls = 0
    clock = None
    clock_batch: list[tuple[str, int]] | None = None
    depth = 0
    wall_s = 0.0
    cpu_s = 0.0
    progress: LinkProgress | None = None


_rs = _RankState()


# -- the backend ---------------------------------------------------------------------


def use_backend(chosen: Collectives | None) -> Collectives:
    """Carry every collective of this process on ``chosen`` (None: a world of one).

    Returns the backend it replaces (not closed). Code that asks ``torch.distributed``
    its rank gets this rank's answer inside :func:`torch_identity`.
    """
    global _backend
    previous = _backend
    _backend = chosen if chosen is not None else Collectives()
    return previous


def _is_shm(chosen: Collectives) -> bool:
    from exogym.comm.shared_memory import SharedMemoryBackend

    return isinstance(chosen, SharedMemoryBackend)


def _stands_in_for_torch() -> Collectives | None:
    """The backend, when it answers for ranks torch knows nothing of (packed ranks, hosts
    that come and go); None where torch's own answers hold (a process group, or none)."""
    from exogym.comm.torch_group import TorchGroup

    inner = _backend.inner if isinstance(_backend, Mirror) else _backend
    if _is_shm(inner):
        inner = inner.fallback  # shared memory over a process group: that group's answers
    if isinstance(inner, TorchGroup) or not _backend.active:
        return None
    return _backend


_assumed = threading.local()  # torch_identity(rank, world_size): answers given outright


def _answer_for_torch(which: int, group: Any) -> int:
    """``torch.distributed``'s rank (``which`` 0) or world size (1) for the calling rank."""
    if group is None or group is dist.group.WORLD:
        assumed = getattr(_assumed, "identity", None)
        if assumed is not None:
            return assumed[which]
        chosen = _stands_in_for_torch()
        if chosen is not None:
            return chosen.rank() if which == 0 else chosen.world_size()
    ask = _torch_identity[which]
    return ask() if group is None else ask(group)


def _rank_for_torch(group: Any = None) -> int:
    return _answer_for_torch(0, group)


def _world_size_for_torch(group: Any = None) -> int:
    return _answer_for_torch(1, group)


def _initialized_for_torch() -> bool:
    return getattr(_assumed, "identity", None) is not None \
        or _stands_in_for_torch() is not None or _torch_identity[2]()


_identity_holders = 0
_identity_lock = threading.Lock()


@contextlib.contextmanager
def torch_identity(rank: int | None = None, world_size: int | None = None) -> Iterator[None]:
    """Inside it, ``torch.distributed.get_rank()``, ``get_world_size()`` and
    ``is_initialized()`` answer for the calling rank where this process's collectives
    are not a ``torch.distributed`` process group (ranks packed in a process, hosts that
    come and go): for code written against ``torch.distributed``.

    The trainer enters it around a model's forward pass (a model may ask its rank) and
    for the whole run of a strategy that is not built into exogym (one written for exo
    gym asks in ``_init_node`` and ``step``); built-in strategies run without it: their
    rank comes from their :class:`~exogym.strategy.context.RankContext`. Outside it
    torch's own functions are in place. It nests, and threads may hold it at once.

    Args:
        rank, world_size: answer these for the calling thread instead (a strategy set up
            outside any group, as for counting its memory); None: the backend's answers.
    """
    global _identity_holders
    previous = getattr(_assumed, "identity", None)
    if rank is not None and world_size is not None:
        _assumed.identity = (rank, world_size)
    with _identity_lock:
        _identity_holders += 1
        if _identity_holders == 1:
            dist.get_rank, dist.get_world_size, dist.is_initialized = (
                _rank_for_torch, _world_size_for_torch, _initialized_for_torch)
    try:
        yield
    finally:
        _assumed.identity = previous
        with _identity_lock:
            _identity_holders -= 1
            if _identity_holders == 0:
                dist.get_rank, dist.get_world_size, dist.is_initialized = _torch_identity


def backend() -> Collectives:
    """The backend this process's collectives travel on."""
    return _backend


def init_process_group(store: ControlStore, rank: int, world_size: int, backend: str,
                       timeout_s: float, device: torch.device | None = None) -> None:
    """Join a ``torch.distributed`` process group through ``store`` and carry the
    collectives on it (a mirrored world stays mirrored, over the new group).

    Args:
        store: from :func:`open_store`.
        rank, world_size: this rank and the number of ranks.
        backend: ``'gloo'`` or ``'nccl'``.
        timeout_s: how long a collective waits for a peer.
        device: this rank's GPU (nccl binds to it).
    """
    from exogym.comm.torch_group import TorchGroup

    group = TorchGroup(store, rank, world_size, backend, timeout_s, device)
    if isinstance(_backend, Mirror):
        use_backend(Mirror(group, _backend.mirror_world))
    else:
        use_backend(group)


def destroy_process_group() -> None:
    """Leave the transport; collectives act as a world of one again."""
    previous = use_backend(None)
    previous.close()


def use_local_collectives(local: Any) -> None:
    """Carry the world's CPU collectives through ``local`` (shared memory, bound to this
    rank) over the current process group; None: the process group alone."""
    from exogym.comm.shared_memory import SharedMemoryBackend

    current = _backend
    if isinstance(current, SharedMemoryBackend):
        current.drain(raise_errors=False)
        current = current.fallback
    use_backend(current if local is None else SharedMemoryBackend(local, current))


def use_mirror_collectives(on: bool, world_size: int | None = None) -> None:
    """Make every collective act as if each peer held this rank's tensors; nothing is sent.

    See :mod:`exogym.comm.mirror`.

    Args:
        on: mirror the collectives, or stop.
        world_size: the ranks of the mirrored world (default: the process group's size).
    """
    current = _backend.inner if isinstance(_backend, Mirror) else _backend
    use_backend(Mirror(current, world_size) if on else current)


def use_packed_world(world: Any) -> None:
    """Carry every collective of this process on ``world``, an
    :class:`exogym.comm.packed.PackedWorld` whose ranks are this process's threads."""
    use_backend(world)


def is_initialized() -> bool:
    """True inside a process group (or its stand-in)."""
    return _backend.active


def nccl_available() -> bool:
    """True when this torch can join ranks with nccl."""
    return dist.is_available() and dist.is_nccl_available()


def new_group(ranks: Sequence[int]) -> Any:
    """A group of ``ranks`` for training collectives.

    Collective over the world: every rank creates every group, in the same
    order, whether it belongs to it or not.
    """
    return _backend.new_group(ranks)


def group_size(group: Any = None) -> int:
    """Ranks in ``group`` (default: the world) as the collectives see them; 1 outside a group."""
    if not _backend.active:
        return 1
    return _backend.group_size(group)


def enter_step(step: int, members: Sequence[int] | None = None, epoch: int | None = None) -> None:
    """This rank is at ``step``, where ``members`` are the ranks present (None: every rank).

    Collectives then meet among the present ranks only (a run where ranks leave
    and rejoin, :mod:`exogym.membership.simulated`). Only backends whose ranks may be
    away (packed ranks, hosts that come and go) take a ``members`` that leaves a
    rank out. ``epoch``: the step at which this membership began (hosts that come
    and go form a new group for each).
    """
    if _backend.active:
        _backend.enter_step(step, members, epoch)


def present_ranks(group: Any = None) -> list[int]:
    """The ranks of ``group`` (default: the world) present at this rank's step."""
    if not _backend.active:
        return [0]
    return _backend.group_ranks(group)


def held_once(key: Any, make: Callable[[], Any]) -> Any:
    """State that is identical on every rank this process runs, held once for them all.

    Ranks packed in a process (:mod:`exogym.comm.packed`) get the one object the
    first of them made with ``make()``; a process with one rank gets its own. A
    strategy keeps there what every rank provably holds the same (DiLoCo's outer
    parameters and outer optimizer), so memory grows with the ranks by less than a
    copy of the training state each.
    """
    return _backend.held_once(key, make)


def ranks_here() -> int:
    """How many ranks this process runs: more than one where ranks are packed
    (:mod:`exogym.comm.packed`), and each may hold a collective's buffers at once."""
    return _backend.ranks_here()


def timed(phase: str) -> contextlib.AbstractContextManager[None]:
    """The calling rank's seconds in the block, its waits for others not included, counted
    as ``phase`` of its process's account where ranks are packed (``summary['packed']``,
    :class:`exogym.comm.packed.PackedTally`); elsewhere nothing."""
    return _backend.timed(phase)


def pause(seconds: float) -> None:
    """Sleep ``seconds`` without holding up other ranks that share this process."""
    if seconds > 0:
        _backend.pause(seconds)


# -- counters --------------------------------------------------------------------------


def comm_bytes() -> int:
    """Payload bytes this rank has passed to counted collectives so far."""
    return _rs.bytes_sent


def comm_calls() -> int:
    """Number of counted collective calls so far."""
    return _rs.calls


def reset_counters() -> None:
    """Zero the byte and call counters (a rank does this before training)."""
    _rs.bytes_sent = 0
    _rs.calls = 0
    link_progress().restart_count(0)


def restore_counters(bytes_sent: int, calls: int) -> None:
    """Set the byte and call counters (a rank resuming from a checkpoint)."""
    _rs.bytes_sent = int(bytes_sent)
    _rs.calls = int(calls)
    link_progress().restart_count(bytes_sent)


def link_progress() -> LinkProgress:
    """This rank's collectives in flight: payload, bytes done, since when
    (:mod:`exogym.comm.in_flight`).

    Call it on the rank's own thread (each rank of a packed process has its own) and
    hand the object to the thread that reads it; reading it never blocks the rank.
    """
    rs = _rs
    if rs.progress is None:
        rs.progress = LinkProgress()
    return rs.progress


def _followed(nbytes: int, call: Callable[[], Any]) -> Any:
    """``call()``, a blocking collective of ``nbytes``, as one piece of this rank's progress."""
    progress = link_progress()
    token = progress.begin(nbytes)
    try:
        result = call()
        progress.advance(token, nbytes)
        return result
    finally:
        progress.end(token)


def _count(nbytes: int, kind: str, group: Any) -> None:
    """Count one collective's payload, and charge it to the simulated clock if there is one."""
    rs = _rs
    rs.bytes_sent += int(nbytes)
    rs.calls += 1
    if rs.clock is None:
        return
    if rs.clock_batch is not None:
        rs.clock_batch.append((kind, int(nbytes)))
        return
    start = _latest_arrival(group)
    rs.clock.finish_at(start + rs.clock.collective_s(kind, nbytes, _group_ranks(group)))


# -- the simulated clock ---------------------------------------------------------------


def use_clock(clock: Any) -> None:
    """Charge every training collective of this rank to ``clock`` (an
    :class:`exogym.sim.clock.SimClock`); None: no simulated time."""
    _rs.clock = clock
    _rs.wall_s = _rs.cpu_s = 0.0


def collective_time() -> tuple[float, float]:
    """Seconds this rank has spent inside counted collectives: (wall, this thread's CPU).

    Kept always: a step's compute time leaves them out, for the simulated clock
    (:func:`use_clock`, which starts them again from 0) and for ``fit(balance=...)``,
    whose fast ranks would otherwise count their wait for a slow one as their own work.
    """
    return _rs.wall_s, _rs.cpu_s


_inside: list[Any] = [None, 0.0]  # what this process's rank waits in now, and since when


def waiting() -> tuple[str, float] | None:
    """What this process's rank is waiting in now, and for how many seconds (None: it is
    not inside a collective). Read by a rank's heartbeat thread, which reports a long wait."""
    what, since = _inside
    if what is None:
        return None
    detail = getattr(_backend, "waiting_for", None)
    return (f"{what}: {detail}" if detail else what), time.monotonic() - since


class _Timed:
    """Adds the time spent inside the outermost counted collective to the totals above,
    and says what the rank waits in meanwhile (:func:`waiting`).

    Args:
        what: the collective, in words (for :func:`waiting`).
    """

    wall = cpu = None

    def __init__(self, what: str = "a collective"):
        self.what = what

    def __enter__(self) -> None:
        rs = _rs
        rs.depth += 1
        if rs.depth == 1:
            self.wall, self.cpu = time.perf_counter(), time.thread_time()
            _inside[:] = [self.what, time.monotonic()]

    def __exit__(self, *exc: object) -> None:
        rs = _rs
        rs.depth -= 1
        if rs.depth == 0 and self.wall is not None:
            rs.wall_s += time.perf_counter() - self.wall
            rs.cpu_s += time.thread_time() - self.cpu
            _inside[0] = None


def _mib(tensor: torch.Tensor) -> str:
    return f"{tensor.numel() * tensor.element_size() / 2**20:.1f} MiB"


def _group_ranks(group: Any) -> list[int]:
    return _backend.group_ranks(group) if _backend.active else [0]


def _latest_arrival(group: Any) -> float:
    """The latest clock among the ranks of ``group``: when a collective among them can start."""
    now = _rs.clock.now
    if not _backend.active or _backend.group_size(group) <= 1:
        return now
    return _backend.latest(now, group)


# -- training collectives (counted) ----------------------------------------------------


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False):
    """All-reduce ``tensor`` in place (default op: SUM); counts its payload bytes."""
    if not _backend.active:
        return DoneWork() if async_op else None
    nbytes = tensor.numel() * tensor.element_size()
    with _Timed(f"an all-reduce of {_mib(tensor)}"):
        _count(nbytes, "all_reduce", group)
        if async_op:
            return _backend.all_reduce(tensor, op, group, async_op)
        return _followed(nbytes, lambda: _backend.all_reduce(tensor, op, group, async_op))


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False):
    """Broadcast ``tensor`` from global rank ``src`` in place; counts its payload bytes."""
    if not _backend.active:
        return DoneWork() if async_op else None
    nbytes = tensor.numel() * tensor.element_size()
    with _Timed(f"a broadcast of {_mib(tensor)} from rank {src}"):
        _count(nbytes, "broadcast", group)
        if async_op:
            return _backend.broadcast(tensor, src, group, async_op)
        return _followed(nbytes, lambda: _backend.broadcast(tensor, src, group, async_op))


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False):
    """Gather every rank's ``tensor`` into ``tensor_list``; counts this rank's payload."""
    if not _backend.active:
        tensor_list[0].copy_(tensor)
        return DoneWork() if async_op else None
    nbytes = tensor.numel() * tensor.element_size()
    with _Timed(f"an all-gather of {_mib(tensor)}"):
        _count(nbytes, "all_gather", group)
        if async_op:
            return _backend.all_gather(tensor_list, tensor, group, async_op)
        return _followed(nbytes, lambda: _backend.all_gather(tensor_list, tensor, group,
                                                             async_op))


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str | None:
    """The type values travel in: a torch dtype, a quantized type's name, or None.

    ``'bfloat16'``/``torch.bfloat16`` give ``torch.bfloat16``; ``'int8'``,
    ``'float8_e4m3fn'``, ``'int4'`` and ``'int2'`` give their name (quantized per
    chunk, see :mod:`exogym.comm.quantize`); None keeps each tensor's own type.

    Raises:
        ValueError: for any other name, listing the accepted ones.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if is_quantized(dtype):
        return str(dtype).lower()
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(
            "comm_dtype must be one of 'float32', 'bfloat16', 'float16' or a quantized "
            f"type {', '.join(repr(d) for d in quant.DTYPES)}, got {dtype!r}"
        ) from None


def runs_within(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Positions of ``sizes`` in runs of consecutive ones totalling at most ``limit`` (a
    larger one alone)."""
    runs: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if current and total + size > limit:
            runs.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        runs.append(current)
    return runs


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Group tensor indices by (device, dtype) into runs of at most ``bucket_bytes``."""
    by_key: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        by_key.setdefault((t.device, t.dtype), []).append(i)
    buckets: list[list[int]] = []
    for indices in by_key.values():
        sizes = [tensors[i].numel() * tensors[i].element_size() for i in indices]
        buckets.extend([indices[j] for j in run] for run in runs_within(sizes, bucket_bytes))
    return buckets


class _Round:
    """The handle of :func:`all_reduce_tensors`: one handle per bucket, waited for in order.

    Args:
        progress: the rank's progress the round is followed in, with its ``token``
            (None: not followed); the round ends there when waited for.
    """

    def __init__(self, progress: LinkProgress | None = None, token: int = 0):
        self._works: list[tuple[Any, int]] = []  # a bucket's handle, and its payload
        self._done = False
        self.sim_done: float | None = None  # when it ends on the simulated clock
        self.progress = progress
        self.token = token

    def add(self, work: Any, payload: int = 0) -> None:
        """A bucket's handle; ``payload``: its bytes, done once it is waited for (0: the
        bucket has completed already, or is not followed)."""
        if work is not None or payload:
            self._works.append((work, payload))

    def wait(self, timeout: Any = None) -> bool:
        """Block until every bucket has arrived; the tensors then hold the result."""
        if not self._done:
            try:
                with _Timed("an all-reduce started earlier"):
                    for work, payload in self._works:
                        if work is not None:
                            work.wait()
                        if payload and self.progress is not None:
                            self.progress.advance(self.token, payload)
            finally:
                if self.progress is not None:
                    self.progress.end(self.token)
            self._done = True
            if self.sim_done is not None and _rs.clock is not None:
                _rs.clock.finish_at(self.sim_done)
        return True

    def is_completed(self) -> bool:
        """True when :meth:`wait` would not block."""
        return self._done or all(work.is_completed() for work in self._works)


def _rank() -> int:
    return _backend.rank() if _backend.active else 0


def _rounding_generator(device: torch.device) -> torch.Generator:
    """A generator seeded by this rank and its count of collectives so far.

    Stochastic rounding then differs between ranks and rounds, leaves torch's
    default generator (data order, dropout) alone, and repeats after a resume
    from a checkpoint, which restores the counters.
    """
    return torch.Generator(device=device).manual_seed(1_000_003 * (_rank() + 1) + _rs.calls)


def _split_into(flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in targets:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def _quantized_bucket(members: list[torch.Tensor], residuals: list[torch.Tensor] | None,
                      dtype: str, chunk: int, rounding: str, group: Any,
                      divide_by: float | None, async_op: bool) -> Any:
    """Quantize one bucket now; gather every rank's payload; dequantize and sum at the end."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in members])
    if residuals is not None:
        flat += torch.cat([r.detach().reshape(-1).float() for r in residuals])
    generator = _rounding_generator(flat.device) if rounding == "stochastic" else None
    q = quant.quantize(flat, dtype, chunk, rounding, generator)
    if residuals is not None:
        _split_into(flat - quant.dequantize(q), residuals)
    wire = quant.to_bytes(q)
    _count(wire.numel(), "all_gather", group)
    gathered = [torch.empty_like(wire) for _ in range(group_size(group))]

    def finish() -> None:
        total = torch.zeros(q.numel, dtype=torch.float32, device=flat.device)
        for part in gathered:  # rank order: bitwise the same sum on every rank
            total += quant.dequantize(quant.from_bytes(part, q.numel, dtype, chunk))
        if divide_by is not None:
            total.div_(divide_by)
        _split_into(total, members)

    return ThenWork(_backend.all_gather(gathered, wire, group, async_op=async_op), finish)


def all_reduce_tensors(
    tensors: Iterable[torch.Tensor],
    op: Any = None,
    group: Any = None,
    average: bool = False,
    dtype: str | torch.dtype | None = None,
    world_size: int | None = None,
    bucket_bytes: int = BUCKET_BYTES,
    *,
    chunk: int = QUANT_CHUNK,
    rounding: str = "nearest",
    error_feedback: list[torch.Tensor] | None = None,
    async_op: bool = False,
):
    """All-reduce many tensors in place with a few bucketed calls.

    With a float ``dtype`` (or None) each bucket is one all-reduce. With a
    quantized ``dtype`` (``'int8'``, ``'float8_e4m3fn'``, ``'int4'``, ``'int2'``)
    each bucket is flattened to float32, quantized with a float32 scale per
    ``chunk`` values (:mod:`exogym.comm.quantize`) and **all-gathered**; every rank
    then dequantizes the payloads and sums them in float32, in rank order, so
    every rank holds bitwise the same result. A rank's counted bytes are its own
    payload, packed values and scales: ``exogym.comm.quantize.payload_bytes(numel)``
    per bucket.

    Args:
        tensors: tensors to reduce in place (any mix of shapes; grouped by device and dtype).
        op: reduce op, SUM by default (the only one a quantized ``dtype`` takes).
        group: process group, the world by default.
        average: divide the sum by the number of ranks in ``group`` (or ``world_size``).
        dtype: type the values travel in (``'bfloat16'``, ``'int8'``, ...); bytes are counted in it.
        world_size: divisor for ``average`` when it differs from the group size
            (e.g. only some ranks contributed non-zero values).
        bucket_bytes: largest flat buffer per call (in the tensors' own type).
        chunk: values per quantization scale (quantized ``dtype`` only).
        rounding: ``'nearest'`` or ``'stochastic'`` (quantized ``dtype`` only).
        error_feedback: one residual buffer per tensor, same shapes, kept by the
            caller (quantized ``dtype`` only): each is added to its tensor before
            quantizing, and then holds what this round's quantization lost.
        async_op: return a handle at once; after its ``wait()`` the tensors hold
            the result. Do not touch the tensors before then.

    Returns:
        None, or the handle (``wait()``, ``is_completed()``) when ``async_op``.

    Raises:
        ValueError: for an unknown dtype, rounding or chunk, an op a quantized type
            cannot reduce, or residual buffers that do not match the tensors.
    """
    tensors = list(tensors)
    wire_dtype = resolve_dtype(dtype)
    quantized = isinstance(wire_dtype, str)
    if quantized:
        quant.check(wire_dtype, chunk, rounding)
        if op not in (None, dist.ReduceOp.SUM):
            raise ValueError(f"a quantized dtype ({wire_dtype!r}) is summed after an all-gather; "
                             f"it cannot reduce with {op!r}: use op=None (SUM) or a float dtype")
    if error_feedback is not None:
        if not quantized:
            raise ValueError(f"error_feedback needs a quantized dtype "
                             f"({', '.join(quant.DTYPES)}), got dtype={dtype!r}")
        error_feedback = list(error_feedback)
        if len(error_feedback) != len(tensors) or any(
                r.shape != t.shape for r, t in zip(error_feedback, tensors)):
            raise ValueError(f"error_feedback must hold one buffer per tensor with its shape: "
                             f"{len(error_feedback)} buffers for {len(tensors)} tensors")
    keep = [i for i, t in enumerate(tensors) if t.numel() > 0]
    residuals = [error_feedback[i] for i in keep] if error_feedback is not None else None
    tensors = [tensors[i] for i in keep]
    if not tensors or not _backend.active:
        return _Round() if async_op else None
    if average and world_size is None:
        world_size = group_size(group)
    divide_by = world_size if average else None
    total = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    buckets = _buckets(tensors, bucket_bytes)
    payloads = [_payload(tensors, bucket, wire_dtype, chunk) for bucket in buckets]
    progress = link_progress()
    token = progress.begin(sum(payloads))
    round_ = _Round(progress, token)
    try:
        with _Timed(f"an all-reduce of {len(tensors)} tensors ({total:.1f} MiB)"):
            _reduce_buckets(round_, tensors, residuals, op, group, wire_dtype, quantized,
                            divide_by, buckets, payloads, chunk, rounding, async_op)
    except BaseException:
        progress.end(token)
        raise
    if async_op:
        # a handle dropped unwaited (its rank left the run) ends its collective too
        weakref.finalize(round_, progress.end, token)
        return round_
    round_.wait()
    return None


def _payload(tensors: list[torch.Tensor], bucket: list[int], wire_dtype: Any, chunk: int) -> int:
    """The bytes one bucket puts on the wire: what :func:`_count` counts for it."""
    elements = sum(tensors[i].numel() for i in bucket)
    if isinstance(wire_dtype, str):
        return quantized_payload_bytes(elements, wire_dtype, chunk)
    return elements * (wire_dtype or tensors[bucket[0]].dtype).itemsize


def _reduce_buckets(round_: _Round, tensors: list[torch.Tensor],
                    residuals: list[torch.Tensor] | None, op: Any, group: Any,
                    wire_dtype: Any, quantized: bool, divide_by: float | None,
                    buckets: list[list[int]], payloads: list[int], chunk: int, rounding: str,
                    async_op: bool) -> None:
    """Start :func:`all_reduce_tensors`' buckets (each with its payload) into ``round_``; a
    blocking bucket is done on return. On a simulated clock, the call starts when the last
    rank arrives and lasts its buckets' time together."""
    rs = _rs
    charged = rs.clock is not None and rs.clock_batch is None
    if charged:
        start = _latest_arrival(group)
        rs.clock_batch = []
    try:
        for bucket, payload in zip(buckets, payloads):
            members = [tensors[i] for i in bucket]
            if quantized:
                work = _quantized_bucket(
                    members, [residuals[i] for i in bucket] if residuals is not None else None,
                    wire_dtype, chunk, rounding, group, divide_by, async_op)
            else:
                _count(payload, "all_reduce", group)
                work = _backend.all_reduce_many(members, op, group, divide_by, wire_dtype,
                                                async_op=async_op)
            if async_op:
                round_.add(work, payload)
            else:
                round_.add(work)
                if round_.progress is not None:
                    round_.progress.advance(round_.token, payload)
    finally:
        if charged:
            items, rs.clock_batch = rs.clock_batch, None
    if charged:
        ranks = _group_ranks(group)
        done = start + sum(rs.clock.collective_s(kind, payload, ranks) for kind, payload in items)
        if async_op:
            round_.sim_done = done
        else:
            rs.clock.finish_at(done)


# -- the side channel: evaluation, averaging, agreement, barriers (never counted) -------


class _Side:
    """Says what the rank waits in during an uncounted side-channel call (:func:`waiting`)."""

    def __init__(self, what: str):
        self.what = what
        self.outer = False

    def __enter__(self) -> None:
        self.outer = _inside[0] is None
        if self.outer:
            _inside[:] = [self.what, time.monotonic()]

    def __exit__(self, *exc: object) -> None:
        if self.outer:
            _inside[0] = None


def side_group_size() -> int:
    """Ranks on the side channel (1 outside a process group or with one rank)."""
    return _backend.side_size() if _backend.active else 1


def side_all_reduce(tensor: torch.Tensor, op: Any = None) -> None:
    """All-reduce ``tensor`` in place over the side channel (default op: SUM); uncounted."""
    if _backend.active:
        with _Side("an agreement among the ranks (side channel)"):
            _backend.side_all_reduce(tensor, op)


def side_broadcast(tensor: torch.Tensor, src: int = 0, ranks: Sequence[int] | None = None) -> None:
    """Broadcast ``tensor`` from rank ``src`` in place over the side channel; uncounted.

    Args:
        tensor: the source on ``src``, the destination elsewhere.
        src: the global rank that sends.
        ranks: only these ranks take part (``src`` among them); default every rank.
            Only backends whose ranks may be away take part of the world (packed
            ranks, hosts that come and go).
    """
    if _backend.active:
        with _Side(f"{_mib(tensor)} from rank {src} (side channel)"):
            _backend.side_broadcast(tensor, src, ranks)


def side_all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
    """Gather every rank's ``tensor`` into ``tensor_list`` over the side channel; uncounted."""
    if _backend.active:
        with _Side("a gather among the ranks (side channel)"):
            _backend.side_all_gather(tensor_list, tensor)
    else:
        tensor_list[0].detach().copy_(tensor)


def side_barrier() -> None:
    """Wait until every rank has reached this point."""
    if _backend.active:
        with _Side("every rank at a barrier (side channel)"):
            _backend.side_barrier()
