"""The SSH launcher: start every rank on its host, watch them, stop them all, restart the job.

A library API, used by NetworkTrainer, the CLI and the wizard::

    from ..hosts.hostsfile import load_hosts
    from .launcher import LaunchOptions, Launcher, RankProgram

    program = RankProgram.from_profile("digits-diloco", overrides={"max_steps": 200})
    options = LaunchOptions(secret_names=["WANDB_API_KEY"])
    with Launcher(load_hosts("hosts.json"), program, options=options) as launcher:
        launcher.dry_run()        # what would run where; connects to nothing
        result = launcher.run()   # pre-flight, start, watch, stop
    result.raise_for_failure()    # LaunchError naming the first failing host:rank

The hosts are reached through a host session (``distributed.hosts.session``:
connections, sync, pre-flight, fetch); the launcher adds what runs there.
What ``run`` does:

1. Optionally copies the project's tracked files to every remote host (``sync=True``).
2. Pre-flight on all hosts in parallel (``distributed.hosts.preflight``); nothing
   starts unless every check passes (``PreflightError`` otherwise), except that a
   run with ``min_nodes`` starts without hosts that are down, when enough others
   pass, and takes each in once it answers (``Launcher.preflight``).
3. Starts each host's ranks (one per slot, numbered host by host) as ``cd
   project_path && python_env ARGS``: the master's as local subprocesses when
   the master is this machine, every other over SSH (one connection per host,
   one channel per rank). The rank variables are set on the command line with ``env
   NAME=value`` (so the SSH server's ``AcceptEnv`` does not matter); secrets
   travel over the channel's stdin to a small supervisor
   (``distributed.hosts.onhost.bootstrap``) that puts them in the rank's environment only.
   Each rank runs in a process group of its own (``distributed.launch.rank_process``).
4. Streams every line to ``on_output`` with a ``[host:rank]`` prefix, saves it
   to ``run_dir/rank{r}.log``, and turns metric lines
   (``exogym.report.metrics.encode_event``) into dicts for ``on_event``; says once
   when a host's ranks report it low on memory (``exogym.report.health``).
5. When a rank exits non-zero or its SSH connection drops, stops every other
   rank's whole process group (TERM, KILL after ``grace_period``); SIGINT and
   SIGTERM to this process do the same. With ``max_restarts=N`` the whole job
   is started again, up to N times, with ``EXOGYM_RESTART=k`` and the
   program's ``resume_args`` added, so ranks continue from their checkpoints.

Every rank sees ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (0..slots-1 on its
host), ``LOCAL_WORLD_SIZE`` (its host's slots), ``NODE_RANK`` (its host's
index), ``MASTER_ADDR``, ``MASTER_PORT``, ``EXOGYM_RESTART``,
``EXOGYM_RUN_DIR`` and ``PYTHONUNBUFFERED``; ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` when its host sets ``interface`` (otherwise the rank
picks the interface that routes to the master); ``EXOGYM_DEVICE`` when its
host sets ``device``; plus the caller's ``env`` and secrets. The variables are
built by ``RankEnvironment.variables`` (``distributed.worker.environment``), the
module that also reads them on the rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exogym.base.io import atomic_write_text
from exogym.base.plural import plural
from exogym.report.health import LowMemoryNotice

from ..hosts.hostsfile import HostsConfig, load_hosts, min_nodes_problem
from ..hosts.preflight import PreflightError, PreflightReport
from ..hosts.remote import BOOTSTRAP_SOURCE, hand_command, rank_command
from ..hosts.session import HostSession, can_listen_on, is_this_machine
from ..hosts.ssh import SSHOptions, ssh_command_line
from ..hosts.sync import WORK_ROOT, is_checkout
from ..profiles.run_dir import utc_now
from ..worker.environment import RankEnvironment
from .elastic_attempt import ElasticAttempt
from .faults import FaultPlan
from .injector import AttemptView, FaultInjector
from .options import (
    SECRET_ENV_NAMES,
    LaunchOptions,
    split_env,
    split_options,
)
from .program import RankPlan, RankProgram
from .progress import ProgressWatch
from .rank_process import ExitQueue, RankRun, RankRunContext
from .results import (
    AttemptResult,
    LaunchError,
    LaunchResult,
    OutputLine,
    RankResult,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "SECRET_ENV_NAMES",
    "AttemptResult",
    "HostSession",
    "LaunchError",
    "LaunchOptions",
    "LaunchResult",
    "Launcher",
    "OutputLine",
    "PreflightError",
    "PreflightReport",
    "RankPlan",
    "RankProgram",
    "RankResult",
    "SSHOptions",
    "is_this_machine",
    "launch",
    "split_options",
]


class Launcher:
    """Starts, watches and stops every rank of a hosts file (one per slot), on a host session.

    The session's connections are opened on first need (``session.preflight``,
    ``session.sync``, ``run``) and kept until ``close``; use it as a context
    manager.

    Args:
        hosts: a ``HostsConfig``, a hosts file path, or a hosts mapping.
        program: what each rank runs (``RankProgram.from_profile``/``from_script``).
        options: the job's options (``LaunchOptions``: run folder, environment,
            secrets, restarts, grace period, sync, ...); default ``LaunchOptions()``.
        ssh: how to reach the hosts (``SSHOptions``) for the session the
            launcher opens; default ``SSHOptions()``.
        session: a host session for these hosts to run on instead of opening
            one (then ``ssh`` and the options' ``project_root``,
            ``master_local`` and ``probe_timeout`` stay unset). Its owner
            closes it; ``close`` closes only a session the launcher opened.
        on_output: called with every ``OutputLine`` (default: print it).
        on_event: called with every metric event dict a rank emits (and every injected
            fault's, ``{"event": "fault", "injected": true, ...}``).
        console: a ``rich.console.Console`` for tables and messages (default: stdout).
        faults: faults to inject while the job runs (:mod:`distributed.launch.faults`,
            carried out by :mod:`distributed.launch.injector`); None: none.
    """

    def __init__(
        self,
        hosts: HostsConfig | str | os.PathLike[str] | Mapping[str, Any],
        program: RankProgram,
        *,
        options: LaunchOptions | None = None,
        ssh: SSHOptions | None = None,
        session: HostSession | None = None,
        on_output: Callable[[OutputLine], None] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        console: Any = None,
        faults: FaultPlan | None = None,
    ) -> None:
        config = hosts if isinstance(hosts, HostsConfig) else load_hosts(hosts)
        if not isinstance(program, RankProgram):
            raise TypeError("program must be a RankProgram (RankProgram.from_profile(...) or "
                            f"RankProgram.from_script(...)), got {type(program).__name__}")
        options = options or LaunchOptions()
        self.program = program
        self.options = options
        self.env, self.secrets = split_env(options)
        #: Signs every value of the run's store (exogym.comm.store.SignedStore); it reaches
        #: the ranks only through their supervisor's stdin, never a command line or log.
        self.store_key = os.urandom(32)
        if session is None:
            probe_timeout = 60.0 if options.probe_timeout is None else options.probe_timeout
            session = HostSession(config, ssh=ssh, project_root=options.project_root,
                                  probe_timeout=probe_timeout,
                                  master_local=options.master_local, console=console)
            self._owns_session = True
        else:
            _check_session(session, config, options, ssh)
            self._owns_session = False
        self.session = session
        if options.min_nodes is not None:
            problem = min_nodes_problem(options.min_nodes, self.config.world_size)
            if problem is not None:
                raise ValueError(f"{problem} of the hosts file")
            if not session.master_local and not can_listen_on(self.config.master.host):
                raise ValueError(
                    f"min_nodes needs the launcher on the master host "
                    f"({self.config.master.host}): the run's store lives in the launcher, so "
                    "that no rank's loss takes it away, and it listens on the master's "
                    "address, which is not one of this machine's; start the run from that "
                    "machine")
        #: Hosts (by index) that did not answer pre-flight, with what failed, which a run
        #: with ``min_nodes`` starts without and takes in once they answer (:meth:`preflight`).
        self.missing: dict[int, str] = {}
        #: Hosts that read a profiles file from outside the project where it lies here
        #: (they share this machine's disk), rather than the copy sent to them.
        self._config_in_place: set[int] = set()
        self._accepted: PreflightReport | None = None  # a failed pre-flight the run starts on
        #: Every change of membership of the last attempt (``min_nodes``), as summary.json
        #: records it: ``{"step", "ranks", "hosts", "reason"}``.
        self.membership: list[dict[str, Any]] = []
        #: The rank that wrote the final model and summary of a run whose ranks come and
        #: go: one that ended it (None: rank 0, as in any other run).
        self.writer: int | None = None
        # The run's start time, the same for every rank and every start of one (set by
        # run(); a dry run's commands carry none).
        self._started: str | None = None

        project_root = session.project_root
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path(options.run_dir) if options.run_dir is not None else (
            (project_root if is_checkout(project_root) else WORK_ROOT) / "runs"
            / f"launch-{stamp}")
        self.run_dir = run_dir.expanduser().resolve()
        try:
            self.rank_run_dir = str(self.run_dir.relative_to(project_root))
        except ValueError:
            self.rank_run_dir = str(self.run_dir)

        self.console = console
        self._on_output = on_output or self._print_output
        self._on_event = on_event
        self._callback_lock = threading.Lock()
        self._callback_failed = False
        self._interrupted: str | None = None
        # SimpleQueue: its put() may be called from a signal handler
        self._exits: ExitQueue = queue.SimpleQueue()
        #: Carries out ``faults`` (None without any).
        self.injector: FaultInjector | None = None
        if faults:
            if faults.min_nodes != options.min_nodes:
                raise ValueError(f"the fault plan was checked for min_nodes={faults.min_nodes} "
                                 f"but the launch has min_nodes={options.min_nodes}")
            self.injector = FaultInjector(
                faults, self.config, session, self.rank_run_dir,
                emit=lambda event: self._deliver(self._on_event, event),
                say=lambda text, style: self._say(text, style=style))
        #: Every injected fault of the last run, as ``summary.json`` records it.
        self.fault_records: list[dict[str, Any]] = []

    @property
    def config(self) -> HostsConfig:
        """The hosts, as the session holds them (its pre-flight may pick the master port)."""
        return self.session.config

    @property
    def master_local(self) -> bool:
        """Whether rank 0 runs on this machine without SSH."""
        return self.session.master_local

    # ------------------------------------------------------------------ setup

    def _get_console(self) -> Any:
        if self.console is None:
            from exogym.base.terminal import output_console

            self.console = output_console()
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
        host = self.config.host_of(rank).rank
        return self.session.fetch(host, Path(self.rank_run_dir) / relative_path, local_path)

    def close(self) -> None:
        """Close the session's connections, when the launcher opened the session."""
        if self._owns_session:
            self.session.close()

    # ------------------------------------------------------------------ pre-flight

    def preflight(self, *, show: bool = True) -> PreflightReport:
        """Pre-flight every host (:meth:`HostSession.preflight`) and decide whether the run
        can start.

        Every host must pass, except with ``min_nodes``: hosts that are down (SSH cannot
        reach them, or their probe gives no answer) are left out when the master and
        hosts with at least ``min_nodes`` ranks pass. The run then starts without them,
        each named once here with what failed, and takes each in once it answers
        (:attr:`missing`; :mod:`distributed.launch.elastic_attempt`).

        Args:
            show: print the report as a table.

        Returns:
            The report.

        Raises:
            PreflightError: a host failed and the run cannot start without it (no
                ``min_nodes``, a host that answered with a problem, the master, or too
                few ranks left).
        """
        report = self.session.preflight(raise_on_failure=False, show=show)
        self.missing = {}
        self._accepted = None
        if report.ok:
            return report
        min_nodes = self.options.min_nodes
        failed = [c for c in report.checks if not c.ok]
        if min_nodes is None or not any(c.down for c in failed):
            raise PreflightError(report)
        answering = [c for c in failed if not c.down]
        if answering:
            raise PreflightError(report, note=(
                f"with min_nodes={min_nodes} a run starts without hosts that do not answer, "
                f"but {', '.join(c.host for c in answering)} answered with a problem: fix it"))
        if failed[0].rank == 0:
            raise PreflightError(report, note=(
                f"with min_nodes={min_nodes} a run starts without hosts that do not answer, "
                f"but not without the master {failed[0].host}: it holds the run's store and "
                "rank 0, which hands the other ranks their first weights"))
        world = self.config.world_size
        ready = sum(len(self.config.hosts[c.rank].ranks) for c in report.checks if c.ok)
        if ready < min_nodes:
            raise PreflightError(report, note=(
                f"with min_nodes={min_nodes} a run starts without hosts that do not answer, "
                f"but only {ready} of {plural(world, 'rank')} answered"))
        for c in failed:
            self.missing[c.rank] = "; ".join(c.problems)
            self._say(f"{c.label} did not answer pre-flight ({self.missing[c.rank]}): the run "
                      f"starts without it on {ready} of {plural(world, 'rank')} "
                      f"(min_nodes={min_nodes}); it is tried every "
                      f"{self.options.probe_interval:g} s and joins once it answers",
                      style="yellow")
        self._accepted = report
        return report

    # ------------------------------------------------------------------ plan / dry run

    def check_faults(self) -> FaultPlan | None:
        """Ask the hosts whether the faults to inject can be made there (a ``cut`` needs
        leave to change a host's firewall); after pre-flight, before anything starts.
        ``run`` does it when it was not done.

        Returns:
            The fault plan as it will run (random cuts without the hosts that refuse them).

        Raises:
            FaultSpecError: a given fault that cannot be made, naming the host and why.
        """
        if self.injector is None:
            return None
        return self.injector.check()

    def plan(self, restart: int = 0) -> list[RankPlan]:
        """How each rank would be started on run ``restart``; connects to nothing."""
        plans = []
        world = self.config.world_size
        master_addr = self.session.master_addr
        for host in self.config.hosts:
            for local_rank, rank in enumerate(host.ranks):
                env = RankEnvironment(
                    rank, world, master_addr, self.config.master_port, local_rank, host.slots,
                    node_rank=host.rank, restart=restart, run_dir=self.rank_run_dir,
                    interface=host.interface, device=host.device,
                    throttle_file=(None if self.injector is None
                                   else self.injector.throttle_path(rank)),
                    min_nodes=self.options.min_nodes, lost_after=self.options.lost_after,
                ).variables(extra=self.env)
                local = self.session.is_local(host.rank)
                argv = self.program.argv(host, restart,
                                         local=local or host.rank in self._config_in_place)
                if self._started and self.program.profile_mode and \
                        "--run-started" not in argv:
                    # One identity for the run: a rank started again (min_nodes) joins the
                    # run its folder holds instead of taking it for an earlier one.
                    argv += ["--run-started", self._started]
                by_hand = hand_command(host.project_path, host.python_env, env, argv)
                if not local:
                    by_hand = ssh_command_line(self.session.targets[host.rank], by_hand,
                                               self.session.ssh)
                plans.append(RankPlan(
                    rank=rank, host=host, local=local, login=self.session.login(host.rank),
                    command=rank_command(host.project_path, host.python_env, env, argv),
                    env_names=tuple(env), secret_names=tuple(sorted(self.secrets)),
                    interface=host.interface, master_addr=master_addr,
                    master_port=self.config.master_port, local_rank=local_rank,
                    by_hand=by_hand))
        return plans

    def dry_run(self) -> list[RankPlan]:
        """Print, per rank, the command that starts it by hand (through ``ssh`` on another
        host; quoted to be copied as it is), the names of the variables it sets, the
        interface and the port; start nothing and connect to nothing.

        Returns:
            The plans printed.
        """
        plans = self.plan()
        console = self._get_console()
        master = plans[0]
        hosts = len(self.config.hosts)
        console.print(f"Dry run: {plural(len(plans), 'rank')} on {plural(hosts, 'host')}, master "
                      f"{master.master_addr}:"
                      f"{master.master_port}; nothing is started and nothing is connected to. "
                      "Each command below starts its rank by hand, from this machine: run each "
                      "in a terminal of its own (the ranks wait for one another).",
                      markup=False, highlight=False, soft_wrap=True)
        for p in plans:
            where = "this machine, no SSH" if p.local else f"over SSH as {p.login}"
            interface = (f"{p.interface} (set in the hosts file)" if p.interface
                         else "chosen by the rank: the one that routes to the master")
            lines = [
                "",
                f"rank {p.rank} on {p.host.host} ({where})" + (
                    f", local rank {p.local_rank} of {p.host.slots}" if p.host.slots > 1
                    else ""),
                f"  port:      {p.master_port} on {p.master_addr}"
                + (" (this rank listens)" if p.rank == 0 else "")
                + ("" if self.config.master_port_given else
                   " (the hosts file names no \"master_port\": another, free one when this "
                   "is taken as the run starts)"),
                f"  interface: {interface}",
                f"  sets:      {' '.join(p.env_names)}",
                "  secrets:   " + (" ".join(p.secret_names) + " (over stdin, never on a command "
                                   "line; by hand, set them in the rank's environment)"
                                   if p.secret_names else "none"),
                f"  command:   {p.by_hand}",
            ]
            if self.options.max_restarts and self.program.resume_args:
                lines.append(f"  on restart adds: {' '.join(self.program.resume_args)}")
            for line in lines:
                console.print(line, markup=False, highlight=False, soft_wrap=True)
        return plans

    # ------------------------------------------------------------------ run

    def run(self) -> LaunchResult:
        """Sync (if asked), pre-flight (unless it passed already), then run the job,
        restarting it up to ``max_restarts`` times after a failure.

        Returns:
            The ``LaunchResult``; call ``raise_for_failure()`` to turn a failure
            into a ``LaunchError``.

        Raises:
            PreflightError: when pre-flight fails and the run cannot start without the
                failed hosts (nothing was started; see :meth:`preflight`).
        """
        if self.options.sync and not self.session.synced:
            self.session.sync()
        report = self.session.report
        if report is None or not (report.ok or report is self._accepted):
            self.preflight()
        if self.injector is not None and not self.injector.checked:
            self.injector.check()
        self.session.rank_files = dict(self.program.sent_files)
        if self.session.rank_files:  # a profiles file from outside the project
            self._config_in_place = self.session.put_files(
                self.session.rank_files,
                ranks=[h for h in range(len(self.config.hosts)) if h not in self.missing],
                in_place=dict(self.program.sent_from))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._started = utc_now()
        attempts: list[AttemptResult] = []
        self._interrupted = None
        max_restarts = self.options.max_restarts
        if self.injector is not None:
            for line in self.injector.plan.describe():
                self._say(line, style="magenta")
        with self._signals_handled():
            try:
                for restart in range(max_restarts + 1):
                    if restart:
                        failed = attempts[-1].first_failure
                        why = f"{failed.label} {failed.reason}" if failed else "a rank failed"
                        self._say(f"restart {restart} of {max_restarts} after {why}",
                                  style="yellow")
                        self.session.connect()
                    attempt = self._attempt(restart)
                    attempts.append(attempt)
                    self._write_index(attempts)
                    if attempt.ok or attempt.interrupted:
                        break
            finally:
                if self.injector is not None:
                    self.fault_records = self.injector.finish()
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
        grace = self.options.grace_period
        progress = ProgressWatch(self.options.stall_after)
        memory = LowMemoryNotice()

        injector = self.injector

        def on_event(event: dict[str, Any]) -> None:
            progress.on_event(event)
            low = memory.check(event)
            if low is not None:
                self._say(low, style="bold red")
            if injector is not None:
                injector.on_event(event)
            if event.get("event") == "final_membership" and event.get("writer") is not None \
                    and event.get("rank") in event.get("present", ()):
                self.writer = int(event["writer"])
            self._deliver(self._on_event, event)

        context = RankRunContext(
            bootstrap={"code": BOOTSTRAP_SOURCE, "env": self.secrets, "grace": grace,
                       "store_key": self.store_key.hex()},
            grace_period=grace, redact=self._redact,
            on_output=lambda line: self._deliver(self._on_output, line),
            on_event=on_event, exits=self._exits)
        if self.options.min_nodes is not None:
            starting = sum(p.host.rank not in self.missing for p in plans)
            self._say(f"starting {f'{starting} of ' if starting < len(plans) else ''}"
                      f"{plural(len(plans), 'rank')}; the run goes on while at least "
                      f"{self.options.min_nodes} remain; logs in {self.run_dir}")
            elastic = ElasticAttempt(plans, self.session, context, self.run_dir, restart,
                                     self.options.min_nodes, self.options.lost_after,
                                     self.options.probe_interval,
                                     lambda text, style: self._say(text, style=style),
                                     lambda: self._interrupted, progress,
                                     missing=self.missing)
            if injector is not None:
                injector.begin_attempt(AttemptView(
                    run_of=elastic.runs.get,
                    away=lambda: set(elastic.lost) | {r for r, run in list(elastic.runs.items())
                                                      if not run.running},
                    hold=elastic.hold))
            try:
                return elastic.run()
            finally:
                if injector is not None:
                    injector.end_attempt()
                self.membership = elastic.membership
                elastic.close()
        runs = [RankRun(plan, self.session.shell(plan.host.rank),
                        self.run_dir / f"rank{plan.rank}.log", restart, context)
                for plan in plans]
        self._say(f"starting {plural(len(runs), 'rank')}" + (f" (restart {restart})" if restart else "")
                  + f"; logs in {self.run_dir}")
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(runs)))) as pool:
            list(pool.map(RankRun.start, runs))
        if injector is not None:
            injector.begin_attempt(AttemptView(
                run_of=lambda rank: runs[rank],
                away=lambda: {run.plan.rank for run in runs if not run.running}))
        try:
            return self._watch(runs, progress, grace, restart)
        finally:
            if injector is not None:
                injector.end_attempt()

    def _watch(self, runs: list[RankRun], progress: ProgressWatch, grace: float,
               restart: int) -> AttemptResult:
        """Watch the ranks of an attempt until all have ended; stop them all on a failure."""
        pending = {r.plan.rank for r in runs}
        first: RankRun | None = None
        stopping_since: float | None = None
        stalled: str | None = None
        forced = False
        while pending:
            if self._interrupted and stopping_since is None:
                self._say(f"{self._interrupted} received: stopping every rank", style="yellow")
                stopping_since = self._stop_all(runs)
            if stopping_since is None and first is None:
                stalled = progress.stalled()
                if stalled:
                    self._say(f"stopping: {stalled}", style="red")
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
                    self._say(f"[{run.host}:{rank}] failed ({run.describe_exit()}); "
                              "stopping every other rank", style="red")
                    stopping_since = self._stop_all(runs)
            if stopping_since is not None and not forced and \
                    time.monotonic() - stopping_since > grace + 15:
                forced = True  # a rank that ignores KILL, or a hung connection
                for rank in pending:
                    runs[rank].force_close()

        ranks = tuple(run.finish() for run in runs)
        failure = ranks[first.plan.rank] if first is not None else None
        return AttemptResult(restart=restart, ranks=ranks, first_failure=failure,
                             interrupted=self._interrupted, stop_reason=stalled)

    def _stop_all(self, runs: Sequence[RankRun]) -> float:
        """Stop every rank still running, in parallel, without waiting; the time it began."""
        for run in runs:
            if run.running:
                run.stop_requested = True
                threading.Thread(target=run.stop, daemon=True,
                                 name=f"stop-rank{run.plan.rank}").start()
        return time.monotonic()

    # ------------------------------------------------------------------ output

    def _redact(self, text: str) -> str:
        for value in (*self.secrets.values(), self.store_key.hex()):
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
            "master": f"{self.session.master_addr}:{self.config.master_port}",
            "ranks": [{"rank": p.rank, "host": p.host.host, "local_rank": p.local_rank,
                       "login": p.login,
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


def _check_session(session: HostSession, config: HostsConfig, options: LaunchOptions,
                   ssh: SSHOptions | None) -> None:
    """A given session must be for the same hosts, and the settings it fixed not given again."""
    if session.config.hosts != config.hosts or (
            config.master_port_given and session.config.master_port != config.master_port):
        raise ValueError("session= was opened for other hosts than the launcher's; give the "
                         "launcher the session's hosts (session.config)")
    given = [name for name, value in (("ssh", ssh), ("project_root", options.project_root),
                                      ("master_local", options.master_local),
                                      ("probe_timeout", options.probe_timeout))
             if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} cannot be given with session=: the session has "
                         "its own (set them when opening the HostSession)")


def launch(hosts: HostsConfig | str | os.PathLike[str] | Mapping[str, Any],
           program: RankProgram, *, check: bool = True,
           on_output: Callable[[OutputLine], None] | None = None,
           on_event: Callable[[dict[str, Any]], None] | None = None,
           console: Any = None, **options: Any) -> LaunchResult:
    """Run ``program`` on every host of ``hosts``: ``Launcher(...).run()`` in one call.

    Args:
        hosts: a ``HostsConfig``, a hosts file path or a hosts mapping.
        program: what each rank runs.
        check: raise ``LaunchError`` when the job fails or is interrupted.
        on_output, on_event, console: as for ``Launcher``.
        **options: any field of ``LaunchOptions`` or ``SSHOptions`` (see ``split_options``).

    Returns:
        The ``LaunchResult``.

    Raises:
        TypeError: for an option that is neither.
        PreflightError: when pre-flight fails; nothing was started.
        LaunchError: when ``check`` and the job did not finish.
    """
    launch_options, ssh = split_options(options, owner="launch()")
    with Launcher(hosts, program, options=launch_options, ssh=ssh, on_output=on_output,
                  on_event=on_event, console=console) as launcher:
        result = launcher.run()
    if check:
        result.raise_for_failure()
    return result
