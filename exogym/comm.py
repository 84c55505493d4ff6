"""Collectives for training traffic, with byte counters, and the side channel.

This is the only module of the project that calls ``torch.distributed``: it
opens rendezvous stores, joins and leaves the process group, and carries every
collective. Every byte a strategy sends goes through it, so the counters here
are the ground truth for ``comm_bytes``. A rank "sends" the payload it passes to a
collective: ``numel * element_size`` of its tensor (for ``all_gather``, of its
own contribution). Protocol overhead is not counted.

Three things happen here so that strategies need not care:

- **Staging.** gloo works on CPU tensors; a tensor on MPS (or on CUDA when the
  process group is gloo) is copied to the CPU, reduced, and copied back. For an
  asynchronous call the copy back happens in the returned handle's ``wait()``,
  never before the collective has finished.
- **Bucketing.** :func:`all_reduce_tensors` flattens many small tensors into a
  few flat buffers, so a model with hundreds of tensors costs a few calls.
- **Precision.** ``dtype=`` makes values travel in a narrower type (bf16, fp16);
  bytes are counted in that type while the model keeps its own precision.
- **Quantization.** ``dtype='int8'``, ``'float8_e4m3fn'``, ``'int4'`` or ``'int2'``
  quantizes each bucket with a float32 scale per chunk (:mod:`exogym.quantize`);
  the packed payloads are all-gathered and every rank dequantizes and sums them
  in float32, in rank order, so every rank ends with bitwise the same result.
- **Asynchrony.** ``all_reduce_tensors(..., async_op=True)`` returns a handle at
  once; its ``wait()`` leaves the result in the tensors. Through torch.distributed
  it rides torch's own work objects; through shared memory a thread per rank runs
  the started collectives in the order they were started (every rank starts them
  in the same order, so they meet), and a blocking collective first waits for
  those still running. Bytes are counted when a collective starts.

When no process group is initialised (a strategy used outside a trainer) the
collectives act as a world of one: nothing moves and nothing is counted.

**The side channel** (``side_all_reduce``, ``side_broadcast``,
``side_all_gather``, ``side_barrier``) carries what is not training:
evaluation, model averaging, agreement between ranks, barriers. It runs over
its own gloo group, created by :func:`init_process_group`, stages non-CPU
tensors through the CPU, and is never counted, so ``comm_bytes`` stays the
strategy's own traffic. Outside a process group, or with one rank, it acts as
a world of one.

``EXOGYM_COLLECTIVES`` chooses how a run's training collectives travel:
unset (or ``auto``), a simulation's CPU ranks meet in shared memory and
everything else goes through ``torch.distributed``; ``torch`` sends everything
through ``torch.distributed``; ``mirror`` sends nothing: every collective
returns what it would if every peer held exactly this rank's tensors (a sum is
``world_size`` times the tensor, a gather ``world_size`` copies of it). A
mirrored run does all of a strategy's own work per step (selection, packing,
compression, decoding) with no network and no waiting for peers, which is how
``bench/multihost.py`` measures a strategy's compute time. Bytes are counted
as usual. A mirrored world may be larger than the process group
(``use_mirror_collectives(True, world_size=N)``): one process then does the
work of one of ``N`` ranks (:mod:`exogym.step_time`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "ReduceOp",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_reduce_tensors",
    "collectives_mode",
    "collective_time",
    "comm_bytes",
    "comm_calls",
    "destroy_process_group",
    "group_size",
    "init_process_group",
    "is_connection_error",
    "is_initialized",
    "nccl_available",
    "new_group",
    "open_store",
    "reset_counters",
    "restore_counters",
    "resolve_dtype",
    "side_all_gather",
    "side_all_reduce",
    "side_barrier",
    "side_broadcast",
    "side_group_size",
    "use_clock",
    "use_local_collectives",
    "use_mirror_collectives",
    "use_packed_world",
    "enter_step",
    "pause",
    "present_ranks",
]

MODE_ENV = "EXOGYM_COLLECTIVES"
MODES = ("auto", "torch", "mirror")

from exogym import quantize as quant  # noqa: E402
from exogym.strategy.facts import (  # noqa: E402 - the planner reads the same numbers
    BUCKET_BYTES,
    QUANT_CHUNK,
    is_quantized,
)

ReduceOp = dist.ReduceOp

_backend_by_group: dict[object, str] = {}
_local = None  # SharedMemoryCollectives when every rank shares this machine
_mirror = False  # every peer holds what this rank holds: nothing is sent
_mirror_world: int | None = None  # ranks a mirrored world has (None: the process group's)
_side_group = None  # evaluation, averaging, agreement, barriers: never counted

_packed = None  # PackedWorld when this process runs several ranks in turn (exogym.packed)


class _RankState(threading.local):
    """What belongs to one rank rather than to the process: its counters and clock.

    Thread-local, so that the ranks a packed process runs as threads each keep
    their own; a process with one rank has one.

    ``clock`` is the simulated clock (``fit(network=...)``), ``clock_batch`` the
    collectives of one ``all_reduce_tensors`` call charged together, and
    ``wall_s``/``cpu_s`` the time spent inside counted collectives (wall, and
    this thread's CPU), which a step's compute time leaves out.
    """

    bytes_sent = 0
    calls = 0
    clock = None
    clock_batch: list[tuple[str, int]] | None = None
    depth = 0
    wall_s = 0.0
    cpu_s = 0.0


_rs = _RankState()


# -- the process group ---------------------------------------------------------------


def open_store(addr: str, port: int, *, is_master: bool = False, world_size: int | None = None,
               timeout_s: float = 300.0) -> dist.Store:
    """The TCP store ranks meet at: hosted here (``is_master``) or reached at ``addr:port``.

    Args:
        addr: the store's address.
        port: its port; 0 on the master lets the operating system pick one (``store.port``).
        is_master: host the store in this process.
        world_size: processes that will join through it (None: not known yet).
        timeout_s: how long a call on the store waits.
    """
    return dist.TCPStore(addr, port, world_size, is_master=is_master,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def init_process_group(store: dist.Store, rank: int, world_size: int, backend: str,
                       timeout_s: float, device: torch.device | None = None) -> None:
    """Join the training process group through ``store``, and create the side group.

    Args:
        store: from :func:`open_store`.
        rank, world_size: this rank and the number of ranks.
        backend: ``'gloo'`` or ``'nccl'``.
        timeout_s: how long a collective waits for a peer.
        device: this rank's GPU (nccl binds to it).
    """
    global _side_group
    timeout = timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if backend == "nccl" and device is not None else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)
    _backend_by_group.clear()
    _side_group = dist.new_group(backend="gloo", timeout=timeout) if world_size > 1 else None


def destroy_process_group() -> None:
    """Leave the process group and its side group; collectives act as a world of one again."""
    global _side_group
    _drain(raise_errors=False)
    _side_group = None
    _backend_by_group.clear()
    if _packed is None and _active():
        dist.destroy_process_group()


def is_initialized() -> bool:
    """True inside a process group."""
    return _active()


def nccl_available() -> bool:
    """True when this torch can join ranks with nccl."""
    return dist.is_available() and dist.is_nccl_available()


class _MirroredGroup:
    """A subgroup of a mirrored world: nothing is sent over it, only its size counts."""

    def __init__(self, size: int):
        self.size = size


def new_group(ranks: Sequence[int]):
    """A process group of ``ranks`` for training collectives.

    Collective over the world: every rank creates every group, in the same
    order, whether it belongs to it or not.
    """
    if _mirror:
        return _MirroredGroup(len(ranks))
    if _packed is not None:
        return _packed.group(ranks)
    return dist.new_group(ranks=list(ranks))


def group_size(group=None) -> int:
    """Ranks in ``group`` (default: the world) as the collectives see them; 1 outside a group."""
    if isinstance(group, _MirroredGroup):
        return group.size
    if _packed is not None:
        return _packed.size(group)
    if not _active():
        return 1
    if _mirror and _mirror_world is not None and (group is None or group is dist.group.WORLD):
        return _mirror_world
    return dist.get_world_size(group)


def is_connection_error(exc: BaseException) -> bool:
    """True for an error a collective raised because a peer's connection failed."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("gloo", "Connection reset", "Connection closed", "NCCL"))


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


def use_local_collectives(local) -> None:
    """Route world-group CPU collectives through ``local`` (shared memory); None: torch only."""
    global _local
    _drain(raise_errors=False)
    _local = local


def use_mirror_collectives(on: bool, world_size: int | None = None) -> None:
    """Make every collective act as if each peer held this rank's tensors; nothing is sent.

    See the module's description of ``EXOGYM_COLLECTIVES=mirror``.

    Args:
        on: mirror the collectives, or stop.
        world_size: the ranks of the mirrored world (default: the process group's size).
    """
    global _mirror, _mirror_world
    _mirror = bool(on)
    _mirror_world = world_size if on else None


def use_packed_world(world) -> None:
    """Route every collective of this process through ``world``, an
    :class:`exogym.packed.PackedWorld` whose ranks are this process's threads.

    There is no torch process group in such a process, so that code which asks
    torch.distributed who it is keeps working, ``torch.distributed.get_rank()``,
    ``get_world_size()`` and ``is_initialized()`` then answer for the calling rank.
    Meant for a process that runs nothing else (the trainer's packed processes).
    """
    global _packed
    _packed = world
    get_rank, get_world_size = dist.get_rank, dist.get_world_size

    def packed_rank(group=None) -> int:
        return world.rank() if group is None or group is dist.group.WORLD else get_rank(group)

    def packed_world_size(group=None) -> int:
        if group is None or group is dist.group.WORLD:
            return world.world_size
        return get_world_size(group)

    dist.get_rank = packed_rank
    dist.get_world_size = packed_world_size
    dist.is_initialized = lambda: True


def enter_step(step: int, members: Sequence[int] | None = None) -> None:
    """This rank is at ``step``, where ``members`` are the ranks present (None: every rank).

    Collectives then meet among the present ranks only (a run where ranks leave
    and rejoin, :mod:`exogym.membership`). Only ranks packed in a process
    (:mod:`exogym.packed`) can meet among some ranks; elsewhere a ``members``
    that leaves a rank out is refused.
    """
    if _packed is not None:
        _packed.enter_step(step, members)
    elif members is not None and _active() and len(set(members)) != dist.get_world_size():
        raise RuntimeError("only ranks packed in a process can meet without some of their "
                           "peers (rank_failures runs its ranks that way)")


def present_ranks(group=None) -> list[int]:
    """The ranks of ``group`` (default: the world) present at this rank's step."""
    return _group_ranks(group)


def pause(seconds: float) -> None:
    """Sleep ``seconds`` without holding up other ranks that share this process."""
    if seconds <= 0:
        return
    if _packed is not None:
        _packed.sleep(seconds)
    else:
        time.sleep(seconds)


def _mirror_reduce(tensor: torch.Tensor, op, group) -> None:
    """What an all-reduce returns when all ranks of ``group`` hold ``tensor``."""
    if op is None or op == dist.ReduceOp.SUM:
        if tensor.dtype != torch.bool:
            tensor.mul_(group_size(group))
    elif op == dist.ReduceOp.PRODUCT:
        if tensor.dtype != torch.bool:
            tensor.pow_(group_size(group))
    # AVG, MAX, MIN and the bitwise ops of equal tensors give the tensor itself.


def _local_for(tensor: torch.Tensor, group, op=None, *, blocking: bool = True):
    """The shared-memory collectives when they can carry this call, else None.

    A blocking caller gets them only once the collectives started asynchronously
    have finished, so that two threads never meet in shared memory at once.
    """
    if _mirror or _local is None or not (group is None or group is dist.group.WORLD):
        return None
    if not _local.supports(tensor, op):
        return None
    if blocking:
        _drain()
    return _local


class _Future:
    """A collective the background thread runs; ``wait()`` returns once it has run."""

    def __init__(self):
        self._event = threading.Event()
        self._error: BaseException | None = None

    def wait(self, timeout=None) -> bool:
        self._event.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()


class _Background:
    """One thread that runs shared-memory collectives in the order they were started."""

    def __init__(self):
        self.pid = os.getpid()
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


_background: _Background | None = None
_last_started: _Future | None = None  # the latest background collective: FIFO, so all before it


def _start_in_background(job: Callable[[], None]) -> _Future:
    global _background, _last_started
    if _background is None or _background.pid != os.getpid():  # a forked child has no thread
        _background = _Background()
    _last_started = _background.submit(job)
    return _last_started


def _drain(raise_errors: bool = True) -> None:
    """Wait until every collective started in the background has run.

    Args:
        raise_errors: raise the error of a failed one (False when leaving the
            group, where the error has been, or will be, raised by its ``wait()``).
    """
    global _last_started
    last, _last_started = _last_started, None
    if _background is None or _background.pid != os.getpid():
        return  # started by the process this one was forked from: not ours to wait for
    if last is not None:
        try:
            last.wait()
        except BaseException:
            if raise_errors:
                raise


def comm_bytes() -> int:
    """Payload bytes this process has passed to counted collectives so far."""
    return _rs.bytes_sent


def comm_calls() -> int:
    """Number of counted collective calls so far."""
    return _rs.calls


def reset_counters() -> None:
    """Zero the byte and call counters (a rank does this before training)."""
    _rs.bytes_sent = 0
    _rs.calls = 0


def restore_counters(bytes_sent: int, calls: int) -> None:
    """Set the byte and call counters (a rank resuming from a checkpoint)."""
    _rs.bytes_sent = int(bytes_sent)
    _rs.calls = int(calls)


def _count(nbytes: int, kind: str, group) -> None:
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


def use_clock(clock) -> None:
    """Charge every training collective of this rank to ``clock`` (an
    :class:`exogym.simclock.SimClock`); None: no simulated time."""
    _rs.clock = clock
    _rs.wall_s = _rs.cpu_s = 0.0


def collective_time() -> tuple[float, float]:
    """Seconds this rank has spent inside counted collectives: (wall, this thread's CPU).

    Kept always: a step's compute time leaves them out, for the simulated clock
    (:func:`use_clock`, which starts them again from 0) and for ``fit(balance=...)``,
    whose fast ranks would otherwise count their wait for a slow one as their own work.
    """
    return _rs.wall_s, _rs.cpu_s


class _Timed:
    """Adds the time spent inside the outermost counted collective to the totals above."""

    wall = cpu = None

    def __enter__(self) -> None:
        rs = _rs
        rs.depth += 1
        if rs.depth == 1:
            self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc: object) -> None:
        rs = _rs
        rs.depth -= 1
        if rs.depth == 0 and self.wall is not None:
            rs.wall_s += time.perf_counter() - self.wall
            rs.cpu_s += time.thread_time() - self.cpu


def _group_ranks(group) -> list[int]:
    if _packed is not None:
        return list(_packed.members(group))
    world = group is None or group is dist.group.WORLD
    if isinstance(group, _MirroredGroup) or world or _mirror:
        return list(range(group_size(group)))
    return list(dist.get_process_group_ranks(group))


def _latest_arrival(group) -> float:
    """The latest clock among the ranks of ``group``: when a collective among them can start.

    Uncounted: through shared memory, the side channel (the world) or ``group`` itself.
    """
    now = _rs.clock.now
    if _mirror or not _active() or group_size(group) <= 1:
        return now
    t = torch.tensor([now], dtype=torch.float64)
    if _packed is not None:
        _packed.all_reduce(t, dist.ReduceOp.MAX, group)
        return float(t.item())
    world = group is None or group is dist.group.WORLD
    local = _local_for(t, group, dist.ReduceOp.MAX) if world else None
    if local is not None:
        local.all_reduce(t, op=dist.ReduceOp.MAX)
    elif world:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_side_group)
    else:
        if _backend(group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _active() -> bool:
    return _packed is not None or (dist.is_available() and dist.is_initialized())


def _backend(group) -> str:
    key = group if group is not None else "__world__"
    backend = _backend_by_group.get(key)
    if backend is None:
        backend = str(dist.get_backend(group))
        _backend_by_group[key] = backend
    return backend


def _needs_staging(tensor: torch.Tensor, group) -> bool:
    if tensor.device.type == "cpu":
        return False
    if tensor.device.type == "mps":
        return True
    return _backend(group) == "gloo"


class _StagedWork:
    """Handle for an async collective on a staged copy; ``wait()`` copies back."""

    def __init__(self, work, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        self._work = work
        self._pairs = pairs
        self._done = False

    def wait(self, timeout=None) -> bool:
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


class _DoneWork:
    """Handle returned when there is nothing to wait for (a world of one)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _in_place(collective, local_name: str, tensor: torch.Tensor, group, async_op: bool,
              **kwargs):
    """Run an in-place collective on ``tensor``, through a CPU copy when gloo needs one.

    ``collective`` is the ``torch.distributed`` function; ``local_name`` its
    shared-memory equivalent, used when the ranks share this machine.
    """
    staging = _needs_staging(tensor, group)
    staged = tensor.detach().to("cpu") if staging else tensor
    local = _local_for(staged, group, kwargs.get("op"))
    if local is not None:
        getattr(local, local_name)(staged, **kwargs)
        if staging:
            tensor.copy_(staged)
        return _DoneWork() if async_op else None
    if not staging:
        return collective(tensor, group=group, async_op=async_op, **kwargs)
    work = collective(staged, group=group, async_op=async_op, **kwargs)
    handle = _StagedWork(work if async_op else _DoneWork(), [(tensor, staged)])
    if async_op:
        return handle
    handle.wait()
    return None


def all_reduce(tensor: torch.Tensor, op=None, group=None, async_op: bool = False):
    """All-reduce ``tensor`` in place (default op: SUM); counts its payload bytes."""
    if not _active():
        return _DoneWork() if async_op else None
    with _Timed():
        _count(tensor.numel() * tensor.element_size(), "all_reduce", group)
        if _mirror:
            _mirror_reduce(tensor, op, group)
            return _DoneWork() if async_op else None
        if _packed is not None:
            return _packed.all_reduce(tensor, op, group, async_op)
        return _in_place(dist.all_reduce, "all_reduce", tensor, group, async_op,
                         op=dist.ReduceOp.SUM if op is None else op)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op: bool = False):
    """Broadcast ``tensor`` from global rank ``src`` in place; counts its payload bytes."""
    if not _active():
        return _DoneWork() if async_op else None
    with _Timed():
        _count(tensor.numel() * tensor.element_size(), "broadcast", group)
        if _mirror:
            return _DoneWork() if async_op else None
        if _packed is not None:
            return _packed.broadcast(tensor, src, group, async_op)
        return _in_place(dist.broadcast, "broadcast", tensor, group, async_op, src=src)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False
):
    """Gather every rank's ``tensor`` into ``tensor_list``; counts this rank's payload."""
    if not _active():
        tensor_list[0].copy_(tensor)
        return _DoneWork() if async_op else None
    with _Timed():
        _count(tensor.numel() * tensor.element_size(), "all_gather", group)
        return _all_gather_uncounted(tensor_list, tensor, group, async_op)


def _all_gather_uncounted(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group,
                          async_op: bool):
    if _mirror:
        for out in tensor_list:
            out.copy_(tensor)
        return _DoneWork() if async_op else None
    if _packed is not None:
        return _packed.all_gather(tensor_list, tensor, group, async_op)
    local = _local_for(tensor, group)
    if local is not None and all(t.device.type == "cpu" for t in tensor_list):
        local.all_gather(tensor_list, tensor)
        return _DoneWork() if async_op else None
    if _needs_staging(tensor, group):
        staged_in = tensor.detach().to("cpu")
        staged_out = [torch.empty_like(t, device="cpu") for t in tensor_list]
        work = dist.all_gather(staged_out, staged_in, group=group, async_op=async_op)
        handle = _StagedWork(
            work if async_op else _DoneWork(), list(zip(tensor_list, staged_out))
        )
        if async_op:
            return handle
        handle.wait()
        return None
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


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
    chunk, see :mod:`exogym.quantize`); None keeps each tensor's own type.

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


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Group tensor indices by (device, dtype) into runs of at most ``bucket_bytes``."""
    by_key: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        by_key.setdefault((t.device, t.dtype), []).append(i)
    buckets: list[list[int]] = []
    for indices in by_key.values():
        current: list[int] = []
        size = 0
        for i in indices:
            nbytes = tensors[i].numel() * tensors[i].element_size()
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


class _Round:
    """The handle of :func:`all_reduce_tensors`: per bucket, a transfer and what follows it."""

    def __init__(self):
        self._steps: list[tuple[object, Callable[[], None] | None]] = []
        self._done = False
        self.sim_done: float | None = None  # when it ends on the simulated clock

    def add(self, work, finish: Callable[[], None] | None) -> None:
        self._steps.append((work, finish))

    def wait(self, timeout=None) -> bool:
        """Block until every bucket has arrived; the tensors then hold the result."""
        if not self._done:
            with _Timed():
                for work, finish in self._steps:
                    if work is not None:
                        work.wait()
                    if finish is not None:
                        finish()
            self._done = True
            if self.sim_done is not None and _rs.clock is not None:
                _rs.clock.finish_at(self.sim_done)
        return True

    def is_completed(self) -> bool:
        """True when :meth:`wait` would not block."""
        return self._done or all(work is None or work.is_completed() for work, _ in self._steps)


def _rank() -> int:
    if _packed is not None:
        return _packed.rank()
    return dist.get_rank() if _active() else 0


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


def _quantized_bucket(round_: _Round, members: list[torch.Tensor],
                      residuals: list[torch.Tensor] | None, dtype: str, chunk: int,
                      rounding: str, group, divide_by: float | None, async_op: bool) -> None:
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

    local = _local_for(wire, group, blocking=not async_op)
    if local is not None and async_op:
        round_.add(_start_in_background(lambda: local.all_gather(gathered, wire)), finish)
        return
    round_.add(_all_gather_uncounted(gathered, wire, group, async_op), finish)


def all_reduce_tensors(
    tensors: Iterable[torch.Tensor],
    op=None,
    group=None,
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
    ``chunk`` values (:mod:`exogym.quantize`) and **all-gathered**; every rank
    then dequantizes the payloads and sums them in float32, in rank order, so
    every rank holds bitwise the same result. A rank's counted bytes are its own
    payload, packed values and scales: ``exogym.quantize.payload_bytes(numel)``
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
    round_ = _Round()
    if not tensors or not _active():
        return round_ if async_op else None
    if average and world_size is None:
        world_size = group_size(group)
    divide_by = world_size if average else None
    with _Timed():
        _reduce_buckets(round_, tensors, residuals, op, group, average, wire_dtype, quantized,
                        world_size, divide_by, bucket_bytes, chunk, rounding, async_op)
    if async_op:
        return round_
    round_.wait()
    return None


def _reduce_buckets(round_: _Round, tensors: list[torch.Tensor],
                    residuals: list[torch.Tensor] | None, op, group, average: bool,
                    wire_dtype, quantized: bool, world_size: int | None,
                    divide_by: float | None, bucket_bytes: int, chunk: int, rounding: str,
                    async_op: bool) -> None:
    """Start :func:`all_reduce_tensors`' buckets into ``round_``; on a simulated clock, the
    call starts when the last rank arrives and lasts its buckets' time together."""
    rs = _rs
    charged = rs.clock is not None and rs.clock_batch is None
    if charged:
        start = _latest_arrival(group)
        rs.clock_batch = []
    try:
        _start_buckets(round_, tensors, residuals, op, group, average, wire_dtype, quantized,
                       world_size, divide_by, bucket_bytes, chunk, rounding, async_op)
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


def _start_buckets(round_: _Round, tensors: list[torch.Tensor],
                   residuals: list[torch.Tensor] | None, op, group, average: bool,
                   wire_dtype, quantized: bool, world_size: int | None,
                   divide_by: float | None, bucket_bytes: int, chunk: int, rounding: str,
                   async_op: bool) -> None:
    for bucket in _buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in bucket]
        if quantized:
            _quantized_bucket(round_, members,
                              [residuals[i] for i in bucket] if residuals is not None else None,
                              wire_dtype, chunk, rounding, group, divide_by, async_op)
            continue
        reduce_op = dist.ReduceOp.SUM if op is None else op
        elements = sum(t.numel() for t in members)
        local = _local_for(members[0], group, op, blocking=not async_op)
        if local is not None:
            # Straight from the tensors into shared memory and back: no flat copy.
            _count(elements * (wire_dtype or members[0].dtype).itemsize, "all_reduce", group)

            def reduce_in_place(local=local, members=members, reduce_op=reduce_op) -> None:
                local.all_reduce_many(members, reduce_op, wire_dtype=wire_dtype,
                                      divide_by=divide_by)

            if async_op:
                round_.add(_start_in_background(reduce_in_place), None)
            else:
                reduce_in_place()
            continue
        if _packed is not None and wire_dtype in (None, members[0].dtype) \
                and all(t.device.type == "cpu" for t in members):
            # Ranks packed in this process reduce the tensors themselves: no flat copy.
            _count(elements * members[0].element_size(), "all_reduce", group)
            round_.add(_packed.all_reduce_many(members, reduce_op, group, divide_by, async_op),
                       None)
            continue
        flat = torch.cat([t.reshape(-1) for t in members])
        if wire_dtype is not None and flat.dtype != wire_dtype:
            flat = flat.to(wire_dtype)
        work = all_reduce(flat, op=op, group=group, async_op=async_op)

        def finish(flat=flat, members=members) -> None:
            if average:
                flat = flat.to(members[0].dtype) if flat.dtype != members[0].dtype else flat
                flat.div_(world_size)
            _split_into(flat, members)

        round_.add(work, finish)


# -- the side channel: evaluation, averaging, agreement, barriers (never counted) -------


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself on the CPU (without autograd), else a CPU copy of it."""
    return tensor.detach() if tensor.device.type == "cpu" else tensor.detach().to("cpu")


def _copy_back(tensor: torch.Tensor, staged: torch.Tensor) -> None:
    if staged.data_ptr() != tensor.data_ptr():
        tensor.detach().copy_(staged)


def side_group_size() -> int:
    """Ranks on the side channel (1 outside a process group or with one rank)."""
    if _packed is not None:
        return _packed.size(_packed.side)
    return 1 if _side_group is None else dist.get_world_size(_side_group)


def side_all_reduce(tensor: torch.Tensor, op=None) -> None:
    """All-reduce ``tensor`` in place over the side channel (default op: SUM); uncounted."""
    if _packed is not None:
        staged = _to_cpu(tensor)
        _packed.all_reduce(staged, op, _packed.side)
        _copy_back(tensor, staged)
        return
    if _side_group is None:
        return
    staged = _to_cpu(tensor)
    dist.all_reduce(staged, op=ReduceOp.SUM if op is None else op, group=_side_group)
    _copy_back(tensor, staged)


def side_broadcast(tensor: torch.Tensor, src: int = 0, ranks: Sequence[int] | None = None) -> None:
    """Broadcast ``tensor`` from rank ``src`` in place over the side channel; uncounted.

    Args:
        tensor: the source on ``src``, the destination elsewhere.
        src: the global rank that sends.
        ranks: only these ranks take part (``src`` among them; ranks packed in a
            process only, :mod:`exogym.packed`); default every rank.
    """
    if _packed is not None:
        staged = _to_cpu(tensor)
        group = _packed.side if ranks is None else _packed.group(ranks, side=True)
        _packed.broadcast(staged, src, group)
        _copy_back(tensor, staged)
        return
    if ranks is not None and _active() and len(set(ranks)) != dist.get_world_size():
        raise RuntimeError("a broadcast among some ranks needs them packed in a process "
                           "(exogym.packed)")
    if _side_group is None:
        return
    staged = _to_cpu(tensor)
    dist.broadcast(staged, src=src, group=_side_group)
    _copy_back(tensor, staged)


def side_all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
    """Gather every rank's ``tensor`` into ``tensor_list`` over the side channel; uncounted."""
    if _packed is not None:
        staged_out = [_to_cpu(t) for t in tensor_list]
        _packed.all_gather(staged_out, _to_cpu(tensor), _packed.side)
        for target, staged in zip(tensor_list, staged_out):
            _copy_back(target, staged)
        return
    if _side_group is None:
        tensor_list[0].detach().copy_(tensor)
        return
    staged_out = [_to_cpu(t) for t in tensor_list]
    dist.all_gather(staged_out, _to_cpu(tensor), group=_side_group)
    for target, staged in zip(tensor_list, staged_out):
        _copy_back(target, staged)


def side_barrier() -> None:
    """Wait until every rank has reached this point."""
    if _packed is not None:
        _packed.barrier(_packed.side)
    elif _side_group is not None:
        dist.barrier(group=_side_group)
