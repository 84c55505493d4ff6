"""Training strategies: how ranks turn gradients into updates and what they send.

The classes load on first use, so :mod:`exogym.strategy.settings` (every
strategy's settings, declared once) and :mod:`exogym.strategy.facts` (the byte
arithmetic the planner reads) import without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Strategy",
    "SimpleReduceStrategy",
    "DiLoCoStrategy",
    "SPARTAStrategy",
    "FedAvgStrategy",
    "DeMoStrategy",
    "SPARTADiLoCoStrategy",
    "StreamingDiLoCoStrategy",
    "CommunicateOptimizeStrategy",
    "CommunicationModule",
    "OptimSpec",
    "SparseLoCoStrategy",
    "DESLOCStrategy",
    "MuLoCoStrategy",
    "MuonAdamW",
    "AsyncDiLoCoStrategy",
    "RankContext",
]

_HOMES = {
    "Strategy": "strategy",
    "SimpleReduceStrategy": "strategy",
    "DiLoCoStrategy": "diloco",
    "SPARTAStrategy": "sparta",
    "FedAvgStrategy": "federated_averaging",
    "DeMoStrategy": "demo",
    "SPARTADiLoCoStrategy": "sparta_diloco",
    "StreamingDiLoCoStrategy": "streaming_diloco",
    "CommunicateOptimizeStrategy": "communicate_optimize_strategy",
    "CommunicationModule": "communicate_optimize_strategy",
    "OptimSpec": "optim",
    "SparseLoCoStrategy": "sparseloco",
    "DESLOCStrategy": "desloc",
    "MuLoCoStrategy": "muloco",
    "MuonAdamW": "muon",
    "AsyncDiLoCoStrategy": "async_diloco",
    "RankContext": "context",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
