"""SLURM: node lists, rank variables from srun's environment, the sbatch script, a real cluster."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from doc_blocks import code_lines
from ranks import ROOT, free_port, wait_all
from safetensors.torch import load_file
from test_network import COMMON, assert_states_close, simulate

from distributed.app.sbatch import SlurmJob, write_sbatch_script
from distributed.worker.environment import rank_environment
from distributed.worker.slurm_variables import expand_nodelist, port_for_job, tasks_on_node

SLURM_PAGE = "docs/slurm-trackers.md"


@pytest.mark.parametrize("nodelist, hosts", [
    ("localhost", ["localhost"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu-a[1-2],gpu-b3", ["gpu-a1", "gpu-a2", "gpu-b3"]),
    ("nid[008-011]", ["nid008", "nid009", "nid010", "nid011"]),
    ("c[9-11]", ["c9", "c10", "c11"]),
    ("cn[1,3-4],gn[05-06],login", ["cn1", "cn3", "cn4", "gn05", "gn06", "login"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("127.0.0.1", ["127.0.0.1"]),
    ("a100-[0-1]-ib", ["a100-0-ib", "a100-1-ib"]),
])
def test_node_lists_expand_as_scontrol_does(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, why", [
    ("node[01-04", "never closed"),
    ("node01-04]", "without '\\['"),
    ("node[4-1]", "runs backwards"),
    ("node[a-c]", "not a number or a range"),
    ("node[]", "not a number or a range"),
    ("node1,,node2", "empty name"),
    ("", "empty"),
])
def test_a_bad_node_list_is_a_clear_error(nodelist, why):
    with pytest.raises(ValueError, match=why) as info:
        expand_nodelist(nodelist)
    assert repr(nodelist) in str(info.value) or not nodelist


def test_tasks_per_node_reads_slurms_repeat_form():
    assert [tasks_on_node("2(x3),1", i) for i in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="SLURM_NODEID=4"):
        tasks_on_node("2(x3),1", 4)


SRUN_TASK = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2(x2)",
             "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}


def test_a_srun_task_takes_rank_world_local_rank_master_and_port_from_slurm():
    env = rank_environment(SRUN_TASK)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert env.master_addr == "gpu07"
    assert env.master_port == port_for_job("123456")
    assert rank_environment({**SRUN_TASK, "SLURM_JOB_ID": "123457"}).master_port != env.master_port
    assert rank_environment({**SRUN_TASK, "MASTER_PORT": "41511"}).master_port == 41511


def test_explicit_rank_variables_win_over_slurms():
    torchrun = {"RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.9",
                "MASTER_PORT": "41500"}
    env = rank_environment({**SRUN_TASK, **torchrun})
    assert (env.rank, env.world_size, env.local_rank) == (1, 8, 1)
    assert (env.master_addr, env.master_port) == ("10.0.0.9", 41500)


def test_slurm_task_errors_name_the_variable():
    with pytest.raises(ValueError, match="node list"):
        rank_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1"})
    with pytest.raises(ValueError, match="'gpu\\[07-08'"):
        rank_environment({**SRUN_TASK, "SLURM_JOB_NODELIST": "gpu[07-08"})
    with pytest.raises(ValueError, match="MASTER_PORT missing"):
        rank_environment({k: v for k, v in SRUN_TASK.items() if k != "SLURM_JOB_ID"})
    assert rank_environment({"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1"}) is None


def slurm_env(rank: int, world: int, port: int, nodelist: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "GLOO_SOCKET_IFNAME") and not k.startswith("SLURM_")}
    env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank),
               SLURM_JOB_NODELIST=nodelist, SLURM_JOB_ID="4242", MASTER_PORT=str(port),
               PYTHONPATH=str(ROOT))
    return env


@pytest.mark.slow
@pytest.mark.parametrize("nodelist", ["localhost", "127.0.0.[1-2]"])
def test_two_ranks_with_only_slurm_variables_end_with_the_simulated_model(nodelist, tmp_path):
    overrides = COMMON + [f"output_dir={tmp_path / 'net'}"]
    port, procs = free_port(), []
    (tmp_path / "logs").mkdir()
    for rank in range(2):
        args = [sys.executable, "-m", "distributed.worker", "--profile", "digits-diloco",
                "--quiet", *[a for pair in overrides for a in ("--set", pair)]]
        with open(tmp_path / "logs" / f"rank{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(args, cwd=ROOT, env=slurm_env(rank, 2, port, nodelist),
                                          stdout=log, stderr=subprocess.STDOUT))
    codes = wait_all(procs, timeout=240)
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").iterdir()}
    assert codes == [0, 0], logs
    master = expand_nodelist(nodelist)[0]
    assert f"rank 1/2: master {master}:{port}" in logs["rank1.log"], logs["rank1.log"][-2000:]
    assert_states_close(load_file(tmp_path / "net" / "model.safetensors"),
                        simulate("digits-diloco", tmp_path, ["num_nodes=2"]))


def test_the_sbatch_script_passes_bash_n_and_runs_the_profile_with_srun(tmp_path):
    job = SlurmJob("digits-diloco", nodes=4, gpus_per_node=2, time="1:00:00", partition="gpu",
                   project_path="/home/me/exo gym", python="/home/me/venv/bin/python",
                   overrides=["max_steps=100"])
    old = os.umask(0o027)
    try:
        path = write_sbatch_script(job, tmp_path / "job.sbatch")
    finally:
        os.umask(old)
    text = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for directive in ("--nodes=4", "--ntasks-per-node=2", "--gpus-per-node=2",
                      "--time=1:00:00", "--partition=gpu"):
        assert f"#SBATCH {directive}" in lines, text
    assert "cd '/home/me/exo gym'" in lines
    assert any(line.startswith("export MASTER_PORT=") for line in lines)
    assert lines[-1] == ("srun /home/me/venv/bin/python -m distributed.worker --profile "
                         "digits-diloco --set max_steps=100")


def test_the_sbatch_script_defaults_to_this_checkout_and_python_one_rank_per_node(tmp_path):
    path = write_sbatch_script(SlurmJob("digits-ddp", nodes=2), tmp_path / "s.sbatch")
    lines = path.read_text().splitlines()
    assert "#SBATCH --ntasks-per-node=1" in lines and "#SBATCH --nodes=2" in lines
    assert not any("gpus" in line for line in lines)
    assert f"cd {shlex.quote(str(ROOT))}" in lines
    assert lines[-1] == shlex.join(["srun", sys.executable, "-m", "distributed.worker",
                                    "--profile", "digits-ddp"])


@pytest.mark.parametrize("change, message", [
    ({"nodes": 0}, "--nodes must be an integer >= 1, got 0"),
    ({"time": "1h"}, "--time '1h' is not in SLURM's form"),
    ({"partition": "gpu; rm -rf"}, "--partition 'gpu; rm -rf' may hold only"),
    ({"gpus_per_node": 0}, "--gpus-per-node must be >= 1"),
    ({"overrides": ["no_such_key=1"]}, "no_such_key"),
])
def test_a_bad_sbatch_request_fails_before_writing(change, message, tmp_path):
    job = SlurmJob(**{"profile": "digits-diloco", "nodes": 2, **change})
    with pytest.raises(ValueError, match=message):
        write_sbatch_script(job, tmp_path / "s.sbatch")
    assert not (tmp_path / "s.sbatch").exists()


@pytest.mark.slow
def test_the_slurm_command_writes_the_script_and_says_how_to_submit_it(tmp_path):
    out = tmp_path / "job.sbatch"
    result = subprocess.run([sys.executable, "cli_typer.py", "slurm", "digits-diloco", "--nodes",
                             "3", "--time", "30", "--out", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"sbatch {out}" in result.stdout and "3 ranks on 3 nodes" in result.stdout
    assert "#SBATCH --time=30" in out.read_text()
    bad = subprocess.run([sys.executable, "cli_typer.py", "slurm", "no-such-profile", "--nodes",
                          "1", "--out", str(tmp_path / "x")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "no-such-profile" in bad.stderr + bad.stdout
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def cluster():
    from slurm_fixture import slurm_cluster, slurm_missing

    reason = slurm_missing()
    if reason:
        pytest.skip(reason)
    with slurm_cluster() as env:
        # "python" in the documented commands is this interpreter.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        env.pop("GLOO_SOCKET_IFNAME", None)
        yield env


@pytest.mark.slow
@pytest.mark.xdist_group("slurm-cluster")  # one worker: they share the cluster
def test_the_documented_srun_example_trains_two_ranks_on_a_real_cluster(cluster, tmp_path):
    [command] = code_lines(SLURM_PAGE, "Inside an allocation, two ranks", "bash")
    command = command.replace("runs/srun-digits", str(tmp_path / "out"))
    result = subprocess.run(shlex.split(command), cwd=ROOT, env=cluster, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rank 1/2: master localhost:" in result.stderr, result.stderr[-3000:]
    assert '"steps": 30' in (tmp_path / "out" / "summary.json").read_text()
    assert_states_close(load_file(tmp_path / "out" / "model.safetensors"),
                        simulate("digits-diloco", tmp_path, ["num_nodes=2", "max_steps=30"]),
                        atol=1e-4)


@pytest.mark.slow(
    reason="the documented sbatch script run as a job on the test SLURM cluster")
@pytest.mark.xdist_group("slurm-cluster")  # one worker: they share the cluster
def test_the_documented_sbatch_example_runs_the_profile_as_a_job(cluster, tmp_path):
    write, submit = code_lines(SLURM_PAGE, "Then submit it", "bash")
    script = ROOT / shlex.split(submit)[1]
    job_id = None
    assert not script.exists(), f"{script} is in the way; move it"
    write = write.replace("runs/sbatch-digits", str(tmp_path / "out"))
    try:
        made = subprocess.run(shlex.split(write), cwd=ROOT, env=cluster, capture_output=True,
                              text=True, timeout=120)
        assert made.returncode == 0, made.stdout + made.stderr
        assert f"sbatch {script.name}" in made.stdout
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
        submitted = subprocess.run(shlex.split(submit), cwd=ROOT, env=cluster,
                                   capture_output=True, text=True, timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.split()[-1]
        deadline = time.monotonic() + 300
        while subprocess.run(["squeue", "-h", "-j", job_id], env=cluster, capture_output=True,
                             text=True).stdout.strip():
            assert time.monotonic() < deadline, "the job did not finish in 300 s"
            time.sleep(1)
        output = (ROOT / f"slurm-{job_id}.out").read_text()
        assert '"steps": 30' in (tmp_path / "out" / "summary.json").read_text(), output[-3000:]
        assert "rank 0/1: master localhost:" in output, output[-3000:]
    finally:
        script.unlink(missing_ok=True)
        if job_id:
            (ROOT / f"slurm-{job_id}.out").unlink(missing_ok=True)
