"""``setup-hosts``: make every host of a hosts file ready to train, then pre-flight it.

For each host other than this machine, over SSH and in parallel:

1. this project's code at this commit is copied to its ``project_path`` (only the
   files that changed travel; no git is needed there);
2. a Python environment is made at its ``python_env`` with the lock's versions, from
   the host's own package index or from wheels sent from here
   (:mod:`distributed.hosts.provision`);

then the hosts file gets the ``project_path`` and ``python_env`` it lacked (default
``~/exogym`` and ``~/exogym/.venv/bin/python``; a copy of the old file is kept as
``.bak``), and pre-flight runs, which must pass. Run again with nothing changed, each
host answers in a second or two.

Hosts that share a folder (a home on NFS, one disk behind several addresses: found
with probe files, :mod:`distributed.hosts.shared`) are set up once: the project is
copied into a shared project folder from the first of them, and a shared environment
is made by the first and then only checked by the others, so no environment is ever
made twice at once.
"""

from __future__ import annotations

import json
import posixpath
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..hosts.hostsfile import HostsConfig, HostsFileError, load_hosts, unsafe_folder
from ..hosts.preflight import PreflightReport
from ..hosts.provision import (
    DEFAULT_EXTRAS,
    WHEEL_MODES,
    HostProvisioner,
    ProvisionError,
    ProvisionResult,
    declared_requirements,
    lock_path,
    venv_of,
)
from ..hosts.remote import SSHShell
from ..hosts.session import HostSession, is_this_machine
from ..hosts.shared import SharedFolder, ShareProbeError
from ..hosts.ssh import SSHOptions
from ..hosts.sync import PROJECT_ROOT, SyncStats, open_sftp
from ..profiles.setup_files import write_with_backup
from .hosts_check import ssh_files

#: Where a host's copy of the project goes when the hosts file does not say.
DEFAULT_PROJECT_PATH = "~/exogym"
#: The environment's interpreter inside a project folder.
VENV_PYTHON = ".venv/bin/python"


class SetupError(ValueError):
    """Setting up failed on one or more hosts; the message names each host and why (a
    host that cannot be made ready is, like one that fails pre-flight, exit 2)."""


@dataclass(frozen=True)
class SetupRequest:
    """What ``setup-hosts`` was asked.

    Args:
        hosts_file: the hosts file (read, and given the paths it lacks unless ``write``
            is False).
        extras: the project's extras each host's environment gets.
        base_python: the host's own interpreter that makes the environment.
        wheels: ``auto`` (the host's index when it answers, else wheels sent from
            here), ``always`` (wheels from here) or ``never`` (the host's index only).
        write: write the paths chosen into the hosts file (else only say them).
        preflight: pre-flight the hosts at the end.
        known_hosts: the known_hosts file (default ``$EXOGYM_KNOWN_HOSTS`` or ~/.ssh's).
        ssh_config: the SSH client config (default ``$EXOGYM_SSH_CONFIG`` or ~/.ssh's).
        accept_new_host_keys: trust hosts not yet in known_hosts (recorded once).
        ssh_timeout: seconds to wait for each host's connection.
    """

    hosts_file: Path
    extras: tuple[str, ...] = DEFAULT_EXTRAS
    base_python: str = "python3"
    wheels: str = "auto"
    write: bool = True
    preflight: bool = True
    known_hosts: str | None = None
    ssh_config: str | None = None
    accept_new_host_keys: bool = False
    ssh_timeout: float | None = None


@dataclass
class SetupOutcome:
    """What ``setup-hosts`` did.

    Args:
        hosts: per host set up, what its environment step did.
        synced: per host, what copying the project did.
        filled: ``{host: {key: value}}`` written into (or, without ``write``, missing
            from) the hosts file.
        backup: the copy of the hosts file kept before it was rewritten, if any.
        report: the pre-flight report (None when not run).
        seconds: the whole setup's wall time.
    """

    hosts: list[ProvisionResult] = field(default_factory=list)
    synced: list[SyncStats] = field(default_factory=list)
    filled: dict[str, dict[str, str]] = field(default_factory=dict)
    backup: Path | None = None
    report: PreflightReport | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The outcome as plain JSON: ``seconds``, ``ready`` and per host what was done."""
        synced = {s.host: s for s in self.synced}
        hosts = []
        for r in self.hosts:
            s = synced.get(r.host)
            hosts.append({"host": r.host, "platform": r.platform, "python_env": r.python_env,
                          "environment": r.action, "seconds": round(r.seconds, 3),
                          "steps": {k: round(v, 3) for k, v in r.steps.items()},
                          "wheels_sent": r.wheels_sent, "bytes_sent": r.bytes_sent,
                          "environment_from": r.shared_from,
                          "project_from": s.shared_from if s else None,
                          "files_copied": s.copied if s else 0,
                          "files_unchanged": s.unchanged if s else 0,
                          "file_bytes_copied": s.bytes_copied if s else 0, "notes": r.notes})
        return {"seconds": round(self.seconds, 3), "hosts": hosts, "filled": self.filled,
                "ready": self.report.ok if self.report is not None else None}


# --------------------------------------------------------------------------- the hosts file


def _entries(data: dict[str, Any]) -> list[tuple[tuple[str, int | None], Any]]:
    found: list[tuple[tuple[str, int | None], Any]] = [(("master", None), data.get("master"))]
    workers = data.get("workers")
    if isinstance(workers, list):
        found += [(("workers", i), w) for i, w in enumerate(workers)]
    return found


def fill_paths(data: Mapping[str, Any], this_checkout: str = str(PROJECT_ROOT),
               this_python: str | None = None) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """The hosts file's content with each host's missing ``project_path`` and
    ``python_env`` filled in, and what was filled (``{host: {key: value}}``).

    A host that is this machine keeps this checkout and this Python; any other gets
    ``~/exogym`` and the environment inside its project folder.
    """
    import sys

    this_python = this_python or sys.executable
    out = json.loads(json.dumps(data))  # a deep copy of plain JSON
    filled: dict[str, dict[str, str]] = {}
    for (where, index), entry in _entries(out):
        if entry is None:
            continue
        obj = {"host": entry} if isinstance(entry, str) else entry
        if not isinstance(obj, dict) or not isinstance(obj.get("host"), str):
            continue  # load_hosts names the problem
        local = is_this_machine(obj["host"])
        added: dict[str, str] = {}
        project = obj.get("project_path", out.get("project_path"))
        if project is None:
            project = this_checkout if local else DEFAULT_PROJECT_PATH
            added["project_path"] = project
        if obj.get("python_env", out.get("python_env")) is None:
            added["python_env"] = this_python if local else f"{project.rstrip('/')}/{VENV_PYTHON}"
        if added:
            obj.update(added)
            filled[obj["host"]] = added
            if where == "master":
                out["master"] = obj
            else:
                out["workers"][index] = obj
    return out, filled


def read_hosts_json(path: Path) -> dict[str, Any]:
    """The hosts file's JSON object.

    Raises:
        HostsFileError: for a file that is missing, unreadable or not a JSON object (the
            message :func:`load_hosts` gives).
    """
    try:
        data = json.loads(path.expanduser().read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        load_hosts(path)  # raises the error that names the file, the line and the fix
        raise
    if not isinstance(data, dict):
        load_hosts(path)
        raise HostsFileError([f"hosts file: {str(path)!r} must hold a JSON object"], str(path))
    return data


# --------------------------------------------------------------------------- the setup


def setup_hosts(request: SetupRequest, console: Console) -> SetupOutcome:
    """Set up every host of ``request.hosts_file``; see the module docstring.

    Raises:
        HostsFileError: the hosts file is invalid (before any host is reached).
        ValueError: for a bad option (an unknown extra, wheels mode or python_env).
        SetupError: naming each host that could not be set up, or that failed pre-flight.
    """
    start = time.monotonic()
    if request.wheels not in WHEEL_MODES:
        raise ValueError(f"--wheels {request.wheels!r}: give one of {', '.join(WHEEL_MODES)}")
    requirements = declared_requirements(request.extras)
    lock = lock_path()
    if not lock.is_file():
        raise ValueError(f"the lock {lock} is missing: setup installs the versions it pins")
    data = read_hosts_json(request.hosts_file)
    filled_data, filled = fill_paths(data)
    config = load_hosts(filled_data)
    remote = [h for h in config.hosts if not is_this_machine(h.host)]
    for host in remote:
        venv = venv_of(host.python_env)  # a python_env setup cannot manage fails before any SSH
        why = unsafe_folder(venv)
        if why is not None:
            raise HostsFileError([f"{host.host}: python_env {host.python_env!r} would make its "
                                  f"environment in {venv!r}: {why}; give an interpreter path "
                                  "in a folder of its own, or leave python_env out for "
                                  f"PROJECT/{VENV_PYTHON}"], str(request.hosts_file))
    outcome = SetupOutcome(filled=filled)
    options = SSHOptions(**ssh_files(request.known_hosts, request.ssh_config, request.ssh_timeout),
                         accept_new_host_keys=request.accept_new_host_keys)
    with HostSession(config, ssh=options, console=console) as session:
        errors = session.connect()
        unreachable = [f"[{config.hosts[r].host}] {e}" for r, e in errors.items()]
        if unreachable:
            raise SetupError("cannot reach every host:\n  " + "\n  ".join(unreachable))
        if remote:
            console.print(f"copying the project to {len(remote)} "
                          f"host{'s' if len(remote) > 1 else ''}", markup=False)
            outcome.synced = session.sync()
            outcome.hosts = _provision_all(session, config, remote, request, requirements,
                                           lock, console)
        if filled:
            if request.write:
                outcome.backup = write_with_backup(request.hosts_file,
                                                   json.dumps(filled_data, indent=2) + "\n")
            config = load_hosts(filled_data)
        if request.preflight:
            outcome.report = session.preflight(raise_on_failure=False)
    outcome.seconds = time.monotonic() - start
    show_outcome(outcome, request, console)
    if outcome.report is not None and not outcome.report.ok:
        raise SetupError("pre-flight failed after setup: fix the problems in the table above "
                         "(each row names the host and the fix), then run setup-hosts again")
    return outcome


def _provision_all(session: HostSession, config: HostsConfig, remote: Sequence[Any],
                   request: SetupRequest, requirements: Sequence[str], lock: Path,
                   console: Console) -> list[ProvisionResult]:
    """Make every remote host's environment in parallel, each environment once: of hosts
    that share one (:func:`shared_environments`), the first makes it and the others check
    it once it is made. Raise naming every failure."""

    def say(line: str) -> None:
        console.print(line, markup=False, highlight=False)

    try:
        shared = shared_environments(session, remote)
    except ShareProbeError as exc:
        raise SetupError("setting up failed:\n  " + "\n  ".join(exc.failures)) from None
    made_by = {k: group for group in shared for k in group.keys[1:]}
    for group in shared:
        say(f"{group.describe('environment')}: made once, on {group.leader_host}")

    def one(host: Any) -> ProvisionResult | str:
        shell = session.shell(host.rank)
        if not isinstance(shell, SSHShell):
            return f"[{host.host}] has no SSH connection"
        sftp = open_sftp(shell.client, host.host)  # NoSFTPError: a bad host, not a failure
        try:
            provisioner = HostProvisioner(
                shell, sftp, host.host, python_env=host.python_env,
                project_path=host.project_path, requirements=requirements, lock=lock,
                base_python=request.base_python, wheels=request.wheels, say=say)
            group = made_by.get(host.rank)
            if group is None:
                return provisioner.ensure()
            made = results.get(group.leader)
            if not isinstance(made, ProvisionResult):
                return (f"[{host.host}] shares its environment with {group.leader_host}, "
                        "where making it failed (above)")
            return provisioner.check_shared(made)
        except ProvisionError as exc:
            return str(exc) if str(exc).startswith("[") else f"[{host.host}] {exc}"
        except OSError as exc:
            return f"[{host.host}] copying files there failed: {exc}"
        finally:
            sftp.close()

    results: dict[int, ProvisionResult | str] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(remote)))) as pool:
        for wave in ([h for h in remote if h.rank not in made_by],
                     [h for h in remote if h.rank in made_by]):
            results.update(zip((h.rank for h in wave), pool.map(one, wave)))
    ordered = [results[h.rank] for h in remote]
    failures = [r for r in ordered if isinstance(r, str)]
    if failures:
        raise SetupError("setting up failed:\n  " + "\n  ".join(failures))
    return [r for r in ordered if isinstance(r, ProvisionResult)]


def shared_environments(session: HostSession, remote: Sequence[Any]) -> list[SharedFolder]:
    """The groups of ``remote`` hosts whose ``python_env`` is one environment: their
    environments' parent folders are one folder (:meth:`HostSession.shared_folders`; the
    environment itself may not exist yet) and the environments have one name there.

    Raises:
        ShareProbeError: naming each host that did not answer in time.
    """
    venvs = {h.rank: venv_of(h.python_env) for h in remote}
    hosts = {h.rank: h.host for h in remote}
    parents = session.shared_folders({r: posixpath.dirname(v) or "." for r, v in venvs.items()})
    groups = []
    for parent in parents:
        by_name: dict[str, list[int]] = {}
        for k in parent.keys:
            by_name.setdefault(posixpath.basename(venvs[k]), []).append(k)
        for keys in by_name.values():
            if len(keys) > 1:
                groups.append(SharedFolder(tuple(keys), tuple(hosts[k] for k in keys),
                                           tuple(venvs[k] for k in keys)))
    return sorted(groups, key=lambda g: g.keys)


def show_outcome(outcome: SetupOutcome, request: SetupRequest, console: Console) -> None:
    """A table of what each host got, and the hosts-file lines written or to write."""
    synced = {s.host: s for s in outcome.synced}
    if outcome.hosts:
        table = Table(title="setup-hosts", title_justify="left")
        for column in ("host", "platform", "environment", "files copied", "seconds", "of which"):
            table.add_column(column, overflow="fold")
        actions = {"unchanged": "unchanged", "index": "installed from its index",
                   "wheels": "installed from wheels sent", "shared": "made on {}"}
        for r in outcome.hosts:
            s = synced.get(r.host)
            files = "-" if s is None else (f"{s.copied} of {s.copied + s.unchanged}"
                                           if s.shared_from is None
                                           else f"copied to {s.shared_from}")
            steps = ", ".join(f"{k} {v:.1f}" for k, v in r.steps.items()) or "-"
            table.add_row(r.host, r.platform,
                          actions.get(r.action, r.action).format(r.shared_from), files,
                          f"{r.seconds:.1f}", steps)
        console.print(table)
        for r in outcome.hosts:
            for note in r.notes:
                console.print(f"[{r.host}] {note}", markup=False, highlight=False)
    if outcome.filled:
        what = "wrote into" if request.write else "add to"
        lines = [f"  {host}: " + ", ".join(f'"{k}": "{v}"' for k, v in keys.items())
                 for host, keys in outcome.filled.items()]
        console.print(f"{what} {request.hosts_file}:\n" + "\n".join(lines), markup=False,
                      highlight=False)
        if outcome.backup is not None:
            console.print(f"the previous hosts file is kept as {outcome.backup}", markup=False)
    console.print(f"setup took {outcome.seconds:.1f} s", markup=False)
