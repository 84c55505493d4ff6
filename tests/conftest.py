"""Shared fixtures: run every test from a temporary working directory.

Tests send traffic only to loopback or to namespaces they made: the wizard's
LAN search (mDNS multicast) reads an empty answer instead, unless a test that
made its own namespaces asks for the real thing (tests/test_discovery.py).
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
# Runs across hosts skip the pre-flight link probe (half a second of data per host, every
# run) unless a test of the probe asks for it (tests/test_replay.py, tests/test_launcher.py).
os.environ["EXOGYM_LINK_PROBE_S"] = "0"


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


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the test with a temporary folder as the working directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path

