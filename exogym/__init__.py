"""exogym: simulate distributed training on one machine.

K ranks run as K processes talking through ``torch.distributed``; strategies
(AllReduce, DiLoCo, FedAvg, ...) decide how they train and communicate::

    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy

    trainer = Trainer(model, train_dataset, val_dataset)
    model = trainer.fit(strategy=DiLoCoStrategy(inner_optim="adam", H=100), num_nodes=4)
"""

from exogym.train_node import TrainNode
from exogym.trainer import LocalTrainer, RankFailedError, Trainer

__version__ = "0.1.0"

__all__ = ["Trainer", "LocalTrainer", "TrainNode", "RankFailedError", "__version__"]
