"""The SSH launcher: check every host, start one rank per host, watch them, stop them all.

A library API, used by NetworkTrainer, the CLI and the wizard::

    from distributed.hosts.hostsfile import load_hosts
    from distributed.launch.launcher import Launcher, RankProgram

    program = RankProgram.from_profile("digits-diloco", overrides={"max_steps": 200})
    with Launcher(load_hosts("hosts.json"), program, secret_names=["WANDB_API_KEY"]) as launcher:
        launcher.dry_run()        # what would run where; connects to nothing
        result = launcher.run()   # pre-flight, start, watch, stop
    result.raise_for_failure()    # LaunchError naming the first failing host:rank

What ``run`` does:

1. Optionally copies the project's tracked files to every remote host (``sync=True``).
2. Pre-flight on all hosts in parallel (``distributed.hosts.preflight``); nothing
   starts unless every check passes (``PreflightError`` otherwise).
3. Starts rank ``r`` on ``hosts[r]`` as ``cd project_path && python_env ARGS``:
   rank 0 as a local subprocess when the master is this machine, every other
   rank over SSH. The rank variables are set on the command line with ``env
   NAME=value`` (so the SSH server's ``AcceptEnv`` does not matter); secrets
   travel over the channel's stdin to a small supervisor
   (``distributed.hosts.onhost.bootstrap``) that puts them in the rank's environment only.
   Each rank runs in a process group of its own.
4. Streams every line to ``on_output`` with a ``[host:rank]`` prefix, saves it
   to ``run_dir/rank{r}.log``, and turns metric lines
   (``exogym.metrics.encode_event``) into dicts for ``on_event``.
5. When a rank exits non-zero or its SSH connection drops, stops every other
   rank's whole process group (TERM, KILL after ``grace_period``); SIGINT and
   SIGTERM to this process do the same. With ``max_restarts=N`` the whole job
   is started again, up to N times, with ``EXOGYM_RESTART=k`` and the
   program's ``resume_args`` added, so ranks continue from their checkpoints.

Every rank sees ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (0), ``LOCAL_WORLD_SIZE``
(1), ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``EXOGYM_RESTART``,
``EXOGYM_RUN_DIR`` and ``PYTHONUNBUFFERED``; ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` when its host sets ``interface`` (otherwise the rank
picks the interface that routes to the master); ``EXOGYM_DEVICE`` when its
host sets ``device``; plus the caller's ``env`` and secrets.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import json
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distributed.hosts.hostsfile import HostsConfig, HostSpec, load_hosts
from distributed.hosts.onhost.bootstrap import MARK
from distributed.hosts.preflight import PreflightError, PreflightReport, run_preflight
from distributed.hosts.remote import BOOTSTRAP_SOURCE, LocalShell, Shell, SSHShell, Started, rank_command
from distributed.hosts.ssh import (
    DEFAULT_KNOWN_HOSTS,
    DEFAULT_SSH_CONFIG,
    SSHConnectError,
    SSHOptions,
    SSHTarget,
    connect,
    load_ssh_config,
    resolve_target,
)
from distributed.hosts.sync import PROJECT_ROOT, SyncStats, code_files, sync_files, tracked_files
from exogym.io import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "SECRET_ENV_NAMES",
    "AttemptResult",
    "LaunchError",
    "LaunchResult",
    "Launcher",
    "OutputLine",
    "PreflightError",
    "PreflightReport",
    "RankPlan",
    "RankProgram",
    "RankResult",
    "is_this_machine",
    "launch",
]

#: Variables always treated as secrets: sent over stdin, never shown or logged.
SECRET_ENV_NAMES = frozenset({"WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"})
#: Variables the launcher sets for every rank; a caller may not set them.
LAUNCHER_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "EXOGYM_RESTART", "EXOGYM_RUN_DIR",
                      "PYTHONUNBUFFERED")
#: How many of a rank's last output lines a result keeps.
LAST_LINES = 20

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# --------------------------------------------------------------------------- what runs


@dataclass(frozen=True)
class RankProgram:
    """What every rank runs: the arguments given to each host's ``python_env``.

    Build one with ``from_profile`` (profile mode) or ``from_script`` (script mode).

    Args:
        args: the arguments after the interpreter, e.g. ``("train.py", "--lr", "0.1")``.
        resume_args: added after ``args`` when the job is restarted after a
            failure (``max_restarts``), so ranks continue from their newest
            checkpoint instead of starting over.
        profile_mode: whether ``args`` run ``distributed.worker``; a host's
            ``device`` is then also passed as ``--set device=...``.
    """

    args: tuple[str, ...]
    resume_args: tuple[str, ...] = ()
    profile_mode: bool = False

    @classmethod
    def from_profile(cls, profile: str, *, config: str | None = None,
                     overrides: Mapping[str, object] | Sequence[str] = (),
                     resume_args: Sequence[str] = ("--resume",)) -> RankProgram:
        """``python -m distributed.worker --profile NAME [--config FILE] [--set k=v ...]``.

        Args:
            profile: the profile (a ``[distributed:NAME]`` section) to run.
            config: the profiles file, relative to each host's ``project_path``.
            overrides: profile keys to override, as a mapping or ``"key=value"`` strings.
            resume_args: added on a restart (default ``--resume``).
        """
        if not isinstance(profile, str) or not profile.strip():
            raise ValueError(f"profile must be a profile name, got {profile!r}")
        args = ["-m", "distributed.worker", "--profile", profile]
        if config is not None:
            args += ["--config", str(config)]
        if isinstance(overrides, Mapping):
            items = [f"{key}={_setting(value)}" for key, value in overrides.items()]
        elif isinstance(overrides, str):
            raise TypeError(f'overrides must be a mapping or a list of "key=value" strings, got '
                            f"the string {overrides!r}; wrap it in a list")
        else:
            items = list(overrides)
        for item in items:
            if not isinstance(item, str) or "=" not in item or item.startswith("="):
                raise ValueError(f'each override must look like "key=value", got {item!r}')
            args += ["--set", item]
        return cls(tuple(args), tuple(resume_args), profile_mode=True)

    @classmethod
    def from_script(cls, script: str, args: Sequence[str] = (), *,
                    resume_args: Sequence[str] = ()) -> RankProgram:
        """``python SCRIPT ARGS...``: the same script on every host (as under torchrun).

        Args:
            script: the script, relative to each host's ``project_path`` or absolute.
            args: its arguments.
            resume_args: added on a restart (e.g. ``("--resume",)``).
        """
        if not isinstance(script, str) or not script.strip():
            raise ValueError(f"script must be a path to a Python file, got {script!r}")
        return cls((script, *map(str, args)), tuple(resume_args))

    def argv(self, host: HostSpec, restart: int = 0) -> list[str]:
        """The arguments for ``host``'s rank on run ``restart`` (0 for the first)."""
        argv = list(self.args)
        if self.profile_mode and host.device:
            argv += ["--set", f"device={host.device}"]
        if restart > 0:
            argv += list(self.resume_args)
        return argv


def _setting(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True)
class RankPlan:
    """How one rank is started: everything ``dry_run`` shows, nothing secret.

    Args:
        rank: the rank.
        host: its host.
        local: True when it runs on this machine without SSH.
        login: ``local`` or the SSH login ``user@host[:port]``.
        command: the exact shell command run on the host.
        env_names: names of the variables set on the command line.
        secret_names: names of the variables sent over stdin.
        interface: the interface forced by the hosts file, or ``None`` (the
            rank picks the one that routes to the master).
        master_addr: where the rank finds the master.
        master_port: the master's port.
    """

    rank: int
    host: HostSpec
    local: bool
    login: str
    command: str
    env_names: tuple[str, ...]
    secret_names: tuple[str, ...]
    interface: str | None
    master_addr: str
    master_port: int


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class OutputLine:
    """One line a rank printed.

    Args:
        rank: the rank.
        host: its host.
        stream: ``stdout`` or ``stderr``.
        text: the line, without its newline (secrets replaced by ``***``).
    """

    rank: int
    host: str
    stream: str
    text: str

    @property
    def prefix(self) -> str:
        """``[host:rank]``."""
        return f"[{self.host}:{self.rank}]"

    def __str__(self) -> str:
        return f"{self.prefix} {self.text}"


@dataclass(frozen=True)
class RankResult:
    """How one rank ended.

    Args:
        rank: the rank.
        host: its host.
        exit_code: its exit code (128 + N after signal N); ``None`` when it is
            unknown because the connection was lost or it never started.
        reason: the ending in words (``finished``, ``exited with code 3``,
            ``killed by SIGKILL``, ``stopped by the launcher``, ...).
        stopped: True when the launcher stopped it (another rank failed, or
            the launcher was interrupted).
        duration_s: seconds from start to end.
        log_path: its log file.
        last_lines: its last output lines.
    """

    rank: int
    host: str
    exit_code: int | None
    reason: str
    stopped: bool
    duration_s: float
    log_path: Path
    last_lines: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when it exited with code 0."""
        return self.exit_code == 0

    @property
    def label(self) -> str:
        """``host:rank``."""
        return f"{self.host}:{self.rank}"


@dataclass(frozen=True)
class AttemptResult:
    """One start of the whole job (the first, or a restart).

    Args:
        restart: 0 for the first start, k for the k-th restart.
        ranks: every rank's result, in rank order.
        first_failure: the rank whose failure stopped the job, if one did.
        interrupted: the signal name (``SIGINT``/``SIGTERM``) when the
            launcher was interrupted.
    """

    restart: int
    ranks: tuple[RankResult, ...]
    first_failure: RankResult | None
    interrupted: str | None

    @property
    def ok(self) -> bool:
        """True when every rank exited with code 0."""
        return self.interrupted is None and all(r.ok for r in self.ranks)


@dataclass(frozen=True)
class LaunchResult:
    """The outcome of ``Launcher.run``.

    Args:
        run_dir: where the logs (``rank{r}.log``) and the index (``launch.json``) are.
        attempts: the first start and every restart, in order.
    """

    run_dir: Path
    attempts: tuple[AttemptResult, ...]

    @property
    def ok(self) -> bool:
        """True when the last attempt finished with every rank at exit code 0."""
        return bool(self.attempts) and self.attempts[-1].ok

    @property
    def ranks(self) -> tuple[RankResult, ...]:
        """The ranks of the last attempt."""
        return self.attempts[-1].ranks if self.attempts else ()

    @property
    def first_failure(self) -> RankResult | None:
        """The rank whose failure ended the last attempt, if any."""
        return self.attempts[-1].first_failure if self.attempts else None

    @property
    def interrupted(self) -> str | None:
        """The signal that interrupted the launcher, if one did."""
        return self.attempts[-1].interrupted if self.attempts else None

    @property
    def restarts(self) -> int:
        """How many times the job was restarted."""
        return max(0, len(self.attempts) - 1)

    def describe(self) -> str:
        """The outcome in a few lines: who failed first, how, and its last lines."""
        if self.ok:
            return f"all {len(self.ranks)} ranks finished (logs in {self.run_dir})"
        if self.interrupted:
            return f"interrupted by {self.interrupted}; every rank was stopped"
        failed = self.first_failure
        if failed is None:
            bad = [r for r in self.ranks if not r.ok]
            failed = bad[0] if bad else None
        if failed is None:
            return "the job did not finish"
        lines = "\n".join(f"    {line}" for line in failed.last_lines) or "    (no output)"
        others = " the other ranks were stopped;" if len(self.ranks) > 1 else ""
        restarts = f" after {self.restarts} restart(s)" if self.restarts else ""
        return (f"rank {failed.rank} on {failed.host} ({failed.label}) failed{restarts}: "
                f"{failed.reason};{others} its last lines (log: {failed.log_path}):\n{lines}")

    def raise_for_failure(self) -> None:
        """Raise ``LaunchError`` unless every rank finished."""
        if not self.ok:
            raise LaunchError(self)


class LaunchError(RuntimeError):
    """A launched job failed or was interrupted.

    Args:
        result: the full result; ``result.first_failure`` names the rank.
    """

    def __init__(self, result: LaunchResult) -> None:
        self.result = result
        super().__init__(result.describe())


# --------------------------------------------------------------------------- helpers


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


def _check_env(env: Mapping[str, object], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise ValueError(f"{what}: {name!r} is not a valid variable name (letters, digits "
                             "and _, not starting with a digit)")
        if name in LAUNCHER_ENV_NAMES:
            raise ValueError(f"{what}: {name} is set by the launcher for each rank; remove it "
                             f"(the launcher sets {', '.join(LAUNCHER_ENV_NAMES)})")
        if value is None:
            raise ValueError(f"{what}: {name} has no value")
        out[name] = str(value)
    return out


# --------------------------------------------------------------------------- the launcher


class Launcher:
    """Checks, starts, watches and stops one rank per host of a hosts file.

    Connections are opened on first need (``preflight``, ``sync``, ``run``)
    and kept until ``close``; use it as a context manager.

    Args:
        hosts: a ``HostsConfig``, a hosts file path, or a hosts mapping.
        program: what each rank runs (``RankProgram.from_profile``/``from_script``).
        run_dir: where logs go; default ``<project_root>/runs/launch-<time>``.
            Ranks get it as ``EXOGYM_RUN_DIR``, relative to their project
            directory when it lies inside ``project_root``.
        env: extra variables for every rank (values visible on the command
            line; names in ``SECRET_ENV_NAMES`` or ``secret_names`` are moved
            to the secrets).
        secrets: variables sent over stdin only; never on a command line, in
            a log, in a dry run, or in ``launch.json``.
        secret_names: more names to treat as secrets; a name with no value in
            ``env`` or ``secrets`` is taken from this process's environment.
        max_restarts: how many times to restart the whole job after a failure.
        grace_period: seconds between TERM and KILL when stopping a rank.
        sync: copy the project's tracked files to every remote host first.
        project_root: the local checkout (code hash and sync); default: this one.
        master_local: run rank 0 here without SSH (``None``: when the master
            is this machine, see ``is_this_machine``).
        known_hosts_path, ssh_config_path, accept_new_host_keys, allow_agent,
            look_for_keys, connect_timeout: SSH settings (see ``SSHOptions``).
        probe_timeout: seconds a host's pre-flight probe may take.
        on_output: called with every ``OutputLine`` (default: print it).
        on_event: called with every metric event dict a rank emits.
        console: a ``rich.console.Console`` for tables and messages (default: stdout).
    """

    def __init__(
        self,
        hosts: HostsConfig | str | os.PathLike[str] | Mapping[str, Any],
        program: RankProgram,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        env: Mapping[str, object] | None = None,
        secrets: Mapping[str, str] | None = None,
        secret_names: Sequence[str] = (),
        max_restarts: int = 0,
        grace_period: float = 5.0,
        sync: bool = False,
        project_root: str | os.PathLike[str] | None = None,
        master_local: bool | None = None,
        known_hosts_path: str | os.PathLike[str] = DEFAULT_KNOWN_HOSTS,
        ssh_config_path: str | os.PathLike[str] | None = DEFAULT_SSH_CONFIG,
        accept_new_host_keys: bool = False,
        allow_agent: bool = True,
        look_for_keys: bool = True,
        connect_timeout: float = 10.0,
        probe_timeout: float = 60.0,
        on_output: Callable[[OutputLine], None] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        console: Any = None,
    ) -> None:
        self.config = hosts if isinstance(hosts, HostsConfig) else load_hosts(hosts)
        if not isinstance(program, RankProgram):
            raise TypeError("program must be a RankProgram (RankProgram.from_profile(...) or "
                            f"RankProgram.from_script(...)), got {type(program).__name__}")
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be a whole number >= 0, got {max_restarts!r}")
        if grace_period < 0:
            raise ValueError(f"grace_period must be >= 0 seconds, got {grace_period!r}")
        self.program = program
        self.max_restarts = max_restarts
        self.grace_period = float(grace_period)
        self.sync_first = sync
        self.probe_timeout = float(probe_timeout)
        self.project_root = Path(project_root or PROJECT_ROOT).resolve()
        self.ssh_options = SSHOptions(
            known_hosts_path=known_hosts_path, ssh_config_path=ssh_config_path,
            accept_new_host_keys=accept_new_host_keys, allow_agent=allow_agent,
            look_for_keys=look_for_keys, connect_timeout=connect_timeout)

        self.env, self.secrets = self._split_env(env or {}, secrets or {}, secret_names)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(run_dir) if run_dir is not None else (
            self.project_root / "runs" / f"launch-{stamp}")
        self.run_dir = self.run_dir.expanduser().resolve()
        try:
            self.rank_run_dir = str(self.run_dir.relative_to(self.project_root))
        except ValueError:
            self.rank_run_dir = str(self.run_dir)

        ssh_config = load_ssh_config(self.ssh_options)
        master = self.config.master
        self.master_local = is_this_machine(master.host) if master_local is None \
            else bool(master_local)
        self.targets: dict[int, SSHTarget] = {
            h.rank: resolve_target(h, self.ssh_options, ssh_config)
            for h in self.config.hosts if h.rank != 0 or not self.master_local}
        self.master_addr = self.targets[0].hostname if 0 in self.targets else master.host

        self.console = console
        self._on_output = on_output or self._print_output
        self._on_event = on_event
        self._callback_lock = threading.Lock()
        self._shells: dict[int, Shell] = {}
        self._connect_errors: dict[int, SSHConnectError] = {}
        self._notes: dict[int, list[str]] = collections.defaultdict(list)
        self._report: PreflightReport | None = None
        self._synced = False
        self._interrupted: str | None = None
        # SimpleQueue: its put() may be called from a signal handler
        self._exits: queue.SimpleQueue[tuple[int, int | None] | None] = queue.SimpleQueue()
        self._callback_failed = False

    # ------------------------------------------------------------------ setup

    def _split_env(self, env: Mapping[str, object], secrets: Mapping[str, str],
                   secret_names: Sequence[str]) -> tuple[dict[str, str], dict[str, str]]:
        plain = _check_env(env, "env")
        hidden = _check_env(secrets, "secrets")
        names = set(SECRET_ENV_NAMES) | set(secret_names)
        for name in secret_names:
            _check_env({name: ""}, "secret_names")
        for name in list(plain):
            if name in names:
                hidden[name] = plain.pop(name)
        for name in secret_names:
            if name not in hidden:
                if name not in os.environ:
                    raise ValueError(f"secret_names: {name} has no value: pass it in secrets= "
                                     "or set it in this process's environment")
                hidden[name] = os.environ[name]
        return plain, hidden

    def _get_console(self) -> Any:
        if self.console is None:
            from rich.console import Console

            self.console = Console()
        return self.console

    def _say(self, text: str, style: str | None = None) -> None:
        self._get_console().print(f"[launcher] {text}", style=style, markup=False,
                                  highlight=False, soft_wrap=True)

    def _print_output(self, line: OutputLine) -> None:
        stream = self.console.file if self.console is not None else (
            sys.stderr if line.stream == "stderr" else sys.stdout)
        stream.write(f"{line}\n")
        stream.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fetch(self, rank: int, relative_path: str, local_path: str | os.PathLike[str]) -> Path:
        """Copy a file a rank wrote (relative to its ``EXOGYM_RUN_DIR``) to ``local_path``.

        Rank 0 on this machine is read directly; a remote rank's file comes over SFTP.
        """
        local_path = Path(local_path)
        host = self.config.hosts[rank]
        run_dir = Path(self.rank_run_dir)
        if rank not in self.targets:
            source = run_dir if run_dir.is_absolute() else Path(host.project_path) / run_dir
            data = (source.expanduser() / relative_path).read_bytes()
        else:
            if rank not in self._shells:
                errors = self.connect()
                if rank in errors:
                    raise errors[rank]
            shell = self._shells[rank]
            remote = run_dir if run_dir.is_absolute() else Path(host.project_path) / run_dir
            with shell.client.open_sftp() as sftp:  # type: ignore[attr-defined]
                with sftp.open(str(remote / relative_path), "rb") as f:
                    data = f.read()
        atomic_write_bytes(local_path, data)
        return local_path

    def close(self) -> None:
        """Close every SSH connection."""
        for shell in self._shells.values():
            shell.close()
        self._shells.clear()

    # ------------------------------------------------------------------ plan / dry run

    def plan(self, restart: int = 0) -> list[RankPlan]:
        """How each rank would be started on run ``restart``; connects to nothing."""
        plans = []
        world = self.config.world_size
        for host in self.config.hosts:
            env = {
                "RANK": str(host.rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1", "NODE_RANK": str(host.rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.config.master_port),
                "EXOGYM_RESTART": str(restart), "EXOGYM_RUN_DIR": self.rank_run_dir,
                "PYTHONUNBUFFERED": "1",
            }
            env.update(self.env)
            if host.interface:
                env["GLOO_SOCKET_IFNAME"] = host.interface
                env["NCCL_SOCKET_IFNAME"] = host.interface
            if host.device:
                env["EXOGYM_DEVICE"] = host.device
            local = host.rank not in self.targets
            plans.append(RankPlan(
                rank=host.rank, host=host, local=local,
                login="local" if local else self.targets[host.rank].label,
                command=rank_command(host.project_path, host.python_env, env,
                                     self.program.argv(host, restart)),
                env_names=tuple(env), secret_names=tuple(sorted(self.secrets)),
                interface=host.interface, master_addr=self.master_addr,
                master_port=self.config.master_port))
        return plans

    def dry_run(self) -> list[RankPlan]:
        """Print, per host, the exact command, the names of the variables it sets, the
        interface and the port; start nothing and connect to nothing.

        Returns:
            The plans printed.
        """
        plans = self.plan()
        console = self._get_console()
        master = plans[0]
        console.print(f"Dry run: {len(plans)} rank(s), master {master.master_addr}:"
                      f"{master.master_port}; nothing is started and nothing is connected to.",
                      markup=False, highlight=False, soft_wrap=True)
        for p in plans:
            where = "this machine, no SSH" if p.local else f"over SSH as {p.login}"
            interface = (f"{p.interface} (set in the hosts file)" if p.interface
                         else "chosen by the rank: the one that routes to the master")
            lines = [
                "",
                f"rank {p.rank} on {p.host.host} ({where})",
                f"  port:      {p.master_port} on {p.master_addr}"
                + (" (this rank listens)" if p.rank == 0 else ""),
                f"  interface: {interface}",
                f"  sets:      {' '.join(p.env_names)}",
                "  secrets:   " + (" ".join(p.secret_names) + " (over stdin, never on a command "
                                   "line)" if p.secret_names else "none"),
                f"  command:   {p.command}",
            ]
            if self.max_restarts and self.program.resume_args:
                lines.append(f"  on restart adds: {' '.join(self.program.resume_args)}")
            for line in lines:
                console.print(line, markup=False, highlight=False, soft_wrap=True)
        return plans

    # ------------------------------------------------------------------ connect / sync / check

    def connect(self) -> dict[int, SSHConnectError]:
        """Open the SSH connections not open yet, in parallel.

        Returns:
            For each rank whose host could not be reached, why.
        """
        if self.master_local and 0 not in self._shells:
            self._shells[0] = LocalShell()
        todo = [r for r in self.targets
                if r not in self._shells or not self._shells[r].alive()]

        def one(rank: int) -> tuple[int, Any]:
            try:
                client, accepted = connect(self.targets[rank], self.ssh_options)
            except SSHConnectError as exc:
                return rank, exc
            for key in accepted:
                self._notes[rank].append(f"trusted a new host key and recorded it in "
                                         f"{self.ssh_options.known_hosts}: {key}")
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

    def sync(self) -> list[SyncStats]:
        """Copy the project's tracked files to every remote host's ``project_path``.

        Returns:
            One ``SyncStats`` per host synced (hosts that cannot be reached
            are left to pre-flight, which reports them).

        Raises:
            RuntimeError: naming every host where copying failed, and why.
        """
        self.connect()
        files = tracked_files(self.project_root)
        remote = [r for r in self.targets if r in self._shells]

        def one(rank: int) -> SyncStats | str:
            host = self.config.hosts[rank]
            shell = self._shells[rank]
            assert isinstance(shell, SSHShell)
            try:
                return sync_files(shell.client, host.host, self.project_root, host.project_path,
                                  files)
            except (OSError, EOFError) as exc:
                return (f"[{host.host}:{rank}] copying the project to {host.project_path} "
                        f"failed: {exc}; check that {self.targets[rank].user} may write there")

        with ThreadPoolExecutor(max_workers=max(1, min(16, len(remote)))) as pool:
            outcomes = list(pool.map(one, remote))
        failures = [o for o in outcomes if isinstance(o, str)]
        if failures:
            raise RuntimeError("sync failed:\n" + "\n".join(f"  {f}" for f in failures))
        stats = [o for o in outcomes if isinstance(o, SyncStats)]
        for s in stats:
            self._say(f"synced {s.host}: {s.copied} file(s) copied ({s.bytes_copied} bytes), "
                      f"{s.unchanged} unchanged")
        self._synced = True
        return stats

    def preflight(self, *, raise_on_failure: bool = True, show: bool = True) -> PreflightReport:
        """Check every host in parallel (see ``distributed.hosts.preflight``).

        Args:
            raise_on_failure: raise ``PreflightError`` when a check fails.
            show: print the report as a table.

        Returns:
            The report.

        Raises:
            PreflightError: when a check fails and ``raise_on_failure``.
        """
        self.connect()
        logins = {r: ("local" if r not in self.targets else self.targets[r].label)
                  for r in range(self.config.world_size)}
        report = run_preflight(
            self.config, dict(self._shells), dict(self._connect_errors), logins,
            master_addr=self.master_addr, files=code_files(self.project_root),
            connect_timeout=self.ssh_options.connect_timeout, probe_timeout=self.probe_timeout,
            notes=self._notes)
        self._report = report
        if show:
            report.render(self._get_console())
        if raise_on_failure and not report.ok:
            raise PreflightError(report)
        return report

    # ------------------------------------------------------------------ run

    def run(self) -> LaunchResult:
        """Sync (if asked), pre-flight (unless it passed already), then run the job,
        restarting it up to ``max_restarts`` times after a failure.

        Returns:
            The ``LaunchResult``; call ``raise_for_failure()`` to turn a failure
            into a ``LaunchError``.

        Raises:
            PreflightError: when pre-flight fails (nothing was started).
        """
        if self.sync_first and not self._synced:
            self.sync()
        if self._report is None or not self._report.ok:
            self.preflight()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        attempts: list[AttemptResult] = []
        self._interrupted = None
        with self._signals_handled():
            for restart in range(self.max_restarts + 1):
                if restart:
                    failed = attempts[-1].first_failure
                    why = f"{failed.label} {failed.reason}" if failed else "a rank failed"
                    self._say(f"restart {restart} of {self.max_restarts} after {why}",
                              style="yellow")
                    self.connect()
                attempt = self._attempt(restart)
                attempts.append(attempt)
                self._write_index(attempts)
                if attempt.ok or attempt.interrupted:
                    break
        result = LaunchResult(self.run_dir, tuple(attempts))
        self._say(result.describe().splitlines()[0], style="green" if result.ok else "red")
        return result

    @contextlib.contextmanager
    def _signals_handled(self) -> Iterator[None]:
        """Turn SIGINT/SIGTERM into a clean stop of every rank (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self._interrupted is None:
                self._interrupted = signal.Signals(signum).name
                self._exits.put(None)  # wake the watch loop

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def _attempt(self, restart: int) -> AttemptResult:
        """Start every rank, watch until all have ended, stop them all on a failure."""
        plans = self.plan(restart)
        self._exits = queue.SimpleQueue()
        runs = [_RankRun(self, plan, self._shells.get(plan.rank),
                         self.run_dir / f"rank{plan.rank}.log", restart) for plan in plans]
        self._say(f"starting {len(runs)} rank(s)" + (f" (restart {restart})" if restart else "")
                  + f"; logs in {self.run_dir}")
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(runs)))) as pool:
            list(pool.map(_RankRun.start, runs))

        pending = {r.plan.rank for r in runs}
        first: _RankRun | None = None
        stopping_since: float | None = None
        forced = False
        while pending:
            if self._interrupted and stopping_since is None:
                self._say(f"{self._interrupted} received: stopping every rank", style="yellow")
                stopping_since = self._stop_all(runs)
            try:
                item = self._exits.get(timeout=0.2)
            except queue.Empty:
                item = None
            if item is not None:
                rank, code = item
                pending.discard(rank)
                run = runs[rank]
                if code != 0 and first is None and not run.stop_requested \
                        and not self._interrupted:
                    first = run
                    self._say(f"[{run.plan.host.host}:{rank}] failed ({run.describe_exit()}); "
                              "stopping every other rank", style="red")
                    stopping_since = self._stop_all(runs)
            if stopping_since is not None and not forced and \
                    time.monotonic() - stopping_since > self.grace_period + 15:
                forced = True  # a rank that ignores KILL, or a hung connection
                for rank in pending:
                    runs[rank].force_close()

        ranks = tuple(run.finish() for run in runs)
        failure = ranks[first.plan.rank] if first is not None else None
        return AttemptResult(restart=restart, ranks=ranks, first_failure=failure,
                             interrupted=self._interrupted)

    def _stop_all(self, runs: Sequence[_RankRun]) -> float:
        """Stop every rank still running, in parallel, without waiting; the time it began."""
        for run in runs:
            if run.running:
                run.stop_requested = True
                threading.Thread(target=run.stop, args=(self.grace_period,), daemon=True,
                                 name=f"stop-rank{run.plan.rank}").start()
        return time.monotonic()

    # ------------------------------------------------------------------ output

    def _redact(self, text: str) -> str:
        for value in self.secrets.values():
            if len(value) >= 4 and value in text:
                text = text.replace(value, "***")
        return text

    def _deliver(self, callback: Callable[[Any], None] | None, item: Any) -> None:
        if callback is None:
            return
        with self._callback_lock:
            try:
                callback(item)
            except Exception as exc:  # noqa: BLE001 - a broken callback must not stop a rank's output
                if not self._callback_failed:
                    self._callback_failed = True
                    sys.stderr.write(f"[launcher] output/event callback failed: {exc!r}; "
                                     "further failures are not shown\n")

    def _write_index(self, attempts: Sequence[AttemptResult]) -> None:
        """Write ``run_dir/launch.json``: hosts, commands and outcomes (no secret values)."""
        index = {
            "run_dir": str(self.run_dir),
            "world_size": self.config.world_size,
            "master": f"{self.master_addr}:{self.config.master_port}",
            "ranks": [{"rank": p.rank, "host": p.host.host, "login": p.login,
                       "command": p.command, "env": list(p.env_names),
                       "secrets": list(p.secret_names),
                       "log": str(self.run_dir / f"rank{p.rank}.log")} for p in self.plan()],
            "attempts": [{
                "restart": a.restart, "ok": a.ok, "interrupted": a.interrupted,
                "first_failure": a.first_failure.label if a.first_failure else None,
                "ranks": [{"rank": r.rank, "host": r.host, "exit_code": r.exit_code,
                           "reason": r.reason, "stopped": r.stopped,
                           "duration_s": round(r.duration_s, 3)} for r in a.ranks],
            } for a in attempts],
        }
        atomic_write_text(self.run_dir / "launch.json", json.dumps(index, indent=2) + "\n")


class _RankRun:
    """One rank during one attempt: its process, output readers and exit."""

    def __init__(self, launcher: Launcher, plan: RankPlan, shell: Shell | None, log_path: Path,
                 restart: int) -> None:
        self.launcher = launcher
        self.plan = plan
        self.shell = shell
        self.log_path = log_path
        self.restart = restart
        self.started: Started | None = None
        self.start_error: str | None = None
        self.pgid: int | None = None
        self.pgid_known = threading.Event()
        self.exit_report: dict[str, Any] = {}
        self.exit_code: int | None = None
        self.stop_requested = False
        self.running = False
        self.t0 = self.t1 = time.monotonic()
        self.last_lines: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self.threads: list[threading.Thread] = []
        self.log_lock = threading.Lock()
        self.log: Any = None
        self.decode: Callable[[str], dict[str, Any] | None] | None = None

    @property
    def host(self) -> str:
        return self.plan.host.host

    def start(self) -> None:
        """Start the rank; a failure to start counts as the rank failing."""
        from exogym.metrics import decode_line

        self.decode = decode_line
        self.log = open(self.log_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self.log.write(f"# exogym launcher: rank {self.plan.rank} on {self.host} "
                       f"({self.plan.login}), start {self.restart}, "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self.t0 = time.monotonic()
        message = {"code": BOOTSTRAP_SOURCE, "env": self.launcher.secrets,
                   "grace": self.launcher.grace_period}
        try:
            if self.shell is None:
                raise ConnectionError(f"no connection to {self.plan.login}")
            self.started = self.shell.start(self.plan.command, message)
        except OSError as exc:
            self.start_error = f"could not start: {exc}"
            self._line("stderr", self.start_error)
            self.t1 = time.monotonic()
            self.launcher._exits.put((self.plan.rank, None))
            return
        self.running = True
        for name, target, args in (("out", self._read, ("stdout",)),
                                   ("err", self._read, ("stderr",)),
                                   ("wait", self._wait, ())):
            thread = threading.Thread(target=target, args=args, daemon=True,
                                      name=f"rank{self.plan.rank}-{name}")
            thread.start()
            self.threads.append(thread)

    def _read(self, stream_name: str) -> None:
        assert self.started is not None
        stream = self.started.stdout if stream_name == "stdout" else self.started.stderr
        try:
            for raw in iter(stream.readline, b""):
                self._line(stream_name, raw.decode("utf-8", "replace").rstrip("\r\n"))
        except (OSError, EOFError, ValueError):
            pass  # the stream closed under us: the exit (or its absence) tells the story

    def _line(self, stream_name: str, text: str) -> None:
        if stream_name == "stdout":
            at = text.find(MARK)
            if at >= 0:
                self._control(text[at + len(MARK):])
                text = text[:at]
                if not text:
                    return
        text = self.launcher._redact(text)
        with self.log_lock:
            self.log.write(text + "\n")
        event = self.decode(text) if self.decode is not None else None
        if event is not None:
            event.setdefault("rank", self.plan.rank)
            event.setdefault("host", self.host)
            self.launcher._deliver(self.launcher._on_event, event)
            return
        self.last_lines.append(text)
        self.launcher._deliver(self.launcher._on_output,
                               OutputLine(self.plan.rank, self.host, stream_name, text))

    def _control(self, payload: str) -> None:
        try:
            report = json.loads(payload)
        except ValueError:
            return
        if "pgid" in report:
            self.pgid = int(report["pgid"])
            self.pgid_known.set()
        if "exit" in report:
            self.exit_report = report

    def _wait(self) -> None:
        assert self.started is not None
        code = self.started.wait()
        self.exit_code = code
        self.t1 = time.monotonic()
        self.running = False
        self.launcher._exits.put((self.plan.rank, code))

    def stop(self, grace: float) -> None:
        """Stop the rank's whole process group: TERM, then KILL after ``grace`` s."""
        if not self.running or self.started is None or self.shell is None:
            return
        if not self.pgid_known.wait(timeout=5.0):
            # The supervisor never reported: closing its stdin makes it stop the rank itself.
            self.started.close()
            return
        assert self.pgid is not None
        self.shell.kill_group(self.pgid, grace, self.plan.host.python_env)

    def force_close(self) -> None:
        """Last resort: KILL the group at once and drop the connection's channel."""
        if self.shell is not None and self.pgid is not None:
            self.shell.kill_group(self.pgid, 0.0, self.plan.host.python_env)
        if self.started is not None:
            self.started.close()

    def describe_exit(self) -> str:
        code = self.exit_code
        if self.start_error:
            return self.start_error
        if code is None:
            if self.shell is not None and not self.shell.alive():
                return f"the SSH connection to {self.plan.login} was lost"
            return "it ended without an exit status"
        if "name" in self.exit_report:
            return f"killed by {self.exit_report['name']} (exit code {code})"
        if code == 0:
            return "finished"
        return f"exited with code {code}"

    def finish(self) -> RankResult:
        """Wait for the output to drain, make sure nothing of the rank is left, close."""
        for thread in self.threads:
            thread.join(timeout=5.0)
        if self.started is not None:
            if not self.exit_report and self.pgid is not None and self.shell is not None \
                    and self.shell.alive():
                # the supervisor did not see the rank end (it was killed, or lost its
                # channel): stop the rank's group here, so nothing is left behind
                self.shell.kill_group(self.pgid, min(self.launcher.grace_period, 2.0),
                                      self.plan.host.python_env)
            self.started.close()
        stopped = self.stop_requested and self.exit_code != 0
        reason = "stopped by the launcher" if stopped else self.describe_exit()
        with self.log_lock:
            self.log.write(f"# exogym launcher: rank {self.plan.rank} {reason}\n")
            self.log.close()
        return RankResult(rank=self.plan.rank, host=self.host, exit_code=self.exit_code,
                          reason=reason, stopped=stopped, duration_s=self.t1 - self.t0,
                          log_path=self.log_path, last_lines=tuple(self.last_lines))


def launch(hosts: HostsConfig | str | os.PathLike[str] | Mapping[str, Any],
           program: RankProgram, *, check: bool = True, **options: Any) -> LaunchResult:
    """Run ``program`` on every host of ``hosts``: ``Launcher(...).run()`` in one call.

    Args:
        hosts: a ``HostsConfig``, a hosts file path or a hosts mapping.
        program: what each rank runs.
        check: raise ``LaunchError`` when the job fails or is interrupted.
        **options: any keyword argument of ``Launcher``.

    Returns:
        The ``LaunchResult``.

    Raises:
        PreflightError: when pre-flight fails; nothing was started.
        LaunchError: when ``check`` and the job did not finish.
    """
    with Launcher(hosts, program, **options) as launcher:
        result = launcher.run()
    if check:
        result.raise_for_failure()
    return result
