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
    from exogym.run.comparison import compare
    from exogym.run.train_node import TrainNode
    from exogym.run.trainer import LocalTrainer, RankFailedError, Trainer
    from exogym.sim.network import Network

__version__ = "0.1.0"

__all__ = ["Trainer", "LocalTrainer", "TrainNode", "RankFailedError", "Network", "compare",
           "__version__"]

#: Import paths that exo gym's users and our documentation use, kept working as the
#: modules behind them moved (``module`` or ``module:name``); a test imports each one.
COMPATIBLE_IMPORTS = (
    "exogym:Trainer", "exogym:LocalTrainer", "exogym:TrainNode",
    "exogym.trainer:Trainer", "exogym.trainer:LocalTrainer", "exogym.train_node:TrainNode",
    "exogym.logger:CSVLogger", "exogym.logger:WandbLogger",
    "exogym.strategy:Strategy", "exogym.strategy:SimpleReduceStrategy",
    "exogym.strategy:DiLoCoStrategy", "exogym.strategy:SPARTAStrategy",
    "exogym.strategy:FedAvgStrategy", "exogym.strategy:DeMoStrategy",
    "exogym.strategy:SPARTADiLoCoStrategy", "exogym.strategy:CommunicateOptimizeStrategy",
    "exogym.strategy:OptimSpec",
    "exogym.strategy.strategy:SimpleReduceStrategy", "exogym.strategy.optim:OptimSpec",
    "exogym.strategy.diloco:DiLoCoStrategy", "exogym.strategy.sparta:SPARTAStrategy",
    "exogym.strategy.sparta:SparseCommunicator", "exogym.strategy.sparta:RandomIndexSelector",
    "exogym.strategy.sparta:ShuffledSequentialIndexSelector",
    "exogym.strategy.sparta:PartitionedIndexSelector",
    "exogym.strategy.federated_averaging:FedAvgStrategy",
    "exogym.strategy.federated_averaging:AveragingCommunicator",
    "exogym.strategy.demo:DeMoStrategy",
    "exogym.strategy.communicate_optimize_strategy:CommunicateOptimizeStrategy",
    "exogym.strategy.communicate_optimize_strategy:CommunicationModule",
    "exogym.strategy.communicate:all_reduce", "exogym.strategy.communicate:broadcast",
    "exogym.strategy.communicate:all_gather",
)

_LAZY = {"Trainer": "exogym.run.trainer", "LocalTrainer": "exogym.run.trainer",
         "RankFailedError": "exogym.run.trainer", "TrainNode": "exogym.run.train_node",
         "Network": "exogym.sim.network", "compare": "exogym.run.comparison"}


def __getattr__(name: str) -> Any:
    # Imported on first use, so light modules (exogym.report.metrics, exogym.base.io) load
    # without torch: the launcher and the CLI's --help stay fast.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'exogym' has no attribute {name!r}")
