"""A launcher's events as they arrive, each stamped with its time, and waiting for one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Event = dict[str, Any]


class Events:
    """Every event the launcher hands over (pass it as ``on_event``), with its time of arrival.

    ``items`` holds ``(time.monotonic() at arrival, event)`` pairs in order.
    """

    def __init__(self) -> None:
        self.items: list[tuple[float, Event]] = []
        self.cond = threading.Condition()

    def __call__(self, event: Event) -> None:
        with self.cond:
            self.items.append((time.monotonic(), event))
            self.cond.notify_all()

    def first(self, test: Callable[[Event], bool], timeout: float,
              after: float = 0.0) -> tuple[float, Event] | None:
        """The first event arrived at or after ``after`` that passes ``test``, with its time;
        None once ``timeout`` seconds have gone without one."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for t, e in self.items:
                    if t >= after and test(e):
                        return t, e
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)

    def wait(self, test: Callable[[Event], bool], timeout: float,
             after: float = 0.0) -> tuple[float, Event]:
        """As :meth:`first`, but raise TimeoutError, naming the last events, when none comes."""
        found = self.first(test, timeout, after)
        if found is None:
            raise TimeoutError(f"no such event within {timeout:.0f} s; the last: "
                               f"{[e for _, e in self.items[-3:]]}")
        return found

    def of(self, kind: str, rank: int | None = None) -> list[tuple[float, Event]]:
        """Every event of ``kind`` (of ``rank`` when given), with its time of arrival."""
        return [(t, e) for t, e in self.items if e.get("event") == kind
                and (rank is None or e.get("rank") == rank)]
