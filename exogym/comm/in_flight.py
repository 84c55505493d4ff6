"""A rank's collectives in flight, as another thread reads them: bytes done of bytes sent, since when.

The comm module (:mod:`exogym.comm.collectives`) keeps one :class:`LinkProgress` per
rank (:func:`exogym.comm.link_progress`) and updates it on the rank's own thread:
when a counted collective starts (with its payload: the bytes ``comm_bytes`` counts
for it), as each of its pieces completes, and when it ends. Another thread (the
rank's monitor, :mod:`exogym.run.monitor`) reads :meth:`LinkProgress.snapshot` at any
moment: every update publishes a new immutable :class:`LinkSnapshot`, so a reader
never sees half an update and never takes a lock the rank could wait on.

**Pieces.** Progress advances a piece at a time: a bucket of
:func:`~exogym.comm.all_reduce_tensors` (at most ``BUCKET_BYTES``, 32 MiB: a
23M-parameter model's 92 MB all-reduce moves in three steps), or the whole tensor of
a single-tensor collective. A bucket is one call of the transport (one gloo or NCCL
all-reduce) whose inside cannot be seen. Buckets are not cut smaller for the sake
of progress: gloo's ring sums each segment of a buffer starting from another rank,
so the same values cut differently are added in another order (3 ranks, 8M values
cut into 8 calls: 1.7M sums differed in their last bits), and a run must give the
same numbers whether or not anyone watches it.

An asynchronous collective is in flight from its start until its handle's ``wait()``
returns; an asynchronous single-tensor collective (whose handle is the transport's
own) is not followed. Torch-free: plain numbers.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["LinkProgress", "LinkSnapshot"]


class LinkSnapshot(NamedTuple):
    """A rank's counted collectives at one moment.

    Args:
        in_flight: collectives started and not yet ended.
        bytes_total: the payload of those in flight (0 when none).
        bytes_done: of ``bytes_total``, the bytes whose pieces have completed.
        started_at: the clock when the oldest collective in flight started (None when none).
        advanced_at: the clock when a piece of those in flight last completed (None before).
        bytes_finished: payload bytes of every piece completed so far: what ``comm_bytes``
            counts once no collective is in flight.
        busy_s: seconds with a collective in flight, up to the moment the last one ended
            (see :meth:`busy_at` for the time up to now).
        busy_since: the clock when the link last became busy (None while idle).
        collectives: collectives ended so far.
        last_started_at, last_bytes, last_s: the collective that ended last: when it
            started, the bytes of it done, and the seconds it lasted (None, 0, 0.0 before one).
    """

    in_flight: int = 0
    bytes_total: int = 0
    bytes_done: int = 0
    started_at: float | None = None
    advanced_at: float | None = None
    bytes_finished: int = 0
    busy_s: float = 0.0
    busy_since: float | None = None
    collectives: int = 0
    last_started_at: float | None = None
    last_bytes: int = 0
    last_s: float = 0.0

    @property
    def done(self) -> float | None:
        """The share of the collectives in flight that is done, 0..1 (None when none is)."""
        if not self.in_flight:
            return None
        return self.bytes_done / self.bytes_total if self.bytes_total else 0.0

    def busy_at(self, now: float) -> float:
        """Seconds with a collective in flight, up to ``now`` (a time of the same clock)."""
        ongoing = now - self.busy_since if self.busy_since is not None else 0.0
        return self.busy_s + max(0.0, ongoing)


class LinkProgress:
    """One rank's collectives in flight: written by the rank's thread, read from any.

    Args:
        clock: the time source in seconds (``time.monotonic``).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # token -> [payload, bytes done, started at, a piece last completed at (or 0.0)]
        self._open: dict[int, list[float]] = {}
        self._tokens = itertools.count(1)
        self._finished = 0
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._collectives = 0
        self._last: tuple[float | None, int, float] = (None, 0, 0.0)
        self._published = LinkSnapshot()

    def begin(self, payload: int) -> int:
        """A collective of ``payload`` bytes starts; returns its token for the calls below."""
        now = self.clock()
        token = next(self._tokens)
        if not self._open:
            self._busy_since = now
        self._open[token] = [int(payload), 0, now, 0.0]
        self._publish()
        return token

    def advance(self, token: int, nbytes: int) -> None:
        """A piece of ``nbytes`` of collective ``token`` has completed."""
        entry = self._open.get(token)
        if entry is None:
            return
        entry[1] = min(entry[0], entry[1] + int(nbytes))
        entry[3] = self.clock()
        self._finished += int(nbytes)
        self._publish()

    def end(self, token: int) -> None:
        """Collective ``token`` has ended (finished, failed or abandoned); idempotent."""
        entry = self._open.pop(token, None)
        if entry is None:
            return
        now = self.clock()
        self._collectives += 1
        self._last = (entry[2], int(entry[1]), max(0.0, now - entry[2]))
        if not self._open and self._busy_since is not None:
            self._busy_s += max(0.0, now - self._busy_since)
            self._busy_since = None
        self._publish()

    def restart_count(self, bytes_finished: int = 0) -> None:
        """Count the bytes finished from ``bytes_finished`` on (the comm counters were reset,
        or restored from a checkpoint)."""
        self._finished = int(bytes_finished)
        self._publish()

    def snapshot(self) -> LinkSnapshot:
        """The state as of the last update (safe from any thread)."""
        return self._published

    def _publish(self) -> None:
        # A tuple made in one go (a collective pays this at each start, piece and end).
        entries = self._open.values()
        if not entries:
            total, done_bytes, first, last_piece = 0, 0, None, None
        elif len(entries) == 1:
            ((payload, done, started, advanced),) = entries
            total, done_bytes, first = payload, done, started
            last_piece = advanced if done else None
        else:
            total = sum(e[0] for e in entries)
            done_bytes = sum(e[1] for e in entries)
            first = min((e[2] for e in entries), default=None)
            last_piece = max((e[3] for e in entries if e[1]), default=None)
        self._published = LinkSnapshot(
            len(entries), int(total), int(done_bytes), first, last_piece, self._finished,
            self._busy_s, self._busy_since, self._collectives, *self._last)
