"""Small models and datasets shared by the tests."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset


class TinyNet(nn.Module):
    """A two-layer classifier whose forward(batch) returns the loss."""

    def __init__(self, d_in: int = 8, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, batch):
        x, y = batch
        return F.cross_entropy(self.fc2(torch.tanh(self.fc1(x))), y)


class BNNet(nn.Module):
    """A classifier with BatchNorm, so it has float and integer buffers."""

    def __init__(self, d_in: int = 8, classes: int = 3):
        super().__init__()
        self.fc = nn.Linear(d_in, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, classes)

    def forward(self, batch):
        x, y = batch
        return F.cross_entropy(self.out(torch.relu(self.bn(self.fc(x)))), y)


class TinyCNN(nn.Module):
    """A small convolutional classifier of 6x6 one-channel images (4-D conv weights)."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, kernel_size=3)
        self.fc1 = nn.Linear(4 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, classes)

    def forward(self, batch):
        x, y = batch
        h = torch.tanh(self.conv(x)).flatten(1)
        return F.cross_entropy(self.fc2(torch.tanh(self.fc1(h))), y)


class CrashAt:
    """Mixin for a test model: its training forward pass raises at step ``crash_at``
    (counted per model copy), so a run stops as a crash would, after its checkpoints."""

    crash_at: int | None = None
    steps = 0

    def forward(self, batch):
        if torch.is_grad_enabled():
            self.steps += 1
            if self.steps == self.crash_at:
                raise RuntimeError("simulated crash")
        return super().forward(batch)


def toy_images(n: int = 256, classes: int = 3, seed: int = 0) -> TensorDataset:
    """Learnable 1x6x6 images: labels from a fixed random linear map of the pixels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 6, 6, generator=g)
    w = torch.randn(36, classes, generator=g)
    y = (x.flatten(1) @ w).argmax(dim=1)
    return TensorDataset(x, y)


def toy_dataset(n: int = 256, d_in: int = 8, classes: int = 3, seed: int = 0) -> TensorDataset:
    """A learnable classification set: labels from a fixed random linear map."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, classes, generator=g)
    y = (x @ w).argmax(dim=1)
    return TensorDataset(x, y)


def tiny_model(seed: int = 0, cls=TinyNet) -> nn.Module:
    torch.manual_seed(seed)
    return cls()


def trainable_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def assert_models_close(a: nn.Module, b: nn.Module, atol: float = 1e-5) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.allclose(sa[k].float(), sb[k].float(), atol=atol), (
            k, (sa[k].float() - sb[k].float()).abs().max().item())


def assert_models_differ(a: nn.Module, b: nn.Module, atol: float = 1e-4) -> None:
    diffs = [(pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters())]
    assert max(diffs) > atol, diffs
