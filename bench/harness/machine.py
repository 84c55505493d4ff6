"""What this machine's processes use: CPU time (the bench's own and everyone else's), memory."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def busy_ticks() -> int:
    """Clock ticks all cores have spent running processes since boot (``/proc/stat``).

    user + nice + system + steal: interrupt and softirq time is left out, since
    most of it here is the network stack carrying the bench's own traffic.
    """
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = (values + [0] * 8)[:8]
    return user + nice + system + steal


def process_ticks(pid: int) -> int:
    """Clock ticks ``pid`` has run (user and system, every thread); 0 when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(stat[11]) + int(stat[12])


@dataclass
class CpuSample:
    """Busy ticks of the machine and of the bench's own processes at one moment."""

    busy: int
    ours: dict[int, int]
    at: float

    @classmethod
    def take(cls, pids: Iterable[int]) -> CpuSample:
        """The machine's busy ticks and those of ``pids`` (the bench's processes), now."""
        return cls(busy_ticks(), {p: process_ticks(p) for p in pids}, time.monotonic())

    def other_cores(self, later: CpuSample) -> float:
        """Cores kept busy by processes that are not ours between the two samples."""
        ours = sum(later.ours.get(p, t) - t for p, t in self.ours.items())
        ours += sum(t for p, t in later.ours.items() if p not in self.ours)
        seconds = later.at - self.at
        if seconds <= 0:
            return 0.0
        return max(0.0, (later.busy - self.busy - ours) / CLOCK_TICKS / seconds)


def own_cpu_s() -> float:
    """CPU seconds this process has used, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        tree.setdefault(parent, []).append(int(entry.name))
    return tree


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_pss_bytes(root: int) -> tuple[int, dict[int, int]]:
    """The summed proportional set size (PSS: shared pages split among the processes that
    share them) of ``root`` and every process below it, and each one's."""
    tree = _children()
    each: dict[int, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        each[pid] = _pss_kib(pid) * 1024
        todo.extend(tree.get(pid, []))
    return sum(each.values()), each


def used_memory_bytes() -> int:
    """Memory this machine has in use, every process included (``MemTotal - MemAvailable``)."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


def rss_bytes() -> int:
    """This process's resident memory now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakPss:
    """Called with a process tree's root PID again and again (a ``timed_run`` sampler), keeps
    the peak of the tree's summed PSS and each process's own peak."""

    def __init__(self) -> None:
        self.root: int | None = None
        self.summed = 0
        self.each: dict[int, int] = {}

    def __call__(self, root: int) -> None:
        self.root = root
        total, each = tree_pss_bytes(root)
        self.summed = max(self.summed, total)
        for pid, pss in each.items():
            self.each[pid] = max(self.each.get(pid, 0), pss)

    def largest_below_root(self) -> int:
        """The peak of the largest process under the root (the root's, if it has none)."""
        below = [pss for pid, pss in self.each.items() if pid != self.root]
        return max(below) if below else self.each.get(self.root or -1, 0)
