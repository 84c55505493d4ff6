"""A real profile across three "hosts" over SSH equals its local simulation.

Rank 0 runs on this machine (127.0.0.1); ranks 1 and 2 log in over SSH to the
test sshd on 127.0.0.2 and 127.0.0.3 and run this checkout's worker.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from io import StringIO
from pathlib import Path

import pytest
import torch
from ranks import ROOT, free_port
from rich.console import Console
from safetensors.torch import load_file
from sshd_fixture import serve_sshd

from distributed.hosts.ssh import SSHOptions
from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram
from distributed.profiles.profile import parse_overrides
from distributed.worker.run_profile import run_profile


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    yield from serve_sshd(tmp_path_factory)


def hosts(sshd):
    worker = {"ssh_port": sshd.port}
    return {"master": "127.0.0.1",
            "workers": [{"host": "127.0.0.2", **worker}, {"host": "127.0.0.3", **worker}],
            "ssh_user": sshd.user, "ssh_key_path": str(sshd.key_path),
            "python_env": sys.executable, "project_path": str(ROOT), "master_port": free_port()}


def launcher(sshd, program, tmp_path, on_event, **options):
    ssh = SSHOptions(known_hosts_path=sshd.known_hosts, ssh_config_path=sshd.ssh_config,
                     allow_agent=False, look_for_keys=False, connect_timeout=5)
    return Launcher(hosts(sshd), program,
                    options=LaunchOptions(run_dir=tmp_path / "launch", grace_period=2, **options),
                    ssh=ssh, console=Console(file=StringIO(), width=200),
                    on_output=lambda line: None, on_event=on_event)


def test_a_host_s_rank_takes_its_device_and_a_restart_continues_the_run_it_replaced():
    """What the launcher starts on each host of these runs, without starting it: a host's
    ``device`` reaches its rank, and a restart (``max_restarts``) resumes the run it started
    with ``--overwrite`` instead of replacing it a second time."""
    from distributed.hosts.hostsfile import load_hosts

    config = load_hosts({"master": "127.0.0.1",
                         "workers": [{"host": "127.0.0.2", "device": "cpu"}],
                         "python_env": sys.executable, "project_path": str(ROOT)})
    program = RankProgram.from_profile("digits-diloco", overrides=["max_steps=40"],
                                       overwrite=True)
    master, worker = config.hosts
    first = program.argv(worker)
    assert first[:4] == ["-m", "distributed.worker", "--profile", "digits-diloco"], first
    assert "--overwrite" in first and "device=cpu" in first and "--resume" not in first
    assert "device=cpu" not in program.argv(master)
    again = program.argv(worker, restart=1)
    assert "--overwrite" not in again and again[-1] == "--resume", again
    assert "max_steps=40" in again and "device=cpu" in again


@pytest.mark.slow(reason="a run over SSH on three hosts and its simulation")
def test_three_host_diloco_over_ssh_equals_the_simulation(sshd, tmp_path):
    settings = ["max_steps=40", "val_interval=20", "num_threads=1", "checkpoint_interval=None",
                "num_nodes=3"]
    events = []
    program = RankProgram.from_profile("digits-diloco",
                                       overrides=settings + [f"output_dir={tmp_path / 'net'}"])
    with launcher(sshd, program, tmp_path, events.append) as job:
        result = job.run()
    assert result.ok, result.describe()
    assert {e["rank"] for e in events if e.get("event") == "step"} == {0, 1, 2}
    real = load_file(tmp_path / "net" / "model.safetensors")
    run_profile("digits-diloco", overrides=parse_overrides(
        settings + [f"output_dir={tmp_path / 'sim'}"]), progress=False, local=True)
    simulated = load_file(tmp_path / "sim" / "model.safetensors")
    for key in real:
        assert torch.allclose(real[key].float(), simulated[key].float(), atol=1e-5), key


def _worker_pid(rank: int, marker: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        argv = cmdline.split("\0")
        # the rank itself (python -m distributed.worker ...), not its supervisor (python -c ...)
        if argv[1:3] == ["-m", "distributed.worker"] and marker in cmdline \
                and f"RANK={rank}" in environ:
            return int(entry.name)
    return None


@pytest.mark.slow(
    reason="a run across hosts whose rank is killed and restarted from its checkpoint")
def test_max_restarts_finishes_the_run_from_the_checkpoint_after_a_killed_rank(sshd, tmp_path):
    out = tmp_path / "net"
    program = RankProgram.from_profile("digits-ddp", overrides=[
        "max_steps=400", "num_threads=1", "num_nodes=3", "val_size=0",
        "checkpoint_interval=100", f"output_dir={out}"])
    events = []
    killed = threading.Event()

    def on_event(event):
        events.append(event)
        if (not killed.is_set() and event.get("rank") == 2 and event.get("step", 0) >= 150
                and event.get("event") == "step"):
            pid = _worker_pid(2, str(out))
            if pid:
                killed.set()
                os.kill(pid, signal.SIGKILL)

    started = time.monotonic()
    with launcher(sshd, program, tmp_path, on_event, max_restarts=1) as job:
        result = job.run()
    assert killed.is_set()
    assert result.ok and result.restarts == 1, result.describe()
    assert result.attempts[0].first_failure.rank == 2
    resumed = [e for e in events if e.get("event") == "start" and e.get("step", 0) > 0]
    assert {e["rank"] for e in resumed} == {0, 1, 2}
    steps = {e["step"] for e in resumed}
    logs = "\n".join(line for line in (tmp_path / "launch" / "rank2.log").read_text().splitlines()
                     if "exogym-event" not in line)
    assert len(steps) == 1, logs
    assert steps.pop() in range(100, 400, 100), logs
    assert '"steps": 400' in (out / "summary.json").read_text()
    assert time.monotonic() - started < 300


@pytest.mark.slow(reason="a script run on three hosts over SSH, then its model compared")
def test_network_trainer_driver_runs_the_script_on_every_host_and_returns_the_model(
        sshd, tmp_path):
    import json
    import subprocess

    from exogym import LocalTrainer
    from exogym.strategy import DiLoCoStrategy

    hosts_file = tmp_path / "hosts.json"
    hosts_file.write_text(json.dumps(hosts(sshd)))
    options = {"known_hosts_path": str(sshd.known_hosts), "ssh_config_path": str(sshd.ssh_config),
               "allow_agent": False, "look_for_keys": False, "run_dir": str(tmp_path / "run"),
               "env": {"PYTHONPATH": str(ROOT)}}
    env = dict(os.environ, EXOGYM_TEST_LAUNCHER_OPTIONS=json.dumps(options), PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    fit = dict(max_steps=30, batch_size=32, val_size=64, val_interval=10, num_threads=1,
               logger=None, progress=False, seed=0)
    done = subprocess.run([sys.executable, "tests/scripts/network_fit.py", str(hosts_file),
                           str(tmp_path / "final.pt"), json.dumps(fit)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    real = torch.load(tmp_path / "final.pt")

    from distributed.tasks.builtin import digits_task

    model, train, val = digits_task(seed=0)
    simulated = LocalTrainer(model, train, val).fit(
        strategy=DiLoCoStrategy(H=10, lr=0.003), num_nodes=3, **fit).state_dict()
    for key in real:
        assert torch.allclose(real[key], simulated[key], atol=1e-5), key
