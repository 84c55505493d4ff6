"""Which network interface reaches an address: what gloo must bind to.

gloo picks an interface from ``GLOO_SOCKET_IFNAME``; a wrong guess (a Docker
bridge, a VPN) is the classic cause of a multi-host job that hangs at start.
We ask the routing table which interface the master is reached through.
"""

from __future__ import annotations

import ipaddress
import re
import shutil
import socket
import subprocess


def _route_get(address: str) -> str | None:
    ip = shutil.which("ip")
    if ip:
        try:
            out = subprocess.run([ip, "-o", "route", "get", address], capture_output=True,
                                 text=True, timeout=5).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        match = re.search(r"\bdev\s+(\S+)", out)
        if match:
            return match.group(1)
    route = shutil.which("route")
    if route:  # macOS / BSD
        try:
            out = subprocess.run([route, "-n", "get", address], capture_output=True, text=True,
                                 timeout=5).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        match = re.search(r"interface:\s*(\S+)", out)
        if match:
            return match.group(1)
    return None


def resolve_address(host: str) -> str:
    """The IPv4 address of ``host`` (a name or an address)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)


def _interface_owning(address: str) -> str | None:
    ip = shutil.which("ip")
    if not ip:
        return None
    try:
        out = subprocess.run([ip, "-o", "addr", "show"], capture_output=True, text=True,
                             timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == address:
            return fields[1].split("@")[0]
    return None


def interface_for(host: str) -> str | None:
    """Name of the local interface that routes to ``host``, or None if unknown.

    When ``host`` is this machine's own (non-loopback) address, that is the
    interface holding it: the master must listen where its peers can reach it.
    """
    address = resolve_address(host)
    if ipaddress.ip_address(address).is_loopback:
        names = [name for _, name in socket.if_nameindex()]
        return next((n for n in ("lo", "lo0") if n in names), None)
    return _interface_owning(address) or _route_get(address)

