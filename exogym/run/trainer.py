"""Trainer: simulate K-node training on this machine, K ranks as K processes.

``fit`` validates every argument, then starts one process per rank. Each runs
:func:`exogym.run.run_rank.run_rank` — the same function a real host runs — joined to
the others by ``torch.distributed`` over a TCP store that the parent opens on a
port the operating system picks (so parallel fits never collide). Ranks report
metric events through a pipe of their own (written synchronously: no feeder
thread competing with training for the interpreter lock); the parent shows
progress, keeps the history, and finally averages the ranks' models into the
one it returns.

CPU ranks with one thread each are forked straight from this process; other
ranks come from a fork server that has imported torch once. Either way starting
K ranks costs milliseconds rather than K imports of torch. Training collectives
among the local ranks go through shared memory (:mod:`exogym.comm.shared_memory`)
rather than loopback sockets. If any rank fails, the others are stopped at once
and the failing rank's traceback is raised.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import gc
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from exogym import comm
from exogym.base.blas_buffers import thread_buffers_releasable
from exogym.base.io import atomic_torch_save
from exogym.base.stop_signal import (
    finish_whole_blocks,
    interruptions_deferred,
    sigterm_as_interrupt,
    stop_on_sigterm,
)
from exogym.comm.averaging import RunningSum, average_of_sums, average_state_dicts
from exogym.comm.mailbox import new_run_id, remove_segments
from exogym.comm.packed import PackedTally, PackedWorld, process_ranks
from exogym.comm.shared_memory import SharedMemoryCollectives
from exogym.config.fit_args import FitArgs, fit_args_doc, fit_signature
from exogym.report.goodput import goodput_summary, measure_goodput
from exogym.report.loggers import Logger, make_logger
from exogym.report.summary import ProgressSink, RunReporter, summarize
from exogym.report.trace import TraceWriter, trace_path
from exogym.run.devices import available_cores, loopback_interface
from exogym.run.memory import (
    ScratchPlan,
    StateBytes,
    check_memory,
    scratch_plan,
    with_measured_minibatch,
)
from exogym.run.run_rank import Rendezvous, run_rank
from exogym.run.spec import (
    Placement,
    RunSpec,
    check_data,
    check_forward,
    make_run_spec,
    sample_batch,
)
from exogym.strategy.strategy import Strategy

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from exogym.config.fit_kwargs import FitKwargs


_NO_RUN_FOLDER = ("fit(trace=True) writes the trace into the logger's run folder, but this "
                  "run's logger has none (logger=None or 'wandb'): give trace= a folder or a "
                  ".jsonl path, or logger='csv'")


class RankFailedError(RuntimeError):
    """A rank of the run failed; ``rank`` names it and the message holds its traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


class _Portable:
    """Carries the run spec to a rank process.

    Pickled with cloudpickle, so a model, dataset or strategy class defined in
    a notebook or inside a function travels by value, while tensors still go
    through shared memory (torch's multiprocessing reducers) instead of being
    copied into the pickle.
    """

    def __init__(self, obj: Any):
        self.obj = obj

    def __reduce__(self):
        import copyreg
        import io
        import pickle
        from collections import ChainMap
        from multiprocessing.reduction import ForkingPickler

        import cloudpickle

        class _Pickler(cloudpickle.CloudPickler):
            dispatch_table = ChainMap(ForkingPickler._extra_reducers,
                                      cloudpickle.CloudPickler.dispatch_table, copyreg.dispatch_table)

        buffer = io.BytesIO()
        _Pickler(buffer).dump(self.obj)
        return pickle.loads, (buffer.getvalue(),)


# Imported once by the fork server, so a rank starts with them loaded. Building
# an optimizer imports torch._dynamo (seconds), so it is loaded here too.
PRELOAD = ["__main__", "exogym.run.run_rank", "exogym.run.trainer", "torch._dynamo"]


def _can_fork(spec: RunSpec, placement: Placement) -> bool:
    """Fork the ranks straight from this process: no re-import, so start-up is fastest.

    Only where it is safe: Linux, CPU ranks (a forked child cannot use a CUDA or
    MPS context of its parent), one compute thread per rank (GNU OpenMP hangs
    in a forked child that starts a thread pool its parent already used), and
    no other Python thread running here (a lock another thread holds at the
    fork stays held forever in the child: a notebook, a live display, a
    second fit in parallel; tqdm's idle monitor is stopped first:
    :func:`_stop_idle_monitors`), nor a library's own thread (a gloo group's loop,
    a TCP store's server, left by an earlier run in this process: the child
    inherits their locks in whatever state they were). The ranks are forked
    before the rendezvous store starts its own thread.
    """
    if not (sys.platform.startswith("linux") and spec.device_type == "cpu"
            and placement.threads_per_rank(spec) == 1 and not _library_threads()
            and "fork" in mp.get_all_start_methods()):
        return False
    if threading.active_count() > 1:
        _stop_idle_monitors()
    return threading.active_count() == 1


#: Seconds to wait for tqdm's monitor to stop before a fork; one that has not stopped by
#: then leaves the fit to the fork server.
MONITOR_STOP_S = 2.0


def _stop_idle_monitors() -> None:
    """Stop tqdm's monitor thread, the one Python thread a library leaves behind on its own.

    tqdm starts it with its first progress bar (a Hugging Face download or tokenizer, a
    ``datasets`` map) and it lives on, asleep, for the rest of the process; with it
    alive no fit of that process could fork its ranks, and each would start a fork
    server instead (4x the CPU of a fit of a small causal LM). It only adjusts the
    refresh of bars that are slow to print: stopped (and joined), it holds no lock at
    the fork, and tqdm starts a new one with its next bar.
    """
    tqdm_std = sys.modules.get("tqdm.std")
    monitor_class = getattr(tqdm_std, "TMonitor", None)
    if monitor_class is None:
        return
    for thread in threading.enumerate():
        if isinstance(thread, monitor_class) and thread.is_alive():
            thread.was_killed.set()  # what its exit() does, with a bound on the join
            thread.join(timeout=MONITOR_STOP_S)


#: Native threads a fork leaves safe: jemalloc's purging thread (pyarrow's allocator, loaded
#: with Hugging Face ``datasets`` or pandas) takes its locks around a fork and the child
#: runs without it. Forking past it keeps a fit in a script that imported ``datasets``
#: from starting a fork server that imports that script again (2.0 s against 30.3 s for a
#: two-rank fit of a small causal LM on a loaded machine).
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def _library_threads() -> list[str]:
    """Names of this process's native threads that a library started and named, except
    those a fork leaves safe (:data:`FORK_SAFE_THREADS`).

    Threads nobody named (the main thread, OpenMP's workers) carry the
    process's own name; torch and gloo name theirs (``pt_gloo_runloop``,
    ``gloo_tcp_loop``, ``pt_tcpstore_uv``). Empty where /proc is absent.
    """
    try:
        with open("/proc/self/comm") as f:
            own = f.read().strip()
        names = []
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
            if name != own and name not in FORK_SAFE_THREADS:
                names.append(name)
        return names
    except OSError:
        return []


_frozen = False


def _freeze_before_fork() -> None:
    """Move every live object to the collector's permanent generation, once per process.

    As the Python docs advise before ``fork()``: the collector then never writes
    to those objects' headers, so forked ranks keep sharing their pages instead
    of copying them, and neither the ranks' nor this process's collections (nor
    the one at interpreter exit) re-walk the ~300,000 objects torch and
    torch._dynamo create at import. No collection runs first: walking those
    objects costs 0.2 s to find a few hundred unreachable ones, whose memory
    is not worth it.
    """
    global _frozen
    if not _frozen:
        gc.freeze()
        _frozen = True


def _mp_context(spec: RunSpec, placement: Placement):
    if _can_fork(spec, placement):
        import torch._dynamo  # noqa: F401 - every rank's first optimizer needs it: load it once

        _freeze_before_fork()
        return mp.get_context("fork")
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("spawn")


def _open_store(start_port: int | None):
    """A TCP store on 127.0.0.1: on ``start_port`` or the next free port, or one the OS picks."""
    if start_port is None:
        return comm.open_store("127.0.0.1", 0, is_master=True)
    last_error: Exception | None = None
    for port in range(start_port, min(start_port + 100, 65536)):
        try:
            return comm.open_store("127.0.0.1", port, is_master=True)
        except (RuntimeError, OSError) as exc:  # port taken: try the next
            last_error = exc
    raise RuntimeError(f"no free port in {start_port}..{start_port + 99}: {last_error}")


def _watch_parent(parent_pid: int) -> None:
    # A rank must not outlive the process that started it (e.g. killed with SIGKILL).
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(1)


#: The events a rank's messages gather (:class:`_EventBatches`); any other goes at once.
_BATCHED = frozenset({"step", "link"})


class _EventBatches:
    """A rank's events on their way to the parent, a few per message.

    Step and link events wait until ``interval_s`` has passed since the last
    message; any other event (start, system, result, ...) goes at once, with
    whatever waits before it, so order is kept, and so does the step of a
    checkpoint: the steps a checkpoint holds are on their way the moment it is
    written. One message per step would wake the parent hundreds of times a
    second, on the cores the ranks need; so would the link figures of a process
    of 512 ranks waiting at a collective, each rank's once a second.

    Args:
        conn: this rank's end of the pipe to the parent.
        interval_s: longest a step event waits while the rank keeps stepping.
    """

    def __init__(self, conn: connection.Connection, interval_s: float = 0.1):
        self.conn = conn
        self.interval_s = interval_s
        self._pending: list[dict[str, Any]] = []
        self._sent_at = time.monotonic()

    def __call__(self, event: dict[str, Any]) -> None:
        self._pending.append(event)
        if event.get("event") not in _BATCHED or event.get("checkpoint") or \
                time.monotonic() - self._sent_at >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        """Send every waiting event now."""
        if self._pending:
            # Taken off the list only inside the block: an interruption that comes before
            # it leaves the events here for the rank's last message, and one in the middle
            # of the send waits (cut in two, the parent could read none of it).
            with interruptions_deferred():
                batch, self._pending = self._pending, []
                self.conn.send(batch)
        self._sent_at = time.monotonic()


def _take_environment(environ: dict[str, str] | None) -> None:
    """Make this rank's environment the fit's: a rank started by the fork server (or
    spawned) inherits the server's environment, from when it started, not the one the
    fit ran in (``EXOGYM_COLLECTIVES`` set since, for one)."""
    if environ is not None and environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)


def _local_rank_entry(payload: Any, placement: Placement, rank: int,
                      events: connection.Connection, result_dir: str, parent_pid: int,
                      local: SharedMemoryCollectives | None = None,
                      environ: dict[str, str] | None = None) -> None:
    """Body of one simulated rank's process.

    ``events`` is this rank's end of a pipe to the parent: the parent first sends
    the rendezvous store's port through it (the store is opened only once every
    rank has started), then the rank sends its metric events back.
    """
    # A forked rank may inherit a live display's stand-ins for stdout/stderr: write directly.
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    _take_environment(environ)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    stop_on_sigterm()  # stopped from outside or by the parent: leave through the finally blocks
    emit = _EventBatches(events)
    try:
        spec: RunSpec = payload.obj if isinstance(payload, _Portable) else payload
        iface = loopback_interface()
        if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
        port = int(events.recv())
        state = run_rank(spec, placement, rank,
                         Rendezvous("127.0.0.1", port, store_on_rank0=False), emit,
                         shared_memory=local)
        path = atomic_torch_save(state, Path(result_dir) / f"rank{rank}.pt", durable=False)
        emit({"event": "result", "rank": rank, "process": rank, "path": str(path)})
        code = 0
    except BaseException:
        try:
            emit({"event": "error", "rank": rank, "traceback": traceback.format_exc()})
        except OSError:
            pass  # the parent is gone
        code = 1
    events.close()
    os._exit(code)


#: Longest a packed process that fails or is stopped waits for its rank threads' blocks
#: under way (a checkpoint's rename and its step's event: milliseconds), well inside the
#: parent's grace before it kills the process (:func:`_stop`).
WHOLE_BLOCKS_WAIT_S = 1.0


def _packed_process_entry(payload: Any, placement: Placement, index: int, processes: int,
                          events: connection.Connection, result_dir: str,
                          parent_pid: int, run_id: str,
                          environ: dict[str, str] | None = None,
                          releases_scratch: bool | None = None) -> None:
    """Body of one process of a packed simulation: its block of ranks, run in turn.

    Each rank is a thread (:mod:`exogym.comm.packed`). The process writes the float64
    sum of its ranks' final states (those still present at the end) and their
    count; the parent finishes the average from every process's part, and the
    process's account (:class:`~exogym.comm.packed.PackedTally`) comes with its
    result. ``releases_scratch``: whether a rank gives its BLAS scratch back as it
    hands its turn on (:func:`exogym.run.memory.scratch_plan`; None: the world's
    default).
    """
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    _take_environment(environ)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop_on_sigterm()
    batches = _EventBatches(events)
    sending = threading.Lock()

    def emit(event: dict[str, Any]) -> None:
        with sending:
            batches(event)

    def fail(rank: int) -> None:
        # A rank thread between its checkpoint's rename and the step's event (a
        # done_whole block) finishes it first: os._exit would lose the event.
        finish_whole_blocks(WHOLE_BLOCKS_WAIT_S)
        try:
            emit({"event": "error", "rank": rank, "traceback": traceback.format_exc()})
            events.close()
        except OSError:
            pass  # the parent is gone
        os._exit(1)  # the process's other ranks wait on this one: stop them all

    first_rank = -1
    try:
        spec: RunSpec = payload.obj if isinstance(payload, _Portable) else payload
        first_rank = process_ranks(spec.num_nodes, processes, index).start
        # torch's thread count is per thread: this one sums the final states, and with
        # the ranks' count it does not wait on a core another process is using.
        torch.set_num_threads(placement.threads_per_rank(spec))
        port = int(events.recv())
        world = PackedWorld(spec.num_nodes, processes, index,
                            lambda: comm.open_store("127.0.0.1", port, timeout_s=spec.timeout_s),
                            spec.timeout_s, run_id=run_id,
                            device=placement.device_of(spec, first_rank))
        if releases_scratch is not None:
            world.releases_scratch = releases_scratch
        comm.use_backend(world)
        _one_malloc_arena()
        # The process's ranks' final states, summed as they end, in rank order: a state
        # waits only for those of lower ranks that have not ended yet.
        total = RunningSum()
        ended: dict[int, dict[str, torch.Tensor] | None] = {}
        order = list(world.here)
        summing = threading.Lock()

        def body(rank: int) -> None:
            try:
                world.sit(rank)
                try:
                    state = run_rank(spec, placement, rank, None, emit)
                finally:
                    world.stand()
                with summing:
                    ended[rank] = state  # None: away at the end (rank_failures)
                    while order and order[0] in ended:
                        done = ended.pop(order.pop(0))
                        if done is not None:
                            total.add(done)
            except BaseException:
                fail(rank)

        threads = [threading.Thread(target=body, args=(rank,), name=f"exogym-rank{rank}",
                                    daemon=True) for rank in world.here]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        world.close()
        path = None
        if total.count:
            part = {"sums": total.sums, "count": total.count}
            path = str(atomic_torch_save(part, Path(result_dir) / f"process{index}.pt",
                                         durable=False))
        emit({"event": "result", "process": index, "path": path, "packed": world.tally.as_dict()})
    except BaseException:
        fail(first_rank)
    events.close()
    os._exit(0)


def _one_malloc_arena() -> None:
    """Let every thread of this process allocate from one malloc arena (glibc).

    The ranks of a packed process run in turn, each in a thread of its own. With an
    arena per thread (glibc's default), the memory a rank frees after its step (its
    gradients, activations) stays in that rank's arena, so a process held every
    rank's worth at once; with one arena the next rank reuses it. Elsewhere (another
    C library) this does nothing.
    """
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def simulation_processes(spec: RunSpec, placement: Placement, processes: int | None) -> int | None:
    """How many processes a simulation packs its ranks into; None: one process per rank.

    Ranks are packed (:mod:`exogym.comm.packed`) when asked (``processes`` below the
    ranks), when ranks leave and rejoin (``rank_failures``: CPU ranks one process per
    core, accelerator ranks one process per device), or when there are more CPU ranks
    than cores, where one process per core runs the ranks in turn. The ranks of a
    packed process share its device (``devices[process % len(devices)]`` on CUDA).

    Raises:
        ValueError: packing was asked for ranks that cannot be packed
            (``EXOGYM_COLLECTIVES`` set to another mode), naming why.
    """
    k = spec.num_nodes
    packable = comm.collectives_mode() == "auto"
    asked = (processes is not None and processes < k) or bool(spec.rank_failures)
    if asked and not packable:
        what = "rank_failures" if spec.rank_failures else f"processes={processes}"
        raise ValueError(f"{what} runs several ranks in a process, which needs the default "
                         f"collectives, but {comm.MODE_ENV}={comm.collectives_mode()} asks "
                         "for other collectives")
    if not packable or k == 1:
        return None
    if processes is not None:
        return processes if processes < k or spec.rank_failures else None
    if spec.rank_failures:
        return packed_processes(spec, placement)
    if spec.device_type == "cpu" and k > packed_processes(spec, placement):
        return packed_processes(spec, placement)
    return None  # accelerator ranks are packed when asked (processes=)


def packed_processes(spec: RunSpec, placement: Placement) -> int:
    """The processes ranks are packed into when nothing says how many: one per core
    (CPU ranks, each with its threads) or one per device (accelerator ranks), at most
    one per rank."""
    if spec.device_type == "cpu":
        slots = max(1, available_cores() // placement.threads_per_rank(spec))
    else:
        slots = len(placement.devices or [0])
    return min(spec.num_nodes, slots)


def stack_problem(spec: RunSpec) -> str | None:
    """Why the ranks of ``spec`` cannot be stacked (None: they can)."""
    from exogym.run.stack import probe_model, strategy_problem

    if spec.num_nodes == 1:
        return "a run of one rank has nothing to stack"
    if comm.collectives_mode() != "auto":
        return f"{comm.MODE_ENV}={comm.collectives_mode()} asks for other collectives"
    if spec.balance != "none":
        return (f"balance={spec.balance!r} gives each rank its own share of samples, so "
                "their batches differ")
    problem = strategy_problem(spec.strategy)
    if problem is not None:
        return problem
    batch = sample_batch(spec.train_dataset, spec.dataloader_kwargs)
    if batch is None:
        from exogym.run.stack import model_problem

        return model_problem(spec.model)
    return probe_model(spec.model, batch)


def simulation_stacking(spec: RunSpec, placement: Placement, stack: bool | str,
                        processes: int | None, packed: int | None
                        ) -> tuple[int | None, Placement]:
    """The processes (None: one per rank) and placement of ``fit(stack=...)``: stacked
    ranks are packed, one process per core (CPU ranks) or per device (accelerator
    ranks) unless ``processes`` says otherwise.

    ``stack='auto'`` stacks accelerator ranks that are packed anyway (``processes=``,
    ``rank_failures``) where nothing stands in the way, and leaves every other run as
    it was (``packed`` processes): on the CPU a batched model computes no faster than
    its ranks one after the other (``python -m bench.sim_scale --stack``,
    ``python -m bench.gpu``).

    Raises:
        StackError: ``stack=True`` for ranks that cannot be stacked, naming why.
    """
    from exogym.run.stack import StackError

    if stack == "auto":
        if packed is None or spec.device_type == "cpu" or stack_problem(spec):
            return packed, placement
    else:
        problem = stack_problem(spec)
        if problem is not None:
            raise StackError(f"stack=True: {problem}; leave stack out to run the ranks "
                             "without stacking")
    if packed is None:
        packed = processes if processes is not None else packed_processes(spec, placement)
    return packed, dataclasses.replace(placement, stacked=True)


class Trainer:
    """Trains a model with a distributed strategy on K simulated nodes.

    Args:
        model: an ``nn.Module`` whose ``forward(batch)`` returns a scalar loss, or one
            called by name on a dict batch (``forward(**batch)``, a Hugging Face
            ``PreTrainedModel``) whose output holds it (``.loss``, ``["loss"]``, or a
            tuple's first item): :mod:`exogym.run.model_loss`.
        train_dataset: a Dataset (sharded across ranks), any map-style dataset of dicts
            (a ``datasets.Dataset``, a list of dicts), or a factory
            ``f(rank, num_nodes, is_train) -> Dataset``.
        val_dataset: the same for validation (may be None with ``val_size=0``).
        start_port: first port to try for the ranks' rendezvous (default: any free port).
        device: default device for ``fit`` (``'cpu'``, ``'cuda'``, ``'mps'``; None: best).
        devices: default CUDA indices for ``fit``.

    After ``fit``, ``history`` holds one dict per (rank, step).
    """

    def __init__(self, model: torch.nn.Module, train_dataset: Any, val_dataset: Any = None,
                 start_port: int | None = None, device: str | None = None,
                 devices: list[int] | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if start_port is not None and not (isinstance(start_port, int) and 0 < start_port < 65536):
            raise ValueError(f"start_port must be a port number 1..65535, got {start_port!r}")
        self.model = model
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.start_port = start_port
        self.device = device
        self.devices = devices
        self.history: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        self._processes: int | None = None
        self._packed_tallies: dict[int, dict[str, Any]] = {}  # packed processes: their accounts
        self._scratch: ScratchPlan | None = None  # packed ranks: do they keep BLAS scratch
        #: The training state a rank holds, accounted before the run (exogym.run.memory).
        self.state_bytes: StateBytes | None = None
        self.rank_stats: dict[int, dict[str, Any]] = {}
        self.log_dir: Path | None = None
        self.run_config: dict[str, Any] = {}
        #: Where the last fit wrote its trace (``fit(trace=...)``); None without one.
        self.trace_path: Path | None = None
        #: Whose events the trace holds: every rank's, in a simulation.
        self.trace_source = "simulation"
        #: The heading of the summary table shown when a fit ends.
        self.summary_title = "run summary"
        #: Called once ``fit`` has checked every argument, before it writes or starts
        #: anything: where a caller replaces an earlier run, so a refusal loses nothing.
        self.before_start: Callable[[], None] | None = None

    #: ``fit`` refuses ranks without a sample of their own and warns of a batch larger
    #: than a rank's share (a rank across hosts leaves that to rank 0's worker).
    checks_data = True

    def _checked(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[FitArgs, RunSpec, Placement]:
        """Every check ``fit`` makes before it writes or starts anything, with its warnings."""
        fit_args = FitArgs.from_call("fit()", args, dict(kwargs))
        if fit_args.device is None and self.device is not None:
            fit_args = dataclasses.replace(fit_args, device=self.device)
        if fit_args.devices is None and self.devices is not None:
            fit_args = dataclasses.replace(fit_args, devices=self.devices)
        spec = make_run_spec(self.model, self.train_dataset, self.val_dataset, fit_args)
        if self.checks_data:
            check_data(spec.train_dataset, spec.num_nodes, spec.batch_size,
                       spec.shared_samples, spec.partition)
        check_forward(spec.model, spec.train_dataset, spec.dataloader_kwargs)
        placement = self._placement(spec)
        spec = with_measured_minibatch(spec, placement)
        self._processes = self._packing(spec, placement, fit_args.processes)
        if fit_args.stack is not False:
            self._processes, placement = self._stacking(spec, placement, fit_args.stack,
                                                        fit_args.processes)
        self.state_bytes = self._check_memory(spec, placement)
        self._scratch = None
        if self._processes and thread_buffers_releasable():
            # Ranks on an accelerator hold their state there, not in this machine's memory.
            state = self.state_bytes if spec.device_type == "cpu" else StateBytes(0, 0, 0, 0, 0)
            self._scratch = scratch_plan(state, spec.num_nodes, self._processes,
                                         stacked=placement.stacked)
        return fit_args, spec, placement

    def check(self, *args: Any, **kwargs: Unpack[FitKwargs]) -> None:
        """Make every check ``fit`` would make with these arguments, and give its warnings,
        without writing or starting anything (a dry run).

        Raises:
            ValueError, TypeError: what ``fit`` would refuse, worded as ``fit`` words it.
        """
        self._checked(args, dict(kwargs))

    def fit(self, *args: Any, **kwargs: Unpack[FitKwargs]) -> torch.nn.Module:
        fit_args, spec, placement = self._checked(args, dict(kwargs))
        if self.before_start is not None:
            self.before_start()
        run_logger = make_logger(fit_args.logger, fit_args.log_dir, fit_args.run_name,
                                 fit_args.wandb_project)
        if fit_args.trace is True and not hasattr(run_logger, "run_dir"):
            raise ValueError(_NO_RUN_FOLDER)
        return self._fit_spec(spec, placement, run_logger, fit_args.progress, fit_args.trace)

    fit.__signature__ = fit_signature(  # type: ignore[attr-defined]
        {"Strategy": Strategy, "Logger": Logger, "ProgressSink": ProgressSink}, torch.nn.Module)
    fit.__doc__ = "Train and return the average of the ranks' final models.\n\n" + fit_args_doc()

    def _packing(self, spec: RunSpec, placement: Placement, processes: int | None) -> int | None:
        """Processes to pack the ranks into (None: one per rank); see :func:`simulation_processes`."""
        return simulation_processes(spec, placement, processes)

    def _stacking(self, spec: RunSpec, placement: Placement, stack: bool | str,
                  processes: int | None) -> tuple[int | None, Placement]:
        """The processes and placement of ``fit(stack=...)``; see :func:`simulation_stacking`."""
        return simulation_stacking(spec, placement, stack, processes, self._processes)

    def _check_memory(self, spec: RunSpec, placement: Placement) -> StateBytes:
        """Refuse a run whose ranks' training state does not fit this machine's memory."""
        return check_memory(spec, spec.num_nodes, self._processes or spec.num_nodes,
                            stacked=placement.stacked)

    def _placement(self, spec: RunSpec) -> Placement:
        """Where the ranks run: here, every rank shares this machine."""
        return spec.placement_here()

    def _fit_spec(self, spec: RunSpec, placement: Placement, run_logger: Logger | None,
                  progress: bool | ProgressSink, trace: str | bool | None = None
                  ) -> torch.nn.Module:
        if isinstance(progress, bool):
            reporter = RunReporter(spec.num_nodes, show=progress, log_interval=spec.log_interval)
        else:
            reporter = progress
        self.history = []
        self.rank_stats = {}
        self._packed_tallies = {}
        self.run_config = spec.config()
        labels: dict[int, list[int]] = {}

        def on_event(event: dict[str, Any]) -> None:
            if event.get("event") == "step":
                self.history.append({k: v for k, v in event.items() if k != "event"})
            elif event.get("event") == "start" and "labels" in event:
                labels[event["rank"]] = event["labels"]
                labels.update(enumerate(event.get("labels_by_rank") or []))
            elif event.get("event") == "done":
                self.rank_stats[event["rank"]] = event
            reporter.on_event(event)
            if run_logger is not None:
                run_logger.log_event(event)
            if tracer.started:
                tracer.on_event(event)

        if run_logger is not None:
            run_logger.start(spec.config())
            self.log_dir = getattr(run_logger, "run_dir", None)
        tracer = self._start_trace(spec, trace)
        started = time.perf_counter()
        failed = True
        error: BaseException | None = None
        try:
            with sigterm_as_interrupt():  # SIGTERM stops the run as Ctrl-C does
                states = self._execute(spec, placement, on_event)
            failed = False
        except KeyboardInterrupt as exc:
            error = exc
            raise FitInterrupted(interrupted_message(spec)) from None  # one line, not two
        except BaseException as exc:
            error = exc
            raise
        finally:
            reporter.close()
            self.history.sort(key=lambda r: (r["step"], r["rank"]))
            self.summary = summarize(self.history, spec.num_nodes, time.perf_counter() - started,
                                     labels)
            if self._scratch is not None:
                self.summary["notes"] = [self._scratch.note]
            if self._processes:
                self.summary["processes"] = self._processes
                if self._packed_tallies:
                    self.summary["packed"] = PackedTally.total(
                        [self._packed_tallies[i] for i in sorted(self._packed_tallies)])
            if placement.stacked:
                self.summary["stacked"] = True
            membership = spec.membership()
            if membership is not None:
                self.summary["membership"] = membership.changes(self.summary["steps"])
            goodput = self._goodput(spec)
            if goodput is not None:
                self.summary["goodput"] = goodput
            peaks = [s.get("peak_rss_bytes", 0) for s in self.rank_stats.values()]
            if peaks:
                self.summary["peak_rss_bytes_per_rank"] = max(peaks)
            if self.state_bytes is not None:
                self.summary["state_bytes_per_rank"] = self.state_bytes.per_rank
            if run_logger is not None:
                run_logger.finish(self.summary, failed=failed)
            self._end_trace(tracer, spec, error)
        reporter.finish(self.summary, title=self.summary_title)
        final = copy.deepcopy(self.model)
        if states:  # none for a host's rank that was away at the end (exogym.membership.hosts)
            final.load_state_dict(average_state_dicts(states))
        return final

    def _goodput(self, spec: RunSpec) -> dict[str, Any] | None:
        """``summary['goodput']`` (:mod:`exogym.report.goodput`): in full for a run whose
        ranks came and went, the plain fraction otherwise (None: not measured here)."""
        changes = self.summary.get("membership") or []
        measured = measure_goodput(self.history, getattr(spec.strategy, "round_steps", 1),
                                   spec.num_nodes, failures=spec.rank_failures or (),
                                   changes=changes)
        return goodput_summary(measured, detail=len(changes) > 1 or bool(spec.rank_failures))

    def _start_trace(self, spec: RunSpec, trace: str | bool | None) -> TraceWriter:
        """The run's trace writer, started when ``fit(trace=...)`` asks for one
        (:mod:`exogym.report.trace`); a run resumed from a checkpoint continues the trace
        already there."""
        tracer = TraceWriter()
        if trace is None:
            self.trace_path = None
            return tracer
        if trace is True:
            if self.log_dir is None:
                raise ValueError(_NO_RUN_FOLDER)
            trace = str(self.log_dir)
        self.trace_path = trace_path(trace)
        tracer.start(self.trace_path, source=self.trace_source, num_nodes=spec.num_nodes,
                     config=self.run_config, run=spec.run_identity,
                     append=spec.resume_from is not None)
        membership = spec.membership()
        if membership is not None:
            # the simulated schedule is known: note when the ranks reach each change
            tracer.watch(c["step"] - 1 for c in membership.changes(1 << 62))
            tracer.watch(at - 1 for _, at, _ in spec.rank_failures or ())
        return tracer

    def _end_trace(self, tracer: TraceWriter, spec: RunSpec, error: BaseException | None) -> None:
        """Write what the events did not say (the simulated schedule's changes, the failure)
        and publish the trace under its final name."""
        if not tracer.started:
            return
        for rank, at, back in spec.rank_failures or ():
            if at <= self.summary.get("steps", 0):
                tracer.scheduled("fault", at, rank=rank, what="leaves", back_at_step=back)
        for change in self.summary.get("membership") or []:
            tracer.scheduled("membership", change["step"], ranks=change["ranks"],
                             reason=change["reason"])
        why = None
        if error is not None:
            lines = [line for line in str(error).splitlines() if line.strip()] or \
                [type(error).__name__]
            why = lines[-1].strip() if len(lines) > 1 else lines[0]
            if isinstance(error, RankFailedError):
                tracer.fault(rank=error.rank, what="failed", error=why)
            elif isinstance(error, KeyboardInterrupt):
                why = "interrupted"
        tracer.end(failed=error is not None, error=why)

    def _execute(self, spec: RunSpec, placement: Placement,
                 on_event: Callable[[dict[str, Any]], None]) -> list[dict[str, torch.Tensor]]:
        """Run the ranks as local processes; return their final states in rank order.

        Packed (several ranks to a process), each process sums its ranks' states:
        the one state returned is the average of them all.
        """
        ctx = _mp_context(spec, placement)
        payload = _Portable(spec)
        packed = self._processes
        count = packed or spec.num_nodes
        local = None if packed else SharedMemoryCollectives.for_model(
            spec.model, spec.num_nodes, ctx, spec.timeout_s)
        pipes = [ctx.Pipe(duplex=True) for _ in range(count)]
        # Events received and not yet handed on: a Ctrl-C or SIGTERM in the middle of a
        # message leaves its rest here, for the way out.
        inbox: collections.deque[dict[str, Any]] = collections.deque()
        store = None
        run_id = new_run_id()
        # What a forked rank inherits, given to the others (None: forked, it has it).
        environ = None if ctx.get_start_method() == "fork" else dict(os.environ)
        with tempfile.TemporaryDirectory(prefix="exogym-") as result_dir:
            if packed:
                placement = dataclasses.replace(placement, processes=packed)
                releases = None if self._scratch is None else self._scratch.releases
                procs = [ctx.Process(target=_packed_process_entry, name=f"exogym-ranks{index}",
                                     args=(payload, placement, index, packed, pipes[index][1],
                                           result_dir, os.getpid(), run_id, environ, releases))
                         for index in range(packed)]
            else:
                procs = [
                    ctx.Process(target=_local_rank_entry, name=f"exogym-rank{rank}",
                                args=(payload, placement, rank, pipes[rank][1], result_dir,
                                      os.getpid(), local, environ))
                    for rank in range(spec.num_nodes)
                ]
            try:
                for p in procs:
                    p.start()
                for _, child_end in pipes:
                    child_end.close()
                # Only now: the store's server thread must not exist while ranks are forked.
                store = _open_store(self.start_port)
                for parent_end, _ in pipes:
                    try:
                        parent_end.send(store.port)
                    except OSError:
                        pass  # that rank already died: _collect reports how
                paths = self._collect(procs, [parent_end for parent_end, _ in pipes], on_event,
                                      lambda i: _process_name(spec.num_nodes, packed, i),
                                      inbox, self._packed_tallies)
                # One state (or process's sum) loaded at a time: the parent holds one sum,
                # never every rank's model.
                total = RunningSum()
                for i in range(count):
                    if paths[i] is None:
                        continue
                    loaded = torch.load(paths[i], map_location="cpu", weights_only=True)
                    if packed:
                        total.add(loaded["sums"], loaded["count"])
                    else:
                        total.add(loaded)
                    del loaded
                if not total.count:
                    return []
                return [average_of_sums([(total.sums, total.count)], spec.model.state_dict())]
            finally:
                _stop(procs)
                # What the ranks sent on their way out (an interrupted run's last steps)
                # still reaches the trace and the loggers.
                _forward_rest([parent_end for parent_end, _ in pipes], on_event, inbox)
                for parent_end, child_end in pipes:
                    parent_end.close()
                    child_end.close()
                remove_segments(run_id)  # what a process that died left in shared memory
                del store

    @staticmethod
    def _collect(procs, readers: list[connection.Connection],
                 on_event: Callable[[dict[str, Any]], None],
                 name: Callable[[int], str] = lambda i: f"rank {i}",
                 inbox: collections.deque[dict[str, Any]] | None = None,
                 tallies: dict[int, dict[str, Any]] | None = None
                 ) -> dict[int, str | None]:
        """Handle every process's events until each has reported its result; raise on failure.

        A message's events wait in ``inbox`` until each is handled: what an interruption
        leaves there (``on_event`` raised), :func:`_forward_rest` hands on.

        Returns each process's result file (None where it has none), by process index;
        ``tallies`` receives each packed process's account
        (:class:`~exogym.comm.packed.PackedTally`), by process index.
        """
        inbox = collections.deque() if inbox is None else inbox
        paths: dict[int, str] = {}
        errors: list[dict[str, Any]] = []
        error_deadline = None
        rank_of = {p.sentinel: rank for rank, p in enumerate(procs)}
        watching = list(readers) + [p.sentinel for p in procs]

        def handle(event: dict[str, Any]) -> None:
            nonlocal error_deadline
            kind = event.get("event")
            if kind == "error":
                # Peers of a failing rank may fail too, with connection errors; wait briefly
                # for every report so the rank that failed first is the one named.
                errors.append(event)
                error_deadline = error_deadline or time.monotonic() + 2.0
            elif kind == "result":
                paths[event["process"]] = event["path"]
                if tallies is not None and event.get("packed"):
                    tallies[event["process"]] = event["packed"]
            else:
                on_event(event)

        def drain(conn: connection.Connection) -> bool:
            """Handle what ``conn`` holds now; False once its writer has closed."""
            try:
                while conn.poll():
                    # Ctrl-C and SIGTERM wait until a message taken off the pipe is handed
                    # on whole, each event once: cut in two, its events were lost to the
                    # trace (a second Ctrl-C does not wait).
                    with interruptions_deferred():
                        message = conn.recv()
                        inbox.extend(message if isinstance(message, list) else [message])
                        while inbox:
                            handle(inbox.popleft())
            except (EOFError, OSError):
                return False
            return True

        while len(paths) < len(procs):
            if errors and (time.monotonic() > error_deadline
                           or all(p.exitcode is not None for p in procs)):
                raise _root_cause(errors)
            for ready in connection.wait(watching, timeout=0.2):
                if isinstance(ready, connection.Connection):
                    if not drain(ready):
                        watching.remove(ready)
                    continue
                index = rank_of[ready]  # this process has exited
                watching.remove(ready)
                reader = readers[index]
                drain(reader)
                if reader in watching:
                    watching.remove(reader)
                if index not in paths and not errors:
                    procs[index].join(timeout=1.0)
                    raise RankFailedError(
                        index, f"{name(index)} died with exit code {procs[index].exitcode} "
                        "before reporting an error (killed, out of memory, or it could not "
                        "unpickle the model/dataset: classes must be importable from a "
                        "module or the main script)")
        return paths


def _process_name(world_size: int, processes: int | None, index: int) -> str:
    """How an error names a simulation's process: its rank, or the ranks it packs."""
    if not processes:
        return f"rank {index}"
    ranks = process_ranks(world_size, processes, index)
    return f"the process of ranks {ranks.start}..{ranks.stop - 1}"


_COMM_MARKERS = ("gloo", "Connection reset", "Connection closed", "DistBackendError",
                 "DistNetworkError", "NCCL")


def _root_cause(errors: list[dict[str, Any]]) -> RankFailedError:
    """The error of the rank that failed on its own, not of a peer it took down."""
    own = [e for e in errors if not any(m in e["traceback"] for m in _COMM_MARKERS)]
    event = (own or errors)[0]
    return RankFailedError(event["rank"], f"rank {event['rank']} failed:\n{event['traceback']}")


def _forward_rest(readers: list[connection.Connection],
                  on_event: Callable[[dict[str, Any]], None],
                  inbox: collections.deque[dict[str, Any]] | None = None) -> None:
    """Hand ``on_event`` the metric events still waiting in ``inbox`` (the rest of a
    message whose handling was interrupted) and in ``readers`` (the ranks have stopped):
    their results and errors are left out, the run's outcome is decided."""
    waiting = list(inbox or ())
    for conn in readers:
        try:
            while conn.poll():
                message = conn.recv()
                waiting += message if isinstance(message, list) else [message]
        except (EOFError, OSError):
            continue
    for event in waiting:
        if event.get("event") not in ("error", "result"):
            on_event(event)


def _stop(procs, grace_s: float = 3.0) -> None:
    """Stop any rank still running: SIGTERM, then SIGKILL after ``grace_s``."""
    alive = [p for p in procs if p.pid is not None and p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5)


class FitInterrupted(KeyboardInterrupt):
    """``fit`` was stopped by Ctrl-C or SIGTERM; the message says how to continue."""


def interrupted_message(spec: RunSpec) -> str:
    """One line for an interrupted fit: where its newest complete checkpoint is and how to
    continue from it (or that there is none)."""
    said = "fit() was interrupted; the ranks were stopped"
    if not spec.checkpoint_interval:
        return (said + " and no checkpoint was asked for (checkpoint_interval), so a new fit "
                       "starts over")
    from exogym.run.checkpoint import list_steps

    root = Path(spec.save_dir) / (spec.run_name or "run")
    held = [set(list_steps(root, rank)) for rank in range(spec.num_nodes)]
    common = set.intersection(*held) if held else set()
    if not common:
        return said + f"; no checkpoint was complete yet in {root}"
    return (said + f"; the newest checkpoint every rank has is at step {max(common)} in "
                   f"{root}: call fit again with the same arguments and resume_from='auto' "
                   "to continue from it")


class LocalTrainer(Trainer):
    """The simulation on this machine (the same as :class:`Trainer`)."""
