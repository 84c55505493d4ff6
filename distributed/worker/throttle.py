"""A rank slowed down from outside: its throttle file, read as the rank trains.

When the launcher injects faults (``--inject``, ``--inject-random``;
:mod:`distributed.launch.injector`) every rank is started with
``EXOGYM_THROTTLE_FILE`` naming a file of its own; an injected ``slow`` writes
``{"factor": F, "fault": k}`` there on the rank's host (and ``1.0`` when it
ends). The rank looks at the file at most every :data:`CHECK_EVERY_S` seconds
(one ``stat``), and after each step sleeps off ``1/F - 1`` times the step's
compute (:meth:`exogym.run.timing.StepTimer.throttle_step`): it trains at F of
its speed. A restarted rank reads the file afresh, so a slow outlives a kill.
"""

from __future__ import annotations

import json
import os
import sys
import time

from .environment import THROTTLE_VARIABLE

#: Seconds between two looks at the throttle file.
CHECK_EVERY_S = 0.1


class FileThrottle:
    """The speed factor a throttle file holds (1.0 while there is none).

    Args:
        path: the file (the launcher writes it atomically: a rename).
        rank: this rank, for the line it prints when its speed changes.
    """

    def __init__(self, path: str | os.PathLike[str], rank: int) -> None:
        self.path = os.fspath(path)
        self.rank = rank
        self._factor = 1.0
        self._seen: tuple[int, int] | None = None
        self._checked = float("-inf")

    def factor(self) -> float:
        """The factor now; the file is read again only when it changed."""
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY_S:
            return self._factor
        self._checked = now
        try:
            stat = os.stat(self.path)
        except OSError:
            return self._factor
        seen = (stat.st_mtime_ns, stat.st_ino)
        if seen == self._seen:
            return self._factor
        self._seen = seen
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            factor = float(data["factor"])
        except (OSError, ValueError, KeyError, TypeError):
            return self._factor  # caught between writes, or not ours: keep the last
        if not 0.0 < factor <= 1.0:
            return self._factor
        if factor != self._factor:
            said = "back to full speed" if factor == 1.0 else \
                f"slowed to {factor:g} of its speed (injected fault {data.get('fault')})"
            print(f"rank {self.rank}: {said}", file=sys.stderr, flush=True)
        self._factor = factor
        return factor


def throttle_from_environment(rank: int) -> FileThrottle | None:
    """The throttle the launcher set up for this rank (None when it set none)."""
    path = os.environ.get(THROTTLE_VARIABLE)
    return FileThrottle(path, rank) if path else None
