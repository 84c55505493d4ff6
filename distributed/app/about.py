"""What the faces say about themselves: ``--version``.

The version is the one ``pyproject.toml`` declares (the checkout the command
runs from is the code that runs), else the installed ``exogym`` package's;
a git checkout adds its commit, since hosts are compared by the code they
hold. Imports nothing heavy: ``--version`` answers at once.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from exogym.base import install_mode
from exogym.base.install_mode import command, install_extra, wizard_command

__all__ = ["command", "command_name", "command_words", "install_extra", "package_version",
           "version_line", "wizard_command"]

#: The checkout this module belongs to.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def package_version(root: Path = PROJECT_ROOT) -> str:
    """``[project] version`` of ``root/pyproject.toml``; else the installed exogym's; else
    ``unknown``."""
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        text = ""
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if project:
        found = re.search(r'^version\s*=\s*["\']([^"\']+)["\']', project.group(1), re.M)
        if found:
            return found.group(1)
    from importlib import metadata

    try:
        return metadata.version("exogym")
    except metadata.PackageNotFoundError:
        return "unknown"


def git_commit(root: Path = PROJECT_ROOT) -> str | None:
    """The short commit ``root`` has checked out (``+`` when files differ from it); None
    outside a git checkout or without git."""
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def command_words() -> list[str]:
    """How the user starts this command line: ``["exogym"]`` installed (or when the
    ``exogym`` command started it), ``["python", "cli_typer.py"]`` from a checkout. Hints
    that print a command use it (:mod:`exogym.base.install_mode`)."""
    return install_mode.command_words()


def command_name() -> str:
    """:func:`command_words` as one string: ``exogym`` or ``python cli_typer.py``."""
    return " ".join(command_words())


def version_line(program: str) -> str:
    """One line for ``--version``: ``exogym 0.1.0 (cli_typer.py, commit abc1234, Python 3.11.7)``."""
    parts = [program]
    commit = git_commit()
    if commit:
        parts.append(f"commit {commit}")
    parts.append(f"Python {sys.version.split()[0]}")
    return f"exogym {package_version()} ({', '.join(parts)})"
