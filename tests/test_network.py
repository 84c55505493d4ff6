"""Real ranks as separate processes joined over TCP: simulation equals reality."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import warm
from ranks import ROOT, free_port, rank_env, start_ranks, wait_all
from safetensors.torch import load_file

from distributed.profiles.profile import parse_overrides
from distributed.worker.environment import rank_environment
from distributed.worker.run_profile import run_profile

COMMON = ["max_steps=40", "val_interval=20", "num_threads=1", "checkpoint_interval=None"]


def simulate(profile, tmp_path, extra=()):
    """The same profile as a local simulation; returns its final model state."""
    out = tmp_path / "sim"
    overrides = parse_overrides(COMMON + list(extra) + [f"output_dir={out}"])
    run_profile(profile, overrides=overrides, progress=False, local=True)
    return load_file(out / "model.safetensors")


def assert_states_close(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol), k


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["digits-diloco", "digits-ddp"])
def test_three_real_ranks_end_with_the_simulated_model(profile, tmp_path):
    overrides = COMMON + ["num_nodes=3", f"output_dir={tmp_path / 'net'}"]
    procs = start_ranks(profile, 3, overrides, tmp_path / "logs")
    codes = wait_all(procs, timeout=240)
    logs = {p: p.read_text() for p in (tmp_path / "logs").iterdir()}
    assert codes == [0, 0, 0], logs
    real = load_file(tmp_path / "net" / "model.safetensors")
    simulated = simulate(profile, tmp_path, ["num_nodes=3"])
    assert_states_close(real, simulated)
    assert "@@exogym-event" in logs[tmp_path / "logs" / "rank1.log"]


@pytest.mark.slow
def test_killing_one_rank_makes_the_others_exit_naming_it(tmp_path):
    overrides = ["max_steps=100000", "num_threads=1", "num_nodes=3", "val_size=0",
                 "checkpoint_interval=None", "strategy=ddp", f"output_dir={tmp_path / 'net'}"]
    procs = start_ranks("digits-base", 3, overrides, tmp_path / "logs")
    log2 = tmp_path / "logs" / "rank2.log"
    deadline = time.monotonic() + 120
    while '"step":5,' not in log2.read_text():
        assert time.monotonic() < deadline, log2.read_text()
        assert procs[2].poll() is None, log2.read_text()
        time.sleep(0.2)
    warm.send_signal(procs[2], signal.SIGKILL)
    killed_at = time.monotonic()
    codes = wait_all(procs[:2], timeout=60)
    assert time.monotonic() - killed_at < 30
    for rank, code in enumerate(codes):
        text = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        assert code not in (0, -9), text
        assert "lost rank 2" in text, text


def test_partial_rank_variables_get_a_clear_error():
    with pytest.raises(ValueError, match="MASTER_PORT missing"):
        rank_environment({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    with pytest.raises(ValueError, match="RANK=3 must be in"):
        rank_environment({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    assert rank_environment({}) is None


@pytest.mark.slow
def test_torchrun_starts_the_worker_and_it_trains(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        env.pop(key, None)
    torchrun = shutil.which("torchrun") or ""
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.app.run"]
    result = subprocess.run(
        launcher + ["--nnodes", "1", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "distributed.worker", "--profile", "digits-diloco",
         "--quiet", "--set", "max_steps=30", "--set", "num_threads=1",
         "--set", f"output_dir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = (tmp_path / "summary.json").read_text()
    assert '"steps": 30' in summary
    assert (tmp_path / "model.safetensors").is_file()


def test_rank_env_helper_clears_interface():
    assert "GLOO_SOCKET_IFNAME" not in rank_env(0, 1, 1)


@pytest.mark.slow
def test_ranks_in_network_namespaces_pick_their_interface_and_match_the_simulation(tmp_path):
    from netns import namespaces, netns_available

    reason = netns_available()
    if reason:
        pytest.skip(reason)
    overrides = COMMON + ["num_nodes=3", f"output_dir={tmp_path / 'net'}"]
    with namespaces(3) as (names, addresses):
        prefix = [["ip", "netns", "exec", ns] for ns in names]
        procs = start_ranks("digits-diloco", 3, overrides, tmp_path / "logs", prefix=prefix,
                            addr=addresses[0])
        codes = wait_all(procs, timeout=240)
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").iterdir()}
    assert codes == [0, 0, 0], logs
    for rank in range(3):  # each rank found its namespace's veth, not loopback
        assert "interface vh" in logs[f"rank{rank}.log"], logs[f"rank{rank}.log"][-2000:]
    assert_states_close(load_file(tmp_path / "net" / "model.safetensors"),
                        simulate("digits-diloco", tmp_path, ["num_nodes=3"]))
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count(
        "exo-") == 0


def test_network_driver_checks_values_but_leaves_the_device_to_the_hosts():
    from distributed import NetworkTrainer
    from distributed.hosts.preflight import PreflightError
    from distributed.tasks.builtin import digits_task
    from exogym.strategy import SimpleReduceStrategy

    # 127.0.0.2 is not this machine to the launcher, and no SSH server listens on the port.
    hosts = {"master": "127.0.0.2", "workers": [], "ssh_port": free_port(),
             "python_env": sys.executable, "project_path": str(ROOT)}
    model, train, val = digits_task(seed=0)
    trainer = NetworkTrainer(hosts, model, train, val)
    assert not torch.cuda.is_available()
    # A CPU-only driver can start a CUDA run: it gets as far as contacting the hosts.
    with pytest.raises(PreflightError, match="connection refused"):
        trainer.fit(strategy=SimpleReduceStrategy(), device="cuda", max_steps=2)
    # A value no host could train with fails here, before any host is contacted.
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        trainer.fit(strategy=SimpleReduceStrategy(), batch_size=0)
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda', 'cuda:N' or 'mps'"):
        trainer.fit(strategy=SimpleReduceStrategy(), device="gpu")
    with pytest.raises(TypeError, match="did you mean 'max_steps'"):
        trainer.fit(strategy=SimpleReduceStrategy(), max_step=2)
    # What only a simulation can do is refused, not ignored.
    with pytest.raises(ValueError, match="rank_failures is for a simulation on one machine"):
        trainer.fit(strategy=SimpleReduceStrategy(), rank_failures=[(0, 2, None)])
    with pytest.raises(ValueError, match="processes is for a simulation on one machine"):
        trainer.fit(strategy=SimpleReduceStrategy(), processes=1)


def test_network_driver_refuses_an_unknown_launcher_option_when_built():
    from distributed import NetworkTrainer
    from exogym.data.digits import DigitsMLP

    hosts = {"master": "127.0.0.1", "workers": ["127.0.0.2"], "python_env": sys.executable,
             "project_path": str(ROOT)}
    with pytest.raises(TypeError, match="did you mean 'max_restarts'"):
        NetworkTrainer(hosts, DigitsMLP(), [0], launcher_options={"max_restart": 1})
