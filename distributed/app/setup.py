"""The wizard's set-up steps: hosts files, profiles to choose and write, the link, the estimates.

``wizard.py`` asks and prints; everything it learns or writes goes through
here: reading and writing a hosts file (atomically, with a ``.bak``), the
profiles a person may choose and why some cannot run, writing a profile into
``config.ini``, measuring the link to a worker, and the table of what each
strategy would send and gain on the planned hosts (the planner's projection,
from a measured training step of the profile's model).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distributed.app.compare import profile_for_strategy
from distributed.app.profile_list import ProfileEntry, list_profiles
from distributed.hosts.hostsfile import (
    HostsConfig,
    HostsFileError,
    is_loopback,
    is_other_machine,
    load_hosts,
)
from distributed.hosts.linkspeed import LinkError, LinkMeasurement, measure_link
from distributed.hosts.preflight import PreflightReport
from distributed.hosts.ssh import SSHOptions
from distributed.planning import projection
from distributed.planning.estimate import ModelFacts, measure_model
from distributed.profiles.profile import (
    DEFAULT_CONFIG,
    SUMMARY_COLUMNS,
    Profile,
    ProfileError,
    ProfileSet,
    load_profile,
    parse_overrides,
)
from distributed.profiles.setup_files import has_profile, hosts_text, with_profile, write_with_backup
from exogym.report import human_bytes

__all__ = [
    "DEFAULT_CONFIG", "HostsConfig", "HostsFileError", "LinkError", "PreflightReport", "Profile",
    "ProfileError", "StrategyEstimate", "Estimates", "estimate_strategies", "existing_profile",
    "free_profile_name", "is_loopback", "is_other_machine", "load_hosts", "load_profile",
    "list_profiles", "measure_link_to", "parse_overrides", "ProfileEntry", "profile_name_for",
    "SUMMARY_COLUMNS",
    "same_hosts", "usable_strategies", "write_hosts_file", "write_profile",
]


# --------------------------------------------------------------------------- hosts files


def same_hosts(path: Path, config: HostsConfig) -> bool:
    """Whether ``path`` is a valid hosts file listing exactly ``config``'s hosts."""
    try:
        return load_hosts(path).to_dict() == config.to_dict()
    except HostsFileError:
        return False


def write_hosts_file(path: Path, config: HostsConfig) -> Path | None:
    """Write ``config`` to ``path`` atomically; the previous file's copy, if one was kept."""
    return write_with_backup(path, hosts_text(config))


def measure_link_to(config: HostsConfig, known_hosts: str | None = None,
                    ssh_config: str | None = None) -> LinkMeasurement:
    """One second of TCP from here to the first worker of ``config``.

    Raises:
        LinkError: the worker could not be reached or the transfer failed.
    """
    if not config.workers:
        raise LinkError("the hosts file has no worker to measure the link to")
    options = SSHOptions(**{k: v for k, v in (("known_hosts_path", known_hosts),
                                               ("ssh_config_path", ssh_config)) if v})
    return measure_link(config.workers[0], options)


# --------------------------------------------------------------------------- profiles


def usable_strategies(profile: Profile, strategies: Sequence[str]) -> list[str]:
    """The strategies ``profile``'s task and settings can run with."""
    usable = []
    for name in strategies:
        try:
            profile_for_strategy(profile, name)
        except ProfileError:
            continue
        usable.append(name)
    return usable


def profile_name_for(base: Profile, strategy: str, nodes: int, on_hosts: bool) -> str:
    """A profile name that says what it runs, e.g. ``digits-diloco-2hosts``."""
    where = f"{nodes}hosts" if on_hosts else f"{nodes}nodes"
    return f"{base.task}-{projection.canonical(strategy).replace('_', '-')}-{where}"


def free_profile_name(config_path: Path, name: str, values: Mapping[str, Any]) -> str:
    """``name`` when no profile in ``config_path`` holds it (or holds exactly ``values``),
    else the first such of ``name-2``, ``name-3``, ..."""
    candidate, number = name, 2
    while True:
        current = existing_profile(config_path, candidate)
        if current is None or current == dict(values):
            return candidate
        candidate, number = f"{name}-{number}", number + 1


def write_profile(config_path: Path, name: str, values: Mapping[str, Any]) -> Path | None:
    """Add (or replace) profile ``name`` in ``config_path`` atomically, then check it reads
    back as a valid profile; the previous file's copy, if one was kept."""
    text = config_path.read_text(encoding="utf-8") if config_path.exists() else ""
    backup = write_with_backup(config_path, with_profile(text, name, dict(values)))
    load_profile(name, config_path)
    return backup


def existing_profile(config_path: Path, name: str) -> dict[str, Any] | None:
    """The keys of profile ``name`` in ``config_path`` as written, or None when there is none."""
    text = config_path.read_text(encoding="utf-8") if config_path.exists() else ""
    if not has_profile(text, name):
        return None
    return ProfileSet(config_path).values(name)


# --------------------------------------------------------------------------- estimates


@dataclass(frozen=True)
class StrategyEstimate:
    """What one strategy would send and gain on the planned hosts.

    Args:
        strategy: its name.
        description: what it sends, in words.
        available: whether the profile's task and settings can run it.
        compute_ms: one rank's training step with this strategy, measured here
            (the profile's own strategy's when this one is not available).
        wire_bytes: bytes one host puts on its link per step, in words.
        comm_ms: time per step spent communicating.
        speedup: over one machine doing the same work.
    """

    strategy: str
    description: str
    available: bool
    compute_ms: float
    wire_bytes: str
    comm_ms: float
    speedup: float


@dataclass(frozen=True)
class Estimates:
    """The measured step and each strategy's estimate.

    Args:
        facts: the profile's model, measured on this machine.
        rows: one estimate per strategy, in the order asked.
    """

    facts: ModelFacts
    rows: tuple[StrategyEstimate, ...]

    @property
    def usable(self) -> list[str]:
        """The strategies the profile can run."""
        return [row.strategy for row in self.rows if row.available]


def _same_strategy(a: str, b: str) -> bool:
    try:
        return projection.canonical(a) == projection.canonical(b)
    except ValueError:  # a strategy of the user's own: only the same name is the same
        return a == b


def estimate_strategies(profile: Profile, strategies: Sequence[str], nodes: int, mbit: float,
                        simulated: bool) -> Estimates:
    """Time one rank's training step here with each strategy, then project each to the hosts.

    Each available strategy is timed with its own step (its optimizer, selection,
    compression and the decoding of ``nodes`` ranks' payloads), so DeMo and SPARTA
    are planned with the work they really add.

    Args:
        profile: the profile whose model, batch and settings are planned.
        strategies: the strategies to estimate.
        nodes: hosts (or simulated nodes) planned.
        mbit: the link's bandwidth in Mbit/s.
        simulated: the nodes share this machine's cores (a local simulation).

    Raises:
        Whatever building the profile's task raises (a missing extra, a bad setting).
    """
    ranks_here = nodes if simulated else 1
    resolved = profile.resolved
    task = resolved.task_fn(**resolved.task_kwargs)  # built once, timed with every strategy
    facts = measure_model(profile, ranks_here=ranks_here, num_nodes=nodes, task=task)
    rows = []
    for name in strategies:
        try:
            planned = profile_for_strategy(profile, name)
        except ProfileError:
            planned = None
        if planned is None:
            compute_s = facts.compute_s_per_step
        elif _same_strategy(name, profile.strategy):
            compute_s = facts.compute_s_per_step
        else:
            with warnings.catch_warnings():
                # Built here only to be timed: what it has to say is the real run's to say.
                warnings.simplefilter("ignore")
                compute_s = measure_model(planned, ranks_here=ranks_here, num_nodes=nodes,
                                          task=task).compute_s_per_step
        values = planned.values if planned is not None else profile.values
        p = projection.predict(name, facts.num_params, nodes, compute_s,
                               projection.mbit_to_bytes_per_s(mbit), shapes=facts.shapes,
                               **projection.relevant_settings(name, values))
        rows.append(StrategyEstimate(name, projection.STRATEGIES[name], planned is not None,
                                     compute_s * 1000, human_bytes(p.wire_bytes),
                                     p.comm_s * 1000, p.speedup))
    return Estimates(facts, tuple(rows))
