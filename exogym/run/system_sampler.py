"""What a rank reports of its host: CPU, memory and GPU use (the fields of a ``system`` event).

:meth:`SystemSampler.sample` reads, with psutil (imported when a sampler is made,
never when this module is) and, for a GPU, torch:

- ``cpu_percent``: the host's CPU use since the previous sample, percent of all its
  cores (from ``psutil.cpu_times``, as ``psutil.cpu_percent`` computes it, but with a
  baseline of its own, so that no other caller's reading moves it); ``cores``;
- ``rss_bytes``: this process's resident memory, with its ``pid`` (the ranks packed in
  one process share it);
- ``mem_available_bytes``, ``mem_total_bytes``: what the host has left, of its total
  (``psutil.virtual_memory``); ``low_memory`` when what is left falls under
  :func:`exogym.report.health.low_memory_threshold`;
- on CUDA: ``gpu`` (``cuda:N``), ``gpu_bytes`` (what this process's allocator holds,
  ``torch.cuda.memory_reserved``), ``gpu_total_bytes`` (the device's memory) and
  ``gpu_percent`` (``torch.cuda.utilization``, where the driver's NVML library is there);
- on MPS: ``gpu`` (``mps``), ``gpu_bytes`` (``torch.mps.driver_allocated_memory``) and
  ``gpu_total_bytes`` (``torch.mps.recommended_max_memory``, where torch has it).

What a host or torch cannot say is left out of the event, and not asked again.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from exogym.report.health import low_memory_threshold

__all__ = ["SystemSampler"]


def _busy_and_total(times: Any) -> tuple[float, float]:
    """CPU seconds busy and in all, from ``psutil.cpu_times()`` (psutil's own arithmetic:
    guest time is already counted in user time, and time waiting for I/O is idle)."""
    total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    idle = times.idle + getattr(times, "iowait", 0.0)
    return total - idle, total


class SystemSampler:
    """Samples this host's CPU, memory and (when ``device`` is one) GPU use.

    Args:
        device: the rank's device (CPU: no GPU figures).
        low_memory_bytes: available bytes under which the host is low on memory
            (default: :data:`exogym.report.health.LOW_MEMORY_SHARE` of its total).
    """

    def __init__(self, device: torch.device | None = None,
                 low_memory_bytes: float | None = None) -> None:
        import psutil

        self._psutil = psutil
        self._process = psutil.Process()
        self.low_memory_bytes = low_memory_bytes
        self._cpu = _busy_and_total(psutil.cpu_times())
        self.cores = psutil.cpu_count() or os.cpu_count() or 1
        self.device = device
        self.gpu: str | None = None
        if device is not None and device.type == "cuda" and torch.cuda.is_available():
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            self.gpu = f"cuda:{index}"
        elif device is not None and device.type == "mps":
            self.gpu = "mps"
        self._utilization = True  # False once the driver says it cannot tell

    def cpu_percent(self) -> float:
        """The host's CPU use since the previous call (or since the sampler was made)."""
        busy, total = _busy_and_total(self._psutil.cpu_times())
        last_busy, last_total = self._cpu
        self._cpu = (busy, total)
        if total <= last_total:
            return 0.0
        return round(min(100.0, max(0.0, 100.0 * (busy - last_busy) / (total - last_total))), 1)

    def sample(self) -> dict[str, Any]:
        """The ``system`` event's fields now."""
        memory = self._psutil.virtual_memory()
        fields: dict[str, Any] = {
            "pid": os.getpid(), "cpu_percent": self.cpu_percent(), "cores": self.cores,
            "rss_bytes": int(self._process.memory_info().rss),
            "mem_available_bytes": int(memory.available), "mem_total_bytes": int(memory.total),
            "low_memory": memory.available < low_memory_threshold(memory.total,
                                                                  self.low_memory_bytes)}
        if self.gpu is not None:
            fields.update(self._gpu())
        return fields

    def _gpu(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"gpu": self.gpu}
        if self.gpu == "mps":
            fields["gpu_bytes"] = int(torch.mps.driver_allocated_memory())
            if hasattr(torch.mps, "recommended_max_memory"):
                fields["gpu_total_bytes"] = int(torch.mps.recommended_max_memory())
            return fields
        fields["gpu_bytes"] = int(torch.cuda.memory_reserved(self.device))
        fields["gpu_total_bytes"] = int(torch.cuda.mem_get_info(self.device)[1])
        if self._utilization:
            try:
                fields["gpu_percent"] = float(torch.cuda.utilization(self.device))
            except Exception:  # noqa: BLE001 - no NVML library, or a device it cannot read
                self._utilization = False
        return fields
