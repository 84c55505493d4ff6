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

import copy
import dataclasses
import math
import os

import torch
from torch.utils.data import DataLoader

from exogym.data import build_dataset, loader_kwargs, to_device
from exogym.devices import rank_device
from exogym.fit_args import divisors
from exogym.spec import Placement, RunSpec


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
        if not _reset_cpu_peak():
            raise RuntimeError("minibatch_size='auto' on the CPU needs Linux's /proc to measure "
                               "memory; give minibatch_size explicitly")
        base = _rss_kib("VmRSS") * 1024
    work = copy.deepcopy(model).to(device)
    with ctx:
        loss = work(to_device(batch, device))
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
    placement = placement or Placement(ranks_per_machine=spec.num_nodes, devices=spec.devices)
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
        loader = DataLoader(dataset, batch_size=size, shuffle=False,
                            **loader_kwargs(dataset, spec.dataloader_kwargs))
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
        f"minibatch_size='auto': even a minibatch of 1 needs {need} for {sharing} rank(s) "
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
