"""Which device each rank trains on, and which backend joins the ranks."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

import torch

from exogym import comm
from exogym.base.plural import plural
from exogym.config.parsers import parse_device


def best_device_type() -> str:
    """``'cuda'`` if a GPU is usable, else ``'mps'`` on Apple silicon, else ``'cpu'``."""
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def resolve_devices(device: str | torch.device | None,
                    devices: Sequence[int] | None) -> tuple[str, list[int] | None]:
    """Check ``device``/``devices`` now and return (device type, device indices).

    ``device`` may be ``None`` (best available), ``'cpu'``, ``'cuda'``, ``'cuda:1'``
    or ``'mps'``; ``devices`` lists CUDA indices to spread ranks over
    (rank r uses ``devices[r % len(devices)]``).
    """
    kind, index = parse_device(device)
    if kind == "best":
        kind = best_device_type()
    if kind == "cpu":
        if devices:
            raise ValueError("devices= lists GPU indices; it cannot be used with device='cpu'")
        return "cpu", None
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError("device='mps' was asked for, but MPS is not available on this "
                             "machine; use device='cpu'")
        return "mps", None
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but no CUDA GPU is available; "
                         "use device='cpu' (or leave device unset to pick the best available)")
    count = torch.cuda.device_count()
    if index:
        if devices:
            raise ValueError(f"give either device='cuda:{index}' or devices=, not both")
        devices = [int(index)]
    if devices is None:
        devices = list(range(count))
    devices = [int(d) for d in devices]
    if not devices:
        raise ValueError("devices= is empty; list at least one GPU index")
    bad = [d for d in devices if not 0 <= d < count]
    if bad:
        raise ValueError(f"devices {bad} do not exist: this machine has {plural(count, 'CUDA GPU')} "
                         f"(indices 0..{count - 1})")
    return "cuda", devices


def rank_device(device_type: str, devices: Sequence[int] | None, rank: int,
                process: int | None = None) -> torch.device:
    """The device rank ``rank`` uses: on CUDA ``devices[rank % len]``, or, for a rank packed
    into process ``process`` (:mod:`exogym.comm.packed`), that process's
    ``devices[process % len]``: the ranks of a process share its device and context."""
    if device_type == "cuda":
        assert devices
        return torch.device("cuda", devices[(rank if process is None else process) % len(devices)])
    return torch.device(device_type)


def backend_for(device_type: str, devices: Sequence[int] | None, num_nodes: int) -> str:
    """nccl when every rank has a GPU of its own, else gloo."""
    if device_type == "cuda" and devices is not None and len(set(devices)) >= num_nodes:
        if comm.nccl_available():
            return "nccl"
    return "gloo"


def available_cores() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_threads(num_nodes: int) -> int:
    """Compute threads per rank: the cores this process may use, shared evenly."""
    return max(1, available_cores() // max(1, num_nodes))


def loopback_interface() -> str | None:
    """Name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None
