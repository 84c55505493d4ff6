"""distributed: run exogym's training for real across the machines you own.

Installed by pip it is ``exogym_distributed`` (dask owns the name ``distributed``);
from a checkout it is ``distributed``. It imports itself only relatively, so both work.

Folders by role; arrows point down and nothing points up (a test reads every
import and enforces it)::

    faces/                        the command line (exogym, cli_typer.py) and the wizard
    app/                          what the faces call
    launch/ worker/ profiles/ planning/
    hosts/ tasks/
    exogym

The names users import from here load on first use, so ``import distributed``
stays light::

    from exogym_distributed import NetworkTrainer, DistributedLauncher, WhisperModelWrapper
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
