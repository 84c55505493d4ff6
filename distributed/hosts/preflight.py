"""Pre-flight: check every host of a job, in parallel, before any rank starts.

For each host: SSH reachable and authenticated (done by the launcher's
connect step, whose errors arrive here), ``project_path`` and ``python_env``
present, Python, torch and project versions, a hash of the project's code
(equal to the master's), the network interface that routes to the master,
and, for workers, a TCP connection to the master port while the master holds
it open (which also proves the port is free there). The outcome is a
``PreflightReport``: one row per host, shown as one table, and every problem
as a line naming the host, what failed and the fix.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from exogym.base.plural import plural

from .hostsfile import HostsConfig, HostSpec
from .onhost.probe import bind_master_port
from .remote import (
    NO_PROJECT_PATH,
    NO_PYTHON,
    PROBE_SOURCE,
    Completed,
    Shell,
    Started,
    probe_command,
)
from .ssh import SSHConnectError
from .sync import LOCAL_PROFILES_SUFFIX

#: The oldest Python a rank may run on (pyproject's requires-python).
MIN_PYTHON = (3, 10)
#: Seconds the master's port hold may take to exit once pre-flight gives the port back.
RELEASE_S = 10.0


@dataclass
class HostCheck:
    """The pre-flight outcome for one host: a row of the table.

    Args:
        rank: the host's index in the hosts file (0 is the master).
        host: the host as the hosts file names it.
        where: ``local`` or the SSH login (``user@host:port``).
        ssh, python, project, versions, code, port, interface: what each
            check found, as shown in the table (``-`` when not checked).
        problems: what failed, each with its fix; empty when the host is ready.
        notes: things worth knowing that do not stop the run.
        probe: the raw probe result, when the probe ran.
        ranks: the ranks it runs, as shown (``"2"``, or ``"2-3"`` for two slots);
            empty: ``rank``.
        down: the host did not answer: SSH could not reach it, or its probe gave no
            answer in time (a host that answered with a problem is not down).
    """

    rank: int
    host: str
    where: str
    ssh: str = "-"
    python: str = "-"
    project: str = "-"
    versions: str = "-"
    code: str = "-"
    port: str = "-"
    interface: str = "-"
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    probe: dict[str, Any] | None = None
    ranks: str = ""
    down: bool = False

    @property
    def ok(self) -> bool:
        """True when nothing on this host stops the run."""
        return not self.problems

    @property
    def label(self) -> str:
        """``[host:rank]`` (``[host:2-3]`` for a host with slots), as its ranks are prefixed."""
        return f"[{self.host}:{self.ranks or self.rank}]"


@dataclass
class PreflightReport:
    """Every host's checks; the run may start only when ``ok``.

    Args:
        checks: one ``HostCheck`` per host, in rank order.
        master_port: the port that was checked on the master.
    """

    checks: list[HostCheck]
    master_port: int

    @property
    def ok(self) -> bool:
        """True when every host passed."""
        return all(c.ok for c in self.checks)

    @property
    def problems(self) -> list[str]:
        """Every problem of every host, each prefixed with ``[host:rank]``."""
        return [f"{c.label} {p}" for c in self.checks for p in c.problems]

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (JSON-serialisable)."""
        return {"ok": self.ok, "master_port": self.master_port,
                "checks": [asdict(c) for c in self.checks]}

    def table(self) -> Any:
        """The report as one ``rich`` renderable: the table, then problems and notes."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=f"Pre-flight: {plural(len(self.checks), 'host')}, master port "
                      f"{self.master_port}", title_justify="left")
        for name in ("host", "rank", "ssh", "python", "project", "versions", "code", "port",
                     "interface", "status"):
            table.add_column(name, overflow="fold")
        for c in self.checks:
            status = Text("ok", style="green") if c.ok else Text(
                f"FAILED ({len(c.problems)})", style="bold red")
            table.add_row(c.host, c.ranks or str(c.rank), c.ssh, c.python, c.project, c.versions, c.code,
                          c.port, c.interface, status)
        parts: list[Any] = [table]
        for i, problem in enumerate(self.problems, 1):
            parts.append(Text(f"{i}. {problem}", style="red"))
        for c in self.checks:
            parts.extend(Text(f"note: {c.label} {n}", style="yellow") for n in c.notes)
        return Group(*parts)

    def render(self, console: Any = None) -> None:
        """Print the table (to ``console``, a ``rich.console.Console``, or stdout)."""
        from exogym.base.terminal import output_console

        (console or output_console()).print(self.table())

    def __str__(self) -> str:
        import io

        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=160, no_color=True, force_terminal=False, emoji=False).print(self.table())
        return buffer.getvalue()


class PreflightError(RuntimeError):
    """Pre-flight found problems, so nothing was started.

    Args:
        report: the full report; ``report.problems`` lists what to fix.
        note: a last line saying why the run could not start without the failed hosts
            (``min_nodes``), if it might have.
    """

    def __init__(self, report: PreflightReport, note: str | None = None) -> None:
        self.report = report
        lines = report.problems
        super().__init__(f"pre-flight failed on {sum(not c.ok for c in report.checks)} of "
                         f"{plural(len(report.checks), 'host')}; nothing was started:\n"
                         + "\n".join(f"  {p}" for p in lines)
                         + (f"\n  {note}" if note else ""))


def _public_version(version: str | None) -> str | None:
    """``2.3.0+cu121`` -> ``2.3.0``: builds for different hardware are the same torch."""
    return None if version is None else version.split("+", 1)[0]


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


class _MasterPort:
    """Holds the master port open for the duration of the checks.

    ``port`` is the port held: the one asked for, or, asked for port 0, the free one
    the master's system picked (as a local run's store takes one).
    """

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.started: Started | None = None
        self.port: int | None = None

    def hold_local(self, master_addr: str, port: int) -> str | None:
        """Bind the port on this machine; an error text, or ``None`` when it is held."""
        try:
            self.sock = bind_master_port(master_addr, port)
        except OSError as exc:
            return exc.strerror or str(exc)
        self.port = self.sock.getsockname()[1]
        return None

    def hold_remote(self, shell: Shell, host: HostSpec, master_addr: str, port: int,
                    timeout: float) -> str | None:
        """Bind the port on the master over SSH; an error text, ``None`` when held.

        Raises:
            OSError: when the check could not run at all (the master's probe
                says why, e.g. a missing python_env).
        """
        import threading

        started = shell.start(probe_command(host.project_path, host.python_env),
                              {"code": PROBE_SOURCE, "action": "listen", "port": port,
                               "master": master_addr})
        answer: list[bytes] = []
        reader = threading.Thread(target=lambda: answer.append(started.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        try:
            reply = json.loads(answer[0]) if answer and answer[0] else None
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or not reply.get("ok"):
            started.close()
            if not isinstance(reply, dict):
                raise OSError(f"the port check on the master gave no answer in {timeout:g} s")
            return str(reply.get("error"))
        self.started = started
        self.port = int(reply.get("port", port))
        return None

    def release(self) -> None:
        """Give the port back; a hold over SSH is waited for (at most
        :data:`RELEASE_S`) until its command has exited, so that the run's store, started
        next on the same address, finds the port free."""
        if self.sock is not None:
            self.sock.close()
        if self.started is not None:
            self.started.end(RELEASE_S)


def run_preflight(
    config: HostsConfig,
    shells: Mapping[int, Shell],
    connect_errors: Mapping[int, SSHConnectError],
    logins: Mapping[int, str],
    *,
    master_addr: str,
    files: Sequence[str],
    connect_timeout: float = 5.0,
    probe_timeout: float = 60.0,
    notes: Mapping[int, Sequence[str]] | None = None,
) -> PreflightReport:
    """Check every host; return the report (it never raises for a host's failure).

    Args:
        config: the hosts.
        shells: for each rank whose host could be reached, where to run commands.
        connect_errors: for each rank whose host could not be reached, why.
        logins: how to name each rank's login in the table (``local`` or ``user@host:port``).
        master_addr: the address workers connect to (``MASTER_ADDR``).
        files: project files (relative paths) whose content every host must share.
        connect_timeout: seconds for a worker's TCP connection to the master port.
        probe_timeout: seconds for a host's probe to finish.
        notes: extra notes per rank (e.g. host keys trusted on the way).
    """
    port = config.master_port
    checks = [HostCheck(rank=h.rank, host=h.host, where=logins.get(h.rank, "-"),
                        ranks=_ranks_text(h)) for h in config.hosts]
    for rank, error in connect_errors.items():
        checks[rank].ssh = "FAILED"
        checks[rank].down = True
        checks[rank].problems.append(str(error))
    for rank, shell in shells.items():
        checks[rank].ssh = "local" if shell.is_local else "ok"
    for rank, extra in (notes or {}).items():
        checks[rank].notes.extend(extra)

    master = config.master
    held = _MasterPort()
    port_held = False
    try:
        if 0 in shells:
            try:
                if shells[0].is_local:
                    error = held.hold_local(master_addr, port)
                else:
                    error = held.hold_remote(shells[0], master, master_addr, port, probe_timeout)
            except OSError as exc:
                checks[0].port = "not checked"
                checks[0].notes.append(f"the master port could not be checked: {exc}")
            else:
                if error is not None and not config.master_port_given:
                    error = _pick_master_port(held, shells[0], master, master_addr, port,
                                              probe_timeout, checks[0])
                if error is None:
                    port_held = True
                    if held.port != port:
                        port = held.port if held.port is not None else port
                        checks[0].port = f"{port} picked"
                    else:
                        checks[0].port = f"{port} free"
                else:
                    checks[0].port = f"{port} in use"
                    checks[0].problems.append(
                        f"master port {port} is taken on {master.host}: something else listens "
                        f"there ({error}); set another \"master_port\" in the hosts file (one "
                        f"free on {master.host}), or leave it out to let the run pick a free "
                        f"one, or stop what listens there (`ss -ltnp 'sport = :{port}'` on "
                        f"{master.host} shows it)")

        def probe_one(rank: int) -> tuple[int, Completed]:
            host = config.hosts[rank]
            message: dict[str, Any] = {"code": PROBE_SOURCE, "action": "probe",
                                       "files": list(files), "master": master_addr}
            if rank != 0 and port_held:
                message["connect"] = [master_addr, port, connect_timeout]
            if _gpu_per_slot(host):
                message["count_gpus"] = True
            command = probe_command(host.project_path, host.python_env)
            return rank, shells[rank].run(command, message, timeout=probe_timeout)

        with ThreadPoolExecutor(max_workers=max(1, min(32, len(shells)))) as pool:
            completed = dict(pool.map(probe_one, sorted(shells)))
    finally:
        held.release()

    for rank, result in completed.items():
        checks[rank].probe = _interpret(checks[rank], config.hosts[rank], result, probe_timeout)
    _compare(config, checks, master_addr, port)
    if 0 not in shells:
        for c in checks[1:]:
            if c.probe is not None:
                c.notes.append("versions, code and the master port were not compared: the "
                               "master could not be checked")
    return PreflightReport(checks=checks, master_port=port)


def check_host(config: HostsConfig, rank: int, shell: Shell, login: str, reference: HostCheck,
               *, master_addr: str, master_port: int, files: Sequence[str],
               connect_timeout: float = 5.0, probe_timeout: float = 60.0) -> HostCheck:
    """Pre-flight for one host that was down when the run's pre-flight ran, now that it
    answers (a run with ``min_nodes`` started without it): the same probe, its versions
    and code held to what the master's probe found then (``reference``), and a TCP
    connection to the master port, where the run's store listens by now.

    Args:
        config: the hosts.
        rank: the host's index (``HostSpec.rank``; not 0: the master is never down).
        shell: where to run the probe on it.
        login: how to name its login (``user@host:port``).
        reference: the master's check from the run's pre-flight.
        master_addr: the address workers connect to (``MASTER_ADDR``).
        master_port: the run's master port.
        files: project files (relative paths) whose content every host must share.
        connect_timeout: seconds for the TCP connection to the master port.
        probe_timeout: seconds for the probe to finish.

    Returns:
        The host's check: ``down`` when its probe gave no answer, its problems otherwise.
    """
    host = config.hosts[rank]
    check = HostCheck(rank=host.rank, host=host.host, where=login, ranks=_ranks_text(host),
                      ssh="local" if shell.is_local else "ok")
    message: dict[str, Any] = {"code": PROBE_SOURCE, "action": "probe", "files": list(files),
                               "master": master_addr,
                               "connect": [master_addr, master_port, connect_timeout]}
    if _gpu_per_slot(host):
        message["count_gpus"] = True
    result = shell.run(probe_command(host.project_path, host.python_env), message,
                       timeout=probe_timeout)
    check.probe = _interpret(check, host, result, probe_timeout)
    _compare(config, [reference, check], master_addr, master_port)
    return check


def _pick_master_port(held: _MasterPort, shell: Shell, master: HostSpec, master_addr: str,
                      first: int, timeout: float, check: HostCheck) -> str | None:
    """The hosts file names no master port and ``first`` is taken: hold a free port the
    master's system picks instead, and say so; an error text when none could be held."""
    if shell.is_local:
        error = held.hold_local(master_addr, 0)
    else:
        error = held.hold_remote(shell, master, master_addr, 0, timeout)
    if error is None:
        check.notes.append(f"master port {first} is taken on {master.host}, and the hosts file "
                           f"names no \"master_port\": the run uses port {held.port}, a free "
                           "one the master picked (set \"master_port\" to fix one)")
    return error


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _interpret(check: HostCheck, host: HostSpec, result: Completed,
               timeout: float) -> dict[str, Any] | None:
    """Fill ``check`` from a probe's output; the parsed probe, or ``None`` when it failed."""
    py = host.python_env
    if result.returncode == NO_PROJECT_PATH:
        check.project = "missing"
        check.problems.append(
            f"project_path {host.project_path} does not exist on this host: clone the project "
            'there, run with sync=True (--sync) to copy it, or fix "project_path"')
        return None
    check.project = "ok"
    if result.returncode == NO_PYTHON:
        check.python = "missing"
        check.problems.append(
            f"python_env {py} was not found (or is not executable) on this host: create the "
            'environment there (python3 -m venv ...; pip install ...) or fix "python_env"')
        return None
    if result.returncode is None:
        check.python = "no answer"
        check.down = True
        why = _last_line(result.stderr)
        check.problems.append(f"the pre-flight probe with {py} did not finish within "
                              f"{timeout:g} s{f' ({why})' if why else ''}: is the host "
                              "overloaded, or the connection dropping?")
        return None
    if result.returncode != 0:
        check.python = "fails"
        check.problems.append(
            f"python_env {py} failed to run the probe (exit code {result.returncode}): "
            f"{_last_line(result.stderr) or 'no error output'}; check that it is a working "
            f"Python {'.'.join(map(str, MIN_PYTHON))}+")
        return None
    try:
        found = json.loads(_last_line(result.stdout))
    except ValueError:
        check.python = "fails"
        check.problems.append(f"the probe printed something unexpected with {py}: "
                              f"{_last_line(result.stdout)[:200]!r}")
        return None

    check.python = found["python"]
    version = tuple(int(p) for p in found["python"].split(".")[:2])
    if version < MIN_PYTHON:
        check.problems.append(
            f"python_env {py} is Python {found['python']}; the project needs "
            f"{'.'.join(map(str, MIN_PYTHON))} or newer: point \"python_env\" at a newer one")
    check.versions = f"torch {found['torch'] or '-'} · project {found['project_version'] or '-'}"
    if found["torch"] is None:
        check.problems.append(f"torch is not installed for {py}: install it there "
                              f"({py} -m pip install torch)")
    check.code = found["code_hash"][:10]
    route = found.get("route") or {}
    interfaces = found.get("interfaces")
    if host.interface:
        check.interface = f"{host.interface} (set)"
        if interfaces is not None and host.interface not in interfaces:
            check.problems.append(
                f'interface {host.interface} does not exist on this host; it has '
                f'{", ".join(interfaces)}: fix "interface" for it in the hosts file, or remove '
                "it to use the one that routes to the master")
        elif route.get("interface") and route["interface"] != host.interface:
            check.notes.append(f"the route to the master goes through {route['interface']}, "
                               f"but {host.interface} is set")
    elif route.get("interface"):
        check.interface = f"{route['interface']} (route)"
    elif route.get("source"):
        check.interface = f"src {route['source']}"
    else:
        check.interface = "unknown"
        check.notes.append(f"could not tell which interface routes to the master "
                           f"({route.get('how', 'no route information')}); the rank will pick")
    connect = found.get("connect")
    if connect is not None:
        check.port = "reachable" if connect["ok"] else f"{connect['error']}"
    _check_slots(check, host, found)
    return found


def _ranks_text(host: HostSpec) -> str:
    """The host's ranks in a word: ``2``, or ``2-3`` for a host with two slots."""
    ranks = host.ranks
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _gpu_per_slot(host: HostSpec) -> bool:
    """Whether each of the host's ranks takes a GPU of its own (``cuda:LOCAL_RANK``)."""
    return host.slots > 1 and host.device == "cuda"


def _check_slots(check: HostCheck, host: HostSpec, found: Mapping[str, Any]) -> None:
    """Hold a host's ``slots`` to its devices: a GPU per rank on CUDA, a note past its cores."""
    if host.slots == 1:
        return
    if _gpu_per_slot(host):
        gpus = found.get("gpus")
        if gpus is None:
            check.problems.append(
                f'"slots": {host.slots} with "device": "cuda" needs {host.slots} GPUs, but no '
                "NVIDIA GPU was found here (nvidia-smi is not on the PATH of its python_env's "
                'shell): install the driver, or use "device": "cpu"')
        elif gpus < host.slots:
            check.problems.append(
                f'"slots": {host.slots} with "device": "cuda" needs {host.slots} GPUs (one per '
                f"rank, cuda:LOCAL_RANK), but this host has {gpus}: lower \"slots\" to {gpus} "
                "or less")
        return
    if host.device is not None and host.device.startswith("cuda:"):
        check.notes.append(f"its {host.slots} ranks share one GPU ({host.device}); "
                           '"device": "cuda" gives each rank a GPU of its own')
        return
    cpus = found.get("cpus")
    if cpus and host.slots > cpus:
        check.notes.append(f'"slots": {host.slots} is more than its {cpus} CPU cores: its ranks '
                           "will share cores and each step will be slower")


def _compare(config: HostsConfig, checks: list[HostCheck], master_addr: str, port: int) -> None:
    """Hold every host's versions and code to the master's; check reachability of the port."""
    reference = checks[0].probe
    for check in checks[1:]:
        found = check.probe
        if found is None:
            continue
        connect = found.get("connect")
        if connect is not None and not connect["ok"]:
            hint = ""
            if _is_loopback(master_addr) and not _is_loopback(config.hosts[check.rank].host):
                hint = (f"; {master_addr} is a loopback address that only the master itself can "
                        'reach: put the master\'s network address in "master"')
            check.problems.append(
                f"cannot reach the master port {master_addr}:{port} from this host "
                f"({connect['error']}): let TCP port {port} through the master's firewall and "
                f"check that this host can route to {master_addr}{hint}")
        if reference is None:
            continue
        if found["torch"] and reference["torch"] and \
                _public_version(found["torch"]) != _public_version(reference["torch"]):
            check.problems.append(
                f"torch {found['torch']} here but {reference['torch']} on the master: install "
                f"the same version everywhere (pip install torch=="
                f"{_public_version(reference['torch'])})")
        if found["project_version"] != reference["project_version"]:
            check.problems.append(
                f"project version {found['project_version']} here but "
                f"{reference['project_version']} on the master: update this host's checkout "
                "(sync=True / --sync, or git pull)")
        if found["code_hash"] != reference["code_hash"]:
            differ = sorted(path for path, digest in found["files"].items()
                            if reference["files"].get(path) != digest)
            shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5
                                             else "")
            own = [p for p in differ if p.endswith(LOCAL_PROFILES_SUFFIX)]
            check.problems.append(
                f"code differs from the master's (hash {found['code_hash'][:10]} vs "
                f"{reference['code_hash'][:10]}) in {len(differ)} file"
                f"{'s' if len(differ) != 1 else ''}: {shown}; sync the checkouts "
                "(sync=True / --sync copies the master's tracked files"
                + (f" and its own profiles in {', '.join(own)}, which git does not hold"
                   if own else ", or git pull on each host") + ")")
        if found["python"].rsplit(".", 1)[0] != reference["python"].rsplit(".", 1)[0]:
            check.notes.append(f"Python {found['python']} here, {reference['python']} on the "
                               "master")
