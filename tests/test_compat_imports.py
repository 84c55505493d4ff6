"""exo gym's import paths, and the ones our documentation uses, keep working (listed in exogym)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from ranks import ROOT

import exogym


@pytest.mark.parametrize("path", exogym.COMPATIBLE_IMPORTS)
def test_a_compatible_import_path_still_imports(path):
    module, _, name = path.partition(":")
    loaded = importlib.import_module(module)
    if name:
        value = getattr(loaded, name)
        assert value.__name__ == name, (path, value)


def test_the_list_covers_the_paths_the_design_promises():
    promised = {"exogym:Trainer", "exogym:LocalTrainer", "exogym:TrainNode",
                "exogym.strategy.optim:OptimSpec", "exogym.logger:CSVLogger",
                "exogym.logger:WandbLogger", "exogym.strategy.communicate:all_reduce",
                "exogym.strategy.demo:DeMoStrategy"}
    assert promised <= set(exogym.COMPATIBLE_IMPORTS)


@pytest.mark.slow
def test_from_imports_of_the_re_exports_work_in_a_fresh_interpreter():
    code = ("from exogym.trainer import LocalTrainer, Trainer\n"
            "from exogym.logger import CSVLogger, WandbLogger\n"
            "from exogym.train_node import TrainNode\n"
            "from exogym.strategy.communicate import all_reduce, broadcast, all_gather\n"
            "import exogym.run.trainer as real\n"
            "assert Trainer is real.Trainer and LocalTrainer is real.LocalTrainer\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
