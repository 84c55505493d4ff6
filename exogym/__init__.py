"""exogym: simulate distributed training on one machine.

K ranks run as K processes talking through ``torch.distributed``; strategies
(AllReduce, DiLoCo, FedAvg, ...) decide how they train and communicate::

    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy

    trainer = Trainer(model, train_dataset, val_dataset)
    model = trainer.fit(strategy=DiLoCoStrategy(inner_optim="adam", H=100), num_nodes=4)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what editors and type checkers see; at run time they load on first use
    from exogym.run.train_node import TrainNode
    from exogym.run.trainer import LocalTrainer, RankFailedError, Trainer
    from exogym.sim.network import Network

__version__ = "0.1.0"

__all__ = ["Trainer", "LocalTrainer", "TrainNode", "RankFailedError", "Network", "__version__"]

_LAZY = {"Trainer": "exogym.run.trainer", "LocalTrainer": "exogym.run.trainer",
         "RankFailedError": "exogym.run.trainer", "TrainNode": "exogym.run.train_node",
         "Network": "exogym.sim.network"}


def __getattr__(name: str) -> Any:
    # Imported on first use, so light modules (exogym.report.metrics, exogym.base.io) load
    # without torch: the launcher and the CLI's --help stay fast.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'exogym' has no attribute {name!r}")
