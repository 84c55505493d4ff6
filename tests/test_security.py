"""Nobody else gets in: every attack a stranger can make is refused.

A stranger here can write files a person later opens (a checkpoint, a run folder
with its trace, a hosts file), or reach this machine over the network. Each test
makes one such attack, as the stranger would, and checks that it is refused: no
code of theirs runs, nothing of the person's is lost, nothing hangs.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ranks import ROOT
from toys import tiny_model, toy_dataset

from exogym import Trainer
from exogym.run.checkpoint import MAGIC, CheckpointError, checkpoint_path, load_checkpoint
from exogym.strategy import FedAvgStrategy

QUIET = dict(logger=None, progress=False)


def cli(*args, cwd: Path, env: dict | None = None, timeout: float = 120
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "cli_typer.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, "COLUMNS": "400", **(env or {})})


class _Planted:
    """Unpickling this creates the file ``marker``: what a stranger's payload would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _crafted_checkpoint(path: Path, payload: object) -> None:
    """A checkpoint with a valid header and checksum around ``payload`` (torch.save'd)."""
    import io

    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(MAGIC + hashlib.sha256(body).digest() + body)


# -- A: no file runs code --------------------------------------------------------------


def test_a_crafted_checkpoint_is_refused_without_running_its_code(tmp_path):
    marker = tmp_path / "ran"
    path = checkpoint_path(tmp_path / "run", 0, 4)
    _crafted_checkpoint(path, {"state": _Planted(marker)})
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        load_checkpoint(path)
    assert not marker.exists()


def test_resuming_from_a_crafted_checkpoint_runs_no_code_and_starts_afresh(tmp_path, capfd):
    marker = tmp_path / "ran"
    _crafted_checkpoint(checkpoint_path(tmp_path / "run", 0, 4), {"step": _Planted(marker)})
    ds = toy_dataset(32)
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=FedAvgStrategy(), num_nodes=1, max_steps=2, batch_size=8,
                save_dir=str(tmp_path), run_name="run", resume_from="auto", **QUIET)
    assert not marker.exists()
    assert [r["step"] for r in trainer.history] == [1, 2]  # nothing was resumed
    assert "skipping checkpoint" in capfd.readouterr().out


def test_a_checkpoint_round_trips_the_training_state_as_tensors_and_json(tmp_path):
    import random

    import numpy as np

    from exogym.run.checkpoint import save_checkpoint

    model = torch.nn.BatchNorm1d(3)
    state = {"model": model.state_dict(), "rng": {"numpy": np.random.get_state(),
                                                  "python": random.getstate()},
             "optim": {"state": {0: {"step": torch.tensor(3.0)}},
                       "param_groups": [{"betas": (0.9, 0.99), "lr": float("inf")}]},
             "dtype": torch.bfloat16}
    back = load_checkpoint(save_checkpoint(state, tmp_path, 0, 1))
    assert back["model"]._metadata == model.state_dict()._metadata  # the module versions
    assert back["rng"]["python"] == state["rng"]["python"]
    assert (back["rng"]["numpy"][1] == state["rng"]["numpy"][1]).all()
    assert back["optim"]["state"][0]["step"].item() == 3.0
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert back["dtype"] is torch.bfloat16


def test_a_state_holding_an_object_is_refused_when_saved_naming_its_place(tmp_path):
    from exogym.base.plain_state import PlainStateError
    from exogym.run.checkpoint import save_checkpoint

    with pytest.raises(PlainStateError, match=r"state\['strategy'\]\['helper'\] is a .*Path"):
        save_checkpoint({"strategy": {"helper": Path("x")}}, tmp_path, 0, 1)


def test_a_hand_over_description_that_is_a_pickle_is_refused_without_running_it(tmp_path):
    import io

    from exogym.base.plain_state import PlainStateError
    from exogym.membership.handover import describe, flatten_tensors, read_description

    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({"state": _Planted(marker), "tensors": []}, buffer)
    with pytest.raises(PlainStateError):
        read_description(buffer.getvalue())
    assert not marker.exists()
    # what a rank really sends reads back
    tensors, skeleton = flatten_tensors({"model": {"w": torch.ones(2)}, "step": 3})
    again = read_description(describe(skeleton))
    assert again["tensors"] == [((2,), torch.float32)] and again["state"]["step"] == 3


def test_no_loader_unpickles():
    found = subprocess.run(
        ["grep", "-rnE", r"weights_only *= *False|pickle\.loads?\(|cloudpickle\.loads?\(",
         "exogym", "distributed"], capture_output=True, text=True, cwd=ROOT)
    assert found.stdout == ""


def _planted_run_folder(folder: Path, task: str) -> None:
    """A run folder as a stranger writes it: its trace names ``task`` to import."""
    from exogym.report.trace import TRACE_FILE

    settings = {"task": task, "strategy": "ddp", "num_nodes": 1, "max_steps": 1}
    header = {"kind": "run", "version": 2, "source": "simulation", "num_nodes": 1,
              "run": {"profile": "p", "fingerprint": "0" * 64,
                      "started": "2024-01-01T00:00:00Z", "settings": settings}}
    step = {"kind": "step", "rank": 0, "step": 1, "loss": 1.0}
    folder.mkdir(parents=True)
    (folder / TRACE_FILE).write_text(json.dumps(header) + "\n" + json.dumps(step) + "\n")


@pytest.mark.parametrize("command", ["replay", "recommend"])
def test_a_run_folder_naming_code_is_not_imported_unless_the_persons_profile_names_it(
        tmp_path, command):
    # the module a stranger's folder names: importing it leaves a marker behind
    (tmp_path / "lib").mkdir()
    marker = tmp_path / "imported"
    (tmp_path / "lib" / "planted_task.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef task(**kw):\n    return None\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "lib"), os.environ.get(
        "PYTHONPATH", "")])}
    run = tmp_path / "run"
    _planted_run_folder(run, "planted_task:task")
    args = ["replay", run] if command == "replay" else \
        ["recommend", "digits-ddp", "--trace", run, "--link-mbit", "100"]
    done = cli(*args, cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "'planted_task:task'" in done.stderr and "--trust-code" in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists()
    # the person's own profile names the same task: it is theirs to run
    config = tmp_path / "config.ini"
    config.write_text("[distributed:mine]\ntask = planted_task:task\nstrategy = ddp\n")
    cli("replay", run, "--config", config, cwd=tmp_path, env=env)
    assert marker.exists()
    marker.unlink()
    cli(*args, "--trust-code", cwd=tmp_path, env=env)
    assert marker.exists()
