"""A refused run leaves no trace, and every refusal names the setting and its range.

A run refused at start (a value out of range, a device that is not there) must not
claim a run folder nor move ``BASE.latest``; an earlier run's folder and pointer
stay as they were. Optimizer and outer-optimizer settings are checked by name when
the strategy is made, through ``--set`` or in Python alike.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ranks import ROOT

from distributed.hosts.onhost import runfolders


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli_typer.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


QUICK = ["--set", "max_steps=4", "--set", "H=2", "--set", "val_size=16", "--set",
         "num_threads=1", "--logger", "none"]


@pytest.mark.parametrize("setting, named", [
    ("outer_lr=-1", "outer_lr must be a number > 0, got -1"),
    ("outer_lr=abc", "outer_lr must be a number > 0, got 'abc'"),
    ("outer_momentum=1.5", "outer_momentum must be a number in [0, 1), got 1.5"),
    ("nesterov=3", "nesterov must be true or false"),
    ("H=0", "H must be an integer >= 1"),
    ("lr=fast", "lr must be a positive number"),
    ("device=cuda" if not __import__("torch").cuda.is_available() else "device=mps",
     "was asked for"),
])
def test_a_run_refused_at_start_takes_no_folder_and_leaves_latest_alone(tmp_path, setting,
                                                                        named):
    earlier = cli("distributed-train", "digits-diloco", *QUICK, cwd=tmp_path)
    assert earlier.returncode == 0, earlier.stderr
    runs = tmp_path / "runs"
    before = sorted(p.name for p in runs.iterdir())
    pointed = runfolders.latest(str(runs / "digits-diloco"))
    refused = cli("distributed-train", "digits-diloco", *QUICK, "--set", setting, cwd=tmp_path)
    assert refused.returncode == 2, (refused.returncode, refused.stderr)
    assert named in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert sorted(p.name for p in runs.iterdir()) == before
    assert runfolders.latest(str(runs / "digits-diloco")) == pointed


DRY_REFUSED = [("outer_lr=-1", "outer_lr must be a number > 0"), ("H=0", "H must be an integer"),
               ("lr=fast", "lr must be a positive number"),
               ("outer_lr=abc", "outer_lr must be a number > 0, got 'abc'")]
if not __import__("torch").cuda.is_available():
    DRY_REFUSED.append(("device=cuda", "no CUDA GPU is available"))


@pytest.mark.parametrize("setting, named", DRY_REFUSED)
def test_a_dry_run_refuses_what_the_run_would_refuse(tmp_path, setting, named):
    done = cli("distributed-train", "digits-diloco", "--dry-run", "--set", setting,
               cwd=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert named in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists()


def test_a_dry_run_warns_as_the_run_would(tmp_path):
    done = cli("distributed-train", "digits-diloco", "--dry-run", "--set", "batch_size=5000",
               "--set", "max_steps=10", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "batch_size=5000 is larger than one rank's share of the data" in said, said
    assert "H=20 > max_steps=10" in said, said
    assert "nothing is started" in said
    assert not (tmp_path / "runs").exists()


def test_a_first_run_refused_leaves_no_runs_folder_behind(tmp_path):
    refused = cli("distributed-train", "digits-diloco", *QUICK, "--set", "outer_lr=-1",
                  cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert not (tmp_path / "runs" / "digits-diloco").exists()
    assert not os.path.lexists(tmp_path / "runs" / "digits-diloco.latest")


def test_a_release_leaves_a_folder_that_holds_more_than_the_claim(tmp_path):
    base = str(tmp_path / "runs" / "p")
    identity = {"fingerprint": "f", "started": "now"}
    first = runfolders.claim_new(base, identity)
    second = runfolders.claim_new(base, {**identity, "started": "later"})
    assert second["previous_latest"] == first["folder"]
    (Path(second["folder"]) / "trace.jsonl").write_text("{}\n")  # the run had started
    assert runfolders.release(base, second["folder"], {**identity, "started": "later"},
                              second["previous_latest"]) == {"released": False}
    assert Path(second["folder"]).is_dir()
    os.unlink(Path(second["folder"]) / "trace.jsonl")
    # another run's claim is never released by this one
    assert runfolders.release(base, second["folder"], identity,
                              second["previous_latest"]) == {"released": False}
    assert runfolders.release(base, second["folder"], {**identity, "started": "later"},
                              second["previous_latest"]) == {"released": True}
    assert not Path(second["folder"]).exists()
    assert runfolders.latest(base) == first["folder"]


@pytest.mark.parametrize("make, message", [
    (lambda s: s.DiLoCoStrategy(outer_lr=-1), "DiLoCoStrategy: outer_lr must be a number > 0"),
    (lambda s: s.DiLoCoStrategy(outer_lr="abc"), "outer_lr must be a number > 0, got 'abc'"),
    (lambda s: s.DiLoCoStrategy(outer_momentum=-0.1), "outer_momentum must be a number in [0, 1)"),
    (lambda s: s.SPARTADiLoCoStrategy(outer_lr=float("inf")), "outer_lr must be a number > 0"),
    (lambda s: s.DiLoCoStrategy(optim_spec=s.OptimSpec("adamw", lr=-3)),
     "AdamW: lr must be a number > 0, got -3"),
    (lambda s: s.DiLoCoStrategy(optim_spec=s.OptimSpec("adamw", betas=(0.9, 1.5))),
     "AdamW: betas[1] must be a number in [0, 1), got 1.5"),
    (lambda s: s.DiLoCoStrategy(optim_spec=s.OptimSpec("sgd", momentum="fast")),
     "SGD: momentum must be a number in [0, 1), got 'fast'"),
    (lambda s: s.DiLoCoStrategy(optim_spec=s.OptimSpec("sgd", lr=0.1, nesterov=True)),
     "SGD(lr=0.1, nesterov=True) is refused by torch: Nesterov momentum requires"),
])
def test_optimizer_settings_are_checked_by_name_when_the_strategy_is_made(make, message):
    from exogym import strategy

    with pytest.raises(ValueError) as caught:
        make(strategy)
    assert message in str(caught.value)
