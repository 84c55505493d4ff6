"""Tensors between the processes of one machine: shared-memory segments, announced in the store.

The processes of a packed simulation (:mod:`exogym.comm.packed`) exchange
partial results keyed by collective, not in one lockstep sequence. Each
process posts its part into a segment of shared memory it owns (a file in
``/dev/shm``, mapped by every reader), and announces it under the
collective's key in the run's store: a short control message naming the
segment and the byte range, never the bytes. Readers map the segment once
and read the part in place, with no copy through a socket. A reader counts
itself done in the store; the owner reuses the segment once every reader of
its last part has counted.

Segments are named by run, process and a serial number, so a name is never
reused; a reader maps only a segment of this run, of the process it expects,
of the size announced (:meth:`Mailbox.read`); the owner removes its files when
the world closes, and the trainer removes whatever a process that died left
behind (:func:`remove_segments`).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from exogym.comm.protocol import PeerTimeoutError

#: Smallest segment created (a part that small is common: scalars, small buckets).
MIN_SEGMENT_BYTES = 1 << 20
#: Segments a process keeps for reuse beyond those in use.
KEEP_FREE = 2
#: Mapped segments of other processes a reader keeps open.
KEEP_MAPPED = 8
#: An announcement: ``SEGMENT:SIZE:OFFSET:NBYTES``, the segment named ``RUN-PROCESS-SERIAL``.
_ANNOUNCEMENT = re.compile(r"(?P<name>[A-Za-z0-9_.-]+-(?P<serial>\d+)):"
                           r"(?P<size>\d{1,15}):(?P<offset>\d{1,15}):(?P<nbytes>\d{1,15})")


class AnnouncementError(RuntimeError):
    """A shared-memory announcement in the store names no segment of this run."""


def segment_dir() -> Path:
    """Where segments live: ``/dev/shm`` where it exists, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def new_run_id() -> str:
    """A name for one run's segments, unique on this machine."""
    return f"exogym-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_segments(run_id: str, directory: Path | None = None) -> int:
    """Remove every segment of run ``run_id`` still on disk; how many were removed."""
    directory = directory or segment_dir()
    removed = 0
    for path in directory.glob(f"{run_id}-*"):
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _map(path: Path, nbytes: int) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


class _Segment:
    """One shared-memory file of this process, mapped here."""

    def __init__(self, path: Path, nbytes: int):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self.path = path
        self.nbytes = nbytes
        self.data = _map(path, nbytes)
        # While in use: the key readers count themselves done under, how many will,
        # and the part's other keys, removed with it.
        self.busy: tuple[str, int, tuple[str, ...]] | None = None
        self.holding = False  # this process still reads its own part from it

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class Mailbox:
    """This process's segments, and the other processes' it reads.

    Thread-safe only under the caller's lock: a packed world calls it with its
    lock held for :meth:`take` and :meth:`reclaim`, and reads without it.

    Args:
        run_id: the run's name for its segments (:func:`new_run_id`).
        index: this process.
        store: opens a client of the run's store (each caller passes its own
            client to the reading and posting calls).
        timeout_s: how long a reader waits for a part to be announced.
        directory: where segments live (default :func:`segment_dir`).
    """

    def __init__(self, run_id: str, index: int, timeout_s: float,
                 directory: Path | None = None):
        self.run_id = run_id
        self.index = index
        self.timeout_s = float(timeout_s)
        self.directory = directory or segment_dir()
        self._serial = 0
        self._free: list[_Segment] = []
        self._busy: list[_Segment] = []
        self._mapped: OrderedDict[str, torch.Tensor] = OrderedDict()

    # -- this process's segments -------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a part of this process may still be unread by a peer."""
        return bool(self._busy)

    def reclaim(self, store: Any) -> None:
        """Take back the segments every reader has finished with."""
        still = []
        for segment in self._busy:
            count_key, readers, keys = segment.busy
            if not segment.holding and store.add(count_key, 0) >= readers:
                for key in (count_key, *keys):
                    store.delete_key(key)
                segment.busy = None
                self._free.append(segment)
            else:
                still.append(segment)
        self._busy = still
        while len(self._free) > KEEP_FREE:
            smallest = min(self._free, key=lambda s: s.nbytes)
            self._free.remove(smallest)
            smallest.remove()

    def take(self, nbytes: int, count_key: str, readers: int,
             keys: tuple[str, ...] = ()) -> _Segment:
        """A segment of at least ``nbytes`` for a part that ``readers`` processes will read;
        they count themselves done under ``count_key``; ``keys`` go when it is reclaimed."""
        fits = [s for s in self._free if s.nbytes >= nbytes]
        if fits:
            segment = min(fits, key=lambda s: s.nbytes)
            self._free.remove(segment)
        else:
            self._serial += 1
            size = max(MIN_SEGMENT_BYTES, -(-nbytes // 4096) * 4096)
            path = self.directory / f"{self.run_id}-{self.index}-{self._serial}"
            try:
                segment = _Segment(path, size)
            except OSError as exc:
                raise RuntimeError(f"could not create {size:,} bytes of shared memory at "
                                   f"{path} for a collective: {exc}") from exc
        segment.busy = (count_key, readers, keys)
        segment.holding = True
        self._busy.append(segment)
        return segment

    @staticmethod
    def release(segment: _Segment) -> None:
        """This process is done with its own part in ``segment``: once every reader has
        counted itself done too, the segment may be reused."""
        segment.holding = False

    @staticmethod
    def announce(store: Any, key: str, segment: _Segment, offset: int, nbytes: int) -> None:
        """Say in the store where the part posted under ``key`` lies."""
        store.set(key, f"{segment.path.name}:{segment.nbytes}:{offset}:{nbytes}")

    # -- other processes' segments -----------------------------------------------------

    def read(self, store: Any, key: str, what: Callable[[], str], owner: int) -> torch.Tensor:
        """The bytes announced under ``key`` by process ``owner`` (a view of its segment,
        not a copy).

        Waits for the announcement up to the mailbox's timeout; ``what`` says in an
        error what was waited for. An announcement is believed only when it names a
        segment of this run and of ``owner`` (``RUN-OWNER-SERIAL``, never a path), a byte
        range inside it, and a file of that very size that this user owns: a segment is
        mapped as it is, never a file extended or one elsewhere written.

        Raises:
            PeerTimeoutError: nothing was announced in time.
            AnnouncementError: the announcement is not one of this run's.
        """
        if not store.wait([key], self.timeout_s):
            raise PeerTimeoutError(f"{what()}: not posted within {self.timeout_s:.0f} s "
                                   "(the process that owes it failed or stopped)")
        raw = store.get(key)
        name, size, offset, nbytes = self._checked(key, raw, owner)
        data = self._mapped.get(name)
        if data is None:
            self._check_file(key, name, size)
            data = _map(self.directory / name, size)
            self._mapped[name] = data
            while len(self._mapped) > KEEP_MAPPED:
                self._mapped.popitem(last=False)
        else:
            self._mapped.move_to_end(name)
        return data[offset:offset + nbytes]

    def _checked(self, key: str, raw: bytes, owner: int) -> tuple[str, int, int, int]:
        """The segment, its size and the byte range an announcement names, if it is one
        this run's process ``owner`` can have made."""
        text = raw.decode("ascii", errors="replace")
        match = _ANNOUNCEMENT.fullmatch(text)
        if match is None or match["name"] != f"{self.run_id}-{owner}-{match['serial']}":
            raise AnnouncementError(f"store key {key!r} announces {text[:80]!r}, not a "
                                    f"segment of this run's process {owner}: refused")
        size, offset, nbytes = int(match["size"]), int(match["offset"]), int(match["nbytes"])
        if offset + nbytes > size:
            raise AnnouncementError(f"store key {key!r} announces bytes {offset}.."
                                    f"{offset + nbytes} of a {size}-byte segment: refused")
        return match["name"], size, offset, nbytes

    def _check_file(self, key: str, name: str, size: int) -> None:
        path = self.directory / name
        try:
            info = os.lstat(path)
        except OSError as exc:
            raise AnnouncementError(f"store key {key!r} announces segment {name}, which "
                                    f"cannot be read: {exc.strerror}") from None
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() \
                or info.st_size != size:
            raise AnnouncementError(f"store key {key!r} announces segment {name} of {size} "
                                    f"bytes, but {path} is not a file of this user of that "
                                    "size: refused")

    def drain(self, store: Any, timeout_s: float, poll_s: float = 0.005) -> list[str]:
        """Wait until every reader of this process's parts has counted itself done, up to
        ``timeout_s``; the count keys still short at the end (empty: all were read).

        A process that leaves right after a collective must not remove a segment a
        slower peer has yet to map: the peer would find the announced file gone.
        """
        for segment in self._busy:
            segment.holding = False  # this process reads nothing more
        deadline = time.monotonic() + timeout_s
        while True:
            self.reclaim(store)
            if not self._busy or time.monotonic() >= deadline:
                return [segment.busy[0] for segment in self._busy]
            time.sleep(poll_s)

    def close(self) -> None:
        """Remove this process's segments and forget the others'."""
        for segment in self._free + self._busy:
            segment.remove()
        self._free, self._busy = [], []
        self._mapped.clear()
