"""exo gym's import path for the loggers (``from exogym.logger import CSVLogger``).

They live in :mod:`exogym.report.loggers`; this module only re-exports them, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exogym.report.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger", "WandbLogger"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from exogym.report import loggers

        return getattr(loggers, name)
    raise AttributeError(f"module 'exogym.logger' has no attribute {name!r}")
