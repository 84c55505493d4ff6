"""Scikit-learn's handwritten digits: a small, real, offline task for examples and benchmarks.

1,797 grey 8x8 images of the digits 0-9 ship inside scikit-learn, so nothing
is downloaded. This module turns them into torch datasets of ``(x, y)``
batches, gives two small models whose ``forward(batch)`` returns the loss
(the model contract of the trainer), and scores a model's accuracy. It needs
only torch and scikit-learn, never the trainer, so anything that runs a
training (an example, a benchmark, a task on real hosts) can reuse it.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from exogym.base.install_mode import install_extra

__all__ = ["load_digits_tensors", "digits_datasets", "DigitsMLP", "DigitsCNN", "evaluate"]

NUM_CLASSES = 10


def _bundled_digits_file() -> Path | None:
    """scikit-learn's own copy of the digits (``digits.csv.gz``), found without importing it."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 images as ``x`` (float32, shape ``(N, 64)``, values in [0, 1]) and labels ``y``.

    Read straight from the file scikit-learn ships (importing scikit-learn
    takes longer than the whole read: it matters to a host that rejoins a
    run); through ``sklearn.datasets.load_digits`` where that file is not found.
    """
    path = _bundled_digits_file()
    if path is not None:
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.float64)
        pixels, labels = table[:, :-1], table[:, -1]
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"the digits data comes with scikit-learn: {install_extra('examples')} "
                "(or pip install scikit-learn)") from None
        data = load_digits()
        pixels, labels = data.data, data.target
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    return x, y


def digits_datasets(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """A seeded split of the digits into training and validation datasets.

    Args:
        val_fraction: share of the images held out for validation.
        seed: seed of the split (the same seed always gives the same split).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction!r}")
    x, y = load_digits_tensors()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(round(len(x) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


class DigitsMLP(nn.Module):
    """A two-layer perceptron for 8x8 digits; ``forward((x, y))`` returns the cross-entropy.

    Args:
        hidden: width of the hidden layer (64 gives 4,810 parameters).
    """

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, NUM_CLASSES)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.reshape(len(x), 64))))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.logits(x), y)

    def metric_sums(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, tuple[int, int]]:
        """Correct predictions and samples: the trainer logs ``val_accuracy``."""
        return _accuracy_sums(self, batch)


class DigitsCNN(nn.Module):
    """A small convolutional network for 8x8 digits; ``forward((x, y))`` returns the cross-entropy.

    Args:
        channels: channels of the first convolution (the second has twice as many).
    """

    def __init__(self, channels: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc = nn.Linear(2 * channels * 4 * 4, NUM_CLASSES)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x.reshape(len(x), 1, 8, 8)))
        h = F.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.fc(h.flatten(1))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.logits(x), y)

    def metric_sums(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, tuple[int, int]]:
        """Correct predictions and samples: the trainer logs ``val_accuracy``."""
        return _accuracy_sums(self, batch)


def _accuracy_sums(model: nn.Module, batch) -> dict[str, tuple[int, int]]:
    x, y = batch
    return {"accuracy": (int((model.logits(x).argmax(dim=1) == y).sum()), len(y))}


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, batch_size: int = 512) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` (one with ``logits(x)``) on ``dataset``."""
    was_training = model.training
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    try:
        for x, y in torch.utils.data.DataLoader(dataset, batch_size=batch_size):
            logits = model.logits(x)
            total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
            count += len(y)
    finally:
        model.train(was_training)
    return total_loss / max(count, 1), correct / max(count, 1)
