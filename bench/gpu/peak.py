"""DiLoCo that notes, in each rank's process, the most CUDA memory the process has allocated.

It runs inside the ranks, of this project or of exo-explore/gym (whichever
``exogym`` is imported: both have ``exogym.strategy.diloco.DiLoCoStrategy``).
After each step, when ``torch.cuda.max_memory_allocated()`` of the process's
device has grown since it last wrote, it writes that figure to
``$BENCH_GPU_PEAK_DIR/PID.json`` (atomically). Packed ranks share a process
and so a file. A step costs one call into the allocator's counters; files are
written a few times a run, while the peak grows.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch

from bench.gpu import PEAK_DIR_ENV
from exogym.strategy.diloco import DiLoCoStrategy

_written: dict[int, int] = {}  # pid -> the peak last written (a forked process starts anew)
_lock = threading.Lock()  # packed ranks may step in threads of one process


class PeakNotingDiLoCo(DiLoCoStrategy):
    """:class:`DiLoCoStrategy` (its arguments) that notes its process's peak CUDA memory after
    every step, as the module says."""

    def step(self) -> None:
        super().step()
        note_peak()


def note_peak() -> None:
    """Write this process's peak allocated CUDA memory when it grew (CUDA ranks only)."""
    folder = os.environ.get(PEAK_DIR_ENV)
    if not folder or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    with _lock:
        peak = torch.cuda.max_memory_allocated()
        pid = os.getpid()
        if peak <= _written.get(pid, 0):
            return
        path = Path(folder) / f"{pid}.json"
        part = path.with_suffix(".part")
        part.write_text(json.dumps({"pid": pid, "max_memory_allocated": peak}))
        part.replace(path)
        _written[pid] = peak


def summed_peaks(folder: Path) -> int | None:
    """The sum of the peaks the processes wrote to ``folder`` (None: none wrote)."""
    peaks = [json.loads(p.read_text())["max_memory_allocated"] for p in folder.glob("*.json")]
    return sum(peaks) if peaks else None
