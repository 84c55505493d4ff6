"""Start a training run the one way both faces do: validate, pre-flight, run, with the dashboard.

``cli_typer.py distributed-train`` and ``wizard.py`` describe the run they
want as a ``TrainRequest`` and call :func:`train` (or :func:`dry_run`). With
a hosts file the profile runs across the hosts through the SSH launcher, one
rank per host (profile mode: every host builds the task from the same
``config.ini``); without one it runs as a local simulation of the same
profile. Either way the live dashboard shows it.

Every run gets a folder of its own, chosen (and claimed) once before anything
starts, here for a simulation and on the master host for a run across hosts
(:mod:`distributed.profiles.run_dir`): ``output_dir`` when it holds no run,
else the next free ``output_dir-2``, ...; ``--overwrite`` replaces the run in
``output_dir``; ``--resume`` continues only a run with the same settings. The
ranks are given that folder as their ``output_dir``.

Errors are sorted for the faces: bad input raises before anything starts
(``ProfileError``, ``HostsFileError``, ``PreflightError``, ``ValueError``,
``FileNotFoundError``; ``RunFolderError``, a ``ValueError``, when the run's
folder cannot take it, ``NothingToResumeError`` when ``--resume`` finds nothing);
a run that started and failed raises ``RunFailedError``, one that Ctrl-C stopped
``RunInterrupted``. Torch is imported only when a local simulation starts.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shlex
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from exogym.base.escapes import printable
from exogym.base.install_mode import command
from exogym.base.plural import plural
from exogym.base.terminal import output_console
from exogym.config.fit_args import BALANCE_MODES
from exogym.report.goodput import GoodputMeter, goodput_summary
from exogym.report.loggers import LOGGER_NAMES
from exogym.report.summary import MergeLog, print_goodput
from exogym.report.trace import TRACE_FILE, TraceWriter

from ..hosts.hostsfile import HostsConfig, load_hosts
from ..hosts.onhost import runfolders
from ..hosts.preflight import PreflightError
from ..hosts.remote import module_source, probe_command
from ..hosts.sync import BUILTIN_CONFIG, PROJECT_ROOT, is_checkout
from ..launch.faults import FaultPlan, FaultSpecError, plan_faults
from ..launch.launcher import Launcher
from ..launch.options import split_options
from ..launch.program import RankProgram
from ..profiles.profile import (
    LAUNCH_KEYS,
    Profile,
    ProfileWarning,
    load_profile,
    parse_overrides,
)
from ..profiles.run_dir import (
    NothingToResumeError,
    RunFolderError,
    RunPlacement,
    place_run,
    record_resume,
    release_placement,
    take_placement,
)
from ..tasks.extras import missing_extra, require_extra
from ..worker.command import override_items, set_args, worker_args
from ..worker.environment import FINAL_MODEL
from .about import command_words
from .dashboard import Dashboard
from .fanout import FanOut
from .hosts_check import ssh_files
from .web.server import WebDashboard

__all__ = ["NothingToResumeError", "PreflightError", "RunFailedError", "RunFolderError",
           "RunInterrupted", "TrainOutcome", "TrainRequest", "dry_run", "logger_override",
           "next_steps", "parse_overrides", "resume_hint", "run_warnings", "train", "train_command"]

#: Ranks per core beyond which a local simulation is warned that it will crawl.
RANKS_PER_CORE_WARNING = 4


class RunFailedError(RuntimeError):
    """The run started and did not finish; the message says which rank failed and how.

    Args:
        message: what happened, with the failing rank's last lines when known.
        launch: the launcher's result for a multi-host run.
    """

    def __init__(self, message: str, launch: Any = None) -> None:
        super().__init__(message)
        self.launch = launch


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run that had started; says which run, so that the command to
    continue it names this run's folder and checkpoint, never another's.

    Args:
        folder: the run's folder, as its ``output_dir`` (relative to the working
            directory of the machine that keeps the outputs).
        root: where that folder is from here (the master's ``project_path`` joined in
            when the master is this machine); None when it is on another machine.
        where: words naming that other machine (``" on HOST"``), else empty.
    """

    def __init__(self, folder: Path, root: Path | None, where: str = "") -> None:
        super().__init__(f"the run in {folder}{where} was interrupted")
        self.folder = folder
        self.root = root
        self.where = where


@dataclass(frozen=True)
class TrainRequest:
    """A run, as a face asks for it.

    Args:
        profile: the profile's name (a ``[distributed:NAME]`` section).
        config: the profiles file (default: the project's ``config.ini``).
        overrides: profile keys to replace (parsed ``--set`` values).
        hosts: a hosts file (path) or a loaded ``HostsConfig``; None for a
            local simulation.
        local: simulate locally even when ``hosts`` is given.
        resume: continue the newest run of the profile's folder with the same settings
            from its newest complete checkpoint; with none, ``NothingToResumeError``.
        fresh_if_none: with ``resume``, start a new run when there is nothing to resume.
        overwrite: a new run in ``output_dir`` itself, replacing the run there (by
            default a new run gets a folder of its own).
        max_restarts: restarts of the whole job after a rank fails (multi-host).
        sync: copy the project's tracked files to every host first.
        accept_new_host_keys: trust hosts not yet in known_hosts (recorded once).
        known_hosts: the known_hosts file (default ``$EXOGYM_KNOWN_HOSTS`` or ``~/.ssh/known_hosts``).
        ssh_config: the SSH client config (default ``$EXOGYM_SSH_CONFIG`` or ``~/.ssh/config``).
        ssh_timeout: seconds to wait for each host's TCP connection, SSH greeting and
            login (default ``SSHOptions.connect_timeout``).
        run_dir: where the launcher writes the ranks' logs.
        launcher_options: more fields of ``LaunchOptions`` or ``SSHOptions``
            (e.g. ``allow_agent``; see ``distributed.launch.options.split_options``).
        inject: faults to inject into a run across hosts (``--inject`` specs,
            :mod:`distributed.launch.faults`).
        inject_random: the seed of random faults (``--inject-random``), or None.
        inject_every: how often random faults come (``--every``: ``30s``; default 30 s).
        inject_mtbf: each host's mean time between random failures (``--mtbf``: ``2m``),
            instead of ``inject_every``.
        inject_down: how long each such failure keeps its host down (``--down``: ``30s``).
        inject_failures: the kinds of those failures (``--failures``: ``kill,freeze``).
    """

    profile: str
    config: str | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    hosts: str | os.PathLike[str] | HostsConfig | None = None
    local: bool = False
    resume: bool = False
    fresh_if_none: bool = False
    overwrite: bool = False
    max_restarts: int = 0
    sync: bool = False
    accept_new_host_keys: bool = False
    known_hosts: str | None = None
    ssh_config: str | None = None
    ssh_timeout: float | None = None
    run_dir: str | None = None
    launcher_options: Mapping[str, Any] = field(default_factory=dict)
    inject: tuple[str, ...] = ()
    inject_random: int | None = None
    inject_every: str | float | None = None
    inject_mtbf: str | float | None = None
    inject_down: str | float | None = None
    inject_failures: str | None = None

    @property
    def injects(self) -> bool:
        """Whether faults are to be injected (``--inject``, ``--inject-random``, ``--every``,
        ``--mtbf``, ``--down``)."""
        return bool(self.inject) or self.inject_random is not None or \
            self.inject_every is not None or self.inject_mtbf is not None or \
            self.inject_down is not None or self.inject_failures is not None

    @property
    def multi_host(self) -> bool:
        """True when the run goes across the hosts of a hosts file."""
        return self.hosts is not None and not self.local


@dataclass
class TrainOutcome:
    """How a finished run went.

    Args:
        mode: ``local`` (simulation) or ``hosts``.
        profile: the resolved profile that ran.
        summary: final figures (``exogym.report.summary.summarize``'s keys).
        output_dir: the run's folder, where rank 0 (or the simulation) wrote the final
            model, relative to its working directory (the master's ``project_path``).
        message: one line for the person.
        launch: the launcher's result for a multi-host run.
    """

    mode: str
    profile: Profile
    summary: dict[str, Any]
    output_dir: Path
    message: str
    launch: Any = None


def next_steps(outcome: TrainOutcome) -> str:
    """What a person can do once a run has ended well, as commands of this install: list
    the runs, replay this one in the simulator, load its model (as docs/hosts.md shows)."""
    folder = outcome.output_dir
    tree = folder.parent
    where = " (on the master host, in its project folder)" if outcome.mode == "hosts" else ""
    model = folder / FINAL_MODEL
    return "\n".join([
        f"next steps{where}:",
        f"  {command('runs', *([str(tree)] if tree != Path('runs') else []))}"
        "   # every run, how each went",
        f"  {command('replay', str(folder))}   # replay it in the simulator; add --strategy "
        "NAME for what if",
        "  load the model in Python (docs/hosts.md, \"Loading the final model\"):",
        "    import json; from exogym_distributed.profiles.profile import Profile",
        "    from safetensors import safe_open; from safetensors.torch import load_file",
        f"    with safe_open({str(model)!r}, 'pt') as f: meta = f.metadata()",
        "    profile = Profile(meta['profile'], json.loads(meta['profile_values']))",
        "    model = profile.resolved.task_fn(**profile.resolved.task_kwargs)[0]",
        f"    model.load_state_dict(load_file({str(model)!r}))",
    ])


def shown_note(note: str, prefix: str = "note: ") -> str:
    """A note for the person, its control characters written as escapes: it may name what a
    run folder or a host said (a folder's name, a run's settings, an error)."""
    return prefix + printable(note, keep="\n")


def logger_override(overrides: Mapping[str, Any] | None, logger: str | None) -> dict[str, Any]:
    """``overrides`` with the profile's ``logger`` key replaced by ``--logger``'s value.

    A logger given this way travels like any ``--set``: to the local simulation,
    and to every host, where rank 0 writes the logs into the profile's output folder.

    Args:
        overrides: the parsed ``--set`` values.
        logger: ``'csv'``, ``'wandb'``, ``'tensorboard'``, ``'none'``; None leaves the
            profile's own (``--set logger=...`` or ``logger = ...`` in ``config.ini``).

    Raises:
        ValueError: for any other name.
    """
    merged = dict(overrides or {})
    if logger is None:
        return merged
    name = logger.strip().lower()
    if name not in (*LOGGER_NAMES, "none"):
        raise ValueError(f"--logger {logger!r} is not a logger: give one of "
                         f"{', '.join(LOGGER_NAMES)} or none")
    merged["logger"] = None if name == "none" else name
    return merged


def balance_override(overrides: Mapping[str, Any] | None, balance: str | None) -> dict[str, Any]:
    """``overrides`` with the profile's ``balance`` key replaced by ``--balance``'s value
    (:mod:`exogym.run.balance`); it travels like any ``--set``, to every host.

    Args:
        overrides: the parsed ``--set`` values.
        balance: ``'none'``, ``'batch'`` or ``'steps'``; None leaves the profile's own.

    Raises:
        ValueError: for any other value.
    """
    merged = dict(overrides or {})
    if balance is None:
        return merged
    mode = balance.strip().lower()
    if mode not in BALANCE_MODES:
        raise ValueError(f"--balance {balance!r} is not a mode: give none, batch (per-step "
                         "strategies: batch sizes follow each rank's speed) or steps "
                         "(round-based strategies: inner steps per round follow it)")
    merged["balance"] = mode
    return merged


def elastic_override(overrides: Mapping[str, Any] | None, min_nodes: int | None,
                     lost_after: float | None = None,
                     stall_after: float | None = None) -> dict[str, Any]:
    """``overrides`` with the profile's ``min_nodes``/``lost_after``/``stall_after`` keys
    replaced by ``--min-nodes``/``--lost-after``/``--stall-after`` (None leaves the
    profile's own).

    With ``min_nodes`` a run across hosts goes on while at least that many hosts
    remain: lost hosts are dropped and rejoin when they answer again
    (:mod:`distributed.launch.elastic_attempt`).
    """
    merged = dict(overrides or {})
    if min_nodes is not None:
        merged["min_nodes"] = min_nodes
    if lost_after is not None:
        merged["lost_after"] = lost_after
    if stall_after is not None:
        merged["stall_after"] = stall_after
    return merged


def launch_settings(profile: Profile) -> dict[str, Any]:
    """The launcher's settings a profile carries (``min_nodes``, ``lost_after``,
    ``stall_after``)."""
    return {k: profile.values[k] for k in sorted(LAUNCH_KEYS) if profile.values.get(k) is not None}


def refuse_hosts_only_options(request: TrainRequest, given: Sequence[str],
                              profile: Profile) -> None:
    """Refuse, before anything starts, options that only a run across hosts reads when the
    request simulates here (no ``--hosts``, or ``--local``): they would be ignored.

    Args:
        request: the request.
        given: the command-line options given (``--min-nodes``, ...), as typed.
        profile: the request's resolved profile (``--balance`` is read by a simulation
            whose ranks are given speeds, ``rank_speeds``).

    Raises:
        ValueError: naming the options and what to do.
    """
    if request.multi_host:
        return
    ignored = [o for o in given if o != "--balance"]
    if "--balance" in given and not profile.resolved.run_kwargs.get("rank_speeds"):
        ignored.append("--balance")
    if not ignored:
        return
    why = "--local simulates here" if request.hosts is not None else "without --hosts it simulates here"
    balance = (" (--balance also works in a simulation whose ranks are given speeds: "
               "--set rank_speeds=[1,0.5,...])" if "--balance" in ignored else "")
    verb = "apply" if len(ignored) > 1 else "applies"
    raise ValueError(f"{', '.join(ignored)} only {verb} to a run across hosts, and {why}: "
                     f"give --hosts HOSTS.json, or leave {'them' if len(ignored) > 1 else 'it'} "
                     f"out{balance}")


@dataclass(frozen=True)
class ResolvedRequest:
    """A request resolved once, as everything downstream of the faces reads it.

    Args:
        request: the request as the face asked for it.
        profile: its profile, inheritance and ``--set`` values applied, validated.
        hosts: its hosts, loaded and validated; None for a local simulation.
        faults: the faults it injects, checked against the hosts and the profile; None
            when it injects none.
        num_nodes: the ranks that train: the hosts file's ranks on hosts, else the
            profile's ``num_nodes``.
        strategy: the strategy's known name (``'allreduce'`` becomes ``'ddp'``).
    """

    request: TrainRequest
    profile: Profile
    hosts: HostsConfig | None
    faults: FaultPlan | None
    num_nodes: int
    strategy: str


def resolve(request: TrainRequest) -> ResolvedRequest:
    """``request`` resolved, once: the first call checks the hosts file, then the profile
    (with its ``--set`` values), then the faults, and every later call on the same
    request returns the same object.

    Raises:
        ProfileError, HostsFileError, FaultSpecError: bad input, naming every problem.
    """
    done = request.__dict__.get("_resolved")
    if done is not None:
        return done
    from exogym.strategy import registry

    hosts = None
    if request.multi_host:
        # The hosts file first: reading it needs nothing but the standard library, while a
        # profile's task imports torch (seconds), and a typo there should cost none of them.
        hosts = request.hosts if isinstance(request.hosts, HostsConfig) \
            else load_hosts(request.hosts)
    overrides = dict(request.overrides)
    if request.multi_host:
        # The ranks read the --set values from their command line: the profile is resolved
        # from the values as they travel there, so the launcher and the ranks agree on it.
        overrides = parse_overrides(override_items(overrides))
    profile = load_profile(request.profile, request.config, overrides or None)
    faults = _plan_faults(request, profile, hosts) if request.injects and hosts else None
    resolved = ResolvedRequest(
        request=request, profile=profile, hosts=hosts, faults=faults,
        num_nodes=hosts.world_size if hosts is not None and request.multi_host
        else profile.num_nodes,
        strategy=registry.canonical(profile.strategy))
    object.__setattr__(request, "_resolved", resolved)  # a cache, not a field of the request
    return resolved


def check_request(request: TrainRequest, given: Sequence[str], *, strategy: str | None = None,
                  link_mbit: float | None = None) -> ResolvedRequest:
    """Every check of a ``distributed-train`` request, before anything starts: the request
    resolved (a bad hosts file fails first, then a bad profile or ``--set``, then bad
    faults), options only a run across hosts reads refused in a simulation, and
    ``--strategy`` (only ``auto``, which needs a network: hosts or ``--link-mbit``).

    Args:
        request: the request.
        given: the hosts-only options given, as typed (``--min-nodes``, ...).
        strategy: the ``--strategy`` value, if given.
        link_mbit: the ``--link-mbit`` value, if given.

    Raises:
        ProfileError, HostsFileError, FaultSpecError, ValueError: naming what to change.
    """
    if strategy is not None and strategy.strip().lower() != "auto":
        raise ValueError(f"--strategy {strategy!r}: only auto is understood here; to run "
                         f"another strategy use --set strategy={strategy}")
    resolved = resolve(request)
    refuse_hosts_only_options(request, given, resolved.profile)
    fault_plan(request)  # faults without hosts are refused, naming why
    if strategy is not None and not request.multi_host and link_mbit is None:
        raise ValueError("--strategy auto without --hosts has no network to measure: "
                         "give --link-mbit N to pick for a modelled link of N Mbit/s "
                         "(the simulation itself sends nothing over one)")
    return resolved


def resolve_profile(request: TrainRequest) -> Profile:
    """The request's profile, inheritance and overrides applied, validated (:func:`resolve`)."""
    return resolve(request).profile


def hosts_config(request: TrainRequest) -> HostsConfig:
    """The request's hosts, loaded and validated (``HostsFileError`` lists every problem)."""
    hosts = resolve(request).hosts
    assert hosts is not None, "a request without hosts has no hosts config"
    return hosts


def config_for_hosts(config: str | None) -> str | None:
    """The ``--config`` path as ranks see it: relative to their project directory.

    A file inside this checkout is named relative to its root (each host has
    its own checkout); a file elsewhere keeps its absolute path.
    """
    if config is None:
        return None
    path = Path(config).expanduser().resolve()
    try:
        return str(path.relative_to(PROJECT_ROOT))
    except ValueError:
        return str(path)


def fault_plan(request: TrainRequest) -> FaultPlan | None:
    """The faults the request injects, parsed and checked against its hosts and profile
    (:func:`distributed.launch.faults.plan_faults`); None when it injects none.

    Raises:
        FaultSpecError: a spec that cannot run, or faults without a run across hosts.
    """
    if request.injects and not request.multi_host:
        raise FaultSpecError("--inject and --inject-random make faults on real hosts: give "
                             "--hosts (without --local); a simulation loses ranks with "
                             "rank_failures= instead")
    return resolve(request).faults


def _plan_faults(request: TrainRequest, profile: Profile, config: HostsConfig) -> FaultPlan:
    max_steps = profile.values.get("max_steps")
    return plan_faults(request.inject, config,
                       max_steps=max_steps if isinstance(max_steps, int) else None,
                       min_nodes=profile.values.get("min_nodes"),
                       max_restarts=request.max_restarts, random_seed=request.inject_random,
                       every=request.inject_every, mtbf=request.inject_mtbf,
                       down=request.inject_down, failures=request.inject_failures)


def make_launcher(request: TrainRequest, config: HostsConfig, *, console: Console,
                  dashboard: Dashboard | FanOut | None = None) -> Launcher:
    """A ``Launcher`` running the request's profile on every host (ranks print no progress
    of their own: the dashboard shows their events).

    Raises:
        TypeError: for an unknown key in ``request.launcher_options``.
    """
    program = rank_program(request)
    flat: dict[str, Any] = {
        "run_dir": request.run_dir, "max_restarts": request.max_restarts, "sync": request.sync,
        "accept_new_host_keys": request.accept_new_host_keys,
        **ssh_files(request.known_hosts, request.ssh_config, request.ssh_timeout),
        **launch_settings(resolve_profile(request)),
        **request.launcher_options,
    }
    options, ssh = split_options(flat, owner="TrainRequest(launcher_options=...)")
    return Launcher(config, program, options=options, ssh=ssh, console=console,
                    on_event=dashboard.on_event if dashboard is not None else None,
                    on_output=dashboard.on_output if dashboard is not None else None,
                    faults=fault_plan(request))


def rank_program(request: TrainRequest, placement: RunPlacement | None = None) -> RankProgram:
    """What every host runs for the request: the profile's worker, with the run's folder
    as ``output_dir`` once it is chosen (``placement``), else the request's own."""
    if placement is None:
        return RankProgram.from_profile(
            request.profile, config=config_for_hosts(request.config),
            overrides=request.overrides, resume=request.resume, quiet=True,
            overwrite=request.overwrite)
    return RankProgram.from_profile(
        request.profile, config=config_for_hosts(request.config),
        overrides={**request.overrides, "output_dir": str(placement.folder)},
        resume=placement.resume, quiet=True, run_started=placement.identity.started)


def worker_command(request: TrainRequest) -> str:
    """The command that runs the request's profile as a local simulation by hand, quoted
    for a POSIX shell; from another folder than the project's it starts with ``cd`` there
    (``distributed`` is imported from the project's root), a relative ``--config`` made
    absolute."""
    config = request.config
    here = Path.cwd().resolve()
    # a checkout's package is imported from its root; an installed one from anywhere
    away = is_checkout(PROJECT_ROOT) and here != PROJECT_ROOT.resolve()
    if away and config is not None:
        config = str(Path(config).expanduser().resolve())
    command = shlex.join(["python", *worker_args(request.profile, config=config,
                                                 overrides=request.overrides,
                                                 resume=request.resume,
                                                 overwrite=request.overwrite,
                                                 fresh_if_none=request.fresh_if_none)])
    return f"cd {shlex.quote(str(PROJECT_ROOT))} && {command}" if away else command


def train_command(request: TrainRequest) -> str:
    """The CLI command that runs the request (``python cli_typer.py distributed-train ...``).

    What the wizard shows so a run can be started again by hand. It never
    trusts new host keys: a run records the keys it trusts, so running it
    again needs no such permission.

    Raises:
        ValueError: when the hosts are a loaded ``HostsConfig`` read from no file.
    """
    args = [*command_words(), "distributed-train", request.profile]
    if request.config and Path(request.config).resolve() != BUILTIN_CONFIG.resolve():
        # the built-in profiles are the default: installed, their path is site-packages'
        args += ["--config", str(request.config)]
    if request.hosts is not None:
        hosts = request.hosts.source if isinstance(request.hosts, HostsConfig) else request.hosts
        if hosts is None:
            raise ValueError("a command line needs the hosts as a file; these hosts were "
                             "read from none (write them to a hosts file first)")
        args += ["--hosts", str(hosts)]
    args += set_args(request.overrides)
    if request.local:
        args.append("--local")
    if request.resume:
        args.append("--resume")
    if request.fresh_if_none:
        args.append("--fresh-if-none")
    if request.overwrite:
        args.append("--overwrite")
    if request.max_restarts:
        args += ["--max-restarts", str(request.max_restarts)]
    if request.sync:
        args.append("--sync")
    if request.known_hosts:
        args += ["--known-hosts", request.known_hosts]
    if request.ssh_config:
        args += ["--ssh-config", request.ssh_config]
    if request.ssh_timeout is not None:
        args += ["--ssh-timeout", f"{request.ssh_timeout:g}"]
    if request.run_dir:
        args += ["--run-dir", request.run_dir]
    for spec in request.inject:
        args += ["--inject", spec]
    if request.inject_random is not None:
        args += ["--inject-random", str(request.inject_random)]
    if request.inject_every is not None:
        args += ["--every", str(request.inject_every)]
    if request.inject_mtbf is not None:
        args += ["--mtbf", str(request.inject_mtbf)]
    if request.inject_down is not None:
        args += ["--down", str(request.inject_down)]
    if request.inject_failures is not None:
        args += ["--failures", request.inject_failures]
    return shlex.join(args)


def strategy_setting(profile: Profile, key: str) -> Any:
    """The value of a strategy argument ``key`` for ``profile``: its own, else the strategy's
    default; None when the strategy takes no such argument."""
    resolved = profile.resolved
    if key in resolved.strategy_kwargs:
        return resolved.strategy_kwargs[key]
    parameter = inspect.signature(resolved.strategy_cls).parameters.get(key)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default


def run_warnings(profile: Profile, ranks: int, cores: int | None = None) -> list[str]:
    """What will not go as the settings suggest, with the numbers; nothing is refused.

    Args:
        profile: the resolved profile.
        ranks: how many ranks run (``num_nodes``, or the hosts file's world size).
        cores: the CPU cores those ranks share (a local simulation); None to skip that check.
    """
    found = []
    values = profile.values
    max_steps, H = values.get("max_steps"), strategy_setting(profile, "H")
    if isinstance(max_steps, int) and isinstance(H, int) and H > max_steps:
        name = profile.resolved.strategy_cls.__name__.removesuffix("Strategy")
        found.append(f"H={H} > max_steps={max_steps}: {name} would never communicate (ranks "
                     f"average every H steps); lower H (--set H={max_steps}) or raise max_steps")
    if cores and ranks > RANKS_PER_CORE_WARNING * cores:
        found.append(f"{plural(ranks, 'rank')} on {plural(cores, 'core')} "
                     f"({ranks / cores:.1f} per core): they take turns, so each step will be "
                     "slow; up to "
                     f"{RANKS_PER_CORE_WARNING * cores} ranks keep it reasonable")
    return found


def warn_before_start(profile: Profile, ranks: int, cores: int | None = None) -> None:
    """Each of :func:`run_warnings` as a ``ProfileWarning`` (one plain line in the CLI)."""
    for message in run_warnings(profile, ranks, cores):
        warnings.warn(message, ProfileWarning, stacklevel=2)


def dry_run_notes(request: TrainRequest, profile: Profile, config: HostsConfig,
                  launcher: Launcher) -> list[str]:
    """What a run on hosts would do differently from what the profile or the hosts file
    says: the hosts' ranks replacing ``num_nodes``, a key file that is missing here."""
    notes = []
    asked = profile.values.get("num_nodes")
    if asked is not None and asked != config.world_size:
        notes.append(f"the hosts file's {plural(config.world_size, 'rank')} "
                     f"{'replaces' if config.world_size == 1 else 'replace'} the profile's "
                     f"num_nodes={asked}")
    for rank, target in sorted(launcher.session.targets.items()):
        for key in target.key_files:
            if not os.path.isfile(key):
                notes.append(f"key file {key} for {target.label} (rank {rank}) does not exist "
                             'on this machine: fix "ssh_key_path" in the hosts file or '
                             "IdentityFile in your ssh config, or connecting will fail")
    return notes


def dry_run(request: TrainRequest, console: Console) -> Profile:
    """Show what the request would run, where, and how; start nothing, connect to nothing."""
    profile = resolve_profile(request)
    if request.multi_host:
        config = hosts_config(request)
        with make_launcher(request, config, console=console) as launcher:
            launcher.dry_run()
            notes = dry_run_notes(request, profile, config, launcher)
            if launcher.injector is not None:
                notes += [f"{line} (whether a cut is allowed is asked of its host when the "
                          "run starts)" if "cut" in line else line
                          for line in launcher.injector.plan.describe()]
        notes += run_warnings(profile, config.world_size)
        if notes:
            console.print("", markup=False)
        for note in notes:
            console.print(shown_note(note), markup=False, highlight=False, soft_wrap=True)
        return profile
    console.print(f"Dry run: profile {profile.name} as a local simulation of "
                  f"{plural(profile.num_nodes, 'node')}; nothing is started.",
                  markup=False, highlight=False, soft_wrap=True)
    console.print(f"  command: {worker_command(request)}", markup=False, highlight=False,
                  soft_wrap=True)
    notes = run_warnings(profile, profile.num_nodes, os.cpu_count())
    lacking = missing_extra(profile.task)
    for note in notes + ([lacking] if lacking else []):
        console.print(shown_note(note), markup=False, highlight=False, soft_wrap=True)
    if not lacking:
        # Every check a run makes, with its warnings (the data against the batch size, the
        # device, memory): what the run would refuse, the dry run refuses.
        from ..worker.run_profile import run_profile

        run_profile(profile, progress=False, local=True, check_only=True)
    return profile


def train(request: TrainRequest, console: Console | None = None, *,
          live: bool | None = None, web: WebDashboard | None = None) -> TrainOutcome:
    """Run the request: across its hosts, or as a local simulation; with the dashboard.

    Args:
        request: what to run.
        console: where tables, the dashboard and messages go (default: stdout).
        live: force the dashboard's live table on or off (default: on a terminal).
        web: a ``distributed.app.web.WebDashboard`` to feed beside the terminal's
            (``--web``); the run is added to it with the profile as its configuration.

    Raises:
        ProfileError, HostsFileError, ValueError, FileNotFoundError: bad input,
            found before anything started.
        PreflightError: a host failed pre-flight; nothing was started.
        RunFailedError: the run started and did not finish.
    """
    console = console or output_console()
    profile = resolve_profile(request)
    if request.resume and request.overwrite:
        raise RunFolderError("--resume continues a run and --overwrite starts a new one over "
                             "an earlier one: give one of them")
    if request.multi_host:
        return _train_hosts(request, profile, console, live, web)
    fault_plan(request)  # faults without hosts are refused, naming why
    require_extra(profile.task)  # a task whose extra is missing here stops before any rank
    placement = place_run(profile, ranks=resolve(request).num_nodes,
                          resume=request.resume, overwrite=request.overwrite,
                          fresh_if_none=request.fresh_if_none)
    profile = placement.profile(profile)
    if placement.resume:
        done = finished_run(profile, placement)
        if done is not None:
            return done
        record_resume(placement)
    console.print(shown_note(placement.note, ""), markup=False, highlight=False,
                  soft_wrap=True)
    try:
        return _train_local(profile, placement, console, live, web)
    except KeyboardInterrupt as exc:
        release_placement(placement)  # interrupted before the run wrote anything
        raise RunInterrupted(placement.folder, placement.folder) from exc
    except RunFailedError as exc:
        release_placement(placement)
        hint = resume_hint(request, RunInterrupted(placement.folder, placement.folder))
        if hint is None:
            raise
        raise RunFailedError(f"{exc}\n{hint}", exc.launch) from exc
    except BaseException:
        release_placement(placement)  # refused before it wrote anything: no folder left
        raise


def resume_hint(request: TrainRequest, interrupted: BaseException | None = None) -> str | None:
    """After Ctrl-C: the exact command that continues the run it stopped, with a line
    naming this run's newest checkpoint.

    None when no run had started (``interrupted`` is not a :class:`RunInterrupted`), or it
    has written no checkpoint (a run whose folder is here), or cannot have (no
    ``checkpoint_interval``) on another machine.
    """
    if not isinstance(interrupted, RunInterrupted):
        return None
    profile = resolve_profile(request)
    overrides = dict(request.overrides)
    if interrupted.folder != profile.resolved.output_dir:
        overrides["output_dir"] = str(interrupted.folder)
    command = train_command(dataclasses.replace(request, overrides=overrides, resume=True,
                                                overwrite=False, fresh_if_none=False))
    root = interrupted.folder / "checkpoints" / profile.name
    if interrupted.root is None:
        if not profile.values.get("checkpoint_interval"):
            return None
        return (f"this run's checkpoints, if any were written, are in {root}"
                f"{interrupted.where}; to continue it from the newest complete one:\n"
                f"  {command}")
    steps = runfolders.newest_steps(str(interrupted.root), profile.name)
    if not steps:
        return None
    step = min(steps.values())  # the ranks resume from the newest step all of them have
    return (f"this run's newest checkpoint, at step {step}, is in {root}; to continue "
            f"it:\n  {command}")


def checkpoint_root(profile: Profile) -> Path:
    """Where a run of ``profile`` keeps its checkpoints (``save_dir/run_name`` of the run)."""
    return profile.resolved.output_dir / "checkpoints" / profile.name


def finished_run(profile: Profile, placement: RunPlacement) -> TrainOutcome | None:
    """The outcome of the local run ``placement`` continues when it has nothing left to
    resume: every rank has a checkpoint at ``max_steps`` or later. None when there is
    work left (or ``max_steps`` is not set)."""
    max_steps = profile.values.get("max_steps")
    nodes = profile.num_nodes
    if not isinstance(max_steps, int):
        return None
    step = min(placement.steps.get(rank, 0) for rank in range(nodes))
    if step < max_steps:
        return None
    out = placement.folder
    summary_path = out / "summary.json"
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    where = f"Its results are in {summary_path}" if summary else \
        f"Its checkpoints are in {checkpoint_root(profile)}"
    return TrainOutcome(
        "local", profile, summary, out,
        f"{out} already finished at step {step} (max_steps={max_steps}); nothing to resume. "
        f"{where}. To train further, raise max_steps (--resume --set "
        f"max_steps={2 * max_steps}). The run: {placement.identity.describe()}.")


def _train_local(profile: Profile, placement: RunPlacement, console: Console,
                 live: bool | None, web: WebDashboard | None = None) -> TrainOutcome:
    from exogym.run.run_rank import LostRankError
    from exogym.run.trainer import RankFailedError

    from ..worker.run_profile import run_profile

    nodes = profile.num_nodes
    warn_before_start(profile, nodes, os.cpu_count())
    dashboard = Dashboard(nodes, title=f"{profile.name}: local simulation of {plural(nodes, 'node')}",
                          console=console, live=live)
    if web is not None:
        web.begin_run(profile.name, profile.values, nodes, ["local"] * nodes)
    try:
        trainer = run_profile(profile, progress=FanOut(dashboard, web), local=True,
                              placement=placement)
    except (RankFailedError, LostRankError) as exc:
        raise RunFailedError(brief_failure(exc)) from exc
    finally:
        dashboard.close()
    out = placement.folder
    return TrainOutcome("local", profile, dict(trainer.summary), out,
                        f"simulation finished; final model in {out / FINAL_MODEL}")


def brief_failure(exc: BaseException) -> str:
    """A rank's failure in one line: its first line and the traceback's last (the error)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(exc).__name__
    return f"{lines[0].rstrip(':')}: {lines[-1]} (--debug shows the rank's traceback)"


def master_folders(launcher: Launcher, config: HostsConfig) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A folder action (:mod:`distributed.hosts.onhost.runfolders`) run on the master host,
    in its ``project_path`` with its ``python_env``, over the launcher's session (a
    subprocess when the master is this machine)."""
    master = config.hosts[0]
    source = module_source(runfolders)

    def call(message: dict[str, Any]) -> dict[str, Any]:
        shell = launcher.session.shell(0)
        if shell is None:
            return {"error": f"{master.host} is not connected"}
        done = shell.run(probe_command(master.project_path, master.python_env),
                         {"code": source, **message}, timeout=60)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            why = (done.stderr.strip().splitlines() or ["no answer"])[-1]
            return {"error": f"the command on {master.host} ended with exit code "
                             f"{done.returncode}: {why}"}
        return json.loads(lines[-1])

    return call


def probe_links(launcher: Launcher, console: Console) -> dict[int, Any]:
    """Each host's link rate and latency, measured once pre-flight has passed
    (:func:`distributed.hosts.linkspeed.probe_hosts`, ``link_probe_s`` seconds per host,
    one host at a time); a probe that fails is said and recorded, never fatal."""
    from ..hosts.linkspeed import probe_hosts

    seconds = launcher.options.link_probe_s
    if not seconds or len(launcher.config.hosts) < 2:
        return {}
    links = probe_hosts(launcher.session, seconds=seconds)
    words = []
    for link in links.values():
        if link.error:
            words.append(f"{link.host}: not measured ({link.error})")
        else:
            latency = "" if link.latency_s is None else f", {link.latency_s * 1e3:.2f} ms"
            words.append(f"{link.host} {link.rate_bps / 1e6:.1f} Mbit/s{latency}")
    console.print("links (pre-flight probe, sender to peer): " + "; ".join(words),
                  markup=False, highlight=False, soft_wrap=True)
    return links


def start_hosts_trace(tracer: TraceWriter, launcher: Launcher, profile: Profile,
                      placement: RunPlacement, where_out: Path,
                      links: Mapping[int, Any] | None = None) -> None:
    """Start the trace of a run across hosts (:mod:`exogym.report.trace`) from the
    launcher's event stream, which carries every rank's events.

    With the master on this machine it is written straight into the run's folder,
    beside the ``summary.json`` rank 0 writes; otherwise into the launcher's log
    folder here, and sent to the run's folder on the master when the run ends
    (:func:`end_hosts_trace`). A resumed run continues the trace already there.
    ``links`` (per host index, :func:`probe_links`) puts each rank's host's measured link
    rate and latency into the header's ``hosts``.
    """
    config = launcher.config
    if launcher.master_local:
        path = where_out / TRACE_FILE
    else:
        path = launcher.run_dir / TRACE_FILE
        if placement.resume:
            try:
                launcher.session.fetch(0, placement.folder / TRACE_FILE, path)
            except Exception:  # noqa: BLE001 - no earlier trace to continue: start afresh
                pass
    tracer.start(path, source="hosts", num_nodes=config.world_size,
                 config=profile.values, run=placement.identity.as_dict(),
                 append=placement.resume, profile=profile.name,
                 hosts=[{"rank": rank, "host": host.host,
                         **_link_fields((links or {}).get(host.rank))}
                        for rank, host in enumerate(config.rank_hosts)])


def _link_fields(link: Any) -> dict[str, Any]:
    """A host's probed link as trace fields (nulls when it was not measured)."""
    if link is None:
        return {"link_rate_bps": None, "latency_s": None}
    return link.as_trace()


def trace_links(launcher: Launcher, links: Mapping[int, Any] | None = None
                ) -> dict[int, dict[str, Any]]:
    """What the launcher knows of each rank's link: its host, the interface pre-flight
    found routing to the master and, from ``links`` (:func:`probe_links`), the rate and
    latency its host's probe measured."""
    report = launcher.session.report
    found = {}
    for rank, host in enumerate(launcher.config.rank_hosts):
        check = report.checks[host.rank] if report is not None and \
            host.rank < len(report.checks) else None
        route = ((check.probe or {}).get("route") or {}) if check is not None else {}
        interface = route.get("interface") or (
            check.interface if check is not None and check.interface != "-" else None)
        found[rank] = {"host": host.host, "interface": interface,
                       **_link_fields((links or {}).get(host.rank))}
    return found


def end_hosts_trace(tracer: TraceWriter, launcher: Launcher, placement: RunPlacement,
                    result: Any, error: BaseException | None,
                    links: Mapping[int, Any] | None = None) -> str | None:
    """Finish the trace: the ranks whose failure stopped an attempt, how the run ended;
    with the master on another machine, send it to the run's folder there. Returns a
    note for the person when the trace stayed elsewhere than that folder."""
    if not tracer.started:
        return None
    why = None
    if result is not None:
        for attempt in result.attempts:
            failed = attempt.first_failure
            if failed is not None:  # when it failed is not known here: t is null
                tracer.fault(t=None, rank=failed.rank, host=failed.host, what="failed",
                             reason=failed.reason, restart=attempt.restart)
        if not result.ok:
            why = result.describe().splitlines()[0]
    elif error is not None:
        why = "interrupted" if isinstance(error, KeyboardInterrupt) else \
            f"{type(error).__name__}: {error}"
    path = tracer.end(failed=result is None or not result.ok, error=why,
                      links=trace_links(launcher, links))
    if path is None or launcher.master_local:
        return None
    master = launcher.config.master.host
    try:
        sent = master_folders(launcher, launcher.config)(
            {"action": "put", "folder": str(placement.folder), "name": TRACE_FILE,
             "text": path.read_text(encoding="utf-8")})
    except Exception as exc:  # noqa: BLE001 - the trace stays here, and the person is told
        sent = {"error": repr(exc)}
    if "error" in sent:
        return (f"the run's trace is in {path} on this machine: sending it to "
                f"{placement.folder} on {master} failed ({sent['error']})")
    path.unlink(missing_ok=True)  # the run's folder holds it now
    return None


def launcher_record(launcher: Launcher, meter: GoodputMeter, merge_log: MergeLog,
                    max_steps: int | None = None) -> dict[str, Any]:
    """What the launcher saw of a run across hosts, for its ``summary.json``: the goodput,
    an asynchronous run's merges (every rank's), the injected faults, and every change of
    membership as the launcher read it from the store when it was decided.

    The membership is the launcher's record, not only the writing rank's: that rank reads
    the whole log again at the end, when a value written into the store since (a
    stranger's, or one replayed from an earlier run) is ignored as unsigned, so its own
    list can lack entries (it read ``[]`` where hosts had come and gone). As the rank's,
    it leaves out a decision for a round after ``max_steps`` (the run had ended).
    """
    recorded: dict[str, Any] = {"goodput": hosts_goodput(meter, launcher)}
    merges = merge_log.merges()
    if merges is not None:  # every rank's (the writer's history has its own)
        recorded["merges"] = merges
    if launcher.injector is not None:
        recorded["faults"] = launcher.fault_records
    changes = [entry for entry in launcher.membership
               if max_steps is None or entry["step"] <= max_steps]
    if changes:
        recorded["membership"] = changes
    return recorded


def record_in_summary(launcher: Launcher, config: HostsConfig, placement: RunPlacement,
                      fields: dict[str, Any]) -> str | None:
    """Add what the launcher measured to the ``summary.json`` in the run's folder on the
    master (:func:`launcher_record`: ``"goodput"``, ``"membership"`` when hosts came and
    went, and ``"faults"`` when faults were injected: each fault's spec, when it fired and
    ended, and how it went); a note for the person when that could not be done."""
    try:
        done = master_folders(launcher, config)(
            {"action": "merge", "folder": str(placement.folder), "name": "summary.json",
             "fields": fields})
    except Exception as exc:  # noqa: BLE001 - the printed summary still has them
        done = {"error": repr(exc)}
    if "error" in done:
        what = " and ".join(f"the {'injected faults' if k == 'faults' else k}"
                            for k in fields)
        return (f"{what} could not be added to {placement.folder}/summary.json "
                f"on {config.master.host} ({done['error']}); the printed summary and the "
                "trace have them")
    return None


def gather_outputs(launcher: Launcher, config: HostsConfig, placement: RunPlacement,
                   where_out: Path) -> str | None:
    """Bring the final model and summary to the run's folder on the master when another
    host wrote them (rank 0 was away at the end of a ``min_nodes`` run, or was started
    again: a rank that ended it wrote them on its own host). Returns a note for the
    person when they are elsewhere than that folder."""
    writer = launcher.writer
    if writer is None:
        return None
    host = config.host_of(writer)
    if host.rank == config.host_of(0).rank:
        return None
    names = (FINAL_MODEL, "summary.json")
    into = where_out if launcher.master_local else launcher.run_dir
    try:
        for name in names:  # each written atomically: never half a model in the folder
            launcher.session.fetch(host.rank, placement.folder / name, into / name)
    except Exception as exc:  # noqa: BLE001 - the files are still on the writer's host
        return (f"rank {writer} wrote the final model and summary in {placement.folder} on "
                f"{host.host}; copying them here failed "
                f"({exc}): they are still there")
    if launcher.master_local:
        return None
    return (f"rank {writer} on {host.host} wrote the final model and summary: they are "
            f"in {into} on this machine, not in "
            f"{placement.folder} on {config.master.host}")


def hosts_goodput(meter: GoodputMeter, launcher: Launcher) -> dict[str, Any]:
    """``summary['goodput']`` of a run across hosts, from the events the launcher received
    (:mod:`exogym.report.goodput`): in full when hosts came and went or faults were
    injected, the plain fraction otherwise."""
    changes = launcher.membership
    measured = meter.measure(changes)
    return goodput_summary(measured, detail=len(changes) > 1 or meter.faulted)


def _train_hosts(request: TrainRequest, profile: Profile, console: Console,
                 live: bool | None, web: WebDashboard | None = None) -> TrainOutcome:
    config = hosts_config(request)
    warn_before_start(profile, config.world_size)
    rank_hosts = [h.host for h in config.rank_hosts]
    tracer = TraceWriter()  # every rank's events arrive here: the trace is written here
    meter = GoodputMeter(config.world_size)  # and goodput is measured from them here
    merge_log = MergeLog()  # and an asynchronous run's merges, whichever rank reported them
    dashboard = FanOut(Dashboard(config.world_size, rank_hosts,
                                 title=f"{profile.name}: {plural(config.world_size, 'rank')} on "
                                       f"{plural(len(config.hosts), 'host')}",
                                 console=console, live=live), web, tracer, meter, merge_log)
    if web is not None:
        web.begin_run(profile.name, profile.values, config.world_size, rank_hosts)
    with make_launcher(request, config, console=console, dashboard=dashboard) as launcher:
        if request.sync:
            launcher.session.sync()
        launcher.preflight()  # shows the table; PreflightError when the run cannot start
        launcher.check_faults()  # a cut a host does not permit is refused before anything starts
        links = probe_links(launcher, console)  # for the trace: each host's rate and latency
        here = launcher.master_local
        where = "" if here else f" on {config.master.host}"
        placement = place_run(profile, ranks=config.world_size, resume=request.resume,
                              overwrite=request.overwrite, fresh_if_none=request.fresh_if_none,
                              call=master_folders(launcher, config), where=where)
        profile = placement.profile(profile)
        console.print(shown_note(placement.note, ""), markup=False, highlight=False,
                  soft_wrap=True)
        if placement.replacing:  # every check has passed: the earlier run goes now
            placement = take_placement(placement, call=master_folders(launcher, config),
                                       where=where)
            console.print(shown_note(placement.note, ""), markup=False, highlight=False,
                  soft_wrap=True)
        launcher.program = rank_program(request, placement)
        out = placement.folder
        where_out = out if out.is_absolute() else \
            Path(config.master.project_path).expanduser() / out
        start_hosts_trace(tracer, launcher, profile, placement, where_out, links)
        started = time.monotonic()
        result = None
        error: BaseException | None = None
        fault_note = outputs_note = None
        recorded: dict[str, Any] = {}
        try:
            result = launcher.run()
            if result.ok:
                outputs_note = gather_outputs(launcher, config, placement, where_out)
                max_steps = profile.values.get("max_steps")
                recorded = launcher_record(launcher, meter, merge_log,
                                           max_steps if isinstance(max_steps, int) else None)
                fault_note = record_in_summary(launcher, config, placement, recorded)
        except BaseException as exc:
            error = exc
            raise
        finally:
            dashboard.close()
            trace_note = end_hosts_trace(tracer, launcher, placement, result, error, links)
    if trace_note:
        console.print(shown_note(trace_note), markup=False, highlight=False, soft_wrap=True)
    for rank in result.ranks:
        # A rank away at the end of a run that finished without it (min_nodes) is lost, as
        # its membership change told once: not a failure at a step of its own.
        dashboard.set_status(rank.rank, "done" if rank.ok else "lost" if result.ok else
                             "stopped" if rank.stopped else "failed")
    if not result.ok:
        failed = dashboard.summary(time.monotonic() - started)
        if launcher.membership:
            failed["membership"] = launcher.membership
        dashboard.finish(failed, title="run (failed)")
        hint = resume_hint(request, RunInterrupted(out, where_out if here else None, where))
        raise RunFailedError(result.describe() + (f"\n{hint}" if hint else ""), result)
    summary = dashboard.summary(time.monotonic() - started)
    if launcher.membership:  # hosts came and went (min_nodes)
        summary["membership"] = launcher.membership
    if launcher.injector is not None:
        summary["faults"] = launcher.fault_records
    summary["goodput"] = recorded.get("goodput")
    for note in (outputs_note, fault_note):
        if note:
            console.print(shown_note(note), markup=False, highlight=False, soft_wrap=True)
    dashboard.finish(summary)
    print_goodput(console, summary["goodput"])
    return TrainOutcome("hosts", profile, summary, out,
                        f"all {plural(config.world_size, 'rank')} finished; final model in "
                        f"{where_out / FINAL_MODEL} on {config.master.host}, logs in "
                        f"{result.run_dir}", launch=result)
