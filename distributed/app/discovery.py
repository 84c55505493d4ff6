"""Machines on the LAN for the faces: run the agent, list what answers, turn answers into hosts.

``cli_typer.py agent`` and ``discover`` and the wizard's first step call these;
the mDNS work itself is ``distributed.hosts.mdns``'s. Setting
``EXOGYM_DISCOVERED`` to a file written by ``discover --json`` makes
``find_machines`` read that list instead of browsing (for a network whose
multicast is blocked, or to replay a saved answer).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from exogym.base.install_mode import command

from ..hosts.hostkeys import HostKey, fetch_host_key, is_known, trust_host_key
from ..hosts.mdns import (
    Advertiser,
    Browser,
    DiscoveryError,
    MachineAdvert,
    discover,
    ipv4_addresses,
    this_machine,
)
from ..hosts.ssh import SSHOptions

__all__ = ["Browser", "DiscoveryError", "HostKey", "MachineAdvert", "DISCOVERED_ENV",
           "fetch_host_key", "find_machines", "hosts_mapping", "is_known", "machines_table", "other_machines",
           "serve_agent", "ssh_options", "trust_host_key"]

DISCOVERED_ENV = "EXOGYM_DISCOVERED"


def find_machines(timeout: float = 3.0) -> list[MachineAdvert]:
    """The machines advertising on the LAN (see ``EXOGYM_DISCOVERED`` above), by name.

    Raises:
        DiscoveryError: zeroconf is missing, the timeout is not positive, or the
            ``EXOGYM_DISCOVERED`` file cannot be read.
    """
    saved = os.environ.get(DISCOVERED_ENV)
    if saved:
        try:
            rows = json.loads(Path(saved).read_text(encoding="utf-8"))
            return [MachineAdvert(**{**{k: v for k, v in row.items() if k != "memory_gb"},
                                     "addresses": tuple(row["addresses"])}) for row in rows]
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise DiscoveryError(f"{DISCOVERED_ENV}={saved} is not a list written by "
                                 f"`{command('discover', '--json')}`: {exc}") from None
    return discover(timeout)


def machines_table(machines: Sequence[MachineAdvert]) -> Table:
    """One row per machine: what a person needs to pick it and to reach it (its advertised
    name beside its real host name, which differ when another machine took the name first)."""
    table = Table(title=f"{len(machines)} machine{'s' * (len(machines) != 1)} on the LAN",
                  title_justify="left")
    for column in ("name", "host", "addresses", "ssh", "device", "cores", "memory", "torch",
                   "code", "python", "project"):
        table.add_column(column, overflow="fold")
    for m in machines:  # cells as plain text: what another machine says is no markup
        table.add_row(*(Text(cell) for cell in (
            m.name, m.host, ", ".join(m.addresses), m.ssh_command,
            f"{m.device} ({m.device_name})" if m.device_name else m.device,
            str(m.cores), f"{m.memory_gb:g} GB", m.torch or "-", m.code_hash,
            m.python, m.project_path)))
    return table


def serve_agent(console: Console, name: str | None = None, ssh_port: int = 22,
                ssh_user: str | None = None, stop: threading.Event | None = None) -> MachineAdvert:
    """Advertise this machine until Ctrl-C, SIGTERM or ``stop``; say goodbye; the advert, under
    the name it was advertised as (``vm-2`` when another machine advertises ``vm``, which is
    said).

    Raises:
        DiscoveryError: zeroconf is missing, every name tried is taken, or there is no address.
    """
    if not 1 <= ssh_port <= 65535:
        raise DiscoveryError(f"--port must be an SSH port between 1 and 65535, got {ssh_port}")
    stop = stop or threading.Event()
    wanted = this_machine(name=name, ssh_port=ssh_port, ssh_user=ssh_user)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        with Advertiser(wanted) as advertiser:
            advert = advertiser.advert
            if advert.name != wanted.name:
                console.print(f"The name {wanted.name!r} is already advertised on this LAN by "
                              f"another machine; advertising this one as {advert.name!r} "
                              f"(host name {advert.host!r}, in its record). Pass --name to "
                              "choose another.", markup=False, highlight=False)
            console.print(f"Advertising {advert.summary} as {advert.name}._exogym._tcp.local. "
                          f"on {', '.join(advert.addresses)} until Ctrl-C; log in with: "
                          f"{advert.ssh_command}", markup=False, highlight=False)
            while not stop.wait(0.2):
                pass
        console.print(f"Stopped advertising {advert.name} (goodbye sent).", markup=False,
                      highlight=False)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return advert


def ssh_options(known_hosts: str | None = None) -> SSHOptions:
    """The SSH options whose known_hosts file host keys are recorded in (as the launcher's)."""
    from .hosts_check import ssh_files

    files = ssh_files(known_hosts, None)
    return SSHOptions(**{k: v for k, v in files.items() if k == "known_hosts_path"})


def hosts_mapping(master: str, machines: Sequence[MachineAdvert],
                  **top: Any) -> dict[str, Any]:
    """A hosts-file mapping: ``master`` (this machine) runs rank 0, each machine one worker
    at its first address with its advertised SSH port and user, Python and checkout."""
    workers = [{"host": m.addresses[0], "ssh_port": m.ssh_port, "ssh_user": m.ssh_user,
                "python_env": m.python, "project_path": m.project_path} for m in machines]
    return {"master": master, "workers": workers, **top}


def other_machines(machines: Sequence[MachineAdvert]) -> list[MachineAdvert]:
    """``machines`` less this one (an agent may run here too): those sharing none of its
    addresses."""
    try:
        here = set(ipv4_addresses())
    except DiscoveryError:
        here = set()
    return [m for m in machines if not here & set(m.addresses)]
