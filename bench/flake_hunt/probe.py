"""A pytest plugin of the flake hunt: for each test, whether it started processes, opened
sockets or waited on timers (itself, or through the code it ran in the test process), and
how it ended; one JSON line per test appended to ``$EXOGYM_FLAKE_PROBE``.

Loaded with ``-p bench.flake_hunt.probe``; does nothing without the variable.
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
import socket
import subprocess
import threading
import time

import pytest

_seen: set[str] = set()
_failed: list[str] = []


def _noting(kind: str, function):
    def noted(*args, **kwargs):
        _seen.add(kind)
        return function(*args, **kwargs)

    noted.__wrapped__ = function  # type: ignore[attr-defined]
    return noted


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("EXOGYM_FLAKE_PROBE"):
        return
    subprocess.Popen.__init__ = _noting("processes", subprocess.Popen.__init__)
    os.fork = _noting("processes", os.fork)
    multiprocessing.process.BaseProcess.start = _noting(
        "processes", multiprocessing.process.BaseProcess.start)
    socket.socket.__init__ = _noting("sockets", socket.socket.__init__)
    threading.Thread.start = _noting("timers", threading.Thread.start)
    time.sleep = _noting("timers", time.sleep)
    # not signal.setitimer: pytest-timeout sets one around every test


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        text = str(report.longrepr or "failed").strip().splitlines()
        last = next((line for line in reversed(text) if line.startswith("E ")), text[-1])
        _failed.append(f"{report.when}: {last[:200]}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _seen.clear()
    _failed.clear()
    yield
    out = os.environ.get("EXOGYM_FLAKE_PROBE")
    if out:
        # xdist's --dist loadgroup appends "@group" to a grouped test's id: the hunt knows
        # the test by the id it collected
        test = item.nodeid.rsplit("@", 1)[0] if item.get_closest_marker("xdist_group") \
            else item.nodeid
        record = {"test": test, "starts": sorted(_seen),
                  "failure": _failed[0] if _failed else None}
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
