"""Synthetic workloads the benches train: an MLP on random 28x28 "images" with 10 labels.

Imports torch: a bench imports this inside the function that trains, so its
``--help`` stays fast.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset


class SyntheticMLP(nn.Module):
    """An MLP 784-``w1``-``w2``-10 whose ``forward(batch)`` returns the cross-entropy loss.

    Args:
        w1, w2: the two hidden widths.
    """

    def __init__(self, w1: int, w2: int):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, w1), nn.ReLU(),
                                 nn.Linear(w1, w2), nn.ReLU(), nn.Linear(w2, 10))

    def forward(self, batch):
        x, y = batch
        return F.cross_entropy(self.net(x), y)


def synthetic_digits(samples: int, seed: int = 0) -> TensorDataset:
    """``samples`` random 28x28 inputs with random labels 0-9, the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, 28, 28, generator=g),
                         torch.randint(0, 10, (samples,), generator=g))
