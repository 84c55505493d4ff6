"""One progress sink that feeds several: the terminal dashboard and the page in the browser.

``Trainer.fit(progress=...)`` and the launcher's ``on_event`` take one sink; a
run shown both in the terminal and in the browser hands them a ``FanOut`` of
the two. The first sink is the primary one: its ``summary`` is the run's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class FanOut:
    """Passes every event and call on to each sink, in order.

    Args:
        primary: the sink whose ``summary()`` answers (the terminal dashboard).
        others: more sinks (e.g. ``distributed.app.web.WebDashboard``); None entries are skipped.
    """

    def __init__(self, primary: Any, *others: Any) -> None:
        self.primary = primary
        self.sinks = [primary, *(s for s in others if s is not None)]

    def _each(self, method: str, *args: Any, **kwargs: Any) -> None:
        for sink in self.sinks:
            call = getattr(sink, method, None)
            if call is not None:
                call(*args, **kwargs)

    def on_event(self, event: dict[str, Any]) -> None:
        """Give one metric event to every sink."""
        self._each("on_event", event)

    def on_output(self, line: Any) -> None:
        """Give a rank's printed line to every sink that shows such lines."""
        self._each("on_output", line)

    def set_status(self, rank: int, status: str) -> None:
        """Mark a rank's outcome in every sink that tracks it."""
        self._each("set_status", rank, status)

    def close(self) -> None:
        """Stop every sink's live display."""
        self._each("close")

    def finish(self, summary: Mapping[str, Any] | None = None, title: str = "run summary") -> None:
        """Show the final figures in every sink."""
        self._each("finish", summary, title)

    def summary(self, wall_s: float | None = None) -> dict[str, Any]:
        """The primary sink's final figures."""
        return self.primary.summary(wall_s)
