"""Network namespaces joined by one bridge, as hosts on a LAN: the wiring of every bed.

The bridge ``br0`` lives in a namespace of its own; each member namespace gets
one end of a veth pair (with its address, /24), the other end a port of the
bridge. Every veth is made inside the bridge's namespace and moved straight
into its member's, so no interface name is ever taken in the root namespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .system import run


@dataclass(frozen=True)
class Member:
    """A namespace on the LAN: its name, its end of the veth, its address."""

    namespace: str
    interface: str
    address: str


def build_lan(bridge_ns: str, members: Sequence[Member], made: list[str]) -> None:
    """Create ``bridge_ns`` with a bridge and every member's namespace, wired to it.

    Every namespace is appended to ``made`` as soon as it exists, so that the
    caller deletes all of them (``ip netns delete``, which takes the veths and the
    bridge along) even when this fails half-way.
    """
    for ns in [bridge_ns, *(m.namespace for m in members)]:
        run("ip", "netns", "add", ns)
        made.append(ns)
        run("ip", "-n", ns, "link", "set", "lo", "up")
    run("ip", "-n", bridge_ns, "link", "add", "br0", "type", "bridge")
    run("ip", "-n", bridge_ns, "link", "set", "br0", "up")
    for index, member in enumerate(members):
        port = f"xb{index}"
        run("ip", "-n", bridge_ns, "link", "add", port, "type", "veth", "peer", "name",
            member.interface, "netns", member.namespace)
        run("ip", "-n", bridge_ns, "link", "set", port, "master", "br0")
        run("ip", "-n", bridge_ns, "link", "set", port, "up")
        run("ip", "-n", member.namespace, "addr", "add", f"{member.address}/24", "dev",
            member.interface)
        run("ip", "-n", member.namespace, "link", "set", member.interface, "up")


def delete_namespaces(names: list[str]) -> None:
    """Delete the namespaces ``names`` (the last made first) and forget them."""
    for ns in reversed(names):
        run("ip", "netns", "delete", ns, check=False)
    names.clear()
