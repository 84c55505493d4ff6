"""Which optional extra (``pyproject.toml``'s ``[project.optional-dependencies]``) a built-in
task needs, and the command that installs it, known without importing anything heavy.

The install line fits how the project was installed
(:func:`exogym.base.install_mode.install_extra`): ``pip install -e '.[NAME]'`` from a
checkout, ``pip install 'exogym[NAME]'`` installed, each pinned by the lock. Whether a
package is installed is asked with ``importlib.util.find_spec``, which imports nothing
(``profiles`` stays instant).
"""

from __future__ import annotations

import importlib.util

from exogym.base.install_mode import install_extra

__all__ = ["TASK_EXTRAS", "install_command", "missing_extra", "missing_modules",
           "needed_extra", "require_extra"]

#: For a built-in task: the extra it needs and the top-level modules that extra brings
#: which the task imports.
TASK_EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    # the digits are read from the file scikit-learn ships
    "digits": ("examples", ("sklearn",)),
    "whisper": ("whisper", ("transformers", "peft", "soundfile", "scipy")),
}


def install_command(extra: str) -> str:
    """The command that installs ``extra`` into this environment, as this install needs it."""
    return install_extra(extra)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken package, or one blocked in sys.modules
        return False


def missing_modules(task: str) -> list[str]:
    """The modules of ``task``'s extra that are not installed here (none for a task that
    needs no extra)."""
    _, modules = TASK_EXTRAS.get(task, ("", ()))
    return [module for module in modules if not _installed(module)]


def missing_extra(task: str) -> str | None:
    """Why ``task`` cannot run here for want of its extra, naming the command that
    installs it; None when it needs none or the extra is installed."""
    missing = missing_modules(task)
    if not missing:
        return None
    extra = TASK_EXTRAS[task][0]
    return (f"the {task} task needs the {extra} extra, which is not installed here (missing: "
            f"{', '.join(missing)}); install it with: "
            f"{install_command(extra)}")


def needed_extra(task: str) -> str | None:
    """The extra ``task`` lacks here and how to install it, in a few words (``the whisper
    extra: pip install -e '.[whisper]'``); None when nothing is missing."""
    if not missing_modules(task):
        return None
    extra = TASK_EXTRAS[task][0]
    return f"the {extra} extra: {install_command(extra)}"


def require_extra(task: str) -> None:
    """Raise ``ImportError`` with :func:`missing_extra`'s message when ``task``'s extra is
    not installed here."""
    why = missing_extra(task)
    if why is not None:
        raise ImportError(why)
