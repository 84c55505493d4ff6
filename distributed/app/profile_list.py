"""The profiles of a config file as the faces list them: a row each, and why one cannot run.

``python cli_typer.py profiles`` lists them without importing torch (a quick
check: the inheritance, the task and strategy names, the run keys' values), so
it answers at once; the wizard asks for the full check (every key against the
task and the strategy, which imports them). A profile that cannot be read or
run is listed with its error; the others are listed as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..profiles.profile import SUMMARY_COLUMNS, Profile, ProfileError, ProfileSet
from ..tasks.extras import needed_extra

__all__ = ["SUMMARY_COLUMNS", "ProfileEntry", "list_profiles", "profile_names"]


@dataclass(frozen=True)
class ProfileEntry:
    """One profile of a config file, as the faces list it.

    Args:
        name: the profile's name.
        row: its table row (``Profile.summary``, keyed by ``SUMMARY_COLUMNS``).
        why_not: the last problem that stops it from running here, or None when it can run.
        needs: the optional extra its task needs and this machine lacks, with the command
            that installs it (``the whisper extra: pip install -e '.[whisper]'``); None
            when nothing is missing. Hosts that have the extra may still run it.
    """

    name: str
    row: dict[str, str]
    why_not: str | None
    needs: str | None = None


def profile_names(config_path: str | Path | None = None) -> list[str]:
    """The profile names of ``config_path`` (default: the project's config.ini), in file
    order; none when the file cannot be read (what shell completion offers)."""
    try:
        return ProfileSet(config_path).names()
    except (ProfileError, OSError):
        return []


def profile_files(config_path: str | Path | None = None) -> list[Path]:
    """The files profiles are read from: ``config_path`` (default: the project's
    config.ini), then the local profiles file beside it when there is one."""
    return list(ProfileSet(config_path).read)


def list_profiles(config_path: str | Path | None = None, *,
                  full_check: bool = True) -> tuple[Path, list[ProfileEntry]]:
    """Every profile of ``config_path`` (default: the project's config.ini) and of the local
    profiles file beside it (``config.local.ini``), in file order, with its row and why it
    cannot run here; the config file's path first.

    Args:
        config_path: the profiles file.
        full_check: check every key against the task and the strategy (imports them, and
            torch); otherwise only what :meth:`Profile.quick_problems` checks.

    Raises:
        ProfileError: the file is missing or is not a valid INI file.
    """
    profiles = ProfileSet(config_path)
    entries = []
    for name in profiles.names():
        source = str(profiles.source(name))
        try:
            profile = Profile(name, profiles.values(name), source)
        except ProfileError as exc:  # a base_profile that is missing or makes a cycle
            own = Profile(name, dict(profiles.raw[name]), source)
            entries.append(ProfileEntry(name, own.summary(), str(exc).split(";")[0]))
            continue
        problems = profile.problems() if full_check else profile.quick_problems()
        why = problems[-1].splitlines()[-1].strip() if problems else None
        entries.append(ProfileEntry(name, profile.summary(), why,
                                    needed_extra(str(profile.values.get("task")))))
    return profiles.path, entries
