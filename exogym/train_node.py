"""exo gym's import path for ``TrainNode`` (``from exogym.train_node import TrainNode``).

It lives in :mod:`exogym.run.train_node`; this module only re-exports it, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exogym.run.train_node import TrainNode

__all__ = ["TrainNode"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from exogym.run import train_node

        return getattr(train_node, name)
    raise AttributeError(f"module 'exogym.train_node' has no attribute {name!r}")
