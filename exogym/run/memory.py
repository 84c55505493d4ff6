"""minibatch_size='auto': the largest minibatch that fits, measured, not guessed.

For each divisor of ``batch_size`` from the largest down, one forward and
backward pass runs on a copy of the model with a real minibatch, and its peak
memory is measured (CUDA: the allocator's peak; MPS: the driver's allocation;
CPU: the process's peak resident set on Linux). Optimizer state is added as
two copies of the trainable parameters (Adam-like). The first size whose peak,
times the ranks sharing the device, stays under ``max_memory_usage`` of the
device's memory (or of RAM) wins.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from exogym import comm
from exogym.base.plural import plural
from exogym.config.parsers import divisors
from exogym.data.loading import build_dataset, data_loader, to_device
from exogym.run.devices import rank_device
from exogym.run.model_loss import model_loss
from exogym.run.spec import Placement, RunSpec


def total_memory(device: torch.device) -> int:
    """Bytes of memory on ``device`` (RAM for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory())
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


#: Device types on which this process has run a forward and backward for a measure.
_WARMED: set[str] = set()


def _give_back_free_memory() -> None:
    """Return the memory glibc's allocator holds free to the system (elsewhere: nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (VmHWM)
        return True
    except OSError:
        return False


def measure_peak(model: torch.nn.Module, batch, device: torch.device, autocast: bool) -> int:
    """Peak bytes of one forward+backward of ``model`` on ``batch`` (model copy included)."""
    ctx = (torch.autocast(device_type=device.type, dtype=torch.bfloat16)
           if autocast else torch.autocast(device_type=device.type, enabled=False))
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    elif device.type == "mps":
        torch.mps.empty_cache()
        base = torch.mps.driver_allocated_memory()
    else:
        # Freed memory the allocator keeps would be reused unseen by the resident set, and a
        # process's first backward allocates what it keeps for good: give the first back to
        # the system and take the second out of the measure, so a probe measures what one
        # forward and backward take, however many ran in the process before.
        if device.type not in _WARMED:
            _WARMED.add(device.type)
            work = copy.deepcopy(model).to(device)
            with ctx:
                model_loss(work, to_device(batch, device)).backward()
            del work
        _give_back_free_memory()
        if not _reset_cpu_peak():
            raise RuntimeError("minibatch_size='auto' on the CPU needs Linux's /proc to measure "
                               "memory; give minibatch_size explicitly")
        base = _rss_kib("VmRSS") * 1024
    work = copy.deepcopy(model).to(device)
    with ctx:
        loss = model_loss(work, to_device(batch, device))
    loss.backward()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    elif device.type == "mps":
        peak = torch.mps.driver_allocated_memory() - base
    else:
        peak = _rss_kib("VmHWM") * 1024 - base
    del work, loss
    return max(0, int(peak))


def probe_minibatch(spec: RunSpec, max_memory_usage: float,
                    placement: Placement | None = None) -> tuple[int, dict[int, int]]:
    """The largest minibatch dividing ``spec.batch_size`` that fits; also the peaks measured.

    Args:
        spec: the run.
        max_memory_usage: the share of the device's memory (or RAM) the ranks may use.
        placement: this machine's ranks and devices (default: every rank here, as in a
            simulation); only the ranks that share this machine's device count.
    """
    if not 0.0 < max_memory_usage <= 1.0:
        raise ValueError(f"max_memory_usage must be in (0, 1], got {max_memory_usage!r}")
    placement = placement or spec.placement_here()
    device = rank_device(spec.device_type, placement.devices, 0)
    if spec.device_type == "cuda":
        sharing = math.ceil(placement.ranks_per_machine / len(placement.devices or [0]))
    else:
        sharing = placement.ranks_per_machine
    budget = max_memory_usage * total_memory(device)
    dataset = build_dataset(spec.train_dataset, 0, spec.num_nodes, True)
    optimizer_bytes = 2 * sum(p.numel() * p.element_size()
                              for p in spec.model.parameters() if p.requires_grad)
    peaks: dict[int, int] = {}
    for size in sorted(divisors(spec.batch_size), reverse=True):
        loader = data_loader(dataset, spec.dataloader_kwargs, batch_size=size, shuffle=False)
        batch = next(iter(loader))
        try:
            peak = measure_peak(spec.model, batch, device, spec.autocast) + optimizer_bytes
        except torch.OutOfMemoryError:
            peak = None
        if peak is not None:
            peaks[size] = peak
            if peak * sharing <= budget:
                return size, peaks
    smallest = peaks.get(1)
    need = f"{smallest * sharing / 2**30:.2f} GiB" if smallest else "more than the device has"
    raise ValueError(
        f"minibatch_size='auto': even a minibatch of 1 needs {need} for {plural(sharing, 'rank')} "
        f"on {device}, over max_memory_usage={max_memory_usage} of {total_memory(device) / 2**30:.1f}"
        " GiB; use fewer nodes, a smaller model or a larger max_memory_usage"
    )


def with_measured_minibatch(spec: RunSpec, placement: Placement | None = None) -> RunSpec:
    """``spec``, its ``minibatch_size='auto'`` replaced by the largest that fits (measured
    for the ranks ``placement`` puts on this machine)."""
    if spec.minibatch_size != "auto":
        return spec
    size, _ = probe_minibatch(spec, spec.max_memory_usage, placement)
    return dataclasses.replace(spec, minibatch_size=size)


# -- the training state a rank holds, accounted before any rank starts --------------------

#: What a rank's process holds before any model: the interpreter, torch and its libraries
#: (measured: 0.3-0.4 GiB of resident memory per process on Linux).
RUNTIME_BYTES = 400 * 2**20


@dataclass(frozen=True)
class StateBytes:
    """A rank's training state in bytes: what memory holds besides activations and the runtime.

    Args:
        parameters: the model's parameters and buffers.
        gradients: one gradient per trainable parameter, held only while a rank steps
            (ranks packed in one process step in turn: they need one set between them).
        optimizer: the inner optimizer's state (Adam: two copies of the parameters).
        strategy: what the strategy keeps per rank (e.g. DiLoCo's deltas).
        shared: what the strategy keeps that is the same on every rank (DiLoCo's outer
            parameters and optimizer): held once by ranks packed in one process.
    """

    parameters: int
    gradients: int
    optimizer: int
    strategy: int
    shared: int

    @property
    def per_rank(self) -> int:
        """The whole state of one rank with a process of its own."""
        return self.parameters + self.gradients + self.optimizer + self.strategy + self.shared

    def on_machine(self, ranks: int, processes: int, stacked: bool = False) -> int:
        """Bytes ``ranks`` ranks in ``processes`` processes hold, runtimes included; packed
        ranks step in turn and hold one set of gradients per process, stacked ranks
        (:mod:`exogym.run.stack`) compute together and hold one each."""
        own = self.parameters + self.optimizer + self.strategy
        if stacked:
            own += self.gradients
        gradients = 0 if stacked else self.gradients
        return ranks * own + processes * (gradients + self.shared + RUNTIME_BYTES)

    def describe(self) -> str:
        """The parts, for a message."""
        parts = [("parameters", self.parameters), ("gradients", self.gradients),
                 ("optimizer", self.optimizer), ("strategy", self.strategy + self.shared)]
        return ", ".join(f"{name} {gib(n)}" for name, n in parts if n)


def gib(nbytes: int) -> str:
    """``nbytes`` for a person: MiB below a GiB, else GiB."""
    return f"{nbytes / 2**20:.0f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> int:
    """The identity of the memory ``t`` lives in (on the meta device too)."""
    return t.untyped_storage()._cdata


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter and buffer on the meta device: no memory, same shapes."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                         requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _rehearse_round(strategy: Any, meta: torch.nn.Module) -> None:
    """Step a strategy set up on a meta model so that what it makes lazily exists: a step
    creates the optimizer's state; a step that ends a round, the strategy's (reached by
    moving its counter there: a round of H steps on meta is still H steps)."""
    trainable = [p for p in meta.parameters() if p.requires_grad]
    try:
        for step in (0, max(0, strategy.round_steps - 1)) if strategy.round_steps > 1 else (0,):
            strategy.set_step(max(strategy.local_step, step))
            for p in trainable:
                p.grad = torch.empty_like(p)
            strategy.step()
    except Exception:  # noqa: BLE001 - a strategy whose step needs real values: its set-up counts
        pass


def account_state(model: torch.nn.Module, strategy: Any, num_nodes: int) -> StateBytes:
    """The training state one rank of ``strategy`` on ``model`` holds, counted on shapes.

    The strategy is set up and run through one round on a copy of the model on the
    meta device (no memory, no data), so that what it creates lazily (an
    optimizer's moments, DiLoCo's deltas and outer momentum) is counted too.
    """
    from exogym.strategy.context import RankContext
    from exogym.strategy.outer import OuterState

    meta = _meta_copy(model)
    strategy = copy.deepcopy(strategy)
    context = RankContext.alone(meta, 0, num_nodes, max_steps=max(1, strategy.round_steps))
    # One written for exo gym may ask torch.distributed who it is: rank 0 of the run.
    with contextlib.nullcontext() if type(strategy).__module__.startswith("exogym.") \
            else comm.torch_identity(0, num_nodes):
        strategy.setup(context)
        _rehearse_round(strategy, meta)
    # Tensors are told apart by their storage: a view or ``p.data`` of a parameter is
    # the parameter's memory, not more of it.
    counted = {_storage(t) for t in list(meta.parameters()) + list(meta.buffers())}
    optimizer = 0
    for state in strategy.optim.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and _storage(value) not in counted:
                counted.add(_storage(value))
                optimizer += _nbytes(value)
    own = shared = 0

    def walk(value: Any, is_shared: bool, seen: set[int]) -> None:
        nonlocal own, shared
        if id(value) in seen or isinstance(value, torch.nn.Module):
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if _storage(value) not in counted:
                counted.add(_storage(value))
                if is_shared:
                    shared += _nbytes(value)
                else:
                    own += _nbytes(value)
            return
        if isinstance(value, dict):
            for v in value.values():
                walk(v, is_shared, seen)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, is_shared, seen)
        elif isinstance(value, torch.optim.Optimizer):
            walk(list(value.state.values()), is_shared, seen)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            walk(vars(value), is_shared or isinstance(value, OuterState), seen)

    walk(vars(strategy), False, set())
    params = sum(_nbytes(t) for t in list(meta.parameters()) + list(meta.buffers()))
    return StateBytes(parameters=params, gradients=sum(_nbytes(p) for p in meta.parameters()
                                                      if p.requires_grad),
                      optimizer=optimizer, strategy=own, shared=shared)


def available_memory() -> int:
    """Bytes of RAM this machine can give a new run now (Linux: MemAvailable; else all of it)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return total_memory(torch.device("cpu"))


def check_memory(spec: RunSpec, ranks: int, processes: int,
                 available: int | None = None, stacked: bool = False) -> StateBytes:
    """Refuse a run whose training state does not fit this machine's memory, before any
    rank starts; returns the state accounted.

    Only CPU ranks are checked (a GPU's memory is the minibatch probe's business).

    Args:
        spec: the run.
        ranks: ranks this machine runs.
        processes: the processes they run in (fewer than ``ranks`` when packed).
        available: bytes of memory there are (default :func:`available_memory`).
        stacked: the ranks of a process are stacked (each then holds its gradients).

    Raises:
        ValueError: naming the bytes per rank, the memory available and what to change.
    """
    state = account_state(spec.model, spec.strategy, spec.num_nodes)
    if spec.device_type != "cpu":
        return state
    need = state.on_machine(ranks, processes, stacked)
    have = available_memory() if available is None else available
    if need > have:
        packing = (f"{plural(ranks, 'rank')} in {plural(processes, 'process')}"
                   if processes != ranks else plural(ranks, "rank"))
        if stacked:
            packing += " (stacked: each holds its gradients)"
        raise ValueError(
            f"the run needs about {gib(need)} of memory on this machine before any "
            f"activation, and {gib(have)} is available: {packing}, each holding "
            f"{gib(state.per_rank)} of training state ({state.describe()}), plus "
            f"{gib(RUNTIME_BYTES)} of runtime per process. Use fewer ranks on this machine "
            "(num_nodes, or more hosts), pack ranks into fewer processes (processes=) so "
            "that what every rank holds the same is held once, lower minibatch_size, or "
            "train a smaller model")
    return state


# -- what packed ranks spend to save memory, only where memory is short ------------------

#: What torch's BLAS (Intel MKL) keeps for each thread that has run a matrix product, as
#: counted for every rank of a packed process: 4.5 MiB allocated after a step of the
#: 235k-parameter MLP of ``bench.sim_scale``.
SCRATCH_BYTES = 4 << 20
#: The share of the memory free beside the ranks' state that their kept scratch may take.
SCRATCH_SHARE = 1 / 8


def _share() -> str:
    return "an eighth" if SCRATCH_SHARE == 1 / 8 else f"{SCRATCH_SHARE:.0%}"


@dataclass(frozen=True)
class ScratchPlan:
    """Whether the ranks packed in processes give MKL's per-thread scratch back each time
    one hands its turn on (:attr:`exogym.comm.packed.PackedWorld.releases_scratch`), and
    the run's note saying why."""

    releases: bool
    note: str


def scratch_plan(state: StateBytes, ranks: int, processes: int,
                 available: int | None = None, stacked: bool = False) -> ScratchPlan:
    """Keep each packed rank's scratch between its turns unless memory is short.

    A rank of a packed process (:mod:`exogym.comm.packed`) is a thread, and MKL keeps
    a scratch buffer for each thread that has run a matrix product: kept by every
    rank, they take ``ranks`` x :data:`SCRATCH_BYTES` (4 GiB at 1024 ranks). Memory is
    short when that is more than :data:`SCRATCH_SHARE` of the memory this machine has
    free (``available``, default :func:`available_memory`) beside the ranks' state:
    then a rank gives its scratch back whenever it hands its turn on, and takes it
    again from the allocator at its next product.
    """
    have = available_memory() if available is None else available
    beside = max(0, have - state.on_machine(ranks, processes, stacked))
    kept = ranks * SCRATCH_BYTES
    if kept > SCRATCH_SHARE * beside:
        return ScratchPlan(True, f"memory is short for packed ranks to keep BLAS scratch between "
                                 f"turns ({ranks} x {gib(SCRATCH_BYTES)} = {gib(kept)}, over "
                                 f"{_share()} of the {gib(beside)} free beside the "
                                 "ranks' state): a rank gives it back whenever it hands its "
                                 "turn on")
    return ScratchPlan(False, f"packed ranks keep their BLAS scratch between turns ({ranks} x "
                              f"{gib(SCRATCH_BYTES)} = {gib(kept)}, within {_share()} "
                              f"of the {gib(beside)} free beside the ranks' state)")
