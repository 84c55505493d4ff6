"""distributed: run exogym's training for real across the machines you own.

Folders by role; arrows point down and nothing points up (a test reads every
import and enforces it)::

    app/                          what the faces (cli_typer.py, wizard.py) call
    launch/ worker/ profiles/ planning/
    hosts/ tasks/
    exogym

The names users import from here load on first use, so ``import distributed``
stays light::

    from distributed import NetworkTrainer, DistributedLauncher, WhisperModelWrapper
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["NetworkTrainer", "DistributedLauncher", "Launcher", "RankProgram",
           "WhisperModelWrapper"]

_LAZY = {
    "NetworkTrainer": (".app.network_trainer", "NetworkTrainer"),
    "DistributedLauncher": (".launch.launcher", "Launcher"),
    "Launcher": (".launch.launcher", "Launcher"),
    "RankProgram": (".launch.launcher", "RankProgram"),
    "WhisperModelWrapper": (".tasks.whisper.wrapper", "WhisperModelWrapper"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module, __name__), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
