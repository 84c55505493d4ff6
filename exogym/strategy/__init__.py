"""Training strategies: how ranks turn gradients into updates and what they send."""

from .communicate_optimize_strategy import CommunicateOptimizeStrategy, CommunicationModule
from .demo import DeMoStrategy
from .diloco import DiLoCoStrategy
from .federated_averaging import FedAvgStrategy
from .optim import OptimSpec
from .sparta import SPARTAStrategy
from .sparta_diloco import SPARTADiLoCoStrategy
from .strategy import SimpleReduceStrategy, Strategy

__all__ = [
    "Strategy",
    "SimpleReduceStrategy",
    "DiLoCoStrategy",
    "SPARTAStrategy",
    "FedAvgStrategy",
    "DeMoStrategy",
    "SPARTADiLoCoStrategy",
    "CommunicateOptimizeStrategy",
    "CommunicationModule",
    "OptimSpec",
]
