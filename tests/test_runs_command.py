"""``exogym runs`` lists a tree of run folders with how each went; ``runs clean`` removes the
failed and refused ones after asking, and keeps every ``BASE.latest`` pointing at a run."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import warm

from distributed.app.run_list import clean_runs, list_runs, resume_note
from distributed.hosts.onhost import runfolders


def cli(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*warm.cli_command(), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, input=stdin,
                          env={**os.environ, "COLUMNS": "250"})


def claim(base: Path, started: str, strategy: str = "diloco") -> Path:
    identity = {"profile": base.name, "fingerprint": "f", "started": started,
                "settings": {"strategy": strategy}, "may_change": {}}
    return Path(runfolders.claim_new(str(base), identity)["folder"])


def trace(folder: Path, *lines: dict, name: str = "trace.jsonl") -> Path:
    path = folder / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def a_tree(root: Path) -> dict[str, Path]:
    """One run of each kind, under two bases."""
    base = root / "digits-diloco"
    made = {}
    made["finished"] = claim(base, "2026-11-01T10:00:00")
    (made["finished"] / "summary.json").write_text(json.dumps(
        {"steps": 300, "final_val_global_loss": 0.1234, "final_train_loss": 0.2}))
    trace(made["finished"], {"kind": "step", "step": 300}, {"kind": "end", "status": "ok",
                                                           "steps": 300})
    made["stopped"] = claim(base, "2026-11-02T10:00:00")
    trace(made["stopped"], {"kind": "eval", "step": 100, "val_loss": 0.5},
          {"kind": "end", "status": "failed", "error": "interrupted", "steps": 140})
    made["failed"] = claim(base, "2026-11-03T10:00:00")
    trace(made["failed"], {"kind": "end", "status": "failed", "error": "rank 1 failed: boom",
                           "steps": 7})
    made["refused"] = claim(base, "2026-11-04T10:00:00")
    other = root / "digits-ddp"
    made["running"] = claim(other, "2026-11-05T10:00:00", "ddp")
    trace(made["running"], {"kind": "step", "rank": 0, "step": 42},
          name=".trace.jsonl.abc.tmp")
    made["killed"] = claim(other, "2026-11-06T10:00:00", "ddp")
    old = trace(made["killed"], {"kind": "step", "rank": 0, "step": 9},
                name=".trace.jsonl.def.tmp")
    long_ago = time.time() - 3600
    os.utime(old, (long_ago, long_ago))
    return made


def test_runs_are_listed_with_how_each_went(tmp_path):
    made = a_tree(tmp_path / "runs")
    rows = {row.folder: row for row in list_runs(tmp_path / "runs")}
    assert {row.status for row in rows.values()} == {"finished", "stopped", "failed",
                                                    "refused", "running"}
    assert rows[made["finished"]].steps == 300 and rows[made["finished"]].final_loss == 0.1234
    assert rows[made["stopped"]].status == "stopped" and rows[made["stopped"]].steps == 140
    assert rows[made["stopped"]].final_loss == 0.5
    assert rows[made["failed"]].why == "rank 1 failed: boom"
    assert rows[made["refused"]].status == "refused"
    assert rows[made["running"]].status == "running" and rows[made["running"]].steps == 42
    assert rows[made["killed"]].status == "failed" and "killed" in rows[made["killed"]].why
    assert rows[made["running"]].strategy == "ddp" and rows[made["finished"]].size_bytes > 0
    done = cli("runs", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for word in ("finished", "stopped", "failed", "refused", "running", "0.1234",
                 "2026-11-01 10:00:00", "digits-ddp"):
        assert word in done.stdout, done.stdout


@pytest.mark.slow
def test_runs_clean_asks_then_removes_failed_and_refused_runs_and_fixes_latest(tmp_path):
    runs = tmp_path / "runs"
    made = a_tree(runs)
    # digits-ddp.latest names the killed run, digits-diloco.latest the refused one
    assert runfolders.latest(str(runs / "digits-diloco")) == str(made["refused"])
    no = cli("runs", "clean", cwd=tmp_path)
    assert no.returncode == 2 and "give --yes" in no.stderr  # no terminal to ask
    assert made["failed"].is_dir()
    done = cli("runs", "clean", "--yes", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "removed 3 runs" in done.stdout, done.stdout
    for gone in ("failed", "refused", "killed"):
        assert not made[gone].exists(), gone
    for kept in ("finished", "stopped", "running"):
        assert made[kept].is_dir(), kept
    assert runfolders.latest(str(runs / "digits-diloco")) == str(made["stopped"])
    assert runfolders.latest(str(runs / "digits-ddp")) == str(made["running"])
    again = cli("runs", "clean", cwd=tmp_path)
    assert again.returncode == 0 and "nothing to clean" in again.stdout


def test_clean_keeps_a_latest_pointer_that_names_a_run_left(tmp_path):
    made = a_tree(tmp_path / "runs")
    runfolders.point_latest(str(tmp_path / "runs" / "digits-diloco"), str(made["finished"]))
    clean_runs(list_runs(tmp_path / "runs"))
    assert runfolders.latest(str(tmp_path / "runs" / "digits-diloco")) == str(made["finished"])


def test_runs_of_a_folder_that_is_not_there_says_so(tmp_path):
    done = cli("runs", "elsewhere", cwd=tmp_path)
    assert done.returncode == 2 and "elsewhere is not a folder of runs" in done.stderr


def checkpoint(folder: Path, profile: str, rank: int, step: int) -> None:
    ranks = folder / "checkpoints" / profile / f"rank{rank}"
    ranks.mkdir(parents=True, exist_ok=True)
    (ranks / f"step{step:08d}.ckpt").write_bytes(b"x")


def failed_with_checkpoints(root: Path) -> dict[str, Path]:
    made = a_tree(root)
    checkpoint(made["failed"], "digits-diloco", 0, 6)
    checkpoint(made["failed"], "digits-diloco", 1, 4)
    return made


def test_a_failed_run_with_checkpoints_says_how_to_resume_it(tmp_path):
    made = failed_with_checkpoints(tmp_path / "runs")
    rows = {row.folder: row for row in list_runs(tmp_path / "runs")}
    assert rows[made["failed"]].checkpoint_step == 4  # the newest step every rank has
    assert rows[made["refused"]].checkpoint_step is None
    assert resume_note(rows[made["refused"]]) is None
    note = resume_note(rows[made["failed"]])
    assert note is not None and "checkpoint at step 4 and can be resumed" in note
    assert f"digits-diloco --resume --set output_dir={made['failed']}" in note


@pytest.mark.slow(reason="two CLI commands")
def test_runs_and_runs_clean_say_a_failed_run_can_be_resumed(tmp_path):
    made = failed_with_checkpoints(tmp_path / "runs")
    failed = made["failed"].relative_to(tmp_path)
    listed = cli("runs", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "checkpoint at step 4 and can be resumed" in listed.stdout, listed.stdout
    assert f"--resume --set output_dir={failed}" in listed.stdout, listed.stdout
    asked = cli("runs", "clean", cwd=tmp_path)  # no terminal: it says, and removes nothing
    assert asked.returncode == 2, asked.stderr
    assert "checkpoint at step 4 and can be resumed" in asked.stdout, asked.stdout
    assert "3 runs would be removed (1 of them can be resumed" in asked.stderr, asked.stderr
    assert made["failed"].is_dir()


@pytest.mark.slow(reason="resolves the profile and imports torch")
def test_a_local_run_that_fails_after_a_checkpoint_says_how_to_resume_it(tmp_path,
                                                                         monkeypatch):
    from distributed.app import run

    def fails_after_a_checkpoint(profile, placement, *args, **kwargs):
        checkpoint(Path(placement.folder), profile.name, 0, 20)
        raise run.RunFailedError("rank 0 failed: boom")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run, "_train_local", fails_after_a_checkpoint)
    with pytest.raises(run.RunFailedError) as failed:
        run.train(run.TrainRequest(profile="digits-diloco"))
    message = str(failed.value)
    assert message.startswith("rank 0 failed: boom"), message
    assert "newest checkpoint, at step 20" in message and "--resume" in message, message


def test_runs_clean_asks_in_words_that_agree_with_the_count(tmp_path):
    from distributed.app.run_list import RunRow, clean_question

    def row(name: str, checkpoint: int | None = None) -> RunRow:
        return RunRow(tmp_path / name, "p", "ddp", "failed", None, None, 0, "", "",
                      checkpoint)

    assert clean_question([row("a")]) == "Remove this run?"
    assert clean_question([row("a"), row("b")]) == "Remove these 2 runs?"
    assert clean_question([row("a", 5)]) == \
        "Remove this run (it can be resumed: removing it loses its checkpoint)?"
    assert clean_question([row("a", 5), row("b", 7)]) == \
        "Remove these 2 runs (both can be resumed: removing them loses their checkpoints)?"
    assert clean_question([row("a", 5), row("b"), row("c")]) == (
        "Remove these 3 runs (1 of them can be resumed: removing it loses its checkpoint)?")
    assert clean_question([row("a")], asking=False) == "1 run would be removed"
