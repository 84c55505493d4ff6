"""Experiment trackers for real: W&B offline and TensorBoard, read back with their own readers.

W&B runs with ``WANDB_MODE=offline`` (no network) and its run file is read back
with ``wandb leet inspect --json``; TensorBoard's event files are read back
with TensorBoard's ``EventAccumulator``. Both are set from ``fit``, from a
profile (``logger = ...``) and from the CLI (``--logger``), in simulation and
across hosts, where only rank 0 writes.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import code_lines
from faces_support import TINY, sshd_hosts
from ranks import ROOT
from sshd_fixture import serve_sshd
from toys import tiny_model, toy_dataset
from typer.testing import CliRunner

from cli_typer import app
from distributed.app.compare import plan_comparison
from distributed.app.run import logger_override
from exogym import Trainer
from exogym.report.loggers import TensorBoardLogger, make_logger
from exogym.strategy import SimpleReduceStrategy

runner = CliRunner()
FIT = dict(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=4, batch_size=8, val_size=8,
           val_interval=2, progress=False)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    yield from serve_sshd(tmp_path_factory)


@pytest.fixture
def wandb_offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    yield
    if "wandb" in sys.modules:  # its service's threads would keep this test process's later
        sys.modules["wandb"].teardown()  # fits from forking their ranks


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def sets(*pairs: str) -> list[str]:
    return [part for pair in pairs for part in ("--set", pair)]


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of a TensorBoard run folder, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_records(run_path: Path) -> tuple[dict, list[dict]]:
    """An offline W&B run read by wandb's own reader: (summary view, history items)."""
    wandb_cli = [sys.executable, "-c", "import sys; from wandb.cli.cli import cli; sys.exit(cli())"]
    summary = subprocess.run([*wandb_cli, "leet", "inspect", "--summary", "--json", str(run_path)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    records = subprocess.run([*wandb_cli, "leet", "inspect", "--json", str(run_path)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    history = [json.loads(line)["history"]["item"] for line in records.splitlines()
               if line.startswith("{") and json.loads(line).get("type") == "history"]
    return json.loads(summary), history


def one_run_folder(logs: Path) -> Path:
    runs = [p for p in logs.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


# --------------------------------------------------------------------------- fit


@pytest.mark.slow
def test_tensorboard_writes_per_rank_and_global_scalars_that_tensorboard_reads_back(tmp_path):
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(**FIT, logger="tensorboard", log_dir=str(tmp_path), run_name="tb")
    assert trainer.log_dir == tmp_path / "tb"
    got = scalars(tmp_path / "tb")
    rows = {(r["rank"], r["step"]): r for r in trainer.history}
    for rank in (0, 1):
        for key in ("train_loss", "lr", "comm_bytes"):
            assert got[f"rank{rank}/{key}"] == pytest.approx(
                {step: rows[rank, step][key] for step in (1, 2, 3, 4)}), (rank, key)
        assert got[f"rank{rank}/val_loss"] == pytest.approx(
            {step: rows[rank, step]["val_loss"] for step in (2, 4)})
    for step in (1, 2, 3, 4):
        assert got["global/train_loss"][step] == pytest.approx(
            (rows[0, step]["train_loss"] + rows[1, step]["train_loss"]) / 2)
        assert got["global/comm_bytes"][step] == rows[0, step]["comm_bytes"] * 2
    assert got["global/val_loss"] == pytest.approx(
        {step: rows[0, step]["val_global_loss"] for step in (2, 4)})
    assert json.loads((tmp_path / "tb" / "config.json").read_text())["num_nodes"] == 2
    assert json.loads((tmp_path / "tb" / "summary.json").read_text())["steps"] == 4


def test_tensorboard_logs_simulated_time_when_the_events_carry_it(tmp_path):
    logger = make_logger("tensorboard", str(tmp_path), "sim", None)
    logger.start({"num_nodes": 2})
    for step in (1, 2):
        for rank in (0, 1):
            logger.log_event({"event": "step", "rank": rank, "step": step, "train_loss": 1.0,
                              "lr": 0.1, "comm_bytes": 10 * step, "sim_time_s": step + rank / 2})
    logger.log_event({"event": "step", "rank": 0, "step": 3, "train_loss": 1.0, "lr": 0.1,
                      "comm_bytes": 30, "sim_time_s": 3.0})  # rank 1 never reports step 3
    logger.finish({"steps": 3})
    got = scalars(tmp_path / "sim")
    assert got["rank1/sim_time_s"] == {1: 1.5, 2: 2.5}
    assert got["global/sim_time_s"] == {1: 1.5, 2: 2.5}  # the slowest rank, at complete steps
    assert got["rank0/sim_time_s"] == {1: 1.0, 2: 2.0, 3: 3.0}
    assert 3 not in got["global/train_loss"]


@pytest.mark.slow
def test_wandb_offline_run_is_read_back_by_wandbs_own_reader(tmp_path, wandb_offline):
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(**FIT, logger="wandb", log_dir=str(tmp_path), run_name="wb")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    summary, history = wandb_records(runs[0])
    assert summary["name"] == "wb" and summary["state"] == "finished"
    assert summary["config"]["num_nodes"] == 2 and summary["config"]["max_steps"] == 4
    assert summary["config"]["strategy"]["strategy"] == "SimpleReduceStrategy"
    assert summary["summary"]["steps"] == 4
    rank0 = [r for r in trainer.history if r["rank"] == 0]
    assert [h["_step"] for h in history] == [r["step"] for r in rank0]
    for item, row in zip(history, rank0):
        for key in ("train_loss", "lr", "comm_bytes"):
            assert item[key] == pytest.approx(row[key]), key
        if "val_loss" in row:
            assert item["val_global_loss"] == pytest.approx(row["val_global_loss"])


@pytest.mark.parametrize("name, module, extra", [("tensorboard", "tensorboard", "tensorboard"),
                                                 ("wandb", "wandb", "wandb")])
def test_a_missing_tracker_names_its_extra(monkeypatch, tmp_path, name, module, extra):
    real_import = builtins.__import__

    def missing(wanted, *args, **kwargs):
        if wanted == module:
            raise ImportError(f"No module named {module!r}")
        return real_import(wanted, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", missing)
    from exogym.base.install_mode import install_extra

    # the install line for how the project is installed (a checkout here)
    with pytest.raises(ImportError, match=re.escape(install_extra(extra))):
        make_logger(name, str(tmp_path), "x", None)
    ds = toy_dataset()
    with pytest.raises(ImportError, match=re.escape(install_extra(extra))):
        Trainer(tiny_model(), ds, ds).fit(**FIT, logger=name, log_dir=str(tmp_path))
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_tensorboard_logger_is_a_logger_fit_accepts_as_an_instance(tmp_path):
    logger = TensorBoardLogger(log_dir=tmp_path, run_name="mine")
    assert make_logger(logger, "ignored", None, None) is logger


# --------------------------------------------------------------------------- profiles and CLI


def test_the_cli_logger_option_becomes_the_profiles_logger_key():
    assert logger_override({"lr": 0.1}, "TensorBoard") == {"lr": 0.1, "logger": "tensorboard"}
    assert logger_override({"logger": "wandb"}, "none") == {"logger": None}
    assert logger_override({"logger": "wandb"}, None) == {"logger": "wandb"}
    with pytest.raises(ValueError, match=r"--logger 'mlflow' is not a logger: give one of csv, "
                                         r"wandb, tensorboard or none"):
        logger_override({}, "mlflow")


def test_a_bad_logger_on_the_cli_is_bad_input_before_anything_runs(tmp_path):
    for command in ("distributed-train", "compare"):
        result = invoke(command, "--logger", "mlflow", *sets(f"output_dir={tmp_path}"))
        assert result.exit_code == 2, result.output
        assert "--logger 'mlflow' is not a logger" in result.output
    assert not list(tmp_path.iterdir())


def test_compare_gives_every_strategy_the_cli_logger():
    plans = plan_comparison("digits-diloco", ["ddp", "diloco"],
                            overrides=logger_override({}, "tensorboard"))
    assert [p.resolved.run_kwargs["logger"] for p in plans] == ["tensorboard", "tensorboard"]


@pytest.mark.slow
def test_a_profiles_logger_key_writes_tensorboard_into_its_output_folder(tmp_path):
    config = tmp_path / "config.ini"
    out = tmp_path / "out"
    config.write_text("[distributed:tb]\ntask = digits\nstrategy = ddp\nlogger = tensorboard\n"
                      f"output_dir = {out}\n" + "".join(f"{kv.replace('=', ' = ')}\n"
                                                        for kv in TINY))
    result = invoke("distributed-train", "tb", "--config", config)
    assert result.exit_code == 0, result.output
    got = scalars(out / "logs" / "tb")
    assert set(got["rank0/train_loss"]) == set(range(1, 21))
    assert set(got["global/val_loss"]) == {10, 20}


def train_on_three_hosts(sshd, tmp_path, logger: str):
    """``distributed-train digits-ddp`` on the sshd's 3 hosts with ``--logger``; the output folder
    and the CLI's result (checked for exit code 0)."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(sshd_hosts(sshd)))
    out = tmp_path / "net"
    result = invoke("distributed-train", "digits-ddp", "--hosts", hosts, "--logger", logger,
                    "--known-hosts", sshd.known_hosts, "--ssh-config", sshd.ssh_config,
                    "--run-dir", tmp_path / "launch", *sets(*TINY, "num_nodes=3",
                                                            f"output_dir={out}"))
    assert result.exit_code == 0, result.output
    return out, result


@pytest.mark.slow(
    reason="a run across hosts over SSH that logs to a tracker")
def test_across_hosts_only_rank_0_writes_the_tracker_into_the_output_folder(sshd, tmp_path):
    out, result = train_on_three_hosts(sshd, tmp_path, "tensorboard")
    assert "all 3 ranks finished" in result.output
    run = one_run_folder(out / "logs")  # ranks 1 and 2 share this disk and wrote nothing
    got = scalars(run)
    assert {tag.split("/")[0] for tag in got} == {"rank0", "global"}
    assert set(got["rank0/train_loss"]) == set(range(1, 21))
    assert set(got["global/val_loss"]) == {10, 20}
    assert json.loads((run / "config.json").read_text())["num_nodes"] == 3


@pytest.mark.slow(reason="a run across hosts over SSH that logs to a tracker")
def test_across_hosts_rank_0_logs_to_wandb_offline_from_the_launching_shell(
        sshd, tmp_path, wandb_offline):
    out, _ = train_on_three_hosts(sshd, tmp_path, "wandb")
    runs = list((out / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # ranks 1 and 2 share this disk and logged nothing
    summary, history = wandb_records(runs[0])
    assert summary["config"]["num_nodes"] == 3 and summary["state"] == "finished"
    assert [h["_step"] for h in history] == list(range(1, 21))
    assert [h["_step"] for h in history if "val_global_loss" in h] == [10, 20]


# --------------------------------------------------------------------------- the docs


def documented_commands() -> list[str]:
    """The commands of the Trackers section of docs/slurm-trackers.md, in order."""
    return [line.split("  #")[0].strip()
            for line in code_lines("docs/slurm-trackers.md", "## Trackers", "bash")]


@pytest.mark.slow(reason="every tracker command of the docs run as written, each a training run")
def test_the_documented_tracker_commands_run_as_written(tmp_path):
    commands = documented_commands()
    runs = [c for c in commands if "cli_typer.py distributed-train" in c]
    inspect = [c for c in commands if c.startswith("wandb leet inspect")]
    assert len(runs) == 2 and len(inspect) == 1, commands
    (tmp_path / "cli_typer.py").symlink_to(ROOT / "cli_typer.py")  # outputs land in tmp_path
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for command in runs + inspect:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, timeout=600,
                              capture_output=True, text=True)
        assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
    # Each run has its folder: the TensorBoard run the first, the W&B run the next; the
    # page reads each through runs/digits-diloco.latest right after that run.
    first, second = tmp_path / "runs" / "digits-diloco", tmp_path / "runs" / "digits-diloco-2"
    tensorboard_dir = shlex.split(next(c for c in commands if c.startswith("tensorboard")))[-1]
    assert tensorboard_dir == "runs/digits-diloco.latest/logs"
    assert (tmp_path / "runs" / "digits-diloco.latest").resolve() == second.resolve()
    got = scalars(first / "logs" / "digits-diloco")
    assert {f"rank{r}/train_loss" for r in range(4)} <= set(got)
    summary, history = wandb_records(second / "logs" / "wandb" / "latest-run")
    assert summary["config"]["num_nodes"] == 4 and history
    assert "train_loss" in done.stdout  # the inspect command shows the latest metrics
