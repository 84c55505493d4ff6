"""Hosts that are apart: each bed host in a mount namespace of its own, as well as a network one.

A host of an apart bed sees this machine's system (``/usr``, ``/etc``, the system's
``python3``) and nothing of the person testing it:

- its own home (``/root``) and its own ``/tmp``, empty at the start: no caches, no
  ``~/.ssh``, no ``~/.pyenv``, nothing another host or this machine wrote there;
- no checkout of the project and no Python environment of this machine (the checkout
  the tests run from and, when it is a virtual environment, ``sys.prefix`` are covered by
  an empty read-only folder), so a host has what ``setup-hosts`` gives it and nothing else;
- with ``shared_home``, every host the same home (as an NFS home does) and each its own
  ``/tmp``.

Each host's folders live in the bed's folder (``homes/h<i>/root``, ``homes/h<i>/tmp``),
so a test reads what a host wrote from outside; the bed's own folder (sshd config and
keys) is shown to the host at its usual path inside the host's ``/tmp``, with ``homes``
covered, so no host sees another's home.

Every command that enters a host (its sshd, and :meth:`Testbed.in_host`) goes through
:func:`enter_host`: ``unshare --mount`` and a few bind mounts, then the command.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

#: Where an apart bed keeps its hosts' homes and temporary folders, inside its own folder.
HOMES = "homes"
#: The home folder a host has (root's, since the bed's sshd lets root in).
HOME = "/root"


def host_folders(workdir: Path, index: int, shared_home: bool) -> tuple[Path, Path]:
    """The home and ``/tmp`` of host ``index`` of the bed in ``workdir``, made empty
    (``/tmp`` sticky and writable by all, as a system's is)."""
    home = workdir / HOMES / ("shared" if shared_home else f"h{index}") / "root"
    tmp = workdir / HOMES / f"h{index}" / "tmp"
    home.mkdir(parents=True, exist_ok=True)
    home.chmod(0o700)
    tmp.mkdir(parents=True, exist_ok=True)
    tmp.chmod(0o1777)
    # The bed's own folder is shown at its usual path inside the host's /tmp: made here.
    (tmp / workdir.name).mkdir(exist_ok=True)
    return home, tmp


def hidden_paths(project_root: Path) -> list[str]:
    """What of this machine a host must not see besides its home and ``/tmp``: the
    project's checkout and this Python's virtual environment, when they lie elsewhere."""
    hidden = [project_root.resolve()]
    if sys.prefix != sys.base_prefix:  # a virtual environment, not the system's Python
        hidden.append(Path(sys.prefix).resolve())
    covered = (Path(HOME), Path("/tmp"))
    return [str(p) for p in hidden
            if p.is_dir() and not any(p == c or c in p.parents for c in covered)]


def enter_host(workdir: Path, home: Path, tmp: Path, hidden: list[str],
               command: list[str]) -> list[str]:
    """``command`` run in a new mount namespace where ``home`` is ``/root``, ``tmp`` is
    ``/tmp``, the bed's folder is where it was (its ``homes`` covered) and ``hidden``
    paths are empty. Meant to follow ``ip netns exec NAMESPACE``."""
    workdir = workdir.resolve()
    inner = tmp / workdir.name
    steps = [
        f"mount --bind {shlex.quote(str(workdir))} {shlex.quote(str(inner))}",
        f"mount -t tmpfs -o size=64k,mode=0755 exogym-bed-hidden "
        f"{shlex.quote(str(inner / HOMES))}",
        f"mount --bind {shlex.quote(str(home))} {HOME}",
        f"mount --rbind {shlex.quote(str(tmp))} /tmp",  # with the bed folder bound in it
        *(f"mount -t tmpfs -o size=64k,mode=0755,ro exogym-bed-hidden {shlex.quote(p)}"
          for p in hidden),
        'exec "$@"',
    ]
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-ec",
            "\n".join(steps), "sh", *command]


def check_apart() -> str | None:
    """None when hosts can be set apart here, else why not."""
    if os.geteuid() != 0:
        return "mount namespaces need root"
    from shutil import which

    if which("unshare") is None:
        return "unshare (util-linux) is not installed"
    if not Path("/usr/bin/python3").exists():
        return "no system python3 at /usr/bin/python3 for the hosts"
    return None


def main(argv: list[str] | None = None) -> int:
    """Start an apart bed by hand, print how to reach it, and hold it until Enter or Ctrl-C."""
    import argparse
    import json

    from .bed import Testbed
    from .system import TestbedError, check_requirements, free_port

    parser = argparse.ArgumentParser(
        prog="python -m tests.netbed",
        description="Hosts apart on this machine (root): each its own network and mount "
                    "namespace, home, /tmp and sshd, with only the system's python3.")
    parser.add_argument("--hosts", type=int, default=2, help="how many hosts (default 2)")
    parser.add_argument("--shared-home", action="store_true",
                        help="the hosts share one home folder, as NFS homes are shared")
    parser.add_argument("--subnet", default="10.213.61", help="three octets (10.213.61)")
    args = parser.parse_args(argv)
    missing = check_apart() or "; ".join(check_requirements(pin=False))
    if missing:
        print(f"cannot start the bed: {missing}")
        return 2
    try:
        with Testbed(args.hosts, subnet=args.subnet, pin=False, apart=True,
                     shared_home=args.shared_home) as bed:
            hosts = bed.hosts_config(free_port(), launcher_is_master=True)
            path = bed.workdir / "hosts.json"
            path.write_text(json.dumps(hosts, indent=2) + "\n")
            ssh = (f"ssh -i {bed.key_path} -o UserKnownHostsFile={bed.known_hosts} "
                   f"-F {bed.ssh_config}")
            print(f"{args.hosts} hosts apart: "
                  + ", ".join(h.address for h in bed.hosts)
                  + f"; this machine is {bed.uplink_address} to them")
            print(f"a hosts file (paths left out, for setup-hosts): {path}")
            print(f"  python cli_typer.py setup-hosts {path} --known-hosts {bed.known_hosts}")
            print(f"log in: {ssh} root@{bed.hosts[0].address}")
            for host in bed.hosts:
                print(f"host {host.index}'s home is {bed.home(host)} here")
            print("Enter or Ctrl-C removes the bed (namespaces, sshds, homes).")
            try:
                input()
            except (KeyboardInterrupt, EOFError):
                pass
    except TestbedError as exc:
        print(f"cannot start the bed: {exc}")
        return 2
    return 0
