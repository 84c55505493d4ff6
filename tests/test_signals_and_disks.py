"""A full disk names the file it could not write and leaves no temporary file; SIGTERM and
Ctrl-C stop a run keeping its checkpoint and its trace."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time
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


@pytest.mark.slow(
    reason="a run interrupted after its first checkpoint, then resumed, for each signal")
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


def _checkpointing_spec(folder: Path):
    """A one-rank run that saves a checkpoint at every step into ``folder``."""
    from toys import TinyNet, toy_dataset

    from exogym.config.fit_args import RunArgs
    from exogym.run.spec import make_run_spec
    from exogym.strategy import OptimSpec, SimpleReduceStrategy

    ds = toy_dataset()
    return make_run_spec(TinyNet(), ds, ds, RunArgs(
        strategy=SimpleReduceStrategy(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1)),
        num_nodes=1, max_steps=100, batch_size=8, num_threads=1, val_size=0, device="cpu",
        checkpoint_interval=1, save_dir=str(folder), run_name="run"))


@pytest.mark.slow
@pytest.mark.parametrize("signals", [1, 2], ids=["once", "twice"])
def test_a_sigterm_at_any_line_after_a_checkpoints_rename_keeps_its_step_for_the_trace(
        tmp_path, monkeypatch, signals):
    """A rank's checkpoint and its step's event: SIGTERM at each Python line from the
    checkpoint's rename on (the process group's, and with ``twice`` its parent's too, as
    ``_stop`` sends one) leaves the step's event in the pipe, or waiting for the rank's
    last message, whenever the checkpoint file stays. A resumed run starts after that
    checkpoint: a step lost there was a step missing from the resumed timeline."""
    import multiprocessing as mp
    import sys

    from exogym.base.stop_signal import Terminated, stop_on_sigterm
    from exogym.run.checkpoint import checkpoint_path
    from exogym.run.run_rank import _one_at_a_time
    from exogym.run.spec import Placement
    from exogym.run.train_node import TrainNode
    from exogym.run.trainer import _EventBatches

    real_replace = os.replace
    armed: dict[str, int] = {}

    def line_counter(frame, event, arg):
        if event == "line" and "left" in armed:
            armed["left"] -= 1
            if armed["left"] == 0:
                del armed["left"]
                for _ in range(signals):
                    os.kill(os.getpid(), signal.SIGTERM)
        return line_counter

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        if str(dst).endswith(".ckpt") and "left" in armed:
            # from here, count the lines every frame on the stack and every new one runs
            frame = sys._getframe()
            while frame is not None:
                frame.f_trace = line_counter
                frame = frame.f_back
            sys.settrace(line_counter)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not what is tested
    previous = signal.getsignal(signal.SIGTERM)
    reader, writer = mp.Pipe(duplex=False)

    class Pipe:
        """The rank's end of its pipe, noting how many lines were left to count when the
        step's event went."""

        def send(self, message: list[dict]) -> None:
            left = armed.get("left")  # (a line counted here may be the last)
            if left is not None and any(e.get("event") == "step" for e in message):
                armed["at_send"] = left
            writer.send(message)

    # as a rank process emits: its events in batches (steps wait, unless checkpointed),
    # one at a time
    batches = _EventBatches(Pipe(), interval_s=3600.0)
    node = TrainNode(_checkpointing_spec(tmp_path), 0, torch.device("cpu"),
                     emit=_one_at_a_time(batches), placement=Placement(ranks_per_machine=1))
    node.start()
    trained = node.train_step()  # one real step; the sweep's steps reuse its event

    def train_step() -> dict:  # what comes before the checkpoint is not under test
        node.step += 1
        return {**trained, "step": node.step}

    node.train_step = train_step

    def step(line: int) -> bool:
        """The rank's next step, SIGTERM at its ``line``-th line after the checkpoint's
        rename (far: none); whether the step was stopped."""
        # the same lines each time: no checkpoint before (one cut short leaves some)
        shutil.rmtree(node.checkpoint_root, ignore_errors=True)
        stop_on_sigterm()
        armed.clear()
        armed["left"] = line
        try:
            node._one_step(time.perf_counter())
            armed.pop("left", None)  # the step is over: no more lines count
            return False
        except Terminated:
            batches.flush()  # the rank's last message (its error) takes what waits
            return True
        finally:
            sys.settrace(None)
            signal.signal(signal.SIGTERM, previous)

    try:
        far = 1 << 30
        step(far)
        lines = far - armed.pop("at_send")  # from the rename to the step's event in the pipe
        assert lines > 5, lines
        while reader.poll():
            reader.recv()
        for line in range(1, lines + 1):
            stopped = step(line)
            sent = []
            while reader.poll():
                sent += reader.recv()
            steps = {e["step"] for e in sent if e.get("event") == "step"}
            assert stopped or steps == {node.step}, (line, sent)
            if checkpoint_path(node.checkpoint_root, 0, node.step).is_file():
                assert steps == {node.step}, (
                    f"SIGTERM at line {line} of {lines} after the rename: the checkpoint "
                    "stays, its step's event was lost")
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGTERM, previous)
        reader.close()
        writer.close()


def test_a_process_that_leaves_waits_for_a_whole_block_under_way_and_lets_none_begin(
        monkeypatch):
    """A packed process's ranks are threads: one between its checkpoint's rename and the
    step's event (a ``done_whole`` block) finishes before the process leaves with
    ``os._exit``, and no rank begins such a block once the process is leaving."""
    import threading

    from exogym.base import stop_signal

    monkeypatch.setattr(stop_signal, "_whole", stop_signal._WholeBlocks())
    inside, release, order = threading.Event(), threading.Event(), []

    def rank_thread() -> None:
        with stop_signal.done_whole():
            inside.set()
            release.wait(30)
            order.append("its event sent")

    def late_rank_thread() -> None:
        with stop_signal.done_whole():
            order.append("a late block began")

    threading.Thread(target=rank_thread, daemon=True).start()
    assert inside.wait(30)
    releaser = threading.Timer(0.2, release.set)  # the block ends while the process waits
    releaser.start()
    assert stop_signal.finish_whole_blocks(30)
    order.append("the process leaves")
    late = threading.Thread(target=late_rank_thread, daemon=True)
    late.start()
    late.join(0.5)
    assert late.is_alive() and order == ["its event sent", "the process leaves"], order
    releaser.join()
    whole = stop_signal._whole
    with whole.changed:  # the held thread ends with the test, not with the test process
        whole.closed = False
        whole.changed.notify_all()
    late.join(10)
    assert not late.is_alive()
