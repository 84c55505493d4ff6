"""A run that stops making progress is stopped, with what it waited for and where.

Every failure the launcher knows of (a rank that exits, a connection that drops,
a heartbeat that stops) ends or repairs a run within its deadlines. What is
left is a run whose ranks all live and answer but whose steps no longer
advance: a rank stuck in its own code, a collective that waits on a peer
which waits on something else. :class:`ProgressWatch` reads the ranks' events
and says when the run has made no progress (no rank reached a new step) for
longer than its bound: ``stall_rounds`` of the run's measured round time, and
at least ``min_stall_s``. Its message names what each rank reported it was
waiting for (a ``waiting`` event, sent by a rank whose wait lasts) and on which
host.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from exogym.base.plural import plural

#: Rounds without progress that stop a run (the bound is at least MIN_STALL_S).
STALL_ROUNDS = 10
#: The least time without progress that stops a run, in seconds.
MIN_STALL_S = 300.0


class ProgressWatch:
    """Watches a run's step events for progress.

    Args:
        stall_s: a fixed bound in seconds (None: ``stall_rounds`` measured rounds, at
            least ``min_stall_s``).
        stall_rounds: rounds without progress that stop the run.
        min_stall_s: the least bound.
        clock: the time source (for tests).
    """

    def __init__(self, stall_s: float | None = None, stall_rounds: int = STALL_ROUNDS,
                 min_stall_s: float = MIN_STALL_S, clock: Any = time.monotonic):
        self.stall_s = stall_s
        self.stall_rounds = stall_rounds
        self.min_stall_s = min_stall_s
        self.clock = clock
        self.round_steps = 1
        self.best_step = 0
        self.since: float | None = None  # when the run last advanced (None: not training yet)
        self._advances: list[tuple[float, int]] = []  # (time, step) of each new best step
        self.waiting: dict[int, dict[str, Any]] = {}  # the last wait each rank reported
        self.hosts: dict[int, str] = {}
        #: Ranks whose process reported the end of its training (``done``): it writes its
        #: outputs now, with no heartbeat; a process of the rank that starts again leaves it.
        self.finished: set[int] = set()

    def on_event(self, event: dict[str, Any]) -> None:
        """Take one of the run's events."""
        kind = event.get("event")
        rank = event.get("rank")
        if rank is not None and event.get("host"):
            self.hosts[rank] = str(event["host"])
        now = self.clock()
        if kind == "done" and rank is not None:
            self.finished.add(rank)
        if kind == "start":
            self.finished.discard(rank)
            self.round_steps = max(1, int(event.get("round_steps") or 1))
            if self.since is None:
                self.since = now
        elif kind == "step":
            if rank is not None:
                self.waiting.pop(rank, None)
            step = int(event.get("step", 0))
            if step > self.best_step:
                self.best_step = step
                self.since = now
                self._advances.append((now, step))
                del self._advances[:-64]
        elif kind == "waiting" and rank is not None:
            self.waiting[rank] = dict(event, seen=now)

    def round_s(self) -> float | None:
        """The run's measured time per round (median over its recent steps), or None."""
        pairs = self._advances
        if len(pairs) < 3:
            return None
        per_step = [(b[0] - a[0]) / max(1, b[1] - a[1]) for a, b in zip(pairs, pairs[1:])]
        return statistics.median(per_step) * self.round_steps

    def bound_s(self) -> float:
        """Seconds without progress after which the run is stopped."""
        if self.stall_s is not None:
            return self.stall_s
        round_s = self.round_s()
        return max(self.min_stall_s, self.stall_rounds * round_s if round_s else 0.0)

    def stalled(self) -> str | None:
        """None while the run makes progress; else why it is stopped, naming the waits."""
        if self.since is None:
            return None
        idle = self.clock() - self.since
        bound = self.bound_s()
        if idle <= bound:
            return None
        round_s = self.round_s()
        how = (f"{self.stall_s:g} s" if self.stall_s is not None else
               f"{plural(self.stall_rounds, 'round')} of {round_s:.1f} s, at least {self.min_stall_s:g} s"
               if round_s else f"at least {self.min_stall_s:g} s")
        waits = []
        for rank in sorted(self.waiting):
            wait = self.waiting[rank]
            host = self.hosts.get(rank, "?")
            waits.append(f"rank {rank} on {host} waits for {wait.get('what', 'a peer')} "
                         f"(for {float(wait.get('since_s', 0)) + self.clock() - wait['seen']:.0f} s)")
        quiet = sorted(set(self.hosts) - set(self.waiting))
        if quiet:
            waits.append("no wait reported by " + ", ".join(
                f"rank {r} on {self.hosts[r]}" for r in quiet) + " (busy in its own step?)")
        return (f"no progress for {idle:.0f} s (the bound: {how}) after step {self.best_step}: "
                + ("; ".join(waits) or "no rank reported what it waits for"))
