"""What a launch is configured with: ``LaunchOptions`` for the job, ``SSHOptions`` for the hosts.

Callers that hold one flat set of keyword arguments (``launch(**options)``,
``NetworkTrainer(launcher_options={...})``, a request's extra options) turn
them into the two objects with :func:`split_options`, which names an unknown
key and the accepted one it is closest to.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from exogym.base.arg_errors import unknown_args_error

from ..hosts.hostsfile import min_nodes_problem
from ..hosts.linkspeed import PROBE_SECONDS
from ..hosts.ssh import SSHOptions
from ..worker.environment import LAUNCHER_VARIABLES

#: Variables always treated as secrets: sent over stdin, never shown or logged.
SECRET_ENV_NAMES = frozenset({"WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"})

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Sets the default of ``LaunchOptions.link_probe_s`` (seconds; 0: no link probe).
LINK_PROBE_VARIABLE = "EXOGYM_LINK_PROBE_S"
#: ``link_probe_s`` when neither the caller nor the environment sets it.
LINK_PROBE_DEFAULT_S = PROBE_SECONDS


def default_link_probe_s() -> float:
    """``EXOGYM_LINK_PROBE_S`` when set (ValueError naming it unless it is a number of
    seconds from 0 to 60), else :data:`LINK_PROBE_DEFAULT_S`."""
    text = os.environ.get(LINK_PROBE_VARIABLE, "").strip()
    if not text:
        return LINK_PROBE_DEFAULT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 60:
        raise ValueError(f"{LINK_PROBE_VARIABLE}={text!r}: give the seconds of the link "
                         "probe, from 0 (no probe) to 60")
    return seconds


@dataclass(frozen=True)
class LaunchOptions:
    """How a job is launched, beyond what runs (the program) and how hosts are reached (SSH).

    Args:
        run_dir: where logs go; default ``<project_root>/runs/launch-<time>``.
            Ranks get it as ``EXOGYM_RUN_DIR``, relative to their project
            directory when it lies inside ``project_root``.
        env: extra variables for every rank (values visible on the command
            line; names in ``SECRET_ENV_NAMES`` or ``secret_names`` are moved
            to the secrets).
        secrets: variables sent over stdin only; never on a command line, in
            a log, in a dry run, or in ``launch.json``.
        secret_names: more names to treat as secrets; a name with no value in
            ``env`` or ``secrets`` is taken from the launching process's environment.
        max_restarts: how many times to restart the whole job after a failure.
        grace_period: seconds between TERM and KILL when stopping a rank.
        sync: copy the project's tracked files to every remote host first.
        project_root: the local checkout (code hash and sync); default: this one.
        master_local: run rank 0 here without SSH (``None``: when the master
            is this machine, see ``distributed.hosts.session.is_this_machine``).
        probe_timeout: seconds a host's pre-flight probe may take (default 60).
        min_nodes: keep training while at least this many ranks remain
            (:mod:`exogym.membership.hosts`): a lost rank is dropped, its host probed and
            the rank started again when the host answers; it rejoins as the strategy
            allows (during a round, or at the next). A host down at pre-flight is left
            out when enough others answer, and joins the same way
            (:meth:`distributed.launch.launcher.Launcher.preflight`). ``None``
            (default): every rank is needed, a lost one stops the job.
        lost_after: with ``min_nodes``, seconds without a heartbeat after which a
            rank is declared lost (frozen, asleep, cut off); default 10.
        probe_interval: with ``min_nodes``, seconds between attempts to reach the
            host of a lost rank again; default 1.
        stall_after: stop a run whose steps make no progress for this many seconds,
            naming what its ranks wait for (:mod:`distributed.launch.progress`);
            ``None`` (default): 10 of its measured rounds, at least 5 minutes.
        link_probe_s: seconds each host sends to a peer after pre-flight, so that the
            run's trace records every host's link rate and latency (``distributed-train``
            across hosts; :func:`distributed.hosts.linkspeed.probe_hosts`); 0: no probe.
            Default 0.5, or ``EXOGYM_LINK_PROBE_S`` when it is set.

    ``project_root``, ``master_local`` and ``probe_timeout`` configure the host
    session the launcher opens; leave them unset when giving it a session.
    """

    run_dir: str | os.PathLike[str] | None = None
    env: Mapping[str, object] = field(default_factory=dict)
    secrets: Mapping[str, str] = field(default_factory=dict)
    secret_names: Sequence[str] = ()
    max_restarts: int = 0
    grace_period: float = 5.0
    sync: bool = False
    project_root: str | os.PathLike[str] | None = None
    master_local: bool | None = None
    probe_timeout: float | None = None
    min_nodes: int | None = None
    lost_after: float = 10.0
    probe_interval: float = 1.0
    stall_after: float | None = None
    link_probe_s: float = field(default_factory=default_link_probe_s)

    def __post_init__(self) -> None:
        problem = min_nodes_problem(self.min_nodes)
        if problem is not None:
            raise ValueError(problem)
        if self.min_nodes is not None and self.max_restarts:
            raise ValueError("min_nodes and max_restarts do not go together: with min_nodes a "
                             "lost rank rejoins the running job, nothing is restarted; use one")
        for name in ("lost_after", "probe_interval", "stall_after"):
            value = getattr(self, name)
            if name == "stall_after" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.max_restarts, int) or isinstance(self.max_restarts, bool) \
                or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be a whole number >= 0, got "
                             f"{self.max_restarts!r}")
        if isinstance(self.link_probe_s, bool) or not isinstance(
                self.link_probe_s, (int, float)) or not 0 <= self.link_probe_s <= 60:
            raise ValueError(f"link_probe_s must be a number of seconds from 0 (no probe) to "
                             f"60, got {self.link_probe_s!r}")
        if self.grace_period < 0:
            raise ValueError(f"grace_period must be >= 0 seconds, got {self.grace_period!r}")
        if isinstance(self.secret_names, str):
            raise TypeError(f"secret_names must be a list of names, got the string "
                            f"{self.secret_names!r}; wrap it in a list")


def split_options(options: Mapping[str, Any], owner: str = "launch()"
                  ) -> tuple[LaunchOptions, SSHOptions]:
    """Flat keyword arguments as ``LaunchOptions`` and ``SSHOptions``.

    ``{"run_dir": "runs/x", "known_hosts_path": "kh", "allow_agent": False}``
    gives ``LaunchOptions(run_dir="runs/x")`` and ``SSHOptions(known_hosts_path="kh",
    allow_agent=False)``.

    Args:
        options: keys of either object's fields.
        owner: how the error names where the options came from.

    Raises:
        TypeError: naming each unknown key, the closest accepted one, and all of them.
    """
    launch_keys = {f.name for f in dataclasses.fields(LaunchOptions)}
    ssh_keys = {f.name for f in dataclasses.fields(SSHOptions)}
    unknown = set(options) - launch_keys - ssh_keys
    if unknown:
        raise unknown_args_error(owner, unknown, launch_keys | ssh_keys)
    return (LaunchOptions(**{k: v for k, v in options.items() if k in launch_keys}),
            SSHOptions(**{k: v for k, v in options.items() if k in ssh_keys}))


def _check_env(env: Mapping[str, object], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise ValueError(f"{what}: {name!r} is not a valid variable name (letters, digits "
                             "and _, not starting with a digit)")
        if name in LAUNCHER_VARIABLES:
            raise ValueError(f"{what}: {name} is set by the launcher for each rank; remove it "
                             f"(the launcher sets {', '.join(LAUNCHER_VARIABLES)})")
        if value is None:
            raise ValueError(f"{what}: {name} has no value")
        out[name] = str(value)
    return out


def split_env(options: LaunchOptions) -> tuple[dict[str, str], dict[str, str]]:
    """The variables every rank gets on its command line, and those sent over stdin.

    Raises:
        ValueError: for a bad or reserved name, or a secret name with no value anywhere.
    """
    plain = _check_env(options.env, "env")
    hidden = _check_env(options.secrets, "secrets")
    names = set(SECRET_ENV_NAMES) | set(options.secret_names)
    for name in options.secret_names:
        _check_env({name: ""}, "secret_names")
    for name in list(plain):
        if name in names:
            hidden[name] = plain.pop(name)
    for name in options.secret_names:
        if name not in hidden:
            if name not in os.environ:
                raise ValueError(f"secret_names: {name} has no value: pass it in secrets= "
                                 "or set it in this process's environment")
            hidden[name] = os.environ[name]
    return plain, hidden
