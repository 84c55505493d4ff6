"""Shared fixtures: run every test from a temporary working directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the test with a temporary folder as the working directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path

