"""A full disk names the file it could not write and leaves no temporary file; SIGTERM and
Ctrl-C stop a run keeping its checkpoint and its trace."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest
import torch

from exogym.base import io as exo_io
from exogym.base.io import DiskFullError, atomic_torch_save, atomic_write_bytes


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_names_the_file_and_leaves_no_temporary_file(tmp_path, monkeypatch, code):
    target = tmp_path / "run" / "model.bin"

    real_fdopen = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(code, os.strerror(code))

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(exo_io.os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode)))
    for write in (lambda: atomic_write_bytes(target, b"x" * 1000),
                  lambda: atomic_torch_save({"w": torch.zeros(100)}, target)):
        with pytest.raises(DiskFullError) as raised:
            write()
        assert str(raised.value) == f"no space left on device: {target}"
        assert raised.value.errno == code and isinstance(raised.value, OSError)
        assert list(target.parent.iterdir()) == []  # the temporary file is gone


def test_a_disk_without_room_for_the_temporary_file_says_so(tmp_path, monkeypatch):
    target = tmp_path / "trace.jsonl"

    real_open = os.open

    def no_inode(name, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(exo_io.os, "open", no_inode)
    with pytest.raises(DiskFullError, match=f"^no space left on device: {target}$"):
        exo_io.atomic_write_text(target, "{}")


def test_a_signal_as_the_temporary_file_is_made_leaves_no_file(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM whose handler runs the moment the temporary file exists, before
    the write has its descriptor: the file is removed all the same."""
    real_open = os.open
    made = []

    def open_then_interrupted(name, flags, *args, **kwargs):
        fd = real_open(name, flags, *args, **kwargs)
        made.append(name)
        os.close(fd)
        raise KeyboardInterrupt

    monkeypatch.setattr(exo_io.os, "open", open_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(tmp_path / "step00000025.ckpt", b"x" * 100)
    assert len(made) == 1 and Path(made[0]).parent == tmp_path
    assert list(tmp_path.iterdir()) == []


def test_a_temporary_name_already_taken_is_left_alone(tmp_path, monkeypatch):
    target = tmp_path / "model.bin"
    names = iter([tmp_path / ".model.bin.taken.tmp", tmp_path / ".model.bin.free.tmp"])
    monkeypatch.setattr(exo_io, "_temp_beside", lambda path: next(names))
    (tmp_path / ".model.bin.taken.tmp").write_bytes(b"another writer's")
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert (tmp_path / ".model.bin.taken.tmp").read_bytes() == b"another writer's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.bin.taken.tmp", "model.bin"]


def test_other_write_errors_pass_unchanged(tmp_path, monkeypatch):
    real_fdopen = os.fdopen

    def denied(fd, mode):
        real_fdopen(fd, mode).close()
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(exo_io.os, "fdopen", denied)
    with pytest.raises(PermissionError):
        atomic_write_bytes(tmp_path / "f", b"x")
    assert list(Path(tmp_path).iterdir()) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_stops_a_run_as_ctrl_c_does_and_its_resume_continues_the_trace(tmp_path,
                                                                               signum):
    import json
    import subprocess
    import sys

    from ranks import ROOT, interrupt_after_checkpoints

    from distributed.app.replay import load_recording

    args = ["distributed-train", "digits-diloco", "--set", "max_steps=100000", "--set",
            "num_nodes=2", "--set", "checkpoint_interval=5", "--set", "num_threads=1",
            "--set", "val_size=16", "--set", "H=5", "--logger", "none"]
    folder = tmp_path / "runs/digits-diloco"
    returncode, _, err = interrupt_after_checkpoints(
        args, tmp_path, folder / "checkpoints/digits-diloco/rank0", signum=signum)
    assert returncode == 128 + signum, err
    assert "Traceback" not in err, err
    assert "this run's newest checkpoint, at step" in err, err
    command = err.strip().splitlines()[-1].strip()
    assert command.endswith("--set logger=none --resume"), err
    trace = folder / "trace.jsonl"
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[-1]["kind"] == "end" and lines[-1]["error"] == "interrupted", lines[-1]
    assert [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")] == []
    before = {line["step"] for line in lines if line["kind"] == "step"}
    # Every step up to the checkpoint the signal came after reached the trace, also those
    # the ranks had not sent yet when it came.
    assert before and max(before) >= 5, sorted(before)

    # The resumed run, to a few steps past the checkpoint, writes on after those lines.
    checkpoint_steps = [int(p.name.split(".")[0].rsplit("_", 1)[-1].lstrip("step"))
                        for p in (folder / "checkpoints/digits-diloco/rank0").glob("*.ckpt")
                        if any(c.isdigit() for c in p.name)]
    resumed_to = max(before) + 10
    resumed = [a if a != "max_steps=100000" else f"max_steps={resumed_to}" for a in args]
    done = subprocess.run([sys.executable, str(ROOT / "cli_typer.py"), *resumed, "--resume"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 0, done.stderr
    after = [json.loads(line) for line in trace.read_text().splitlines()]
    assert after[:len(lines)] == lines  # the interrupted part, kept whole
    runs = [line for line in after if line["kind"] == "run"]
    assert [r["resumed"] for r in runs] == [False, True]
    later = {line["step"] for line in after[len(lines):] if line["kind"] == "step"}
    assert later and max(later) == resumed_to and min(later) <= max(before) + 1, \
        (sorted(before)[-3:], sorted(later)[:3], checkpoint_steps)
    assert after[-1]["kind"] == "end" and not after[-1].get("failed")
    recording = load_recording(folder)  # replay reads the whole trace, as one run
    from distributed.app.replay import timeline

    real = timeline(recording.lines, recording.round_steps, recording.num_nodes)
    steps = sorted(real.times)
    assert steps == list(range(1, resumed_to + 1)), steps[:5]
    assert all(real.times[b] > real.times[a] for a, b in zip(steps, steps[1:]))
    evaluated = [step for step, _, _ in real.evaluations]
    assert len(evaluated) == len(set(evaluated)), evaluated


def test_a_ctrl_c_while_the_parent_hands_on_a_message_waits_until_each_event_is_handed_once():
    """Ctrl-C in the middle of handing on a message's first event: the message is handed on
    whole, each event once, before the interruption stops the collecting (a step was lost
    to the trace when it came in the middle)."""
    import multiprocessing as mp
    import types

    from exogym.run.trainer import Trainer, _forward_rest

    parent_end, child_end = mp.Pipe()
    child_end.send([{"event": "step", "rank": 0, "step": s} for s in (1, 2, 3)])
    never_read, never_written = os.pipe()  # a rank process that has not exited
    handed: list[int] = []

    def on_event(event: dict) -> None:
        if not handed:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, while this event is handled
            for _ in range(1000):  # Python runs a handler between two bytecodes
                pass
        handed.append(event["step"])

    try:
        with pytest.raises(KeyboardInterrupt):
            Trainer._collect([types.SimpleNamespace(sentinel=never_read)], [parent_end],
                             on_event)
        _forward_rest([parent_end], on_event)  # the way out: nothing is left
    finally:
        for end in (parent_end, child_end):
            end.close()
        os.close(never_read)
        os.close(never_written)
    assert handed == [1, 2, 3]


def test_interruptions_wait_for_the_end_of_a_deferred_block_then_reach_their_handlers():
    from exogym.base.stop_signal import Terminated, interruptions_deferred, sigterm_as_interrupt

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interruptions_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # Python runs a handler between two bytecodes
                pass
            reached.append("end of the block")
    assert reached == ["end of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # as it was
    with sigterm_as_interrupt():
        with pytest.raises(Terminated):
            with interruptions_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):
                    pass
                reached.append("again")
    assert reached[-1] == "again"
    # asked twice, it does not wait: a block stuck on something must not hold the way out
    with pytest.raises(KeyboardInterrupt):
        with interruptions_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
            reached.append("not reached")
    assert reached[-1] == "again"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
