"""exogym: simulate distributed training on one machine.

K ranks run as K processes talking through ``torch.distributed``; strategies
(AllReduce, DiLoCo, FedAvg, ...) decide how they train and communicate::

    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy

    trainer = Trainer(model, train_dataset, val_dataset)
    model = trainer.fit(strategy=DiLoCoStrategy(inner_optim="adam", H=100), num_nodes=4)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["Trainer", "LocalTrainer", "TrainNode", "RankFailedError", "Network", "__version__"]

_LAZY = {"Trainer": "exogym.trainer", "LocalTrainer": "exogym.trainer",
         "RankFailedError": "exogym.trainer", "TrainNode": "exogym.train_node",
         "Network": "exogym.network"}


def __getattr__(name: str) -> Any:
    # Imported on first use, so light modules (exogym.metrics, exogym.io) load
    # without torch: the launcher and the CLI's --help stay fast.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'exogym' has no attribute {name!r}")
