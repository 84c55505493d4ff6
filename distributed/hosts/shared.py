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

Probes tell the hosts of one setup apart; two setups at once (from two terminals, or
two machines, into one home) are kept apart by a :class:`FolderLock`, a lock file in
the folder that the second waits for, with a bound.
"""

from __future__ import annotations

import json
import os
import posixpath
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
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


class FolderBusyError(RuntimeError):
    """Another setup held a :class:`FolderLock` for longer than this one may wait; the
    message names the lock, its holder and what to do."""


class FolderLock:
    """A lock file in a host's folder, for work no two setups may do there at once (making
    one environment), whichever machine they run from and through whichever host that
    shares the folder they reach it.

    It is created exclusively (SFTP's ``O_EXCL``, which NFS keeps), holding who took it,
    when and a random token; a setup that finds it waits, up to ``wait`` seconds, until it
    is gone. A lock older than ``stale_after`` seconds was left by a setup that died (its
    connection lost, its process killed): it is renamed away (then read, so that a lock
    another setup took over a moment before is put back) and this one takes its place.
    The lock is removed on release only while it still holds this one's token.

    Args:
        sftp: an open SFTP client on the host.
        path: the lock file (``~/`` is the home); its folder must exist.
        what: what it guards, in words (``the environment ~/exogym/.venv``).
        host: the host's name, for messages.
        stale_after: seconds after which a lock is taken as left behind.
        wait: seconds to wait at most for a lock another setup holds.
        poll: seconds between looks.
        say: told once, in words, when this setup starts to wait for another's lock.
    """

    def __init__(self, sftp: Any, path: str, *, what: str, host: str, stale_after: float,
                 wait: float, poll: float = 1.0,
                 say: Callable[[str], None] = lambda _: None) -> None:
        if not stale_after > 0 or not wait >= 0 or not poll > 0:
            raise ValueError(f"stale_after and poll must be > 0 and wait >= 0 seconds, got "
                             f"{stale_after!r}, {poll!r} and {wait!r}")
        self.sftp = sftp
        self.path = sftp_path(path)
        self.shown = path
        self.what = what
        self.host = host
        self.stale_after = float(stale_after)
        self.wait = float(wait)
        self.poll = float(poll)
        self.say = say
        self.token = secrets.token_hex(8)
        #: Whether another setup held the lock when this one came for it.
        self.contended = False

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _holder(self, path: str | None = None) -> dict[str, Any] | None:
        """What the lock says (``{}`` while it is being written), None when it is gone."""
        try:
            with self.sftp.open(path or self.path, "r") as handle:
                text = bytes(handle.read()).decode(errors="replace")
        except FileNotFoundError:
            return None
        try:
            found = json.loads(text)
        except ValueError:
            return {}  # created, its content not written yet: as good as fresh
        return found if isinstance(found, dict) else {}

    def acquire(self) -> None:
        """Take the lock, waiting for another setup's at most ``wait`` seconds.

        Raises:
            FolderBusyError: another setup held it all that time.
            OSError: the lock could not be created for another reason (a folder this
                login may not write).
        """
        start = time.monotonic()
        deadline = start + self.wait
        mine = json.dumps({"token": self.token, "by": socket.gethostname(),
                           "pid": os.getpid(), "host": self.host, "started": time.time()})
        gone = False
        while True:
            try:
                handle = self.sftp.open(self.path, "wx")
            except OSError:
                holder = self._holder()
                if holder is None:
                    if gone:
                        raise  # it cannot be made, and is not there: no lock is held
                    gone = True
                    continue  # released between the two looks: once more
            else:
                try:
                    with handle:
                        handle.write(mine.encode())
                except BaseException:
                    self._remove(self.path)  # no empty lock left to keep others waiting
                    raise
                return
            gone = False
            started = holder.get("started")
            if not isinstance(started, (int, float)):  # being written, or never written
                try:
                    started = float(self.sftp.stat(self.path).st_mtime or time.time())
                except FileNotFoundError:
                    continue
            if time.time() - started > self.stale_after:
                self._take_over(holder)
                continue
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
            who = (f"another setup (from {holder.get('by', 'another machine')}, through "
                   f"{holder.get('host', 'a host')}, since {since})")
            if not self.contended:
                self.contended = True
                self.say(f"[{self.host}] {who} is making {self.what}: waiting for it, "
                         f"{self.wait:.0f} s at most")
            if time.monotonic() >= deadline:
                raise FolderBusyError(
                    f"{who} is making {self.what}; waited {time.monotonic() - start:.0f} s "
                    "for it: let it finish and run again, or, if no setup runs any more, "
                    f"remove {self.shown} on {self.host}")
            time.sleep(min(self.poll, max(0.0, deadline - time.monotonic())))

    def _take_over(self, stale: dict[str, Any]) -> None:
        """Rename a stale lock away; put it back if it was another's fresh one by then."""
        aside = f"{self.path}.{self.token}.stale"
        try:
            self.sftp.posix_rename(self.path, aside)
        except FileNotFoundError:
            return  # another setup took it over first
        moved = self._holder(aside)
        if moved is not None and moved.get("token") != stale.get("token"):
            try:
                self.sftp.posix_rename(aside, self.path)  # a fresh lock: give it back
            except OSError:
                pass  # its holder's release finds it gone; its work is done by then
            return
        self._remove(aside)

    def _remove(self, path: str) -> None:
        try:
            self.sftp.remove(path)
        except FileNotFoundError:
            pass  # gone already

    def release(self) -> None:
        """Remove the lock, while it is still this setup's."""
        holder = self._holder()
        if holder is not None and holder.get("token") == self.token:
            self._remove(self.path)
