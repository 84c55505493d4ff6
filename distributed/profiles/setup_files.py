"""Writing the files a set-up produces: a hosts file, and a profile in this checkout's own
profiles file (``config.local.ini``, beside ``config.ini``, which git ignores).

Nothing is overwritten silently: the caller decides (the wizard asks), the old
content is kept beside it as ``NAME.bak``, and every write goes through a
temporary file and a rename, so a file is never half written. A profile is
written as text into its section, leaving every other line of the config file
as it was (comments included).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exogym.base.install_mode import from_checkout, own_files_owner, wizard_command
from exogym.base.io import atomic_write_bytes, atomic_write_text

from ..hosts.hostsfile import HostsConfig
from .profile import SECTION_PREFIX, parse_value


def local_profiles_header(shared: str) -> str:
    """What a new local profiles file beside the profiles file named ``shared`` starts with."""
    git = ("Git ignores this file, so a `git pull` never meets it; " if from_checkout()
           else "")
    where = "beside it" if from_checkout() else "(the built-in one)"
    return (f"# {own_files_owner()} profiles, read after {shared} {where}: a profile here\n"
            "# replaces the one of the same name there, and may name one there as its\n"
            f"# base_profile. {git}`--sync` copies it to the hosts.\n"
            f"# {wizard_command()} adds the profiles it sets up here.\n")


def backup_path(path: str | os.PathLike[str]) -> Path:
    """Where the previous version of ``path`` is kept: ``path.bak``."""
    path = Path(path)
    return path.with_name(path.name + ".bak")


def write_with_backup(path: str | os.PathLike[str], text: str) -> Path | None:
    """Write ``text`` to ``path`` atomically, first copying an existing, different file to
    ``path.bak``.

    Returns:
        The backup's path, or None when there was nothing to back up (no file,
        or the same content).
    """
    path = Path(path).expanduser()
    backup = None
    if path.exists():
        old = path.read_bytes()
        if old == text.encode("utf-8"):
            return None
        backup = atomic_write_bytes(backup_path(path), old)
    atomic_write_text(path, text)
    return backup


def hosts_text(config: HostsConfig) -> str:
    """A hosts file's JSON text for ``config`` (``load_hosts`` reads it back unchanged)."""
    return json.dumps(config.to_dict(), indent=2) + "\n"


def format_value(value: Any) -> str:
    """A profile value as ``config.ini`` text that ``parse_value`` reads back as ``value``.

    Raises:
        ValueError: for a value that would not read back the same (a multi-line string,
            or a string that reads as another type).
    """
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "none"
    elif isinstance(value, str):
        text = value
    else:
        text = repr(value)
    if "\n" in text or parse_value(text) != value or type(parse_value(text)) is not type(value):
        raise ValueError(f"cannot write {value!r} as a config value that reads back the same")
    return text


def profile_section(name: str, values: Mapping[str, Any]) -> str:
    """The ``[distributed:NAME]`` section holding ``values``."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"profile name {name!r}: use letters, digits, '-', '_' and '.' only")
    lines = [f"[{SECTION_PREFIX}{name}]"]
    lines += [f"{key} = {format_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _section_span(text: str, name: str) -> tuple[int, int] | None:
    """Character range of section ``[distributed:NAME]`` (header to before the next one)."""
    header = re.compile(rf"^\[\s*{re.escape(SECTION_PREFIX)}\s*{re.escape(name)}\s*\]\s*$",
                        re.MULTILINE)
    found = header.search(text)
    if found is None:
        return None
    following = re.compile(r"^\[", re.MULTILINE).search(text, found.end())
    return found.start(), following.start() if following else len(text)


def has_profile(config_text: str, name: str) -> bool:
    """Whether ``config_text`` has a section for profile ``name``."""
    return _section_span(config_text, name) is not None


def with_profile(config_text: str, name: str, values: Mapping[str, Any]) -> str:
    """``config_text`` with profile ``name`` set to ``values``: its section replaced in place,
    or appended."""
    section = profile_section(name, values)
    span = _section_span(config_text, name)
    if span is not None:
        start, end = span
        rest = config_text[end:]
        return config_text[:start] + section + ("\n" + rest if rest else "")
    if config_text and not config_text.endswith("\n"):
        config_text += "\n"
    return config_text + ("\n" if config_text else "") + section
