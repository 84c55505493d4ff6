"""Hosts that run several ranks ("slots"): the hosts file, the launcher's plan, pre-flight's
device checks, the documented example, and a real 2 hosts x 2 slots run over the test sshd.

The real run: the master (this machine) runs ranks 0 and 1 as local processes, the
worker 127.0.0.2 runs ranks 2 and 3 over SSH; the final model must equal the 4-rank
simulation's, and the dashboard must show four ranks.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from doc_blocks import code_block
from faces_support import TINY, sshd_hosts
from ports import free_port
from rich.console import Console
from safetensors.torch import load_file
from sshd_fixture import serve_sshd
from typer.testing import CliRunner

from cli_typer import app
from distributed.hosts.hostsfile import HostsFileError, HostSpec, load_hosts
from distributed.hosts.preflight import HostCheck, _check_slots
from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram
from distributed.profiles.profile import parse_overrides
from distributed.worker.run_profile import run_profile

runner = CliRunner()
BASE = {"python_env": "/opt/py/bin/python", "project_path": "/srv/gym"}


def documented_block(kind: str) -> str:
    """The first ``kind`` code block of the "Several ranks per host" section of docs/hosts.md."""
    return code_block("docs/hosts.md", "## Several ranks per host", kind)


# --------------------------------------------------------------------------- the hosts file


def test_slots_make_the_world_size_and_number_ranks_host_by_host():
    config = load_hosts(dict(BASE, master={"host": "10.0.0.1", "slots": 2},
                             workers=[{"host": "10.0.0.2", "slots": 3}, "10.0.0.3"]))
    assert config.world_size == 6
    assert [list(h.ranks) for h in config.hosts] == [[0, 1], [2, 3, 4], [5]]
    assert [h.host for h in config.rank_hosts] == ["10.0.0.1"] * 2 + ["10.0.0.2"] * 3 + [
        "10.0.0.3"]
    assert config.host_of(4).host == "10.0.0.2"
    assert load_hosts(config.to_dict()) == config


def test_top_level_slots_are_every_hosts_default():
    config = load_hosts(dict(BASE, master="10.0.0.1", workers=["10.0.0.2"], slots=4))
    assert [h.slots for h in config.hosts] == [4, 4] and config.world_size == 8


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, None])
def test_bad_slots_name_the_line_the_value_and_the_fix(tmp_path, value):
    path = tmp_path / "hosts.json"
    path.write_text('{"master": "10.0.0.1",\n "workers": [\n  {"host": "10.0.0.2",\n'
                    f'   "slots": {json.dumps(value)}}}],\n'
                    ' "python_env": "python3", "project_path": "/p"}\n')
    with pytest.raises(HostsFileError) as caught:
        load_hosts(path)
    (problem,) = caught.value.problems
    assert problem.startswith('hosts file line 4: "workers[0].slots" must be the number of '
                              "ranks to run on the host, an integer from 1 to 1024")
    assert problem.endswith(f"got {json.dumps(value)}")


def test_host_of_a_rank_outside_the_job_says_how_many_ranks_run():
    config = load_hosts(dict(BASE, master={"host": "10.0.0.1", "slots": 2}, workers=[]))
    with pytest.raises(ValueError, match=r"rank 2 is not in 0..1"):
        config.host_of(2)


# --------------------------------------------------------------------------- the plan


def plan_env(command: str) -> dict[str, str]:
    """The ``env NAME=value`` assignments of a rank's command line (through ``ssh`` too)."""
    words = shlex.split(command)
    if words[0] == "ssh":
        words = shlex.split(words[-1])
    start = words.index("env") + 1
    out = {}
    for word in words[start:]:
        if "=" not in word:
            break
        name, _, value = word.partition("=")
        out[name] = value
    return out


def test_plan_starts_every_slot_with_its_local_rank_and_node_rank():
    hosts = load_hosts(dict(BASE, master={"host": "127.0.0.1", "slots": 2},
                            workers=[{"host": "127.0.0.2", "slots": 2}, "127.0.0.3"],
                            ssh_port=1))
    program = RankProgram.from_profile("digits-ddp")
    with Launcher(hosts, program, options=LaunchOptions(master_local=True)) as job:
        plans = job.plan()
    rows = [(p.rank, p.host.host, p.local, p.local_rank) for p in plans]
    assert rows == [(0, "127.0.0.1", True, 0), (1, "127.0.0.1", True, 1),
                    (2, "127.0.0.2", False, 0), (3, "127.0.0.2", False, 1),
                    (4, "127.0.0.3", False, 0)]
    envs = [plan_env(p.command) for p in plans]
    assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["NODE_RANK"])
            for e in envs] == [("0", "5", "0", "2", "0"), ("1", "5", "1", "2", "0"),
                               ("2", "5", "0", "2", "1"), ("3", "5", "1", "2", "1"),
                               ("4", "5", "0", "1", "2")]
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}


def test_documented_hosts_file_and_dry_run_show_every_rank(tmp_path):
    hosts = load_hosts(json.loads(documented_block("json")))
    assert hosts.world_size == 4 and [h.slots for h in hosts.hosts] == [2, 2]
    (command,) = documented_block("bash").strip().splitlines()
    hosts_file = tmp_path / "hosts.json"
    hosts_file.write_text(documented_block("json"))
    words = shlex.split(command)
    assert words[:2] == ["python", "cli_typer.py"]
    args = [str(hosts_file) if w == "hosts.json" else w for w in words[2:]]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Dry run: 4 ranks on 2 hosts" in result.output
    for rank, host, local in ((0, "192.168.1.100", 0), (1, "192.168.1.100", 1),
                              (2, "192.168.1.101", 0), (3, "192.168.1.101", 1)):
        assert f"rank {rank} on {host} " in result.output
        assert f"local rank {local} of 2" in result.output
    commands = [line for line in result.output.splitlines() if "command:" in line]
    assert len(commands) == 4
    envs = [plan_env(line.split("command:", 1)[1]) for line in commands]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert all(e["EXOGYM_DEVICE"] == "cuda" and e["WORLD_SIZE"] == "4" for e in envs)


# --------------------------------------------------------------------------- pre-flight


def slots_check(device: str | None, slots: int, **found) -> HostCheck:
    host = HostSpec(rank=1, host="gpu-box", python_env="python3", project_path="/p",
                    device=device, slots=slots)
    check = HostCheck(rank=1, host="gpu-box", where="local")
    _check_slots(check, host, {"cpus": 8, "gpus": None, **found})
    return check


def test_preflight_fails_a_cuda_host_with_fewer_gpus_than_slots():
    (problem,) = slots_check("cuda", 4, gpus=2).problems
    assert '"slots": 4' in problem and "this host has 2" in problem and 'lower "slots" to 2' \
        in problem
    (problem,) = slots_check("cuda", 2).problems
    assert "no NVIDIA GPU was found" in problem
    assert slots_check("cuda", 2, gpus=2).ok


def test_preflight_notes_cpu_slots_beyond_the_cores_and_shared_gpus():
    check = slots_check("cpu", 16, cpus=8)
    assert check.ok and "more than its 8 CPU cores" in check.notes[0]
    assert slots_check(None, 4, cpus=8).notes == []
    check = slots_check("cuda:1", 2)
    assert check.ok and "share one GPU (cuda:1)" in check.notes[0]


def test_probe_counts_the_visible_gpus(monkeypatch):
    from distributed.hosts.onhost.probe import count_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")
    assert count_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert count_gpus() == 0


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    yield from serve_sshd(tmp_path_factory)


@pytest.mark.slow
def test_check_hosts_fails_cuda_slots_on_a_host_without_gpus(sshd, tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA driver: the test host needs none")
    config = sshd_hosts(sshd, workers=1)
    config["workers"][0].update(slots=2, device="cuda")
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(config))
    result = runner.invoke(app, ["check-hosts", str(hosts), "--known-hosts",
                                 str(sshd.known_hosts), "--ssh-config", str(sshd.ssh_config)])
    assert result.exit_code == 2, result.output
    assert "[127.0.0.2:1-2]" in result.output and "no NVIDIA GPU was found" in result.output


def test_each_cuda_rank_of_a_host_takes_the_gpu_of_its_local_rank():
    from distributed.worker.environment import RankEnvironment
    from distributed.worker.rank_trainer import RankTrainer

    spec = SimpleNamespace(device_type="cuda", devices=[0, 1, 2, 3])
    for local_rank in range(4):
        env = RankEnvironment(4 + local_rank, 8, "10.0.0.1", free_port(), local_rank, 4)
        placement = RankTrainer._placement(SimpleNamespace(environment=env), spec)
        assert placement.devices == [local_rank]
        assert placement.ranks_per_machine == 4 and placement.backend == "nccl"


# --------------------------------------------------------------------------- a real run


@pytest.mark.slow
def test_two_hosts_with_two_slots_each_equal_the_four_rank_simulation(sshd, tmp_path):
    settings = [s for s in TINY if not s.startswith("num_nodes=")] + ["num_nodes=4"]
    config = sshd_hosts(sshd, workers=1)
    config["master"] = {"host": "127.0.0.1", "slots": 2}
    config["workers"][0]["slots"] = 2
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(config, indent=2))
    out = tmp_path / "net"
    sets = [part for s in settings + [f"output_dir={out}"] for part in ("--set", s)]
    result = runner.invoke(app, ["distributed-train", "digits-diloco", "--hosts", str(hosts),
                                 "--known-hosts", str(sshd.known_hosts), "--ssh-config",
                                 str(sshd.ssh_config), "--run-dir", str(tmp_path / "launch"),
                                 *sets])
    assert result.exit_code == 0, result.output
    ranks = ((0, "127.0.0.1"), (1, "127.0.0.1"), (2, "127.0.0.2"), (3, "127.0.0.2"))
    for rank, host in ranks:
        assert f"[{host}:{rank}] step 20/20" in result.output
        assert (tmp_path / "launch" / f"rank{rank}.log").is_file()
    assert re.search(r"127\.0\.0\.2 .* 2-3 .* ok", result.output)  # pre-flight: its ranks
    assert "all 4 ranks finished" in result.output
    summary = result.output[result.output.index("run summary"):]
    rows = re.findall(r"^\W*(\d)\W+(127\.0\.0\.\d)\W+done\W+20\b", summary, re.MULTILINE)
    assert [(int(r), h) for r, h in rows] == list(ranks)

    launch = json.loads((tmp_path / "launch" / "launch.json").read_text())
    assert [(r["rank"], r["host"], r["local_rank"]) for r in launch["ranks"]] == [
        (0, "127.0.0.1", 0), (1, "127.0.0.1", 1), (2, "127.0.0.2", 0), (3, "127.0.0.2", 1)]

    real = load_file(out / "model.safetensors")
    run_profile("digits-diloco", overrides=parse_overrides(
        settings + [f"output_dir={tmp_path / 'sim'}"]), progress=False, local=True)
    simulated = load_file(tmp_path / "sim" / "model.safetensors")
    for key in real:
        assert torch.allclose(real[key].float(), simulated[key].float(), atol=1e-5), key


def test_launcher_fetches_rank_zeros_model_from_the_master_with_slots(sshd, tmp_path):
    config = sshd_hosts(sshd, workers=1)
    config["master"] = {"host": "127.0.0.1", "slots": 2}
    with Launcher(config, RankProgram.from_script("x.py"),
                  options=LaunchOptions(run_dir=tmp_path / "launch"),
                  console=Console(file=None)) as job:
        (Path(job.run_dir)).mkdir(parents=True)
        (Path(job.run_dir) / "model.bin").write_bytes(b"rank0")
        assert job.fetch(1, "model.bin", tmp_path / "got").read_bytes() == b"rank0"
        with pytest.raises(ValueError, match="rank 3 is not in 0..2"):
            job.fetch(3, "model.bin", tmp_path / "never")
