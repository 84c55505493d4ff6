"""How this project was installed, and so what a message tells a person to type.

From a checkout (``pyproject.toml`` and ``cli_typer.py`` beside ``exogym/``) the faces
run as ``python cli_typer.py ...`` and ``python wizard.py``, extras install with
``pip install -e '.[NAME]'`` from the project's folder, and the checkout's own files
(``distributed_hosts.json.example``) are there to name. Installed from the wheel
(``exogym/`` in site-packages) there is only the ``exogym`` command, extras install
with ``pip install 'exogym[NAME]'``, and no checkout file exists. Every message that
names a command, a file or an install line asks here, so the two cannot drift.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

#: The folder holding ``exogym/``: a checkout, or an installed wheel's site-packages.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
#: The lock an installed wheel carries (setup.py copies it into the package).
INSTALLED_LOCK = ("exogym_distributed", "constraints.txt")


def from_checkout() -> bool:
    """Whether this code runs from a checkout of the project (not an installed wheel)."""
    return (PROJECT_ROOT / "pyproject.toml").is_file() and (PROJECT_ROOT / "cli_typer.py").is_file()


def _installed_command() -> bool:
    """Whether the ``exogym`` command started this process (from a checkout, an editable
    install adds it)."""
    return Path(sys.argv[0]).name in ("exogym", "exogym.exe")


def command_words() -> list[str]:
    """The words that start the command line: ``["exogym"]`` installed (or when the
    ``exogym`` command started this process), else ``["python", "cli_typer.py"]``."""
    if not from_checkout() or _installed_command():
        return ["exogym"]
    return ["python", "cli_typer.py"]


def command(*words: str) -> str:
    """A command line of the CLI as the person should type it, e.g. ``command("agent")``:
    ``python cli_typer.py agent`` from a checkout, ``exogym agent`` installed."""
    return shlex.join([*command_words(), *words])


def wizard_command(*words: str) -> str:
    """The wizard's command line: ``python wizard.py`` from a checkout, ``exogym wizard``
    installed (or when the ``exogym`` command started this process)."""
    start = ["exogym", "wizard"] if command_words() == ["exogym"] else ["python", "wizard.py"]
    return shlex.join([*start, *words])


def lock_file() -> Path | None:
    """The lock (``constraints.txt``) of this install, or None when there is none."""
    path = (PROJECT_ROOT / "constraints.txt" if from_checkout()
            else PROJECT_ROOT.joinpath(*INSTALLED_LOCK))
    return path if path.is_file() else None


def install_extra(extra: str) -> str:
    """The command that installs the optional extra ``extra`` into this environment, pinned
    by the lock: ``pip install -e '.[NAME]' -c constraints.txt`` (from the project's
    folder) in a checkout, ``pip install 'exogym[NAME]' -c /path/to/constraints.txt``
    installed. Without the lock pip may take another torch (gigabytes of CUDA)."""
    lock = lock_file()
    if from_checkout():
        line = f"pip install -e '.[{extra}]'"
        return line + (" -c constraints.txt" if lock is not None else "")
    line = f"pip install 'exogym[{extra}]'"
    return line + (f" -c {shlex.quote(str(lock))}" if lock is not None else "")


def hosts_file_help() -> str:
    """How to make a hosts file: from the checkout's example, or with the wizard."""
    if from_checkout():
        return (f"create it from distributed_hosts.json.example (in {PROJECT_ROOT}), or with "
                f"{wizard_command()}")
    return f"create it with {wizard_command()}, which asks for each host and writes it"


def own_files_owner() -> str:
    """Whose files the user's own profiles are: ``This checkout's`` or ``Your``."""
    return "This checkout's own" if from_checkout() else "Your own"
