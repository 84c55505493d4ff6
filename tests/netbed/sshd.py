"""A private sshd: its config (keys in a temporary folder, keys only, no PAM), its greeting."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from .system import TestbedError


def sshd_config(listen: Sequence[str], host_key: Path, authorized_keys: Path, *,
                max_startups: int = 100, verbose: bool = False) -> str:
    """An ``sshd_config`` that listens on ``listen`` (``address:port`` each) and lets in only
    the holder of a key in ``authorized_keys``."""
    return "\n".join([
        *(f"ListenAddress {address}" for address in listen),
        f"HostKey {host_key}",
        f"AuthorizedKeysFile {authorized_keys}",
        "PidFile none",
        "StrictModes no",  # the files sit in a world-writable temporary folder
        "UsePAM no",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes",
        "PermitRootLogin prohibit-password",
        "UseDNS no",
        "PrintMotd no",
        f"MaxStartups {max_startups}",
        f"MaxSessions {max_startups}",
        "Subsystem sftp internal-sftp",
        *(["LogLevel VERBOSE"] if verbose else []),
        "",
    ])


def wait_for_greeting(proc: subprocess.Popen, addresses: Sequence[str], port: int, log: Path,
                      name: str = "sshd", timeout: float = 15) -> None:
    """Return once the sshd ``proc`` greets (``SSH-...``) on every address at ``port``.

    Raises :class:`TestbedError` with the end of its ``log`` when it exits first or
    ``timeout`` seconds pass.
    """
    deadline = time.monotonic() + timeout
    pending = list(addresses)
    while pending:
        if proc.poll() is not None:
            raise TestbedError(f"{name} exited with {proc.returncode}: {log.read_text()[-1500:]}")
        try:
            with socket.create_connection((pending[0], port), timeout=1) as s:
                if s.recv(64).startswith(b"SSH-"):
                    pending.pop(0)
                    continue
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TestbedError(f"{name} does not answer on {pending[0]}:{port}: "
                               f"{log.read_text()[-1500:]}")
        time.sleep(0.05)
