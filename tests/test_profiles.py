"""Profiles in config.ini: inheritance, routing of keys, and every error message."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ranks import ROOT, free_port

from distributed.app.compare import plan_comparison, profile_for_strategy
from distributed.profiles.profile import (
    Profile,
    ProfileError,
    ProfileSet,
    load_profile,
    parse_overrides,
)
from distributed.tasks.builtin import resolve_task


def write(tmp_path, text):
    path = tmp_path / "config.ini"
    path.write_text(text)
    return path


def test_shipped_profiles_cover_every_strategy_on_digits_and_chargpt_diloco():
    profiles = ProfileSet()
    strategies = {profiles.get(n).strategy for n in profiles.names()
                  if profiles.get(n).task == "digits" and n != "digits-base"}
    assert {"ddp", "diloco", "fedavg"} <= strategies
    assert profiles.get("chargpt-diloco").strategy == "diloco"


def test_base_profile_inheritance_and_key_routing(tmp_path):
    path = write(tmp_path, """
[distributed:base]
task = digits
hidden = 32
lr = 0.01
num_nodes = 2
[distributed:child]
base_profile = base
strategy = diloco
H = 5
seed = 3
""")
    resolved = load_profile("child", path).resolved
    assert resolved.task_kwargs == {"hidden": 32, "seed": 3}
    assert resolved.strategy_kwargs == {"lr": 0.01, "H": 5}
    assert resolved.run_kwargs == {"num_nodes": 2, "seed": 3}


def test_a_profile_is_resolved_once_into_task_strategy_keys_and_output_folder(tmp_path,
                                                                            monkeypatch):
    import distributed.tasks.builtin as builtin
    from exogym.strategy import DiLoCoStrategy

    calls = []
    real = builtin.resolve_task
    monkeypatch.setattr(builtin, "resolve_task",
                        lambda name, near=(): calls.append(name) or real(name, near=near))
    profile = Profile("p", {"task": "digits", "strategy": "diloco", "H": 5, "hidden": 8})
    assert profile.problems() == []
    resolved = profile.resolved
    assert profile.resolved is resolved and calls == ["digits"]
    assert resolved.task_fn is real("digits") and resolved.strategy_cls is DiLoCoStrategy
    assert resolved.task_kwargs == {"hidden": 8} and resolved.strategy_kwargs == {"H": 5}
    assert resolved.output_dir == Path("runs") / "p"
    moved = profile.with_overrides({"output_dir": str(tmp_path / "out")})
    assert moved.resolved.output_dir == tmp_path / "out"


def test_an_invalid_profile_has_no_resolution_and_names_its_problems():
    for values, words in (({"strategy": "ddp"}, "no 'task' key"),
                          ({"task": "digits", "Hh": 1}, "unknown key 'Hh'")):
        with pytest.raises(ProfileError, match=f"profile 'p':\n  {words}"):
            _ = Profile("p", values).resolved


def test_summary_is_a_table_row_even_for_a_profile_that_cannot_run():
    assert Profile("p", {"task": "digits", "num_nodes": 4, "H": 20, "batch_size": 32,
                         "description": "d", "seed": 1}).summary() == {
        "task": "digits", "strategy": "diloco", "nodes": "4",
        "key settings": "batch_size=32 H=20", "description": "d"}
    assert Profile("p", {"strategy": "ddp"}).summary() == {
        "task": "-", "strategy": "ddp", "nodes": "1", "key settings": "", "description": ""}


def test_another_strategy_keeps_the_shared_keys_and_drops_the_old_strategys_own():
    base = load_profile("digits-diloco")
    sparta = profile_for_strategy(base, "sparta", {"p_sparta": 0.01, "H": 7})
    assert sparta.strategy == "sparta" and "H" not in sparta.values
    assert sparta.values["p_sparta"] == 0.01 and sparta.values["lr"] == base.values["lr"]
    with pytest.raises(ProfileError, match="unknown strategy 'magic'"):
        profile_for_strategy(base, "magic")


def demo_warnings(caught: list) -> list:
    return [w for w in caught if "DeMoStrategy replaces" in str(w.message)]


def test_demo_tried_as_a_candidate_warns_nothing_and_warns_when_it_is_built_to_run():
    import warnings

    base = load_profile("digits-diloco")  # inner_optim = adamw, which DeMo replaces
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        demo = profile_for_strategy(base, "demo")
        assert demo.problems() == []
    assert not demo_warnings(caught), caught
    with pytest.warns(UserWarning, match="DeMoStrategy replaces AdamW with DeMo"):
        demo.resolved.strategy_cls(**demo.resolved.strategy_kwargs)  # as the run builds it


@pytest.mark.slow(reason="times two training steps")
def test_demo_timed_for_a_plan_warns_nothing():
    import warnings

    from distributed.planning.estimate import measure_model

    demo = profile_for_strategy(load_profile("digits-diloco"), "demo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        measure_model(demo, steps=1, warmup=0)
    assert not demo_warnings(caught), caught


def test_compared_runs_write_under_the_profiles_output_folder(tmp_path):
    path = write(tmp_path, "[distributed:p]\ntask = digits\nstrategy = diloco\nH = 5\n"
                           f"[distributed:q]\nbase_profile = p\noutput_dir = {tmp_path / 'q'}\n")
    plans = plan_comparison("p", ["ddp", "diloco"], str(path))
    assert [p.resolved.output_dir for p in plans] == [
        Path("runs") / "p" / "compare" / "ddp", Path("runs") / "p" / "compare" / "diloco"]
    plans = plan_comparison("q", ["fedavg"], str(path))
    assert plans[0].resolved.output_dir == tmp_path / "q" / "compare" / "fedavg"
    with pytest.raises(ProfileError, match="'Hx' \\(did you mean 'H'\\?\\)"):
        plan_comparison("p", ["ddp", "diloco"], str(path), {"Hx": 3})


def test_unknown_key_names_it_and_lists_the_accepted(tmp_path):
    path = write(tmp_path, "[distributed:p]\ntask = digits\nstrategy = diloco\nouter_lrr = 1\n")
    with pytest.raises(ProfileError) as err:
        load_profile("p", path)
    text = str(err.value)
    assert "unknown key 'outer_lrr' (did you mean 'outer_lr'?)" in text
    assert "accepted for task 'digits' and strategy 'diloco'" in text and "num_nodes" in text


def test_unknown_profile_lists_the_profiles(tmp_path):
    path = write(tmp_path, "[distributed:alpha]\ntask = digits\n[other]\nx = 1\n")
    with pytest.raises(ProfileError, match=r"no profile 'alpah'.*did you mean 'alpha'.*alpha"):
        load_profile("alpah", path)


def test_base_profile_cycle_is_reported(tmp_path):
    path = write(tmp_path, "[distributed:a]\nbase_profile = b\ntask = digits\n"
                           "[distributed:b]\nbase_profile = a\n")
    with pytest.raises(ProfileError, match="base_profile cycle: a -> b -> a"):
        load_profile("a", path)


def test_missing_task_unknown_strategy_and_unknown_task(tmp_path):
    path = write(tmp_path, "[distributed:a]\nstrategy = diloco\n"
                           "[distributed:b]\ntask = digits\nstrategy = magic\n"
                           "[distributed:c]\ntask = nosuch\n")
    with pytest.raises(ProfileError, match="no 'task' key"):
        load_profile("a", path)
    with pytest.raises(ProfileError, match="unknown strategy 'magic'"):
        load_profile("b", path)
    with pytest.raises(ProfileError, match="unknown task 'nosuch'"):
        load_profile("c", path)


def test_a_profile_without_a_task_lists_every_built_in_task(tmp_path):
    from distributed.tasks import BUILTIN_TASK_NAMES

    path = write(tmp_path, "[distributed:a]\nstrategy = diloco\n")
    with pytest.raises(ProfileError) as refused:
        load_profile("a", path)
    listed = str(refused.value).split("set task = ", 1)[1].split(" | ")
    assert listed[:-1] == list(BUILTIN_TASK_NAMES) and "gpt" in listed, listed
    assert listed[-1].startswith("module:function"), listed


def test_overrides_are_parsed_and_validated():
    assert parse_overrides(["lr=0.5", "H=10", "autocast=true", "device=cpu"]) == {
        "lr": 0.5, "H": 10, "autocast": True, "device": "cpu"}
    with pytest.raises(ProfileError, match="key=value"):
        parse_overrides(["lr"])
    with pytest.raises(ProfileError, match="unknown key 'Hh'"):
        load_profile("digits-diloco", overrides={"Hh": 3})


def test_missing_config_file_is_reported(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        ProfileSet(tmp_path / "none.ini")


def test_task_from_module_function(tmp_path, monkeypatch):
    (tmp_path / "mytask.py").write_text(
        "from distributed.tasks.builtin import digits_task\n"
        "def build(width: int = 16):\n    return digits_task(hidden=width)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, "[distributed:m]\ntask = mytask:build\nstrategy = ddp\nwidth = 8\n")
    resolved = load_profile("m", path).resolved
    model, train, val = resolved.task_fn(**resolved.task_kwargs)
    assert model.fc1.out_features == 8 and len(train) > len(val)


def test_chargpt_task_uses_a_corpus_present_without_download():
    model, train, val = resolve_task("chargpt")(n_layer=1, n_embd=32, n_head=2, block_size=16)
    x, y = train[0]
    assert x.shape == (16,) and (x[1:] == y[:-1]).all()
    with torch.no_grad():
        assert float(model((x[None], y[None]))) > 0 and len(val) > 10


@pytest.mark.slow
def test_worker_exits_2_with_a_readable_message_on_a_bad_profile():
    result = subprocess.run([sys.executable, "-m", "distributed.worker", "--profile", "nope"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "no profile 'nope'" in result.stderr and "Traceback" not in result.stderr


# --------------------------------------------------------------------------- local profiles


SHARED = """
[distributed:base]
task = digits
hidden = 16
batch_size = 16
lr = 0.01
[distributed:run]
base_profile = base
strategy = diloco
H = 5
outer_lr = 0.5
"""
MINE = """
[distributed:run]
base_profile = base
strategy = ddp
[distributed:mine]
base_profile = base
strategy = diloco
H = 2
num_nodes = 2
max_steps = 4
val_size = 32
val_interval = 4
num_threads = 1
checkpoint_interval = none
output_dir = out
"""


def test_local_profiles_are_read_after_config_ini_and_replace_one_of_the_same_name_whole(
        tmp_path):
    shared = write(tmp_path, SHARED)
    local = tmp_path / "config.local.ini"
    local.write_text(MINE)
    profiles = ProfileSet(shared)
    assert profiles.names() == ["base", "run", "mine"]
    # the local "run" replaces the shared one whole: no H or outer_lr is left of it
    assert profiles.values("run") == {"task": "digits", "hidden": 16, "batch_size": 16,
                                      "lr": 0.01, "strategy": "ddp"}
    assert load_profile("mine", shared).values["H"] == 2  # built on a shared profile
    assert load_profile("run", shared).source == str(local)
    assert (profiles.source("base"), profiles.source("mine")) == (shared, local)
    assert ProfileSet(shared, local=False).names() == ["base", "run"]
    assert ProfileSet(shared, local=False).values("run")["H"] == 5


def test_errors_name_the_local_profiles_file(tmp_path):
    shared = write(tmp_path, SHARED)
    local = tmp_path / "config.local.ini"
    local.write_text("[distributed:mine]\nbase_profile = base\nstrategy = diloco\nHh = 3\n")
    with pytest.raises(ProfileError, match=r"profile 'mine' in \S*config\.local\.ini"):
        load_profile("mine", shared)
    with pytest.raises(ProfileError,
                       match=r"no profile 'nope' in \S*config\.ini and \S*config\.local\.ini"):
        load_profile("nope", shared)
    local.write_text("[distributed:broken\ntask = digits\n")
    with pytest.raises(ProfileError, match=r"config\.local\.ini"):
        ProfileSet(shared)


def test_git_ignores_local_profiles_files_beside_any_config():
    for path in ("config.local.ini", "examples/my.local.ini"):
        ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", path])
        assert ignored.returncode == 0, f"{path} is not ignored by git"


@pytest.mark.slow
def test_the_cli_lists_local_profiles_and_the_worker_trains_one(tmp_path):
    from typer.testing import CliRunner

    from cli_typer import app

    shared = write(tmp_path, SHARED)
    (tmp_path / "config.local.ini").write_text(MINE)
    listed = CliRunner().invoke(app, ["profiles", "--config", str(shared)],
                                env={"COLUMNS": "200"})
    assert listed.exit_code == 0, listed.output
    assert "│ mine " in listed.output
    title = " ".join(listed.output.split("┏")[0].split())  # the table says where it read
    assert title == f"Profiles in {shared} and {tmp_path / 'config.local.ini'}", title
    done = subprocess.run([sys.executable, "-m", "distributed.worker", "--profile", "mine",
                           "--config", "config.ini", "--quiet"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 4


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    from sshd_fixture import serve_sshd

    yield from serve_sshd(tmp_path_factory)


@pytest.mark.slow
def test_a_sync_brings_local_profiles_to_a_host_whose_worker_trains_one(sshd, tmp_path):
    """The master's config.local.ini reaches a host (the host's own kept as .bak), pre-flight
    compares it, and the worker started there trains a profile only that file holds."""
    from rich.console import Console

    from distributed.hosts.session import HostSession
    from distributed.hosts.ssh import SSHOptions
    from distributed.hosts.sync import code_files

    project, remote = tmp_path / "project", tmp_path / "remote"
    project.mkdir()
    remote.mkdir()
    (project / "config.ini").write_text(SHARED)
    (project / ".gitignore").write_text("*.local.ini\n")
    (project / "config.local.ini").write_text(MINE)
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run(["git", "-C", str(project), "add", "."], check=True)
    theirs = "[distributed:theirs]\nbase_profile = base\nstrategy = ddp\n"
    (remote / "config.local.ini").write_text(theirs)
    assert "config.local.ini" in code_files(project)
    hosts = {"master": "127.0.0.1", "master_port": free_port(),
             "workers": [{"host": sshd.addresses[0], "ssh_port": sshd.port,
                          "project_path": str(remote)}],
             "ssh_user": sshd.user, "ssh_key_path": str(sshd.key_path),
             "python_env": sys.executable, "project_path": str(project)}
    out = io.StringIO()
    ssh = SSHOptions(known_hosts_path=sshd.known_hosts, ssh_config_path=sshd.ssh_config,
                     allow_agent=False, look_for_keys=False, connect_timeout=5.0)
    with HostSession(hosts, ssh=ssh, project_root=project, probe_timeout=60.0,
                     console=Console(file=out, width=200)) as session:
        before = session.preflight(raise_on_failure=False, show=False)
        problems = " ".join(before.checks[1].problems)
        assert "config.local.ini" in problems and "git does not hold" in problems
        stats = session.sync()
        after = session.preflight(raise_on_failure=False, show=False)
        assert not any("code differs" in p for p in after.checks[1].problems), after.checks[1]
        done = session.shell(1).run(
            f"cd {remote} && PYTHONPATH={ROOT} {sys.executable} -m distributed.worker "
            "--profile mine --config config.ini --quiet", timeout=300)
    assert [s.kept for s in stats] == [("config.local.ini",)]
    assert (remote / "config.local.ini").read_text() == MINE
    assert (remote / "config.local.ini.bak").read_text() == theirs
    assert "kept it there as config.local.ini.bak" in out.getvalue()
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((remote / "out" / "summary.json").read_text())["steps"] == 4
