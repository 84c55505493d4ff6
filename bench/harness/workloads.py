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


def teacher_digits(samples: int, seed: int = 0, teacher_seed: int = 1234) -> TensorDataset:
    """``samples`` random 28x28 inputs labelled by a fixed random teacher network
    (784-64-10, tanh): a task an MLP can learn, with as much fresh data as asked for.

    ``seed`` draws the inputs; every seed's labels come from the same teacher.
    """
    g = torch.Generator().manual_seed(teacher_seed)
    w1 = torch.randn(784, 64, generator=g) / 784 ** 0.5
    b1 = torch.randn(64, generator=g) * 0.1
    w2 = torch.randn(64, 10, generator=g) / 64 ** 0.5
    x = torch.randn(samples, 28, 28, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        labels = (torch.tanh(x.reshape(samples, 784) @ w1 + b1) @ w2).argmax(dim=1)
    return TensorDataset(x, labels)
