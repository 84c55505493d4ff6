"""A rank's monitor: a thread that reports its link and its host's health about once a second.

Every :data:`INTERVAL_S` seconds the thread reads, and never writes:

- the rank's collectives in flight (:func:`exogym.comm.link_progress`), and emits a
  ``link`` event while one is in flight or when bytes have completed since its last
  report (:class:`LinkMeter` says what the figures mean);
- its host (:class:`~exogym.run.system_sampler.SystemSampler`), and emits a
  ``system`` event: one rank per process does (the ranks packed in a process share
  its host and memory).

The ranks packed in one process (:mod:`exogym.comm.packed`) share one such thread
(:class:`MonitorTicker`), which reports for each of them in turn.

The events go out through the rank's ``emit``, as its step events do (a pipe to the
parent in a simulation, a line on stdout from a host), never over the process group,
so watching a run changes neither its byte counts nor its timings. Reading the
progress takes no lock the rank waits on; every wait of the thread is bounded, and
:meth:`RankMonitor.stop` returns within a report's time. A failure of the monitor
(a sampler the host refuses) is said once on stderr and stops it, never the rank.

``EXOGYM_MONITOR_S`` sets the seconds between reports (default 1; ``0`` turns the
monitor off).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from exogym import comm
from exogym.comm.in_flight import LinkProgress, LinkSnapshot
from exogym.run.system_sampler import SystemSampler

__all__ = ["INTERVAL_ENV", "INTERVAL_S", "LinkMeter", "MonitorTicker", "RankMonitor",
           "monitor_interval", "start_monitor"]

#: Seconds between two reports of a rank's monitor.
INTERVAL_S = 1.0
#: The environment variable that sets them (0: no monitor).
INTERVAL_ENV = "EXOGYM_MONITOR_S"


def monitor_interval(environ: Mapping[str, str] | None = None) -> float:
    """Seconds between a monitor's reports: ``EXOGYM_MONITOR_S``, else :data:`INTERVAL_S`
    (0: no monitor).

    Raises:
        ValueError: for a value that is not a number of seconds >= 0, naming it.
    """
    text = (os.environ if environ is None else environ).get(INTERVAL_ENV, "").strip()
    if not text:
        return INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{INTERVAL_ENV}={text!r} must be a number of seconds >= 0 "
                         f"(0 turns the rank's monitor off; unset: {INTERVAL_S:g})")
    return value


class LinkMeter:
    """Turns a rank's successive :class:`~exogym.comm.in_flight.LinkSnapshot` s into its
    ``link`` event's figures.

    - ``in_flight``: a counted collective is in flight;
    - ``done``: the share of it whose bytes have completed (None when none is in flight);
      ``bytes_done`` of ``bytes_total``, ``elapsed_s`` since it started;
    - ``rate_bps``: payload bits per second, the rate achieved now: for a collective in
      flight since before the previous report (or the first), its bytes done over the time
      they took (from its start to the end of its last completed piece); for one that
      ran past the previous report and has ended since, its bytes over its duration;
      otherwise the bytes that completed since the previous report over the time the
      link was busy meanwhile. Payload is what ``comm_bytes`` counts (a ring all-reduce
      puts about ``2 (K - 1) / K`` times it on each link); the time includes waiting for
      the slowest peer to arrive. None until a piece has completed;
    - ``sent_bytes``: the payload completed so far (``comm_bytes`` once none is in flight).
    """

    def __init__(self) -> None:
        self._last: LinkSnapshot | None = None
        self._last_at = 0.0

    def read(self, snap: LinkSnapshot, now: float) -> dict[str, Any] | None:
        """The figures at ``now`` (a ``time.monotonic()``); None when the link has been idle
        since the previous read."""
        last, last_at = self._last, self._last_at
        self._last, self._last_at = snap, now
        sent_before = last.bytes_finished if last is not None else 0
        if not snap.in_flight and snap.bytes_finished == sent_before:
            return None
        rate = None
        started = snap.started_at
        ended = snap.last_started_at
        if started is not None and (last is None or started <= last_at):
            if snap.bytes_done and snap.advanced_at is not None and snap.advanced_at > started:
                rate = snap.bytes_done / (snap.advanced_at - started)
        elif started is None and ended is not None and (last is None or ended <= last_at):
            if snap.last_bytes and snap.last_s > 0:
                rate = snap.last_bytes / snap.last_s
        else:
            busy = snap.busy_at(now) - (last.busy_at(last_at) if last is not None else 0.0)
            sent = snap.bytes_finished - sent_before
            if sent > 0 and busy > 0:
                rate = sent / busy
        return {"in_flight": bool(snap.in_flight), "done": snap.done,
                "bytes_done": snap.bytes_done, "bytes_total": snap.bytes_total,
                "elapsed_s": None if started is None else round(now - started, 3),
                "rate_bps": None if rate is None else round(8 * rate, 1),
                "sent_bytes": snap.bytes_finished}


_system_lock = threading.Lock()
_system_owner: RankMonitor | None = None  # the monitor of this process that samples its host


class RankMonitor:
    """A rank's ``link`` and ``system`` events, from a thread of its own.

    Make it on the rank's own thread (it takes that thread's link progress); it starts
    at once. :meth:`stop` ends the thread, after the last figures unless told not to.

    Args:
        rank: the rank.
        emit: where its events go (safe to call from another thread).
        device: the rank's device (its GPU figures).
        interval_s: seconds between reports.
        progress: the rank's collectives in flight (default: this thread's).
        sampler: what samples the host (default: a :class:`SystemSampler` for ``device``).
        clock: the time source of ``progress`` (``time.monotonic``).
    """

    def __init__(self, rank: int, emit: Callable[[dict[str, Any]], None],
                 device: torch.device | None = None, interval_s: float = INTERVAL_S,
                 progress: LinkProgress | None = None, sampler: SystemSampler | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 ticker: MonitorTicker | None = None) -> None:
        self.rank = rank
        self.emit = emit
        self.interval_s = interval_s
        self.progress = progress if progress is not None else comm.link_progress()
        if sampler is None:  # the ranks of a process share a host: its ticker's sampler
            sampler = ticker.sampler if ticker is not None else SystemSampler(device)
        self.sampler = sampler
        self.clock = clock
        self.meter = LinkMeter()
        self._stop = threading.Event()
        self._stopped = False
        self._ticking = threading.Lock()
        self._ticker = ticker
        self._thread: threading.Thread | None = None
        if ticker is not None:
            ticker.add(self)
        else:
            self._thread = threading.Thread(target=self._run, name=f"exogym-monitor-{rank}",
                                            daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        """True while the thread reports."""
        if self._ticker is not None:
            return not self._stop.is_set() and self._ticker.running
        assert self._thread is not None
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self._tick():
                return

    def _tick(self, scheduled: bool = False) -> bool:
        """One report; False when the monitor failed (said once on stderr) or, for a
        ``scheduled`` one, has stopped."""
        with self._ticking:
            if scheduled and self._stop.is_set():
                return False
            try:
                self.tick()
                return True
            except Exception as exc:  # noqa: BLE001 - the monitor must never stop the rank
                self._stop.set()
                print(f"rank {self.rank}: the monitor stopped ({type(exc).__name__}: {exc}); "
                      "training goes on without link and system figures", file=sys.stderr,
                      flush=True)
                return False

    def tick(self) -> None:
        """Read the link and the host now and emit what there is to say."""
        link = self.meter.read(self.progress.snapshot(), self.clock())
        if link is not None:
            self.emit({"event": "link", "rank": self.rank, **link})
        if self._samples_host():
            self.emit({"event": "system", "rank": self.rank, **self.sampler.sample()})

    def _samples_host(self) -> bool:
        global _system_owner
        with _system_lock:
            if _system_owner is None:
                _system_owner = self
            return _system_owner is self

    def stop(self, last: bool = True) -> None:
        """End the thread (idempotent; bounded: it is waited for at most a report's time).

        Args:
            last: emit the last figures first (not when the rank fails: its error comes next).
        """
        global _system_owner
        if self._stopped:
            return
        self._stopped = True
        running = not self._stop.is_set()
        self._stop.set()
        if self._ticker is not None:
            self._ticker.remove(self)
            with self._ticking:  # a report under way ends first
                pass
            if last and running:
                self._tick()
        else:
            assert self._thread is not None
            self._thread.join(timeout=self.interval_s + 2.0)
            if last and running and not self._thread.is_alive():
                self._tick()
        with _system_lock:
            if _system_owner is self:
                _system_owner = None


class MonitorTicker:
    """One thread that reports for the monitors of every rank a process runs.

    The ranks packed in a process (:mod:`exogym.comm.packed`) share it: 512 of them
    had 512 monitor threads, each waking once a second for the interpreter's lock
    while one rank computed. It runs while a monitor is registered, one report of
    each in turn every ``interval_s``, and holds the one sampler of the host they
    share (``device``: theirs).
    """

    def __init__(self, interval_s: float, device: torch.device | None = None) -> None:
        self.interval_s = interval_s
        self.sampler = SystemSampler(device)  # the host's, for whichever rank samples it
        self._monitors: list[RankMonitor] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def add(self, monitor: RankMonitor) -> None:
        with self._lock:
            self._monitors.append(monitor)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="exogym-monitors",
                                                daemon=True)
                self._thread.start()

    def remove(self, monitor: RankMonitor) -> None:
        with self._lock:
            if monitor in self._monitors:
                self._monitors.remove(monitor)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            with self._lock:
                monitors = list(self._monitors)
                if not monitors:
                    self._thread = None
                    return
            for monitor in monitors:
                if not monitor._tick(scheduled=True):
                    self.remove(monitor)


def start_monitor(rank: int, emit: Callable[[dict[str, Any]], None],
                  device: torch.device | None = None) -> RankMonitor | None:
    """The rank's monitor, started, at ``EXOGYM_MONITOR_S`` (None when set to 0); the
    ranks packed in a process share one thread (:class:`MonitorTicker`)."""
    interval = monitor_interval()
    if interval <= 0:
        return None
    ticker = None
    if comm.ranks_here() > 1:
        ticker = comm.held_once((MonitorTicker, interval),
                                lambda: MonitorTicker(interval, device))
    return RankMonitor(rank, emit, device, interval, ticker=ticker)
