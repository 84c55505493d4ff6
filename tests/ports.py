"""Ports for the tests (:mod:`netbed.ports`, which the bed's hosts and the benches use too:
it needs only the standard library). Every test takes its ports here, and waits here for
what a server does with its connections (:func:`wait_for`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from netbed.ports import AVOID, LOWEST, ephemeral_range, free_port

__all__ = ["AVOID", "LOWEST", "ephemeral_range", "free_port", "wait_for"]


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` every 50 ms until it holds; fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout} s")
        time.sleep(0.05)
