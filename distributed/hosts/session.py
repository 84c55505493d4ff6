"""A host session: connections to every host of a hosts file, and what they allow alone.

Connect to every host in parallel (noting host keys trusted on the way), copy
the project's tracked files to them (once to hosts that share the project folder,
:mod:`.shared`), pre-flight them, fetch a file one of them wrote, close. Nothing
here knows what will run: no program, no environment, no secrets. ``check-hosts``
and the wizard use a session as it is; the job launcher
(``distributed.launch.launcher``) starts its ranks on a session's connections::

    from .session import HostSession

    with HostSession("hosts.json") as session:
        report = session.preflight(raise_on_failure=False)

The master (rank 0) is reached without SSH when it is this machine (see
:func:`is_this_machine`); every other host over SSH, host keys verified
against known_hosts (``distributed.hosts.ssh``).
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import os
import socket
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exogym.base.escapes import printable
from exogym.base.io import atomic_copy_stream
from exogym.base.plural import plural

from .hostsfile import HostsConfig, load_hosts
from .preflight import HostCheck, PreflightError, PreflightReport, check_host, run_preflight
from .remote import LocalShell, Shell, SSHShell
from .shared import SharedFolder, ShareProbeError, find_shared
from .ssh import (
    SSHConnectError,
    SSHOptions,
    SSHTarget,
    connect,
    load_ssh_config,
    resolve_target,
)
from .sync import (
    PROJECT_ROOT,
    ForeignFolderError,
    NoSFTPError,
    SyncStats,
    code_files,
    local_profile_files,
    open_sftp,
    put_files,
    sftp_path,
    sync_files,
    tracked_files,
)

if TYPE_CHECKING:
    from typing_extensions import Self


def is_this_machine(host: str) -> bool:
    """Whether ``host`` is this machine: ``localhost``, ``127.0.0.1``/``::1``, this
    machine's name, or an address of one of its interfaces.

    Other loopback addresses (``127.0.0.2`` ...) count as separate hosts: that
    is how a single machine stands in for several, as in the tests.
    """
    if host in ("localhost", "127.0.0.1", "::1") or host in (socket.gethostname(),
                                                            socket.getfqdn()):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            return False
        return any(a in ("127.0.0.1", "::1") or (_bindable(a) and not _loopback(a))
                   for a in addresses)
    return not ip.is_loopback and _bindable(host)


def can_listen_on(host: str) -> bool:
    """Whether a socket on this machine can listen on ``host``'s address: true for this
    machine and for every other address of its own, loopback ones (``127.0.0.2``) too."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return any(_bindable(a) for a in addresses)


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _bindable(address: str) -> bool:
    """Only addresses of this machine's own interfaces can be bound."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


class HostSession:
    """Connections to the hosts of a hosts file: connect, sync, pre-flight, fetch, close.

    Connections are opened on first need and kept until ``close``; use it as a
    context manager. A session knows hosts, not ranks: the ``rank`` its methods
    take is a host's index (``HostSpec.rank``); every rank of a host with
    several slots runs through its host's one connection.

    Args:
        hosts: a ``HostsConfig``, a hosts file path, or a hosts mapping.
        ssh: how to open SSH connections (default ``SSHOptions()``: known_hosts
            checked, new host keys refused).
        project_root: the local checkout: what ``sync`` copies and whose code
            hash pre-flight compares; default: this one.
        probe_timeout: seconds a host's pre-flight probe may take.
        master_local: reach rank 0 on this machine without SSH (``None``: when
            the master is this machine, see ``is_this_machine``).
        console: a ``rich.console.Console`` for the pre-flight table and
            messages (default: stdout).
    """

    def __init__(
        self,
        hosts: HostsConfig | str | os.PathLike[str] | Mapping[str, Any],
        *,
        ssh: SSHOptions | None = None,
        project_root: str | os.PathLike[str] | None = None,
        probe_timeout: float = 60.0,
        master_local: bool | None = None,
        console: Any = None,
    ) -> None:
        self.config = hosts if isinstance(hosts, HostsConfig) else load_hosts(hosts)
        if probe_timeout <= 0:
            raise ValueError(f"probe_timeout must be > 0 seconds, got {probe_timeout!r}")
        self.ssh = ssh or SSHOptions()
        self.project_root = Path(project_root or PROJECT_ROOT).resolve()
        self.probe_timeout = float(probe_timeout)
        master = self.config.master
        self.master_local = is_this_machine(master.host) if master_local is None \
            else bool(master_local)
        ssh_config = load_ssh_config(self.ssh)
        self.targets: dict[int, SSHTarget] = {
            h.rank: resolve_target(h, self.ssh, ssh_config)
            for h in self.config.hosts if h.rank != 0 or not self.master_local}
        #: The address every rank finds the master at (``MASTER_ADDR``).
        self.master_addr = self.targets[0].hostname if 0 in self.targets else master.host
        self.console = console
        self.report: PreflightReport | None = None
        self.synced = False
        self._shells: dict[int, Shell] = {}
        #: Files each other host gets under its ``project_path`` before its ranks start
        #: (:meth:`put_files`): a profiles file from outside the project.
        self.rank_files: dict[str, bytes] = {}
        self._connect_errors: dict[int, SSHConnectError] = {}
        self._notes: dict[int, list[str]] = collections.defaultdict(list)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def is_local(self, rank: int) -> bool:
        """Whether ``rank`` runs on this machine without SSH."""
        return rank not in self.targets

    def login(self, rank: int) -> str:
        """``local``, or the SSH login ``user@host[:port]`` of ``rank``'s host."""
        return "local" if self.is_local(rank) else self.targets[rank].label

    def shell(self, rank: int) -> Shell | None:
        """Where commands run for ``rank``; ``None`` when its host is not connected."""
        return self._shells.get(rank)

    def _say(self, text: str, style: str | None = None) -> None:
        self._get_console().print(f"[hosts] {text}", style=style, markup=False,
                                  highlight=False, soft_wrap=True)

    def _get_console(self) -> Any:
        if self.console is None:
            from exogym.base.terminal import output_console

            self.console = output_console()
        return self.console

    def connect(self, *, retry_failed: bool = True) -> dict[int, SSHConnectError]:
        """Open the connections not open yet (or dropped), in parallel.

        Args:
            retry_failed: try again the hosts this session already failed to reach
                (otherwise their error stands, and a dead host costs one timeout, not two).

        Returns:
            For each rank whose host could not be reached, why.
        """
        if self.master_local and 0 not in self._shells:
            self._shells[0] = LocalShell()
        todo = [r for r in self.targets
                if (r not in self._shells or not self._shells[r].alive())
                and (retry_failed or r not in self._connect_errors)]

        def one(rank: int) -> tuple[int, Shell | SSHConnectError]:
            try:
                client, accepted = connect(self.targets[rank], self.ssh)
            except SSHConnectError as exc:
                return rank, exc
            for key in accepted:
                self._notes[rank].append(f"trusted a new host key and recorded it in "
                                         f"{self.ssh.known_hosts}: {key}")
                self._say(f"trusted new host key for {key}", style="yellow")
            return rank, SSHShell(client, self.targets[rank].label)

        with ThreadPoolExecutor(max_workers=max(1, min(32, len(todo)))) as pool:
            for rank, outcome in pool.map(one, todo):
                old = self._shells.pop(rank, None)
                if old is not None:
                    old.close()
                if isinstance(outcome, SSHConnectError):
                    self._connect_errors[rank] = outcome
                else:
                    self._connect_errors.pop(rank, None)
                    self._shells[rank] = outcome
        return dict(self._connect_errors)

    def shared_folders(self, folders: Mapping[int, str]) -> list[SharedFolder]:
        """Which of the connected remote hosts' ``folders`` (per rank) are one folder: a
        home shared over NFS, one disk behind several addresses (:mod:`.shared`).

        Raises:
            ShareProbeError: naming each host that did not answer in time.
        """
        clients = {r: shell.client for r, shell in self._shells.items()
                   if r in folders and isinstance(shell, SSHShell)}
        return find_shared(clients, {r: folders[r] for r in clients},
                           {r: self.config.hosts[r].host for r in clients})

    def sync(self) -> list[SyncStats]:
        """Copy the project's tracked files, and its local profiles files beside them
        (``config.local.ini``), to every remote host's ``project_path``; once to hosts
        whose project folders are one folder (:meth:`shared_folders`), from the first.

        Returns:
            One ``SyncStats`` per host synced (hosts that cannot be reached
            are left to pre-flight, which reports them); a host whose folder another
            host's sync filled has ``shared_from`` set and copied nothing itself.

        Raises:
            NoSFTPError: naming every host whose sshd offers no SFTP subsystem.
            RuntimeError: naming every host where copying failed, and why.
        """
        self.connect()
        tracked = tracked_files(self.project_root)
        local = local_profile_files(self.project_root, tracked)
        files = sorted(tracked + local)
        connected = [r for r in self.targets if r in self._shells]
        try:
            shared = self.shared_folders({r: self.config.hosts[r].project_path
                                          for r in connected})
        except ShareProbeError as exc:
            raise RuntimeError("sync failed:\n" + "\n".join(f"  {f}" for f in exc.failures)
                               ) from None
        filled_by = {k: group for group in shared for k in group.keys[1:]}
        for group in shared:
            self._say(f"{group.describe()}: set up once from {group.leader_host}")
        remote = [r for r in connected if r not in filled_by]

        def one(rank: int) -> SyncStats | str | NoSFTPError:
            host = self.config.hosts[rank]
            shell = self._shells[rank]
            assert isinstance(shell, SSHShell)
            try:
                return sync_files(shell.client, host.host, self.project_root, host.project_path,
                                  files, keep_previous=local)
            except NoSFTPError as exc:
                return exc
            except ForeignFolderError as exc:
                return f"[{host.host}:{rank}] {exc}"
            except (OSError, EOFError) as exc:
                return (f"[{host.host}:{rank}] copying the project to {host.project_path} "
                        f"failed: {exc}; check that {self.targets[rank].user} may write there")

        with ThreadPoolExecutor(max_workers=max(1, min(16, len(remote)))) as pool:
            outcomes = list(pool.map(one, remote))
        without_sftp = [host for o in outcomes if isinstance(o, NoSFTPError) for host in o.hosts]
        if without_sftp:
            raise NoSFTPError(without_sftp)
        failures = [o for o in outcomes if isinstance(o, str)]
        if failures:
            raise RuntimeError("sync failed:\n" + "\n".join(f"  {f}" for f in failures))
        stats = [o for o in outcomes if isinstance(o, SyncStats)]
        for s in stats:
            self._say(f"synced {s.host}: {plural(s.copied, 'file')} copied "
                      f"({plural(s.bytes_copied, 'byte')}), "
                      f"{s.unchanged} unchanged")
            for rel in s.kept:
                self._say(f"{s.host} had its own {rel}; kept it there as {rel}.bak",
                          style="yellow")
            for link in s.skipped:
                self._say(f"not copied to {s.host}: {printable(link)} (a symbolic link out of the "
                          "project; copy what it names into the project to send it)",
                          style="yellow")
        by_host = {s.host: s for s in stats}
        for rank, group in filled_by.items():
            stats.append(dataclasses.replace(by_host[group.leader_host], copied=0, unchanged=0,
                                             bytes_copied=0, kept=(),
                                             host=self.config.hosts[rank].host,
                                             shared_from=group.leader_host))
        self.synced = True
        return stats

    def put_files(self, files: dict[str, bytes], ranks: Collection[int] | None = None,
                  in_place: dict[str, str] | None = None) -> set[int]:
        """Write ``files`` (each a path relative to a host's ``project_path``, and its
        bytes) on every connected host other than this machine, or on those of ``ranks``
        (host indices), each file atomically; one already holding the bytes is left alone.

        Args:
            in_place: for each file, its absolute path here; a host that holds every one
                at that path with the same bytes (it shares this machine's disk) gets
                nothing written.

        Returns:
            The hosts (indices) that hold the files in place.

        Raises:
            RuntimeError: naming every host where writing failed, and why.
        """
        chosen = [r for r in (self.targets if ranks is None else ranks)
                  if r in self._shells and not self.is_local(r)]
        failures = []
        found: set[int] = set()
        for rank in chosen:
            host = self.config.hosts[rank]
            shell = self._shells[rank]
            assert isinstance(shell, SSHShell)
            try:
                if put_files(shell.client, host.host, host.project_path, files, in_place):
                    found.add(rank)
            except (OSError, NoSFTPError) as exc:
                failures.append(f"[{host.host}:{rank}] writing {', '.join(sorted(files))} "
                                f"under {host.project_path} failed: {exc}")
        if failures:
            raise RuntimeError("\n".join(failures))
        return found

    def preflight(self, *, raise_on_failure: bool = True, show: bool = True) -> PreflightReport:
        """Check every host in parallel (see ``distributed.hosts.preflight``).

        Args:
            raise_on_failure: raise ``PreflightError`` when a check fails.
            show: print the report as a table.

        Returns:
            The report (also kept as ``report``).

        Raises:
            PreflightError: when a check fails and ``raise_on_failure``.
        """
        self.connect(retry_failed=False)
        logins = {r: self.login(r) for r in range(self.config.world_size)}
        report = run_preflight(
            self.config, dict(self._shells), dict(self._connect_errors), logins,
            master_addr=self.master_addr, files=code_files(self.project_root),
            connect_timeout=self.ssh.connect_timeout, probe_timeout=self.probe_timeout,
            notes=self._notes)
        self.report = report
        if report.master_port != self.config.master_port:
            # The hosts file names no port and the first choice was taken: every rank
            # of this session's runs meets at the one pre-flight found free.
            self.config = dataclasses.replace(self.config, master_port=report.master_port)
            self._say(f"master port {report.master_port} on {self.config.master.host}: the "
                      "hosts file names no \"master_port\" and the default was taken, so "
                      "the run uses this free one", style="yellow")
        if show:
            report.render(self._get_console())
        if raise_on_failure and not report.ok:
            raise PreflightError(report)
        return report

    def recheck(self, rank: int, shell: Shell) -> HostCheck:
        """Pre-flight one host that was down when :meth:`preflight` ran, now that it
        answers (``shell``, from :meth:`reconnect`), held to the master's findings of that
        pre-flight (:func:`distributed.hosts.preflight.check_host`).

        Raises:
            RuntimeError: when no pre-flight with the master's findings has run.
        """
        if self.report is None or self.report.checks[0].probe is None:
            raise RuntimeError("recheck needs the run's pre-flight, with the master's probe, "
                               "first (HostSession.preflight)")
        return check_host(self.config, rank, shell, self.login(rank), self.report.checks[0],
                          master_addr=self.master_addr, master_port=self.config.master_port,
                          files=code_files(self.project_root),
                          connect_timeout=self.ssh.connect_timeout,
                          probe_timeout=self.probe_timeout)

    def fetch(self, rank: int, path: str | os.PathLike[str],
              local_path: str | os.PathLike[str]) -> Path:
        """Copy a file from ``rank``'s host to ``local_path`` (written atomically), in chunks:
        a final model of any size passes through a fixed amount of the launcher's memory.

        Args:
            rank: whose host holds the file.
            path: the file there: absolute, or relative to the host's ``project_path``.
            local_path: where to put it here.

        Returns:
            ``local_path``.

        Raises:
            SSHConnectError: when the host cannot be reached.
            NoSFTPError: when its sshd offers no SFTP subsystem.
            OSError: when the file cannot be read.
        """
        local_path = Path(local_path)
        host = self.config.hosts[rank]
        source = Path(path) if Path(path).is_absolute() else Path(host.project_path) / path
        if self.is_local(rank):
            with open(source.expanduser(), "rb") as f:
                return atomic_copy_stream(local_path, f)
        if rank not in self._shells:
            errors = self.connect()
            if rank in errors:
                raise errors[rank]
        shell = self._shells[rank]
        assert isinstance(shell, SSHShell)
        with open_sftp(shell.client, host.host) as sftp, \
                sftp.open(sftp_path(source.as_posix()), "rb") as f:
            f.prefetch(max_concurrent_requests=64)  # read ahead while the copy writes
            return atomic_copy_stream(local_path, f)

    def reconnect(self, rank: int) -> Shell | SSHConnectError:
        """Drop ``rank``'s host connection and open a fresh one (a host that may have gone).

        Returns:
            The new shell, or why the host could not be reached.
        """
        old = self._shells.pop(rank, None)
        if old is not None:
            old.close()
        if self.is_local(rank):
            self._shells[rank] = LocalShell()
            return self._shells[rank]
        try:
            client, _ = connect(self.targets[rank], self.ssh)
        except SSHConnectError as exc:
            self._connect_errors[rank] = exc
            return exc
        self._connect_errors.pop(rank, None)
        shell = self._shells[rank] = SSHShell(client, self.targets[rank].label)
        return shell

    def close(self) -> None:
        """Close every connection."""
        for shell in self._shells.values():
            shell.close()
        self._shells.clear()
