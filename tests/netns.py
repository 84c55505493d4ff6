"""Throw-away network namespaces joined by a bridge: hosts for tests, cleaned up after."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from contextlib import contextmanager


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


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def namespaces(count: int, subnet: str = "10.231.7", rate: str | None = None):
    """Create ``count`` namespaces with addresses subnet.1.. on one bridge.

    Yields (namespace names, addresses). Every namespace, and with it every veth
    and the bridge, is deleted on exit.
    """
    tag = uuid.uuid4().hex[:6]
    bridge_ns = f"exo-br-{tag}"
    names = [f"exo-h{i}-{tag}" for i in range(count)]
    addresses = [f"{subnet}.{i + 1}" for i in range(count)]
    made: list[str] = []
    try:
        for ns in [bridge_ns, *names]:
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(names, addresses)):
            outer, inner = f"vb{i}{tag}", f"vh{i}{tag}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "netns", bridge_ns)
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", bridge_ns, "link", "set", outer, "master", "br0")
            _ip("-n", bridge_ns, "link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            if rate:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner,
                                "root", "tbf", "rate", rate, "burst", "64kb", "latency", "50ms"],
                               check=True, capture_output=True)
        yield names, addresses
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
