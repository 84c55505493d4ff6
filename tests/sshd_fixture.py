"""A real sshd on loopback addresses for the launcher's tests.

One ``sshd -D`` process listens on several loopback addresses (127.0.0.2,
127.0.0.3, ...) at one free port; each address plays a separate host. Its host
key, the authorized user key, a second key that is *not* authorized, and its
config live in a temporary directory. No ``AcceptEnv`` is configured, so tests
prove that rank variables arrive without it. ``serve_sshd`` stops sshd by its PID.

Skipped, with the reason printed, when sshd or paramiko is not installed
(``tests/setup_system.sh`` installs openssh-server).
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from netbed.sshd import sshd_config, wait_for_greeting
from netbed.system import sshd_binary, stop_process
from ports import free_port

ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6")


@dataclass(frozen=True)
class SSHD:
    """The running test server and the files a client needs to use it."""

    addresses: tuple[str, ...]
    port: int
    user: str
    key_path: Path
    wrong_key_path: Path
    host_public_key: str  # "ssh-ed25519 AAAA..."
    known_hosts: Path  # lists the host key for every address
    ssh_config: Path  # an empty client config
    log_path: Path
    pid: int

    def known_hosts_line(self, address: str) -> str:
        return f"[{address}]:{self.port} {self.host_public_key}\n"


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "exogym-test",
                    "-f", str(path)], check=True)


def serve_sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHD]:
    """Start sshd on the test addresses, yield it, then stop it by PID.

    Meant as the body of a session fixture: ``yield from serve_sshd(tmp_path_factory)``.
    """
    pytest.importorskip("paramiko", reason="paramiko is not installed: pip install paramiko")
    binary = sshd_binary()
    if binary is None:
        pytest.skip("sshd is not installed (tests/setup_system.sh installs openssh-server)")
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen is not installed (tests/setup_system.sh installs openssh-client)")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir

    home = tmp_path_factory.mktemp("sshd")
    host_key, user_key, wrong_key = home / "host_key", home / "user_key", home / "wrong_key"
    for key in (host_key, user_key, wrong_key):
        _keygen(key)
    authorized = home / "authorized_keys"
    authorized.write_text((home / "user_key.pub").read_text())
    port = free_port(*ADDRESSES)
    config = home / "sshd_config"
    config.write_text(sshd_config([f"{a}:{port}" for a in ADDRESSES], host_key, authorized,
                                  max_startups=200, verbose=True))
    log = home / "sshd.log"
    proc = subprocess.Popen([binary, "-D", "-f", str(config), "-E", str(log)],
                            stdin=subprocess.DEVNULL)
    try:
        wait_for_greeting(proc, ADDRESSES, port, log)
        public = (home / "host_key.pub").read_text().split()
        server = SSHD(
            addresses=ADDRESSES, port=port, user=getpass.getuser(), key_path=user_key,
            wrong_key_path=wrong_key, host_public_key=f"{public[0]} {public[1]}",
            known_hosts=home / "known_hosts", ssh_config=home / "ssh_config", log_path=log,
            pid=proc.pid,
        )
        server.known_hosts.write_text("".join(server.known_hosts_line(a) for a in ADDRESSES))
        server.ssh_config.write_text("")
        yield server
    finally:
        stop_process(proc)


class HostSSHD:
    """A second sshd, for one more address, with the first one's keys: a host that can be
    switched off (``stop``) and on again (``start``), as a machine that drops out.

    Args:
        server: the running test server whose keys and port it shares.
        address: the address it listens on (not one of ``ADDRESSES``).
        sftp: whether it offers the SFTP subsystem (False: a host without one).
    """

    def __init__(self, server: SSHD, address: str, *, sftp: bool = True):
        self.server = server
        self.address = address
        home = server.key_path.parent
        self.config = home / f"sshd_config_{address}"
        text = (home / "sshd_config").read_text().splitlines()
        self.config.write_text("\n".join(
            [f"ListenAddress {address}:{server.port}"] +
            [line for line in text if not line.startswith("ListenAddress")
             and (sftp or not line.startswith("Subsystem sftp"))]) + "\n")
        self.log = home / f"sshd_{address}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        with server.known_hosts.open("a") as f:
            f.write(server.known_hosts_line(address))

    def start(self) -> None:
        """Start it and wait until it greets."""
        binary = sshd_binary()
        assert binary is not None
        self.proc = subprocess.Popen([binary, "-D", "-f", str(self.config), "-E", str(self.log)],
                                     stdin=subprocess.DEVNULL)
        wait_for_greeting(self.proc, (self.address,), self.server.port, self.log)

    def stop(self) -> None:
        """Stop it by its PID; connections it already serves stay up, as with a real sshd."""
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
