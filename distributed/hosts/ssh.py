"""SSH connections to the hosts of a job: secure by default, never prompting.

Host keys are checked against a known_hosts file with paramiko's
``RejectPolicy``: an unknown host is refused with its fingerprint shown, unless
``accept_new_host_keys`` is set, in which case a *new* host is trusted once and
its key appended to known_hosts (atomically). A *changed* key is always
refused. ``~/.ssh/config`` is honoured for ``HostName``, ``User``, ``Port`` and
``IdentityFile``. Authentication uses key files and the SSH agent only, so no
password or passphrase prompt can ever block a run. Every failure becomes an
``SSHConnectError`` whose message names the host, what failed and the fix.

paramiko is imported inside the functions that need it, so importing this
module stays cheap.
"""

from __future__ import annotations

import base64
import errno
import getpass
import hashlib
import os
import shlex
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exogym.base.io import atomic_write_text

from .hostsfile import HostSpec

if TYPE_CHECKING:
    import paramiko

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
DEFAULT_SSH_CONFIG = "~/.ssh/config"

_known_hosts_lock = threading.Lock()


@dataclass(frozen=True)
class SSHOptions:
    """How to open SSH connections.

    Args:
        known_hosts_path: the known_hosts file host keys are checked against
            and new keys are recorded in.
        ssh_config_path: an OpenSSH client config to honour, or ``None``.
        accept_new_host_keys: trust a host whose key is not yet in known_hosts
            (once; the key is recorded). A changed key is refused regardless.
        allow_agent: offer the keys of the running SSH agent.
        look_for_keys: also offer the default key files (``~/.ssh/id_*``).
        connect_timeout: seconds for the TCP connect, the SSH banner and
            authentication, each.
        keepalive_s: interval of SSH keepalives, so a dead link is noticed.
    """

    known_hosts_path: str | os.PathLike[str] = DEFAULT_KNOWN_HOSTS
    ssh_config_path: str | os.PathLike[str] | None = DEFAULT_SSH_CONFIG
    accept_new_host_keys: bool = False
    allow_agent: bool = True
    look_for_keys: bool = True
    connect_timeout: float = 10.0
    keepalive_s: float = 10.0

    @property
    def known_hosts(self) -> Path:
        """The known_hosts path, ``~`` expanded."""
        return Path(self.known_hosts_path).expanduser()


@dataclass(frozen=True)
class SSHTarget:
    """Where and as whom to log in for one host, after ``~/.ssh/config``.

    Args:
        alias: the host as written in the hosts file.
        hostname: the address connected to (``HostName`` of ssh config, or the alias).
        port: SSH port.
        user: login user.
        key_files: private key files to offer, in order.
    """

    alias: str
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """``user@host`` plus ``:port`` when it is not 22."""
        port = "" if self.port == 22 else f":{self.port}"
        return f"{self.user}@{self.hostname}{port}"

    @property
    def known_hosts_name(self) -> str:
        """The name this host's key is filed under in known_hosts."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def ssh_command_line(target: SSHTarget, command: str, options: SSHOptions) -> str:
    """The OpenSSH command that runs ``command`` on ``target`` as the launcher's own
    connection would: the same login, port, keys, client config and known_hosts file.

    ``-t`` gives the command a terminal, so that Ctrl-C there stops it. Options equal to
    OpenSSH's defaults are left out.
    """
    words = ["ssh", "-t"]
    if target.port != 22:
        words += ["-p", str(target.port)]
    for key in target.key_files:
        words += ["-i", key]
    config = options.ssh_config_path
    if config is None:
        words += ["-F", "none"]
    elif Path(config).expanduser() != Path(DEFAULT_SSH_CONFIG).expanduser():
        words += ["-F", str(Path(config).expanduser())]
    if options.known_hosts != Path(DEFAULT_KNOWN_HOSTS).expanduser():
        words += ["-o", f"UserKnownHostsFile={options.known_hosts}"]
    words += [f"{target.user}@{target.alias}", command]
    return shlex.join(words)


class SSHConnectError(Exception):
    """Connecting or logging in to a host failed; ``str()`` says why and what to do.

    Args:
        target: the host it was about.
        kind: a short tag for the failure (``unknown-host-key``,
            ``changed-host-key``, ``auth``, ``encrypted-key``, ``key-file``,
            ``refused``, ``timeout``, ``no-greeting``, ``closed``, ``not-ssh``,
            ``unreachable``, ``dns``, ``ssh``).
        message: the full, actionable explanation.
        fingerprint: the host key fingerprint, for host key failures.
    """

    def __init__(self, target: SSHTarget, kind: str, message: str,
                 fingerprint: str | None = None) -> None:
        super().__init__(message)
        self.target = target
        self.kind = kind
        self.message = message
        self.fingerprint = fingerprint


def fingerprint(key: Any) -> str:
    """OpenSSH's SHA256 fingerprint of a paramiko key: ``SHA256:<base64>``."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def load_ssh_config(options: SSHOptions) -> Any:
    """The parsed OpenSSH client config of ``options``, or ``None`` when there is none."""
    if options.ssh_config_path is None:
        return None
    path = Path(options.ssh_config_path).expanduser()
    if not path.is_file():
        return None
    import paramiko

    return paramiko.SSHConfig.from_path(str(path))


def resolve_target(spec: HostSpec, options: SSHOptions, ssh_config: Any = None) -> SSHTarget:
    """Combine a host of the hosts file with ``~/.ssh/config`` into a login target.

    Values written in the hosts file win over ssh config, which wins over
    the defaults (port 22, the local user name).
    """
    found: dict[str, Any] = ssh_config.lookup(spec.host) if ssh_config is not None else {}
    hostname = found.get("hostname", spec.host)
    port = spec.ssh_port or int(found.get("port", 22))
    user = spec.ssh_user or found.get("user") or getpass.getuser()
    keys: list[str] = []
    if spec.ssh_key_path:
        keys.append(os.path.expanduser(spec.ssh_key_path))
    for path in found.get("identityfile", []):
        path = os.path.expanduser(path)
        if path not in keys and os.path.isfile(path):
            keys.append(path)
    return SSHTarget(alias=spec.host, hostname=hostname, port=port, user=user,
                     key_files=tuple(keys))


def _record_host_key(options: SSHOptions, name: str, key: Any) -> None:
    """Append ``name key`` to known_hosts unless present, replacing the file atomically."""
    path = options.known_hosts
    line = f"{name} {key.get_name()} {key.get_base64()}\n"
    with _known_hosts_lock:
        try:
            text = path.read_text(encoding="utf-8")
            mode = path.stat().st_mode & 0o777
        except FileNotFoundError:
            text, mode = "", 0o644
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if line in text:
            return
        if text and not text.endswith("\n"):
            text += "\n"
        atomic_write_text(path, text + line, mode=mode)


def _policy(options: SSHOptions, accepted: list[str], unknown: list[tuple[str, str]]) -> Any:
    """paramiko's RejectPolicy, noting the key it refuses; or, when new keys may be
    accepted, one that records the new key in known_hosts instead of refusing."""
    import paramiko

    class RecordNewHostKey(paramiko.RejectPolicy):
        def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
            if not options.accept_new_host_keys:
                unknown.append((key.get_name(), fingerprint(key)))
                super().missing_host_key(client, hostname, key)
                return
            _record_host_key(options, hostname, key)
            client.get_host_keys().add(hostname, key.get_name(), key)
            accepted.append(f"{hostname} {key.get_name()} {fingerprint(key)}")

    return RecordNewHostKey()


def connect(target: SSHTarget, options: SSHOptions) -> tuple[paramiko.SSHClient, list[str]]:
    """Open an authenticated SSH connection to ``target``.

    Returns:
        The connected client, and the host keys newly trusted on the way
        (``"name type fingerprint"``; empty unless ``accept_new_host_keys``).

    Raises:
        SSHConnectError: with the reason and the fix.
    """
    import paramiko

    for path in target.key_files:
        if not os.path.isfile(path):
            raise SSHConnectError(target, "key-file", (
                f"{target.label}: key file {path} does not exist on this machine; fix "
                '"ssh_key_path" in the hosts file or IdentityFile in your ssh config'))
    client = paramiko.SSHClient()
    known = options.known_hosts
    if known.is_file():
        try:
            client.load_host_keys(str(known))
        except (OSError, paramiko.SSHException) as exc:
            raise SSHConnectError(target, "ssh", (
                f"cannot read known_hosts file {known}: {exc}; fix or move that file")) from None
    accepted: list[str] = []
    unknown: list[tuple[str, str]] = []
    client.set_missing_host_key_policy(_policy(options, accepted, unknown))
    timeout = options.connect_timeout
    sock, greeting = open_ssh_socket(target, options)
    try:
        client.connect(
            target.hostname, port=target.port, username=target.user,
            key_filename=list(target.key_files) or None,
            allow_agent=options.allow_agent, look_for_keys=options.look_for_keys,
            timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
            channel_timeout=timeout, sock=sock,
        )
    except (OSError, EOFError, ValueError, paramiko.SSHException) as exc:
        client.close()
        sock.close()
        if not greeting.startswith(b"SSH-"):
            raise SSHConnectError(target, "not-ssh", (
                f"{target.hostname}:{target.port} answered {greeting[:40]!r} instead of an SSH "
                "greeting: another service listens on that port; fix \"ssh_port\" in the "
                "hosts file")) from None
        raise _explain(target, options, exc, unknown) from None
    transport = client.get_transport()
    if transport is not None and options.keepalive_s > 0:
        transport.set_keepalive(int(max(1, options.keepalive_s)))
    return client, accepted


def open_ssh_socket(target: SSHTarget, options: SSHOptions) -> tuple[socket.socket, bytes]:
    """A TCP connection to ``target`` whose server has begun to greet; and its first bytes.

    The greeting is peeked at, not read, so SSH reads it afterwards. Waiting here
    for it tells apart what paramiko reports alike (or as "No existing session"):
    a server that accepts the connection and stays silent, and one that closes it.

    Raises:
        SSHConnectError: with what happened, how long it waited and what to check.
    """
    where = f"{target.hostname}:{target.port}"
    timeout = options.connect_timeout
    try:
        sock = socket.create_connection((target.hostname, target.port), timeout=timeout)
    except OSError as exc:
        raise _explain(target, options, exc, []) from None
    started = time.monotonic()
    try:
        greeting = sock.recv(64, socket.MSG_PEEK)
    except TimeoutError:
        sock.close()
        raise SSHConnectError(target, "no-greeting", (
            f"{where} accepted the TCP connection but sent no SSH greeting in {timeout:.1f} s: "
            "is sshd running there, or is another service on that port? Check \"ssh_port\" "
            "in the hosts file, and that the host is not overloaded")) from None
    except OSError as exc:
        greeting = b""
        closed = f"reset the connection ({exc.strerror or exc})"
    else:
        closed = "closed the connection at once"
    if not greeting:
        sock.close()
        raise SSHConnectError(target, "closed", (
            f"{where} {closed} before the SSH greeting (after "
            f"{time.monotonic() - started:.2f} s): sshd there may refuse this machine "
            "(hosts.allow, MaxStartups, a firewall), or another service is on that port; check "
            "\"ssh_port\" in the hosts file and the host's sshd log")) from None
    return sock, greeting


def _explain(target: SSHTarget, options: SSHOptions, exc: BaseException,
             unknown: list[tuple[str, str]]) -> SSHConnectError:
    """Turn an exception from ``SSHClient.connect`` into an actionable ``SSHConnectError``."""
    import paramiko

    where = f"{target.hostname}:{target.port}"
    timeout = f"{options.connect_timeout:g}"
    if unknown:
        key_type, fp = unknown[0]
        return SSHConnectError(target, "unknown-host-key", (
            f"{where}: unknown host key ({key_type} {fp}), not in {options.known_hosts}. "
            "Check that fingerprint against the host's own (run `ssh-keygen -lf "
            "/etc/ssh/ssh_host_ed25519_key.pub` there), then rerun with "
            "--accept-new-host-keys (accept_new_host_keys=True) to trust it once and record it"),
            fingerprint=fp)
    if isinstance(exc, paramiko.BadHostKeyException):
        got, expected = fingerprint(exc.key), fingerprint(exc.expected_key)
        return SSHConnectError(target, "changed-host-key", (
            f"{where}: HOST KEY CHANGED: {options.known_hosts} has {expected} but the host "
            f"offers {got}. Someone may be intercepting the connection; refusing. If the host "
            f"was reinstalled, remove the old key with `ssh-keygen -R "
            f"'{target.known_hosts_name}' -f {options.known_hosts}` and connect again"),
            fingerprint=got)
    if isinstance(exc, paramiko.PasswordRequiredException):
        keys = ", ".join(target.key_files) or "a default key"
        return SSHConnectError(target, "encrypted-key", (
            f"{target.label}: the key ({keys}) is protected by a passphrase and no prompt is "
            "ever shown; load it into your agent with `ssh-add <key>` and run again"))
    if isinstance(exc, paramiko.AuthenticationException):
        offered = []
        if target.key_files:
            offered.append("key " + ", ".join(target.key_files))
        if options.allow_agent:
            offered.append("the SSH agent")
        if options.look_for_keys:
            offered.append("the default keys in ~/.ssh")
        tried = " and ".join(offered) if offered else "no key at all"
        key = target.key_files[0] if target.key_files else "~/.ssh/id_ed25519"
        return SSHConnectError(target, "auth", (
            f"authentication failed for {target.user}@{where} with {tried}: add your public "
            f"key to ~/.ssh/authorized_keys of {target.user} on that host (`ssh-copy-id -i "
            f"{key}.pub -p {target.port} {target.user}@{target.hostname}`), or set "
            '"ssh_user"/"ssh_key_path" for it in the hosts file'))
    if isinstance(exc, socket.gaierror):
        return SSHConnectError(target, "dns", (
            f"cannot resolve host name {target.hostname!r} ({exc.strerror}): check the "
            "spelling, or give an IP address, or add it to /etc/hosts or ~/.ssh/config"))
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        codes = {e.errno for e in exc.errors.values()}
        exc = next(iter(exc.errors.values())) if exc.errors else exc
        if errno.ECONNREFUSED in codes:
            return SSHConnectError(target, "refused", (
                f"connection refused by {where}: no SSH server listens there; start sshd on "
                'that host or fix "ssh_port" in the hosts file'))
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return SSHConnectError(target, "timeout", (
            f"no answer from {where} within {timeout} s: check that the host is up, that the "
            'address and "ssh_port" are right, and that no firewall drops SSH'))
    if isinstance(exc, ConnectionRefusedError):
        return SSHConnectError(target, "refused", (
            f"connection refused by {where}: no SSH server listens there; start sshd on "
            'that host or fix "ssh_port" in the hosts file'))
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return SSHConnectError(target, "unreachable", (
            f"{where} is unreachable from this machine ({exc.strerror}): check the address "
            "and that both machines are on the same network"))
    if isinstance(exc, paramiko.SSHException) and "banner" in str(exc).lower():
        return SSHConnectError(target, "timeout", (
            f"{where} accepted the connection but sent no SSH greeting within {timeout} s: "
            'check that "ssh_port" is an SSH server and that the host is not overloaded'))
    return SSHConnectError(target, "ssh", f"{where}: SSH failed: {exc}")
