"""Which hosts share a folder: a home on NFS, or one disk behind several addresses.

Hosts whose ``project_path`` (or whose environment) is one folder must be set up once:
two copies written into one folder at once do the work twice, and two environments
made in one folder at once break each other. A folder's name does not tell: ``~/exogym``
is one folder on two hosts with one NFS home, and two folders on two machines with
disks of their own; ``/home/me/gym`` and ``~/gym`` may be one folder. So the hosts are
asked, with probe files named after a token drawn at random for each look:

1. every host makes the folder (when missing) and creates ``.exogym-share.TOKEN.I`` in
   it, ``I`` its index;
2. once every host has, every host creates a second probe, ``.exogym-share.TOKEN.I.seen``
   (a write into the folder makes an NFS client take the folder's listing afresh, not
   from its cache), then lists the folder: the first probes of this token it finds
   name the hosts it shares the folder with;
3. every host removes its probes.

Hosts that see each other's probes are one group; the first of each group in the
hosts file's order sets the folder up for all of them (:attr:`SharedFolder.leader`). A
host where a probe cannot be written or read stands alone: what setup does there next
reports why. Every step has a deadline: a host that does not answer within it is named
in a :class:`ShareProbeError`.
"""

from __future__ import annotations

import posixpath
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .sync import makedirs_remote, sftp_path

#: Seconds one host may take for each step of the look (an SFTP request or two).
PROBE_TIMEOUT_S = 30.0
#: How a probe file's name starts.
PROBE_PREFIX = ".exogym-share."


class ShareProbeError(RuntimeError):
    """A host did not answer while the hosts were asked which folders they share.

    Args:
        failures: one line per host, naming it, the folder and the deadline.
    """

    def __init__(self, failures: Sequence[str]) -> None:
        self.failures = tuple(failures)
        super().__init__("; ".join(self.failures))


@dataclass(frozen=True)
class SharedFolder:
    """Hosts whose folders are one folder, the one that sets it up first.

    Args:
        keys: the hosts' keys (their index in the hosts file), in order.
        hosts: their names, as the hosts file gives them.
        paths: each host's path of the folder, as its hosts-file entry gives it.
    """

    keys: tuple[int, ...]
    hosts: tuple[str, ...]
    paths: tuple[str, ...]

    @property
    def leader(self) -> int:
        """The key of the host that sets the folder up for all of them."""
        return self.keys[0]

    @property
    def leader_host(self) -> str:
        """The name of the host that sets the folder up for all of them."""
        return self.hosts[0]

    def describe(self, what: str = "folder") -> str:
        """``hosts a and b share ~/exogym``, or when the hosts name it differently,
        ``hosts a and b share one folder (a: /home/me/gym, b: ~/gym)``; ``what`` is what
        the folder is (``environment``: ``share the environment ~/exogym/.venv``)."""
        names = _and(self.hosts)
        if len(set(self.paths)) == 1:
            return f"hosts {names} share {'' if what == 'folder' else f'the {what} '}" \
                   f"{self.paths[0]}"
        each = ", ".join(f"{h}: {p}" for h, p in zip(self.hosts, self.paths))
        return f"hosts {names} share one {what} ({each})"


def _and(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"


def find_shared(clients: Mapping[int, Any], folders: Mapping[int, str],
                hosts: Mapping[int, str], timeout: float = PROBE_TIMEOUT_S,
                token: str | None = None) -> list[SharedFolder]:
    """The groups of hosts whose ``folders`` are one folder; see the module docstring.

    Args:
        clients: per key, a connected ``paramiko.SSHClient`` to the host.
        folders: per key, the host's folder (``~/`` is its home).
        hosts: per key, the host's name, for messages.
        timeout: seconds each host may take for each step.
        token: the probes' token (default: drawn at random).

    Returns:
        One :class:`SharedFolder` per group of two hosts or more, ordered by key; a host
        sharing its folder with none is in none.

    Raises:
        ShareProbeError: naming each host that did not answer within ``timeout``.
        ValueError: for a key of ``folders`` without a client or a name, or a timeout
            that is not above 0.
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    missing = [k for k in folders if k not in clients or k not in hosts]
    if missing:
        raise ValueError(f"no client or name for the host keys {missing}")
    keys = sorted(folders)
    if len(keys) < 2:
        return []
    token = token or secrets.token_hex(8)
    probes = [_Probe(clients[k], sftp_path(folders[k]), token, k, timeout) for k in keys]
    failures: list[str] = []
    with ThreadPoolExecutor(max_workers=min(16, len(keys))) as pool:
        try:
            for step in ("leave", "look"):
                for k, error in zip(keys, pool.map(_Probe.run, probes, [step] * len(keys))):
                    if error is not None:
                        failures.append(f"[{hosts[k]}] no answer within {timeout:g} s while "
                                        f"looking in {folders[k]} for hosts that share it "
                                        f"({error})")
                if failures:
                    raise ShareProbeError(failures)
        finally:
            list(pool.map(_Probe.run, probes, ["remove"] * len(keys)))
    return _groups(keys, {p.key: p.seen for p in probes}, folders, hosts)


def _groups(keys: Sequence[int], seen: Mapping[int, set[int]], folders: Mapping[int, str],
            hosts: Mapping[int, str]) -> list[SharedFolder]:
    """Join the hosts that saw each other's probes (either way round) into groups."""
    group = {k: k for k in keys}

    def root(k: int) -> int:
        while group[k] != k:
            k = group[k]
        return k

    for k in keys:
        for other in seen[k]:
            if other in group:
                a, b = sorted((root(k), root(other)))
                group[b] = a
    members: dict[int, list[int]] = {}
    for k in keys:
        members.setdefault(root(k), []).append(k)
    return [SharedFolder(tuple(ks), tuple(hosts[k] for k in ks), tuple(folders[k] for k in ks))
            for ks in sorted(members.values()) if len(ks) > 1]


class _Probe:
    """One host's part in the look: its SFTP session, its probes, what it saw."""

    def __init__(self, client: Any, folder: str, token: str, key: int, timeout: float):
        self.client = client
        self.folder = folder or "."
        self.token = token
        self.key = key
        self.timeout = timeout
        self.sftp: Any = None
        self.written: list[str] = []
        self.seen: set[int] = set()
        self.alone = False

    def run(self, step: str) -> str | None:
        """Do ``step``; the error when the host did not answer in time, else None."""
        from paramiko import SSHException

        try:
            getattr(self, step)()
        except TimeoutError as exc:  # socket.timeout too
            self.alone = True
            return str(exc) or "timed out"
        except (OSError, EOFError, SSHException):
            self.alone = True  # cannot write or read there: what comes next says why
        return None

    def _create(self, name: str) -> None:
        path = posixpath.join(self.folder, name)
        # an empty file: its name is all it says, so it is whole once it exists
        with self.sftp.open(path, "w"):
            pass
        self.written.append(path)

    def leave(self) -> None:
        self.sftp = self.client.open_sftp()
        self.sftp.get_channel().settimeout(self.timeout)
        makedirs_remote(self.sftp, self.folder, set())
        self._create(f"{PROBE_PREFIX}{self.token}.{self.key}")

    def look(self) -> None:
        if self.alone:
            return
        self._create(f"{PROBE_PREFIX}{self.token}.{self.key}.seen")
        start = f"{PROBE_PREFIX}{self.token}."
        for name in self.sftp.listdir(self.folder):
            rest = name[len(start):] if name.startswith(start) else ""
            if rest.isdigit():
                self.seen.add(int(rest))

    def remove(self) -> None:
        if self.sftp is None:
            return
        try:
            for path in self.written:
                try:
                    self.sftp.remove(path)
                except FileNotFoundError:
                    pass  # gone already
        finally:
            self.sftp.close()
