"""The test bed removes what an earlier, killed benchmark left behind, and only that."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from netbed import OWNER_FILE, PREFIX, reap_stale_beds
from netns import netns_available

REASON = netns_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def _namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def _fake_bed(owner_pid: int) -> tuple[str, list[str], Path]:
    tag = uuid.uuid4().hex[:5]
    names = [f"{PREFIX}-{tag}-br", f"{PREFIX}-{tag}-h0"]
    for name in names:
        subprocess.run(["ip", "netns", "add", name], check=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{tag}-"))
    (folder / OWNER_FILE).write_text(str(owner_pid))
    return tag, names, folder


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_bed_whose_owner_died_is_removed_and_a_live_ones_is_kept():
    dead_tag, dead_names, dead_folder = _fake_bed(_dead_pid())
    live_tag, live_names, live_folder = _fake_bed(os.getpid())
    try:
        removed = reap_stale_beds()
        left = _namespaces()
        assert not any(n in left for n in dead_names)
        assert not dead_folder.exists()
        assert f"namespace {dead_names[0]}" in removed
        assert all(n in left for n in live_names)  # its owner (this test) is alive
        assert live_folder.exists()
        assert not any(live_tag in item for item in removed)
    finally:
        for name in dead_names + live_names:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        for folder in (dead_folder, live_folder):
            subprocess.run(["rm", "-rf", str(folder)])
    assert not any(dead_tag in n or live_tag in n for n in _namespaces())
