"""The wizard's set-up steps: hosts files, profiles to choose and write, the link.

``wizard.py`` asks and prints; everything it learns or writes goes through
here: reading and writing a hosts file (atomically, with a ``.bak``), the
profiles a person may choose and why some cannot run, writing a profile into
this checkout's own profiles file beside ``config.ini`` (``config.local.ini``,
which git ignores), and measuring the link to a worker. What each strategy
would send and gain comes from :mod:`distributed.app.recommend`, as for
``cli_typer.py recommend``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..hosts.hostsfile import (
    HostsConfig,
    HostsFileError,
    is_loopback,
    is_other_machine,
    load_hosts,
)
from ..hosts.linkspeed import LinkError, LinkMeasurement, measure_link
from ..hosts.preflight import PreflightReport
from ..hosts.ssh import SSHOptions
from ..hosts.sync import PROJECT_ROOT, WORK_ROOT, local_profiles_path
from ..planning import projection
from ..profiles.profile import (
    DEFAULT_CONFIG,
    SUMMARY_COLUMNS,
    Profile,
    ProfileError,
    ProfileSet,
    load_profile,
    parse_overrides,
)
from ..profiles.setup_files import (
    hosts_text,
    local_profiles_header,
    with_profile,
    write_with_backup,
)
from .compare import profile_for_strategy
from .profile_list import ProfileEntry, list_profiles
from .setup_hosts import fill_paths

__all__ = [
    "DEFAULT_CONFIG", "WORK_ROOT", "HostsConfig", "HostsFileError", "LinkError", "PreflightReport", "Profile",
    "ProfileError", "existing_profile", "free_profile_name", "is_loopback", "is_other_machine",
    "load_hosts", "load_profile", "list_profiles", "local_profiles_file", "measure_link_to",
    "parse_overrides", "ProfileEntry", "profile_file", "profile_name_for", "SUMMARY_COLUMNS",
    "same_hosts", "same_strategy", "usable_strategies", "with_paths", "write_hosts_file",
    "write_profile",
]


# --------------------------------------------------------------------------- hosts files


def same_hosts(path: Path, config: HostsConfig) -> bool:
    """Whether ``path`` is a valid hosts file listing exactly ``config``'s hosts."""
    try:
        return load_hosts(path).to_dict() == config.to_dict()
    except HostsFileError:
        return False


def with_paths(mapping: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """``mapping`` (a hosts file's content) with each host's missing ``python_env`` and
    ``project_path`` filled in, and what was filled (``{host: {key: value}}``).

    The master is this machine, where the wizard runs: it keeps this Python and this
    project. Any other host gets what ``setup-hosts`` installs there (``~/exogym`` and the
    environment inside it), as :func:`distributed.app.setup_hosts.fill_paths` gives.
    """
    import sys

    data = dict(mapping)
    master = data.get("master")
    filled: dict[str, dict[str, str]] = {}
    if isinstance(master, str) or (isinstance(master, dict) and isinstance(master.get("host"), str)):
        obj = {"host": master} if isinstance(master, str) else dict(master)
        added = {key: value for key, value in (("python_env", sys.executable),
                                               ("project_path", str(PROJECT_ROOT)))
                 if obj.get(key, data.get(key)) is None}
        if added:
            data["master"] = {**obj, **added}
            filled[obj["host"]] = added
    out, others = fill_paths(data)
    return out, {**filled, **others}


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


def local_profiles_file(config_path: Path) -> Path:
    """Where the wizard writes profiles: this checkout's own profiles file beside
    ``config_path`` (``config.local.ini``), git-ignored, read after it everywhere."""
    return local_profiles_path(config_path)


def free_profile_name(config_path: Path, name: str, values: Mapping[str, Any]) -> str:
    """``name`` when no profile of ``config_path`` (or its local profiles file) holds it, or
    one holds exactly ``values``; else the first such of ``name-2``, ``name-3``, ..."""
    candidate, number = name, 2
    while True:
        current = existing_profile(config_path, candidate)
        if current is None or current == dict(values):
            return candidate
        candidate, number = f"{name}-{number}", number + 1


def write_profile(config_path: Path, name: str, values: Mapping[str, Any]
                  ) -> tuple[Path, Path | None]:
    """Add (or replace) profile ``name`` in the local profiles file beside ``config_path``
    (``config.local.ini``; ``config_path`` itself is left as it is) atomically, then check it
    reads back as a valid profile.

    Returns:
        The file written, and the previous file's copy if one was kept.
    """
    path = local_profiles_file(config_path)
    text = path.read_text(encoding="utf-8") if path.exists() \
        else local_profiles_header(Path(config_path).name)
    backup = write_with_backup(path, with_profile(text, name, dict(values)))
    load_profile(name, config_path)
    return path, backup


def existing_profile(config_path: Path, name: str) -> dict[str, Any] | None:
    """The keys of profile ``name`` as ``config_path`` and its local profiles file give it
    (``base_profile`` resolved), or None when neither has it."""
    profiles = ProfileSet(config_path)
    if name not in profiles.raw:
        return None
    return profiles.values(name)


def profile_file(config_path: Path, name: str) -> Path | None:
    """The file profile ``name`` is read from: ``config_path``, its local profiles file,
    or None when neither has it."""
    profiles = ProfileSet(config_path)
    return profiles.source(name) if name in profiles.raw else None


def same_strategy(a: str, b: str) -> bool:
    """Whether strategy names ``a`` and ``b`` name the same strategy (``allreduce`` is ``ddp``)."""
    try:
        return projection.canonical(a) == projection.canonical(b)
    except ValueError:  # a strategy of the user's own: only the same name is the same
        return a == b
