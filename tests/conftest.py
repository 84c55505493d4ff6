"""Shared fixtures: run every test from a temporary working directory.

Tests send traffic only to loopback or to namespaces they made: the wizard's
LAN search (mDNS multicast) reads an empty answer instead, unless a test that
made its own namespaces asks for the real thing (tests/test_discovery.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

_NO_MACHINES = Path(tempfile.mkdtemp(prefix="exogym-tests-")) / "discovered.json"
_NO_MACHINES.write_text("[]\n", encoding="utf-8")
os.environ["EXOGYM_DISCOVERED"] = str(_NO_MACHINES)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the test with a temporary folder as the working directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path

