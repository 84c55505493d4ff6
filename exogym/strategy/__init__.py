"""Training strategies: how ranks turn gradients into updates and what they send."""

from .communicate_optimize_strategy import CommunicateOptimizeStrategy, CommunicationModule
from .diloco import DiLoCoStrategy
from .federated_averaging import FedAvgStrategy
from .optim import OptimSpec
from .strategy import SimpleReduceStrategy, Strategy

__all__ = [
    "Strategy",
    "SimpleReduceStrategy",
    "DiLoCoStrategy",
    "FedAvgStrategy",
    "CommunicateOptimizeStrategy",
    "CommunicationModule",
    "OptimSpec",
]
