"""Beds left behind by a process that died without cleaning up, and their removal.

A bed belongs to the process named in its folder's ``owner.pid``; one whose
owner is gone (killed with SIGKILL, the machine's session ended) leaves its
namespaces, uplink, sshds and folder behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

from .system import pid_alive, run

#: What every bed's namespaces, folder and links are named after.
PREFIX = "exobench"
#: The file in a bed's folder that names the process owning the bed.
OWNER_FILE = "owner.pid"


def reap_stale_beds() -> list[str]:
    """Remove the beds whose owner died; return what was removed.

    Beds of a process still running are left alone.
    """
    names = namespace_names()
    tags = sorted({n.split("-")[1] for n in names
                   if n.startswith(f"{PREFIX}-") and n.count("-") >= 2})
    removed: list[str] = []
    for tag in tags:
        folders = list(Path(tempfile.gettempdir()).glob(f"{PREFIX}-{tag}-*"))
        owners = [int(f.joinpath(OWNER_FILE).read_text() or 0) for f in folders
                  if f.joinpath(OWNER_FILE).is_file()]
        if any(pid_alive(pid) for pid in owners if pid):
            continue
        spaces = [n for n in names if n.startswith(f"{PREFIX}-{tag}-")]
        for ns in spaces:
            pids = run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    removed.append(f"process {pid} in {ns}")
                except (ProcessLookupError, ValueError):
                    pass
        for ns in spaces:
            run("ip", "netns", "delete", ns, check=False)
            removed.append(f"namespace {ns}")
        if Path(f"/sys/class/net/xu{tag}").exists():
            run("ip", "link", "delete", f"xu{tag}", check=False)
            removed.append(f"link xu{tag}")
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


def namespace_names() -> list[str]:
    """Every network namespace of this machine, by name."""
    return run("ip", "netns", "list", check=False).stdout.split()


def bed_stands(tag: str) -> bool:
    """Whether a namespace of the bed ``tag`` is still there."""
    return any(n.startswith(f"{PREFIX}-{tag}-") for n in namespace_names())
