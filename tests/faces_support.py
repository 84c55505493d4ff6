"""What the tests of the faces (CLI, wizard, dashboard) share: hosts on the test sshd, a
task whose rank fails, and a way to read a terminal's screen."""

from __future__ import annotations

import re
import sys
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from ranks import ROOT, free_port
from torch.utils.data import TensorDataset

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][AB012]|\x1b[=>]|\r")

#: Tiny settings that keep a real run short on a slow machine.
TINY = ["max_steps=20", "num_nodes=2", "val_interval=10", "val_size=64", "num_threads=1",
        "checkpoint_interval=None"]


def sshd_hosts(sshd: Any, workers: int = 2, **top: Any) -> dict[str, Any]:
    """A hosts mapping: the master is this machine, the workers log in to the test sshd."""
    return {"master": "127.0.0.1",
            "workers": [{"host": address, "ssh_port": sshd.port}
                        for address in sshd.addresses[:workers]],
            "ssh_user": sshd.user, "ssh_key_path": str(sshd.key_path),
            "python_env": sys.executable, "project_path": str(ROOT),
            "master_port": free_port(), **top}


def plain(screen: str) -> str:
    """Terminal output without colour and cursor sequences."""
    return ANSI.sub("", screen)


class FailingNet(nn.Module):
    """A classifier whose forward raises at call ``fail_at`` (a rank failing mid-run)."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError(f"boom at forward call {self.calls}")
        x, y = batch
        return F.cross_entropy(self.fc(x), y)


def failing_task(fail_at: int = 3):
    """A task (``cli_tasks``-style ``module:function``) whose ranks fail at forward ``fail_at``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    return FailingNet(fail_at), data, data
