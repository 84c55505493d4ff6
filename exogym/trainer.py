"""exo gym's import path for the trainers (``from exogym.trainer import LocalTrainer``).

They live in :mod:`exogym.run.trainer`; this module only re-exports them, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exogym.run.trainer import LocalTrainer, RankFailedError, Trainer

__all__ = ["LocalTrainer", "RankFailedError", "Trainer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from exogym.run import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'exogym.trainer' has no attribute {name!r}")
