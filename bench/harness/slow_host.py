"""A bed host held to part of its core: a cgroup v1 ``cpu`` group with a CPU quota.

The host's ``sshd`` is moved into the group before any rank starts, so every
process it starts (the rank, gloo's threads, the SSH session) is born in it and
shares ``fraction`` of one core. :class:`RankWatch` says which group each rank
of a job really ran in. :func:`held_hosts` holds every host of a bed to an equal
share (:func:`equal_share`), so that hosts that outnumber the cores still never
take each other's time.
"""

from __future__ import annotations

import errno
import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from tests.netbed import PREFIX, Testbed, worker_pid
from tests.netbed.stale import bed_stands

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
#: Cores left to the launcher (and the machine) when the hosts' share is chosen for them.
HEADROOM_CORES = 0.25
#: The smallest share a host may be held to: below it a step is stalled by the quota's
#: period more than it is slowed evenly.
MIN_SHARE = 0.25
#: Shares chosen for the hosts are rounded down to a multiple of this.
SHARE_STEP = 0.05
#: ``cpu.shares`` of a held host's group: eight processes' worth, so that the host gets its
#: quota while other processes on the machine wait (the quota still caps it).
HELD_WEIGHT = 8 * 1024


class SlowGroup:
    """A cgroup v1 ``cpu`` group whose processes share ``fraction`` of one core.

    Args:
        name: the group's folder under ``/sys/fs/cgroup/cpu`` (unique per bench).
        fraction: the quota, a fraction of ``cpu.cfs_period_us`` (100 ms).
        weight: the group's ``cpu.shares`` (default: the kernel's, 1024, as one process's):
            a larger one gives the group its quota before processes of the root group take
            the time, so that others' work on the machine does not cut it short.
    """

    def __init__(self, name: str, fraction: float, weight: int | None = None) -> None:
        self.path = CPU_CGROUP / name
        self.fraction = fraction
        self.weight = weight

    def create(self) -> None:
        """Make the group and set its period, quota and weight."""
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(round(PERIOD_US * self.fraction)))
        if self.weight is not None:
            (self.path / "cpu.shares").write_text(str(self.weight))

    def add(self, pid: int) -> None:
        """Move ``pid`` into the group; what it starts from now on is born in it.

        A process that is gone already is skipped: a host's sshd forks a child for every
        connection (the bed's own check that it answers, too), and such a child can exit
        between the listing of the host's processes and its move.
        """
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
        except ProcessLookupError:
            pass

    def members(self) -> list[int]:
        """The processes in the group."""
        return _read_pids(self.path)

    def throttled_s(self) -> float:
        """Seconds the group's processes have waited for their quota since it was made."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat.get("throttled_time", 0)) / 1e9

    def remove(self) -> None:
        """Move every process back to the root group, then delete the group."""
        release(self.path)


def cgroup_problems() -> list[str]:
    """What this machine lacks to hold a host to part of a core, with the fix (none: [])."""
    if (CPU_CGROUP / "cpu.cfs_quota_us").exists():
        return []
    return [f"the cgroup v1 cpu controller is not mounted at {CPU_CGROUP}: "
            f"mount -t cgroup -o cpu cgroup {CPU_CGROUP}"]


@contextmanager
def slowed(bed: Any, host: Any, fraction: float, part: str = "",
           weight: int | None = None) -> Iterator[SlowGroup]:
    """``host`` of ``bed`` held to ``fraction`` of a core for the block: its sshd moved into a
    new group (every rank it starts is born there); the group removed at the end, also on
    errors. ``part`` tells apart the groups of one bed when it holds several hosts;
    ``weight``: the group's ``cpu.shares`` (:class:`SlowGroup`)."""
    group = SlowGroup(f"{PREFIX}-{bed.tag}{'-' + part if part else ''}-slow", fraction, weight)
    group.create()
    try:
        for pid in bed.pids(host):
            group.add(pid)
        yield group
    finally:
        if group.path.exists():
            group.remove()
            print(f"removed {group.path}", flush=True)


def equal_share(hosts: int, cores: int | None = None) -> float:
    """The largest equal share of a core ``hosts`` hosts can each have on ``cores`` cores
    (default: this machine's), leaving :data:`HEADROOM_CORES` to the launcher: at most one
    core, rounded down to a multiple of :data:`SHARE_STEP`."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    share = min(1.0, (cores - HEADROOM_CORES) / hosts)
    return round(math.floor(share / SHARE_STEP + 1e-9) * SHARE_STEP, 2)


def check_share(share: float, hosts: int, cores: int | None = None) -> None:
    """ValueError, saying what to do, when ``hosts`` hosts held to ``share`` of a core each
    would be stalled by the quota (under :data:`MIN_SHARE`) or would need more than the
    ``cores`` there are (they would then take each other's time)."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    if not 0 < share <= 1:
        raise ValueError(f"a host's share must be a fraction of a core in (0, 1], got {share:g}")
    if share < MIN_SHARE - 1e-9:
        fits = int((cores - HEADROOM_CORES) // MIN_SHARE)
        raise ValueError(f"{hosts} hosts would each get {share:g} of a core, under the "
                         f"{MIN_SHARE:g} core a host needs here (a quota that small stalls "
                         f"steps at random): use {fits} hosts or fewer on this machine's "
                         f"{cores} cores")
    if share * hosts > cores + 1e-9:
        raise ValueError(f"{hosts} hosts at {share:g} of a core each need {share * hosts:g} "
                         f"cores, more than this machine's {cores}: they would take each "
                         f"other's time; give --share {equal_share(hosts, cores):g} or less")


@contextmanager
def held_hosts(bed: Testbed, share: float) -> Iterator[list[SlowGroup]]:
    """Every host of ``bed`` held to ``share`` of a core by a group of its own (its sshd
    moved in, so every rank it starts is born there), for the block; the groups removed
    at the end, also on errors. Each group has the weight :data:`HELD_WEIGHT`: it gets
    its share first when other processes want the cores too, and never more."""
    with ExitStack() as stack:
        yield [stack.enter_context(slowed(bed, host, share, f"h{host.index}", HELD_WEIGHT))
               for host in bed.hosts]


class _WhileBlock:
    """A thread that runs :meth:`_run` while a ``with`` block lasts; :meth:`_run` ends once
    ``_stop`` is set (the block's end) or when it is done."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def __enter__(self):  # noqa: ANN204 - the subclass's own type
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class GroupKeeper(_WhileBlock):
    """While a run lasts, moves every rank process born outside its host's group into it.

    A host's sshd is in its group, so the ranks it starts are born there; but a launcher
    that runs rank 0 itself (its host is the launcher's machine) starts it outside. The
    keeper looks at ``host``'s processes every ``interval`` seconds and moves each
    ``distributed.worker`` process (a rank, or its supervisor) into ``group``; a rank
    restarted after a failure is moved too. ``moved`` counts the processes it moved.

    Args:
        bed: the test bed.
        host: the host whose rank processes are kept in ``group``.
        group: the host's group.
        interval: seconds between looks.
    """

    def __init__(self, bed: Testbed, host: Any, group: SlowGroup, interval: float = 0.25) -> None:
        super().__init__()
        self.bed, self.host, self.group, self.interval = bed, host, group, interval
        self.moved = 0

    def _run(self) -> None:
        wanted = "/" + self.group.path.name
        while not self._stop.wait(self.interval):
            for pid in self.bed.pids(self.host):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"distributed.worker" in argv and cpu_cgroup_of(pid) not in (wanted, None):
                    self.group.add(pid)
                    self.moved += 1


def worker_groups(bed: Testbed) -> dict[int, str]:
    """For each host of ``bed`` running a ``distributed.worker`` process, its ``cpu`` group."""
    found: dict[int, str] = {}
    for host in bed.hosts:
        for pid in bed.pids(host):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            group = cpu_cgroup_of(pid) if b"distributed.worker" in argv else None
            if group is not None:
                found[host.index] = group
    return found


def release(group: Path) -> None:
    """Move ``group``'s processes to the root ``cpu`` group and delete ``group``.

    A process that exits between the listing and the move is skipped; an
    ``rmdir`` refused while the kernel still counts a process that just left
    is tried again for up to 5 seconds.
    """
    deadline = time.monotonic() + 5
    while group.exists():
        for pid in _read_pids(group):
            try:
                (CPU_CGROUP / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                pass
        try:
            group.rmdir()
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _read_pids(group: Path) -> list[int]:
    try:
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def reap_stale_groups() -> list[str]:
    """Remove the slow groups of earlier benches whose test bed is gone (killed unclean)."""
    removed = []
    for group in CPU_CGROUP.glob(f"{PREFIX}-*-slow"):
        tag = group.name.split("-")[1]
        if not bed_stands(tag):
            release(group)
            removed.append(f"cgroup {group}")
    return removed


def cpu_cgroup_of(pid: int) -> str | None:
    """The ``cpu`` controller's group of ``pid`` (``/`` for the root), or None if it is gone."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return None


class RankWatch(_WhileBlock):
    """While a job runs, finds each rank's process and notes its ``cpu`` group.

    Args:
        ranks: how many ranks the job has.
        marker: a string on the job's command line alone (its output folder).
    """

    def __init__(self, ranks: int, marker: str) -> None:
        super().__init__()
        self.ranks = ranks
        self.marker = marker
        self.found: dict[int, tuple[int, str]] = {}  # rank -> (pid, cpu group)

    def _run(self) -> None:
        while len(self.found) < self.ranks and not self._stop.wait(0.5):
            for rank in set(range(self.ranks)) - set(self.found):
                pid = worker_pid(rank, self.marker)
                group = None if pid is None else cpu_cgroup_of(pid)
                if group is not None:
                    self.found[rank] = (pid, group)
