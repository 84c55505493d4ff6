"""A host's SSH key, fetched before any login so a person can confirm its fingerprint.

The wizard adds machines found on the LAN; each is trusted only after the
person says yes to the key's SHA256 fingerprint, shown as OpenSSH shows it.
The key is then recorded in the known_hosts file the launcher checks against,
so the logins that follow are checked like any other.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from .ssh import SSHOptions, _record_host_key, fingerprint


@dataclass(frozen=True)
class HostKey:
    """The key one SSH server presented.

    Args:
        name: the name it is filed under in known_hosts (``host`` or ``[host]:port``).
        key_type: e.g. ``ssh-ed25519``.
        fingerprint: ``SHA256:<base64>``, as ``ssh`` prints it.
        key: the paramiko key.
    """

    name: str
    key_type: str
    fingerprint: str
    key: Any

    @property
    def algorithm(self) -> str:
        """``ED25519``, ``RSA``, ``ECDSA``: the word OpenSSH puts before "key fingerprint"."""
        short = self.key_type.removeprefix("ssh-").split("-")[0]
        return "ECDSA" if short.startswith("ecdsa") else short.upper()


def known_hosts_name(host: str, port: int) -> str:
    """The name a host's key is filed under in known_hosts."""
    return host if port == 22 else f"[{host}]:{port}"


def fetch_host_key(host: str, port: int = 22, timeout: float = 10.0) -> HostKey:
    """The key ``host:port``'s SSH server presents (no login is attempted).

    Raises:
        OSError: the server could not be reached or did not speak SSH within ``timeout``
            (the message says which, with the address).
    """
    import paramiko

    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise OSError(f"cannot reach the SSH server at {host}:{port}: {exc}") from None
    transport = paramiko.Transport(sock)
    transport.banner_timeout = timeout
    try:
        transport.start_client(timeout=timeout)
        key = transport.get_remote_server_key()
    except (paramiko.SSHException, EOFError, OSError) as exc:
        raise OSError(f"{host}:{port} did not complete an SSH handshake within {timeout:g} s "
                      f"({exc or type(exc).__name__}); check that sshd runs there") from None
    finally:
        transport.close()
    return HostKey(known_hosts_name(host, port), key.get_name(), fingerprint(key), key)


def is_known(options: SSHOptions, host_key: HostKey) -> bool:
    """Whether known_hosts already lists exactly this key for this host."""
    import paramiko

    path = options.known_hosts
    if not path.is_file():
        return False
    keys = paramiko.HostKeys(str(path))
    found = keys.lookup(host_key.name)
    return bool(found) and host_key.key_type in found and \
        found[host_key.key_type].asbytes() == host_key.key.asbytes()


def trust_host_key(options: SSHOptions, host_key: HostKey) -> None:
    """Record ``host_key`` in known_hosts (atomically; nothing when it is already there)."""
    _record_host_key(options, host_key.name, host_key.key)
