"""Runs that share an output folder: every run has a folder and an identity of its own, a
rerun never writes over an earlier run, ``--resume`` continues only a run with the same
settings, and the command printed on Ctrl-C continues this run, never another.

The command line is run as a user types it (``python cli_typer.py ...`` in a
subprocess, in a folder of its own); the folder logic also on its own, in process and
through a real subprocess as on a master host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import warm
from doc_blocks import code_block
from ranks import ROOT, interrupt_after_checkpoints
from safetensors import safe_open

from distributed.hosts.onhost import runfolders
from distributed.profiles.profile import load_profile
from distributed.profiles.run_dir import (
    RESUMABLE_KEYS,
    NothingToResumeError,
    RunFolderError,
    RunIdentity,
    place_run,
    rank_identity,
    replace_rank_folder,
    take_placement,
)

#: A run of a few steps with a checkpoint every 2 (2 ranks, one thread each).
SMALL = ["--set", "num_nodes=2", "--set", "val_size=16", "--set", "num_threads=1",
         "--set", "H=2", "--set", "checkpoint_interval=2", "--logger", "none"]


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*warm.cli_command(), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={**os.environ, "COLUMNS": "400"})


def said(result: subprocess.CompletedProcess[str]) -> str:
    """stdout and stderr as one line of words (soft-wrapped lines joined)."""
    return " ".join((result.stdout + result.stderr).split())


def outputs(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in ("summary.json", "model.safetensors")}


def identity_in(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text())


def profile(tmp_path: Path, **overrides):
    values = {"max_steps": 4, "num_nodes": 2, "output_dir": str(tmp_path / "runs" / "p"),
              **overrides}
    return load_profile("digits-diloco", overrides=values)


# --- the identity ----------------------------------------------------------------------


def test_the_fingerprint_leaves_out_only_what_may_change_on_resume(tmp_path):
    base = RunIdentity.of(profile(tmp_path))
    # Keys that may change on resume do not change it...
    assert RunIdentity.of(profile(tmp_path, max_steps=400, checkpoint_interval=7,
                                  val_interval=3, logger=None, device="cpu",
                                  output_dir="elsewhere")).fingerprint == base.fingerprint
    # ...a default written out is the same run...
    assert RunIdentity.of(profile(tmp_path, autocast=False)).fingerprint == base.fingerprint
    # ...and anything else is another run, named key by key.
    other = RunIdentity.of(profile(tmp_path, lr=0.01, batch_size=8))
    assert other.fingerprint != base.fingerprint
    assert base.differences(other) == ["batch_size (32 there, 8 here)",
                                       "lr (0.003 there, 0.01 here)"]
    # the ranks that really run count (a hosts file replaces num_nodes)
    assert RunIdentity.of(profile(tmp_path), ranks=3).fingerprint != base.fingerprint
    assert {"max_steps", "checkpoint_interval", "logger", "device"} <= RESUMABLE_KEYS
    with pytest.raises(RunFolderError, match="--run-started 'yesterday' is not a start time"):
        RunIdentity.of(profile(tmp_path), started="yesterday")


# --- folders, in process -----------------------------------------------------------------


def test_a_new_run_takes_the_next_free_folder_and_the_latest_pointer_follows(tmp_path):
    first = place_run(profile(tmp_path))
    base = tmp_path / "runs" / "p"
    assert first.folder == base and identity_in(base)["fingerprint"] == first.identity.fingerprint
    second = place_run(profile(tmp_path, lr=0.01))
    third = place_run(profile(tmp_path))
    assert [second.folder, third.folder] == [tmp_path / "runs/p-2", tmp_path / "runs/p-3"]
    assert "runs/p holds an earlier run, kept as it is" in second.note
    assert (tmp_path / "runs/p.latest").resolve() == tmp_path / "runs/p-3"
    # A folder that exists but holds no run (only a file of the person's) is taken.
    (tmp_path / "runs/q").mkdir()
    (tmp_path / "runs/q/notes.txt").write_text("mine")
    assert place_run(profile(tmp_path, output_dir=str(tmp_path / "runs/q"))).folder == \
        tmp_path / "runs/q"


def test_two_runs_claiming_the_same_folder_at_once_get_two_folders(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    identity = RunIdentity.of(profile(tmp_path)).as_dict()
    base = str(tmp_path / "runs" / "p")
    with ThreadPoolExecutor(8) as pool:
        claimed = list(pool.map(lambda _: runfolders.claim_new(base, identity)["folder"],
                                range(8)))
    assert len(set(claimed)) == 8


def test_overwrite_replaces_only_the_earlier_runs_outputs(tmp_path):
    base = tmp_path / "runs" / "p"
    earlier = place_run(profile(tmp_path, lr=0.01))
    for name in ("model.safetensors", "summary.json"):
        (base / name).write_text("earlier")
    (base / "checkpoints/p/rank0").mkdir(parents=True)
    (base / "notes.txt").write_text("the person's own")
    again = place_run(profile(tmp_path), overwrite=True)
    assert again.folder == base and again.replacing
    # nothing is removed until the run starts: a run refused meanwhile loses nothing
    assert identity_in(base)["fingerprint"] == earlier.identity.fingerprint
    assert (base / "model.safetensors").read_text() == "earlier"
    assert f"started {earlier.identity.started}" in again.note and "as this run starts" \
        in again.note
    taken = take_placement(again)
    assert sorted(p.name for p in base.iterdir()) == ["notes.txt", "run.json"]
    assert identity_in(base)["fingerprint"] == again.identity.fingerprint
    assert not taken.replacing and "removed" in taken.note
    with pytest.raises(RunFolderError, match="--resume continues a run and --overwrite"):
        place_run(profile(tmp_path), resume=True, overwrite=True)


def test_resume_continues_the_newest_run_with_the_same_settings(tmp_path):
    a = place_run(profile(tmp_path), started="2024-01-01T00:00:00Z")
    b = place_run(profile(tmp_path, lr=0.01), started="2024-01-02T00:00:00Z")
    for placed in (a, b):
        (placed.folder / "checkpoints/digits-diloco/rank0").mkdir(parents=True)
        (placed.folder / "checkpoints/digits-diloco/rank0/step00000002.ckpt").write_text("")
    again = place_run(profile(tmp_path, lr=0.01, max_steps=10), resume=True)
    assert again.folder == b.folder and again.resume and again.steps == {0: 2}
    assert again.identity.started == "2024-01-02T00:00:00Z"  # the run it continues
    assert "changed since: max_steps 4 -> 10" in again.note
    first = place_run(profile(tmp_path), resume=True)
    assert first.folder == a.folder
    with pytest.raises(RunFolderError) as refused:
        place_run(profile(tmp_path, lr=0.02), resume=True)
    assert "no run in" in str(refused.value)
    assert "lr (0.01 there, 0.02 here)" in str(refused.value)  # the latest: b


def test_resume_with_nothing_to_resume_stops_unless_asked_to_start_afresh(tmp_path):
    with pytest.raises(NothingToResumeError, match="nothing to resume: no run of profile "
                                                   "digits-diloco in"):
        place_run(profile(tmp_path), resume=True)
    assert not (tmp_path / "runs").exists()  # looking created nothing
    fresh = place_run(profile(tmp_path), resume=True, fresh_if_none=True)
    assert not fresh.resume and fresh.folder == tmp_path / "runs" / "p"
    assert fresh.note.startswith("nothing to resume (")
    # a run with these settings but no checkpoint: nothing to resume either
    with pytest.raises(NothingToResumeError, match="has no checkpoint"):
        place_run(profile(tmp_path), resume=True)
    with pytest.raises(RunFolderError, match="--fresh-if-none goes with --resume"):
        place_run(profile(tmp_path), fresh_if_none=True)


def test_outputs_from_before_run_identities_are_never_resumed_nor_written_over(tmp_path):
    base = tmp_path / "runs" / "p"
    base.mkdir(parents=True)
    (base / "model.safetensors").write_text("old")
    with pytest.raises(RunFolderError, match="from before runs had an identity"):
        place_run(profile(tmp_path), resume=True)
    assert place_run(profile(tmp_path)).folder == tmp_path / "runs/p-2"
    assert (base / "model.safetensors").read_text() == "old"


def test_runs_of_one_folder_started_within_a_second_are_told_apart(tmp_path, monkeypatch):
    # recommend times its candidates one after the other in one scratch folder, each run
    # replacing the last: a start time in whole seconds made the second of two runs
    # within a second read as the first with different settings ("the settings on this
    # host differ"), and a noisy machine's timing run failed.
    import time as real_time
    import types

    from distributed.profiles import run_dir

    clock = types.SimpleNamespace(**vars(real_time))  # one second, read at two moments
    clock.now = 1_800_000_000.25
    clock.time = lambda: clock.now
    clock.gmtime = lambda secs=None: real_time.gmtime(clock.now if secs is None else secs)
    monkeypatch.setattr(run_dir, "time", clock)
    first = place_run(profile(tmp_path, output_dir="runs/probe"), overwrite=True)
    replace_rank_folder(profile(tmp_path, output_dir=str(first.folder)), first.identity)
    other = profile(tmp_path, output_dir=str(first.folder), lr=0.5)
    clock.now += 0.5
    second = place_run(other, overwrite=True)
    assert second.identity.started != first.identity.started
    replaced = rank_identity(other, 0, 2, overwrite=True, started=second.identity.started)
    assert replaced.started == second.identity.started


# --- a rank started with rank variables: the folder it is given --------------------------


def test_rank_zero_takes_the_folder_claimed_for_it_and_refuses_another_runs(tmp_path):
    placed = place_run(profile(tmp_path))
    given = profile(tmp_path, output_dir=str(placed.folder))
    started = placed.identity.started
    assert rank_identity(given, 0, 2, started=started).same_run(placed.identity)
    assert rank_identity(given, 1, 2, started=started).fingerprint == placed.identity.fingerprint
    # Another new run given that folder is refused, unless it may overwrite.
    with pytest.raises(RunFolderError, match="holds an earlier run .* add --overwrite"):
        rank_identity(given, 0, 2, started="2030-01-01T00:00:00Z")
    replaced = rank_identity(given, 0, 2, overwrite=True, started="2030-01-01T00:00:00Z")
    assert identity_in(placed.folder)["started"] == placed.identity.started  # not yet
    replace_rank_folder(given, replaced)  # as the run starts, every check passed
    assert identity_in(placed.folder)["started"] == replaced.started == "2030-01-01T00:00:00Z"
    # A host whose profile differs from the launcher's says so.
    with pytest.raises(RunFolderError, match=r"settings on this host differ .*lr \(0.003 "
                                             r"there, 0.5 on this host\).*--sync"):
        rank_identity(profile(tmp_path, output_dir=str(placed.folder), lr=0.5), 0, 2,
                      started="2030-01-01T00:00:00Z")
    # Resuming: the same settings continue it, others are refused naming the keys.
    assert rank_identity(given, 0, 2, resume=True).started == "2030-01-01T00:00:00Z"
    with pytest.raises(RunFolderError, match=r"has other settings.*H \(20 there, 5 here\)"):
        rank_identity(profile(tmp_path, output_dir=str(placed.folder), H=5), 0, 2,
                      resume=True)


# --- the folder work on a master host: the same module, run there as source ---------------


def test_the_folder_is_chosen_on_the_master_through_its_own_python(tmp_path):
    from distributed.app.run import master_folders
    from distributed.hosts.remote import LocalShell

    project = tmp_path / "master-checkout"
    project.mkdir()
    launcher = SimpleNamespace(session=SimpleNamespace(shell=lambda host: LocalShell()))
    config = SimpleNamespace(hosts=[SimpleNamespace(host="127.0.0.1", project_path=str(project),
                                                    python_env=sys.executable)])
    call = master_folders(launcher, config)
    relative = profile(tmp_path, output_dir="runs/p")
    first = place_run(relative, call=call, where=" on 127.0.0.1")
    second = place_run(relative, call=call, where=" on 127.0.0.1")
    assert [first.folder, second.folder] == [Path("runs/p"), Path("runs/p-2")]
    assert identity_in(project / "runs/p-2")["started"] == second.identity.started
    assert os.readlink(project / "runs/p.latest") == "p-2"
    assert not (tmp_path / "runs").exists()  # nothing written here, all on the "master"
    with pytest.raises(NothingToResumeError, match="has no checkpoint"):
        place_run(relative, resume=True, call=call, where=" on 127.0.0.1")
    bad = SimpleNamespace(hosts=[SimpleNamespace(host="m", project_path=str(tmp_path / "none"),
                                                 python_env=sys.executable)])
    with pytest.raises(RunFolderError, match="on m: the command on m ended with exit code 90"):
        place_run(relative, call=master_folders(launcher, bad), where=" on m")


# --- the three cases of the issue, through the command line ------------------------------


@pytest.mark.slow(reason="several whole runs into one folder, each a command of its own")
def test_a_rerun_never_replaces_the_last_model_and_overwrite_is_asked_for(tmp_path):
    first = cli("distributed-train", "digits-diloco", *SMALL, "--set", "max_steps=4",
                cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    base = tmp_path / "runs/digits-diloco"
    kept = outputs(base)
    rerun = cli("distributed-train", "digits-diloco", *SMALL, "--set", "max_steps=2",
                cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert outputs(base) == kept
    second = tmp_path / "runs/digits-diloco-2"
    assert "this run's folder: runs/digits-diloco-2 (runs/digits-diloco holds an earlier run, " \
           "kept as it is" in said(rerun)
    assert "final model in runs/digits-diloco-2/model.safetensors" in said(rerun)
    assert (tmp_path / "runs/digits-diloco.latest").resolve() == second
    summary = json.loads((second / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["run"] == identity_in(second)
    with safe_open(second / "model.safetensors", "pt") as f:
        metadata = f.metadata()
    assert metadata["run_fingerprint"] == identity_in(second)["fingerprint"]
    assert json.loads(metadata["run"])["started"] == identity_in(second)["started"]
    assert json.loads((base / "summary.json").read_text())["steps"] == 4

    # an overwrite refused for a bad value, found by the strategy or only as the task is
    # built, loses nothing of the earlier run
    kept = {p.relative_to(base): p.read_bytes() for p in base.rglob("*") if p.is_file()}
    assert {Path("run.json"), Path("trace.jsonl")} <= kept.keys()
    assert any(p.parts[0] == "checkpoints" for p in kept)
    for bad in ("lr=abc", "model=xyz"):
        refused = cli("distributed-train", "digits-diloco", *SMALL, "--set", "max_steps=2",
                      "--overwrite", "--set", bad, cwd=tmp_path)
        assert refused.returncode == 2, said(refused)
        assert {p.relative_to(base): p.read_bytes() for p in base.rglob("*")
                if p.is_file()} == kept
    replaced = cli("distributed-train", "digits-diloco", *SMALL, "--set", "max_steps=2",
                   "--overwrite", cwd=tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    assert ("--overwrite: removed the earlier run's run.json, model.safetensors, summary.json, "
            "trace.jsonl, checkpoints; it was profile digits-diloco") in said(replaced)
    assert json.loads((base / "summary.json").read_text())["steps"] == 2
    assert json.loads((second / "summary.json").read_text()) == summary  # untouched


@pytest.mark.slow
def test_resume_with_nothing_to_resume_exits_2_and_starts_nothing(tmp_path):
    nothing = cli("distributed-train", "digits-diloco", *SMALL, "--set", "max_steps=2",
                  "--resume", cwd=tmp_path)
    assert nothing.returncode == 2, nothing.stdout + nothing.stderr
    assert ("error: --resume: nothing to resume: no run of profile digits-diloco in "
            "runs/digits-diloco") in said(nothing)
    assert "[local:" not in said(nothing) and not (tmp_path / "runs").exists()
    fresh = cli("distributed-train", "digits-diloco", *SMALL, "--set", "max_steps=2",
                "--resume", "--fresh-if-none", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert "nothing to resume (" in said(fresh)
    assert json.loads((tmp_path / "runs/digits-diloco/summary.json").read_text())["steps"] == 2
    # The worker alone, as a person runs it, stops the same way.
    worker = subprocess.run(
        [sys.executable, "-m", "distributed.worker", "--profile", "digits-diloco", "--resume",
         "--quiet", "--set", "output_dir=runs/none"], capture_output=True, text=True,
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert worker.returncode == 2 and "nothing to resume" in worker.stderr, worker.stderr


@pytest.mark.slow(
    reason="a run, a second one interrupted after two checkpoints, then resumed by its "
           "printed command")
def test_ctrl_c_names_this_runs_checkpoint_and_its_command_continues_this_run(tmp_path):
    finished = cli("distributed-train", "digits-diloco", *SMALL, "--set", "max_steps=6",
                   "--set", "output_dir=runs/stale", cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr
    stale = tmp_path / "runs/stale"
    kept = outputs(stale)

    args = ["distributed-train", "digits-diloco", *SMALL, "--set", "max_steps=100000",
            "--set", "output_dir=runs/stale", "--set", "lr=0.01"]
    returncode, _, err = interrupt_after_checkpoints(
        args, tmp_path, tmp_path / "runs/stale-2/checkpoints/digits-diloco/rank0", count=2)
    assert returncode == 130, err
    words = " ".join(err.split())
    assert "is in runs/stale-2/checkpoints/digits-diloco;" in words, err
    assert "runs/stale/" not in words, err
    command = err.strip().splitlines()[-1].strip().split()
    assert command[:4] == ["python", "cli_typer.py", "distributed-train", "digits-diloco"]
    assert "output_dir=runs/stale-2" in command and command[-1] == "--resume", err
    step = int(words.split("newest checkpoint, at step ")[1].split(",")[0])

    # The printed command (with a nearer end: max_steps may change on resume) continues it.
    resumed = cli(*command[2:], "--set", f"max_steps={step + 2}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "continuing the run in runs/stale-2 " in said(resumed)
    assert f"from its checkpoint at step {step}; changed since: max_steps 100000 -> " \
           f"{step + 2}" in said(resumed)
    assert "already finished" not in said(resumed)
    run = identity_in(tmp_path / "runs/stale-2")
    assert run["settings"]["lr"] == 0.01 and run["resumed"][0]["step"] == step
    assert json.loads((tmp_path / "runs/stale-2/summary.json").read_text())["run"][
        "fingerprint"] == run["fingerprint"]
    assert outputs(stale) == kept  # the first run (lr 0.003) is as it was

    # Its settings with --resume continue the first run instead: already finished.
    first = cli("distributed-train", "digits-diloco", *SMALL, "--set", "max_steps=6",
                "--set", "output_dir=runs/stale", "--resume", cwd=tmp_path)
    assert first.returncode == 0 and "runs/stale already finished at step 6" in said(first)
    # Settings of neither: refused, naming what differs from the latest run.
    neither = cli("distributed-train", "digits-diloco", *SMALL, "--set", "max_steps=6",
                  "--set", "output_dir=runs/stale", "--set", "lr=0.5", "--resume",
                  cwd=tmp_path)
    assert neither.returncode == 2
    assert "differs in lr (0.01 there, 0.5 here)" in said(neither)


# --- the documented model-loading snippet, from another folder ---------------------------


@pytest.mark.slow
def test_the_documented_snippet_loads_the_newest_model_from_another_folder(tmp_path):
    """As printed, run where the run was made (not the project's root), with what
    ``pip install -e`` gives: exogym and exogym_distributed, and no ``distributed``."""
    made = cli("distributed-train", "digits-diloco", *SMALL, "--set", "max_steps=2",
               cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    code = code_block("docs/hosts.md", "Load it into the task's model", "python")
    check = ("\nfrom safetensors.torch import load_file as _load\n"
             "assert all((model.state_dict()[k] == v).all() for k, v in _load(path).items())\n"
             "print('loaded', metadata['run_profile'])\n")
    site = tmp_path / "site"  # what pip install -e gives: both packages, from the checkout
    site.mkdir()
    (site / "exogym").symlink_to(ROOT / "exogym")
    (site / "exogym_distributed").symlink_to(ROOT / "distributed")
    env = {**os.environ, "PYTHONPATH": str(site)}
    without = subprocess.run([sys.executable, "-c", "import distributed"], cwd=tmp_path,
                             env=env, capture_output=True, text=True)
    assert "No module named 'distributed'" in without.stderr  # dask's name stays free
    loaded = subprocess.run([sys.executable, "-c", code + check], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip().endswith("loaded digits-diloco")


# --- across hosts: the folder is chosen on the master, and every rank is given it ---------


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    from sshd_fixture import serve_sshd

    yield from serve_sshd(tmp_path_factory)


@pytest.mark.slow(reason="several runs across hosts over SSH, one of them resumed")
def test_runs_across_hosts_get_folders_of_their_own_and_resume_only_their_settings(
        sshd, tmp_path):
    from faces_support import sshd_hosts

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(sshd_hosts(sshd, workers=1)))
    out = tmp_path / "net"
    common = ["distributed-train", "digits-diloco", "--hosts", hosts,
              "--known-hosts", sshd.known_hosts, "--ssh-config", sshd.ssh_config,
              "--run-dir", tmp_path / "launch", *SMALL, "--set", f"output_dir={out}"]
    first = cli(*common, "--set", "max_steps=4", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    kept = outputs(out)
    second = cli(*common, "--set", "max_steps=4", cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"this run's folder: {out}-2 ({out} holds an earlier run" in said(second)
    assert f"final model in {out}-2/model.safetensors" in said(second)
    assert outputs(out) == kept
    claimed = identity_in(Path(f"{out}-2"))
    # rank 0 took the folder claimed for it: the same identity, written by the launcher's side
    assert json.loads((Path(f"{out}-2") / "summary.json").read_text())["run"] == claimed
    assert claimed["settings"]["num_nodes"] == 2

    resumed = cli(*common, "--set", "max_steps=6", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"continuing the run in {out}-2 " in said(resumed)
    assert "rank 0: resumed from step 4" in said(resumed)
    run = identity_in(Path(f"{out}-2"))
    assert run["started"] == claimed["started"] and len(run["resumed"]) == 1
    with safe_open(Path(f"{out}-2") / "model.safetensors", "pt") as f:
        assert f.metadata()["run_started"] == claimed["started"]

    other = cli(*common, "--set", "max_steps=6", "--set", "lr=0.5", "--resume", cwd=tmp_path)
    assert other.returncode == 2
    assert "differs in lr (0.003 there, 0.5 here)" in said(other)
    assert "Pre-flight" in said(other) and "[127.0.0.1:0]" not in said(other)  # no rank ran
