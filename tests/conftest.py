"""Shared fixtures: run every test from a temporary working directory.

Tests send traffic only to loopback or to namespaces they made: the wizard's
LAN search (mDNS multicast) reads an empty answer instead, unless a test that
made its own namespaces asks for the real thing (tests/test_discovery.py).

The suite runs in several processes (pytest-xdist, ``-n auto`` in pyproject.toml): most
tests wait on processes, sockets and timers rather than compute, so more test processes
than cores keep the cores busy. Every test takes its own ports, folders and namespaces, so
tests run side by side, and so do two checkouts' suites. docs/development.md says how to
run the whole suite and the fast lane (``-m "not slow"``), and when to run which.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

_NO_MACHINES = Path(tempfile.mkdtemp(prefix="exogym-tests-")) / "discovered.json"
atexit.register(shutil.rmtree, _NO_MACHINES.parent, True)
_NO_MACHINES.write_text("[]\n", encoding="utf-8")
os.environ["EXOGYM_DISCOVERED"] = str(_NO_MACHINES)
# Several tests press Ctrl-C on commands they start (SIGINT). A shell that starts the suite
# as a background job without job control hands it SIGINT ignored, which every command it
# starts would inherit (and Python leaves an ignored SIGINT ignored): take the default back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# The test processes of -n start with COLUMNS=80 and LINES=24 in their environment where
# the command that started the suite had neither; the commands under test fold their
# output to COLUMNS when it is set, so the tests would see other lines than in one process.
# The first process records what the person's environment said; the others take it back.
for _name in ("COLUMNS", "LINES"):
    _kept = f"EXOGYM_TESTS_{_name}"
    if "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ[_kept] = os.environ.get(_name, "")
    elif os.environ.get(_kept):
        os.environ[_name] = os.environ[_kept]
    elif _kept in os.environ:
        os.environ.pop(_name, None)
# Runs across hosts skip the pre-flight link probe (half a second of data per host, every
# run) unless a test of the probe asks for it (tests/test_replay.py, tests/test_launcher.py).
os.environ["EXOGYM_LINK_PROBE_S"] = "0"
# The warm start server takes the environment as it is now, before any test changed it.
import warm  # noqa: E402

#: Library loggers the commands configure (``distributed.app.console.QUIET_LOGGERS``, named
#: here so that this file imports nothing of the project's).
LIBRARY_LOGGERS = ("paramiko",)


@pytest.fixture(autouse=True)
def restore_library_loggers():
    """Put the library loggers back as they were after every test.

    A command run in this process (``CliRunner``, or :func:`quiet_library_logs` called
    directly) installs a handler on ``paramiko`` and stops it propagating; with ``--debug``
    that handler writes to the runner's stream, closed once the command returns. Left in
    place, the next test would see another test's handlers, level and propagation, and
    pass or fail by the order the tests ran in.
    """
    saved = []
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, list(logger.handlers), logger.level, logger.propagate,
                      logger.disabled))
    yield
    for logger, handlers, level, propagate, disabled in saved:
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate
        logger.disabled = disabled


@pytest.fixture(autouse=True)
def keep_the_import_time_environment():
    """Put back, after every test, the variables torch reads at import (``OMP_NUM_THREADS``,
    ``PYTHONWARNINGS``, ...: :data:`warm.IMPORT_TIME_PREFIXES`) as they were before it.

    A rank run in the test process sets ``OMP_NUM_THREADS`` for its own children; left in
    place, every later warm command of that test process would differ from its server in
    it and start fresh, and a test of the warm start would see another test's leftover.
    """
    def import_time() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k.startswith(warm.IMPORT_TIME_PREFIXES)}

    before = import_time()
    yield
    after = import_time()
    for name in after.keys() - before.keys():
        del os.environ[name]
    for name, value in before.items():
        if after.get(name) != value:
            os.environ[name] = value


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the test with a temporary folder as the working directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path



#: A test that runs longer than this says why it must: ``@pytest.mark.slow(reason=...)``.
LONG_TEST_S = 30.0


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """The test processes of ``-n auto``: two a core, at most eight (``EXOGYM_TEST_WORKERS``
    sets another number). Most tests wait on rank processes, SSH and timers; the few that
    fill the cores (the 20M-parameter runs) are kept apart by their ``xdist_group``."""
    chosen = os.environ.get("EXOGYM_TEST_WORKERS", "").strip()
    if chosen:
        return max(1, int(chosen))
    return max(2, min(8, 2 * (os.cpu_count() or 1)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first (those that say why they are long, then the other slow
    ones), each group in the order it was written: the test processes take work in this
    order, and a long test started last would keep the suite waiting alone at its end."""

    def rank(item: pytest.Item) -> int:
        marker = item.get_closest_marker("slow")
        if marker is None:
            return 2
        return 0 if marker.kwargs.get("reason") else 1

    items.sort(key=rank)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Carry a slow test's reason in its report, for the summary of the long tests (the
    report travels from an xdist worker to the controller; the marker does not)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        marker = item.get_closest_marker("slow")
        reason = marker.kwargs.get("reason") if marker is not None else None
        if reason:
            report.user_properties.append(("slow_reason", reason))


_long_tests: list[tuple[float, str, str | None]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > LONG_TEST_S:
        reason = dict(report.user_properties).get("slow_reason")
        _long_tests.append((report.duration, report.nodeid, reason))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """After the slowest durations: every test over ``LONG_TEST_S`` and why it must be
    that long, and those that do not say why (mark them, or make them faster)."""
    if not _long_tests:
        return
    terminalreporter.section(f"tests over {LONG_TEST_S:.0f} s, and why")
    for duration, nodeid, reason in sorted(_long_tests, reverse=True):
        why = reason or "UNMARKED: give it @pytest.mark.slow(reason=...) or make it faster"
        terminalreporter.write_line(f"{duration:7.1f}s {nodeid}: {why}")
