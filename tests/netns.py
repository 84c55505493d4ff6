"""Throw-away network namespaces joined by a bridge (netbed's wiring): hosts for tests, cleaned up after."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from contextlib import contextmanager

from netbed.lan import Member, build_lan, delete_namespaces


def netns_available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    probe = f"exo-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


@contextmanager
def namespaces(count: int, subnet: str = "10.231.7", rate: str | None = None):
    """Create ``count`` namespaces with addresses subnet.1.. on one bridge (netbed's wiring).

    Yields (namespace names, addresses). Every namespace, and with it every veth
    and the bridge, is deleted on exit.
    """
    tag = uuid.uuid4().hex[:6]
    members = [Member(f"exo-h{i}-{tag}", f"vh{i}{tag}", f"{subnet}.{i + 1}") for i in range(count)]
    made: list[str] = []
    try:
        build_lan(f"exo-br-{tag}", members, made)
        if rate:
            for m in members:
                subprocess.run(["ip", "netns", "exec", m.namespace, "tc", "qdisc", "add", "dev",
                                m.interface, "root", "tbf", "rate", rate, "burst", "64kb",
                                "latency", "50ms"], check=True, capture_output=True)
        yield [m.namespace for m in members], [m.address for m in members]
    finally:
        delete_namespaces(made)
