"""Trainer behaviour a user relies on: history, errors, logs, processes, data."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from ports import free_port
from torch.utils.data import TensorDataset
from toys import TinyNet, tiny_model, toy_dataset

from exogym import LocalTrainer, RankFailedError, Trainer
from exogym.comm.averaging import average_state_dicts
from exogym.report.loggers import CSVLogger, WandbLogger
from exogym.strategy import DiLoCoStrategy, FedAvgStrategy, OptimSpec, SimpleReduceStrategy
from exogym.strategy.strategy import lr_factor

QUIET = dict(logger=None, progress=False)


@pytest.mark.slow
def test_history_has_one_row_per_rank_and_step_with_every_key():
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=DiLoCoStrategy(H=2), num_nodes=2, max_steps=4, batch_size=8,
                val_size=8, val_interval=2, **QUIET)
    assert [(r["rank"], r["step"]) for r in trainer.history] == [
        (rank, step) for step in range(1, 5) for rank in range(2)]
    for row in trainer.history:
        for key in ("rank", "step", "train_loss", "lr", "comm_bytes", "samples", "wall_s"):
            assert key in row
        assert row["samples"] == 8 * row["step"]
        assert ("val_loss" in row) == (row["step"] % 2 == 0)
        if "val_loss" in row:
            assert "val_global_loss" in row


class RecordingSink:
    """A progress object as the faces pass one: records what the trainer hands it."""

    def __init__(self):
        self.events, self.closed, self.summaries = [], 0, []

    def on_event(self, event):
        self.events.append(event)

    def close(self):
        self.closed += 1

    def finish(self, summary, title="run summary"):
        self.summaries.append(summary)


@pytest.mark.slow
def test_fit_feeds_every_event_and_the_summary_to_a_progress_object():
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    sink = RecordingSink()
    trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=3, batch_size=8,
                val_size=8, val_interval=3, logger=None, progress=sink)
    steps = [(e["rank"], e["step"]) for e in sink.events if e["event"] == "step"]
    assert sorted(steps) == [(rank, step) for rank in range(2) for step in range(1, 4)]
    assert {e["rank"] for e in sink.events if e["event"] == "start"} == {0, 1}
    assert {e["rank"] for e in sink.events if e["event"] == "done"} == {0, 1}
    assert sink.closed >= 1 and sink.summaries == [trainer.summary]


def test_fit_rejects_a_progress_value_that_is_neither_bool_nor_sink():
    ds = toy_dataset()
    with pytest.raises(TypeError, match="on_event"):
        Trainer(tiny_model(), ds, ds).fit(strategy=SimpleReduceStrategy(), max_steps=1,
                                          logger=None, progress="yes")


@pytest.mark.slow
def test_val_size_smaller_than_batch_size_works():
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=2, batch_size=32,
                val_size=5, val_interval=1, **QUIET)
    assert all("val_loss" in r for r in trainer.history)


def test_average_state_dicts_keeps_every_dtype():
    states = [{"w": torch.tensor([1.0, 3.0]), "n": torch.tensor(3), "half": torch.tensor([1.0],
              dtype=torch.float16), "flag": torch.tensor(True)},
              {"w": torch.tensor([3.0, 5.0]), "n": torch.tensor(6), "half": torch.tensor([2.0],
               dtype=torch.float16), "flag": torch.tensor(False)}]
    avg = average_state_dicts(states)
    assert torch.equal(avg["w"], torch.tensor([2.0, 4.0]))
    assert avg["n"].dtype == torch.int64 and int(avg["n"]) == 4  # 4.5 rounds to even
    assert avg["half"].dtype == torch.float16
    assert bool(avg["flag"]) is True


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_nodes=0), "num_nodes must be an integer >= 1"),
    (dict(minibatch_size=5), "minibatch_size=5 must divide batch_size=16"),
    (dict(minibatch_size=4, gradient_accumulation=3), "disagree with batch_size"),
    (dict(device="cuda"), "no CUDA GPU is available"),
    (dict(device="tpu"), "device must be"),
    (dict(val_size=-1), "val_size must be an integer >= 0"),
    (dict(max_steps=0), "max_steps must be an integer >= 1"),
    (dict(dataloader_kwargs={"shuffle": True}), "dataloader_kwargs may not set"),
    (dict(logger="mlflow"), "logger must be None"),
])
def test_bad_fit_values_fail_before_any_process_starts(kwargs, message):
    ds = toy_dataset()
    args = dict(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=2, batch_size=16,
                progress=False)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        Trainer(tiny_model(), ds, ds).fit(**args)


def test_unknown_fit_argument_is_named_with_the_accepted_ones():
    ds = toy_dataset()
    with pytest.raises(TypeError) as err:
        Trainer(tiny_model(), ds, ds).fit(strategy=SimpleReduceStrategy(), num_node=2)
    assert "'num_node' (did you mean 'num_nodes'?)" in str(err.value)
    assert "Accepted:" in str(err.value) and "batch_size" in str(err.value)


def test_unknown_strategy_argument_is_named_with_the_accepted_ones():
    with pytest.raises(TypeError) as err:
        DiLoCoStrategy(H=10, outer_lrr=0.5)
    assert "outer_lrr" in str(err.value) and "outer_lr" in str(err.value)
    with pytest.raises(TypeError, match="p_sparta"):
        SimpleReduceStrategy(p_sparta=0.1)
    with pytest.raises(TypeError, match="betas"):
        OptimSpec(torch.optim.SGD, betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="unknown optimizer 'adamx'"):
        DiLoCoStrategy(inner_optim="adamx")
    with pytest.raises(ValueError, match="lr_scheduler must be one of"):
        SimpleReduceStrategy(lr_scheduler="linear")


def test_strategy_is_required():
    ds = toy_dataset()
    with pytest.raises(TypeError, match="needs strategy="):
        Trainer(tiny_model(), ds, ds).fit(num_nodes=2)


class Explodes(TinyNet):
    calls = 0

    def forward(self, batch):
        import torch.distributed as dist

        self.calls += 1
        if dist.get_rank() == 1 and self.calls > 3:
            raise RuntimeError("rank one blew up")
        return super().forward(batch)


def _rank_processes() -> list[int]:
    """Live children of this process or of the fork server (where ranks come from)."""
    from multiprocessing import forkserver

    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    parents = {os.getpid(), server}
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) in parents and fields[0] != "Z" and int(entry.name) != server:
                kids.append(int(entry.name))
    return kids


@pytest.mark.slow
def test_a_failing_rank_ends_the_fit_with_its_traceback_and_leaves_no_process():
    ds = toy_dataset()
    torch.manual_seed(0)
    before = set(_rank_processes())  # e.g. a test sshd started by another test's fixture
    started = time.monotonic()
    with pytest.raises(RankFailedError) as err:
        Trainer(Explodes(), ds, ds).fit(strategy=DiLoCoStrategy(H=2), num_nodes=3,
                                        max_steps=50, batch_size=8, val_size=0, **QUIET)
    assert err.value.rank == 1
    assert "rank one blew up" in str(err.value) and "Traceback" in str(err.value)
    assert time.monotonic() - started < 30
    assert set(_rank_processes()) - before == set()


def test_two_fits_in_parallel_never_collide():
    ds = toy_dataset()
    results = {}

    def run(name):
        trainer = Trainer(tiny_model(), ds, ds)
        trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=3, batch_size=8,
                    val_size=0, **QUIET)
        results[name] = trainer.history

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and all(len(h) == 6 for h in results.values())


@pytest.mark.slow
def test_start_port_is_used_when_free():
    ds = toy_dataset()
    Trainer(tiny_model(), ds, ds, start_port=free_port()).fit(
        strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=1, val_size=0, **QUIET)


def test_dataset_factory_builds_each_ranks_own_data():
    seen = []

    def factory(rank, num_nodes, is_train):
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(40, 8, generator=g)
        return TensorDataset(x, (x[:, 0] > 0).long() + (rank if is_train else 0) % 3)

    trainer = Trainer(tiny_model(), factory, factory)
    trainer.fit(strategy=FedAvgStrategy(H=2), num_nodes=2, num_epochs=1, batch_size=8,
                val_size=16, val_interval=5, **QUIET)
    seen = {r["rank"]: r["step"] for r in trainer.history}
    assert seen == {0: 5, 1: 5}  # 40 samples / 8 per step, one epoch


@pytest.mark.slow
def test_model_is_back_in_train_mode_after_every_eval():
    class MustTrain(TinyNet):
        def forward(self, batch):
            if torch.is_grad_enabled():
                assert self.training, "training step ran in eval mode"
            return super().forward(batch)

    ds = toy_dataset()
    torch.manual_seed(0)
    Trainer(MustTrain(), ds, ds).fit(strategy=DiLoCoStrategy(H=2), num_nodes=2, max_steps=4,
                                     batch_size=8, val_size=8, val_interval=1, **QUIET)


@pytest.mark.slow
def test_autocast_runs_forward_in_bfloat16_on_cpu():
    class DtypeCheck(TinyNet):
        def forward(self, batch):
            x, y = batch
            h = self.fc1(x)
            if torch.is_grad_enabled():
                assert h.dtype == torch.bfloat16
            return super().forward(batch)

    ds = toy_dataset()
    torch.manual_seed(0)
    Trainer(DtypeCheck(), ds, ds).fit(strategy=SimpleReduceStrategy(), num_nodes=1,
                                      max_steps=2, batch_size=8, autocast=True, val_size=0,
                                      device="cpu", **QUIET)


def test_non_scalar_loss_gets_a_clear_error():
    class Vector(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(8, 3)

        def forward(self, batch):
            return self.w(batch[0]).sum(dim=1)

    ds = toy_dataset()
    # refused before any rank starts, naming what forward returned
    with pytest.raises(TypeError, match=r"must return the loss as a scalar tensor, but on a "
                                        r"batch of 2 training samples it returned a tensor of "
                                        r"shape \(2,\)"):
        Trainer(Vector(), ds, ds).fit(strategy=SimpleReduceStrategy(), num_nodes=1,
                                      max_steps=1, batch_size=8, val_size=0, **QUIET)


@pytest.mark.slow
def test_csv_logger_makes_a_new_folder_per_run_and_saves_the_config(in_tmp):
    ds = toy_dataset()
    for _ in range(2):
        Trainer(tiny_model(), ds, ds).fit(strategy=DiLoCoStrategy(H=2), num_nodes=2,
                                          max_steps=4, batch_size=8, val_size=8,
                                          val_interval=2, run_name="demo", progress=False)
    runs = sorted(p.name for p in (in_tmp / "logs").iterdir())
    assert runs == ["demo", "demo-2"]
    config = json.loads((in_tmp / "logs" / "demo" / "config.json").read_text())
    assert config["num_nodes"] == 2 and config["strategy"]["strategy"] == "DiLoCoStrategy"
    history = (in_tmp / "logs" / "demo-2" / "history.csv").read_text().splitlines()
    assert len(history) == 1 + 8
    validation = (in_tmp / "logs" / "demo" / "validation.csv").read_text().splitlines()
    assert validation[0].startswith("step,local_loss") and len(validation) == 3


def test_csv_logger_direct_use_writes_summary(tmp_path):
    logger = CSVLogger(log_dir=tmp_path, run_name="x")
    logger.start({"num_nodes": 1})
    logger.log_event({"event": "step", "rank": 0, "step": 1, "train_loss": 1.0, "lr": 0.1,
                      "comm_bytes": 0, "samples": 4, "wall_s": 0.1})
    logger.finish({"steps": 1})
    assert json.loads((tmp_path / "x" / "summary.json").read_text())["steps"] == 1


def test_wandb_logger_names_the_extra_when_wandb_is_missing(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    from exogym.base.install_mode import install_extra

    with pytest.raises(ImportError, match=re.escape(install_extra("wandb"))):
        WandbLogger(project="p")


@pytest.mark.slow
def test_minibatch_auto_picks_the_largest_that_fits_and_trains():
    from exogym.config.fit_args import RunArgs
    from exogym.run.memory import probe_minibatch
    from exogym.run.spec import make_run_spec

    ds = toy_dataset()
    common = dict(strategy=SimpleReduceStrategy(), num_nodes=2, num_epochs=1, max_steps=2,
                  batch_size=16, minibatch_size="auto", gradient_accumulation=None,
                  shuffle=True, val_size=0, val_interval=1, autocast=False, device="cpu",
                  devices=None, seed=0, num_threads=None, dataloader_kwargs=None,
                  save_dir="ckpt", checkpoint_interval=None, keep_checkpoints=1,
                  resume_from=None, correlation_interval=None, run_name=None, log_interval=1,
                  timeout_s=60)
    spec = make_run_spec(tiny_model(), ds, ds, RunArgs(**common))
    size, peaks = probe_minibatch(spec, max_memory_usage=0.5)
    assert size == 16 and peaks[16] > 0
    with pytest.raises(ValueError, match="even a minibatch of 1"):
        probe_minibatch(spec, max_memory_usage=1e-9)
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=2, batch_size=16,
                minibatch_size="auto", val_size=0, **QUIET)
    assert trainer.history[-1]["samples"] == 32


def test_minibatch_auto_counts_only_the_ranks_on_this_machine():
    """A host running 1 rank of 64 may use the memory 64 simulated ranks must share."""
    import dataclasses

    from exogym.config.fit_args import RunArgs
    from exogym.run.devices import rank_device
    from exogym.run.memory import probe_minibatch, total_memory
    from exogym.run.spec import Placement, make_run_spec

    ds = toy_dataset()
    # A model whose step takes megabytes: a few kilobytes would be within the noise of a
    # resident set measured in pages.
    spec = make_run_spec(TinyNet(hidden=4096), ds, ds, RunArgs(
        strategy=SimpleReduceStrategy(), num_nodes=64, max_steps=2, batch_size=16,
        minibatch_size="auto", val_size=0, device="cpu"))
    _, peaks = probe_minibatch(spec, max_memory_usage=1.0, placement=Placement(1))
    usage = 2 * peaks[16] / total_memory(rank_device("cpu", None, 0))  # room for 2 ranks
    one_here, _ = probe_minibatch(spec, usage, placement=Placement(ranks_per_machine=1))
    assert one_here == 16
    try:
        all_here, _ = probe_minibatch(spec, usage)  # a simulation: all 64 share this machine
    except ValueError:
        all_here = 0
    assert all_here < 16
    assert dataclasses.replace(spec, minibatch_size=one_here).accumulation_steps == 1


def test_threads_per_rank_default_to_cores_shared():
    from exogym.run.devices import default_threads

    cores = len(os.sched_getaffinity(0))
    assert default_threads(1) == cores
    assert default_threads(cores * 4) == 1


def test_num_threads_reaches_the_rank():
    class ThreadSpy(TinyNet):
        def forward(self, batch):
            assert torch.get_num_threads() == 1
            return super().forward(batch)

    ds = toy_dataset()
    torch.manual_seed(0)
    LocalTrainer(ThreadSpy(), ds, ds).fit(strategy=SimpleReduceStrategy(), num_nodes=1,
                                          max_steps=1, num_threads=1, val_size=0, **QUIET)


def test_lr_factor_warmup_and_cosine_shape():
    assert lr_factor(0, 100, warmup_steps=10) == pytest.approx(0.1)
    assert lr_factor(9, 100, warmup_steps=10) == pytest.approx(1.0)
    assert lr_factor(100, 100, warmup_steps=10, cosine=True, min_lr_factor=0.2) == pytest.approx(0.2)
    assert lr_factor(55, 100, warmup_steps=10, cosine=True, min_lr_factor=0.0) == pytest.approx(0.5)


@pytest.mark.slow
def test_a_model_with_metric_sums_gets_them_logged_at_evaluation():
    class Accuracy(TinyNet):
        def metric_sums(self, batch):
            x, y = batch
            right = (self.fc2(torch.tanh(self.fc1(x))).argmax(1) == y).sum()
            return {"accuracy": (right, len(y))}

    ds = toy_dataset()
    torch.manual_seed(0)
    trainer = Trainer(Accuracy(), ds, ds)
    trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=2, batch_size=8,
                val_size=40, val_interval=1, **QUIET)
    for row in trainer.history:
        assert 0.0 <= row["val_accuracy"] <= 1.0
        # 40 samples: the accuracy is a multiple of 1/40
        assert abs(row["val_accuracy"] * 40 - round(row["val_accuracy"] * 40)) < 1e-9


@pytest.mark.slow
def test_torch_scheduler_class_is_honoured():
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=SimpleReduceStrategy(lr=0.1, lr_scheduler=torch.optim.lr_scheduler.StepLR,
                                              lr_scheduler_kwargs={"step_size": 2, "gamma": 0.5}),
                num_nodes=1, max_steps=5, batch_size=8, val_size=0, **QUIET)
    assert [round(r["lr"], 4) for r in trainer.history] == [0.1, 0.1, 0.05, 0.05, 0.025]


def _two_cpu_ranks(ds):
    """The spec and placement of two CPU ranks on this machine, for the fork checks."""
    from exogym.config.fit_args import RunArgs
    from exogym.run.spec import Placement, make_run_spec

    spec = make_run_spec(tiny_model(), ds, ds, RunArgs(
        strategy=SimpleReduceStrategy(), num_nodes=2, num_epochs=1,
        max_steps=2, batch_size=8, minibatch_size=None, gradient_accumulation=None,
        shuffle=True, val_size=0, val_interval=1, autocast=False, device="cpu", devices=None,
        seed=0, num_threads=1, dataloader_kwargs=None, save_dir="ckpt", checkpoint_interval=None,
        keep_checkpoints=1, resume_from=None, correlation_interval=None, run_name=None,
        log_interval=1, timeout_s=60))
    return spec, Placement(ranks_per_machine=2)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux only")
def test_ranks_are_forked_only_while_no_other_thread_runs():
    # A lock another thread holds at a fork stays held in the child forever (glibc's
    # resolver lock once hung a rank): with a second thread alive, ranks come from
    # the fork server instead.
    from exogym.run.trainer import _can_fork, _library_threads

    ds = toy_dataset()
    spec, placement = _two_cpu_ranks(ds)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    baseline = threading.active_count()
    other.start()
    try:
        assert not _can_fork(spec, placement)
        trainer = Trainer(tiny_model(), ds, ds)  # and a fit still works, from the fork server
        trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=2, batch_size=8,
                    val_size=0, num_threads=1, **QUIET)
        assert len(trainer.history) == 4
    finally:
        stop.set()
        other.join()
    if baseline == 1 and not _library_threads():  # other tests' threads may linger here
        assert _can_fork(spec, placement)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux only")
def test_tqdm_s_idle_monitor_is_stopped_so_the_ranks_are_still_forked():
    # A progress bar (a Hugging Face tokenizer, a datasets map) leaves tqdm's monitor thread
    # asleep for the rest of the process; it used to send every later fit to the fork
    # server, at 4x the CPU of a forked fit of a small causal LM.
    from tqdm import tqdm
    from tqdm.std import TMonitor

    from exogym.run.trainer import _can_fork, _library_threads, _stop_idle_monitors

    spec, placement = _two_cpu_ranks(toy_dataset())
    for _ in tqdm(range(2), file=io.StringIO(), mininterval=0):
        pass
    assert any(isinstance(t, TMonitor) and t.is_alive() for t in threading.enumerate())
    others = [t for t in threading.enumerate()
              if t is not threading.main_thread() and not isinstance(t, TMonitor)]
    if others or _library_threads():  # other tests' threads may linger in this process
        _stop_idle_monitors()
    else:
        assert _can_fork(spec, placement)  # which stops it
    assert not any(isinstance(t, TMonitor) and t.is_alive() for t in threading.enumerate())
    for _ in tqdm(range(2), file=io.StringIO()):  # and the next bar has a monitor again
        assert any(isinstance(t, TMonitor) and t.is_alive() for t in threading.enumerate())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux only")
def test_ranks_are_not_forked_while_a_library_thread_runs():
    # An earlier run's gloo loop or TCP store server (native threads Python does not
    # count) once aborted a forked rank with "Invalid argument".
    import datetime

    import torch.distributed as dist

    from exogym.run.trainer import _can_fork, _library_threads

    ds = toy_dataset()
    spec, placement = _two_cpu_ranks(ds)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    try:
        assert "pt_tcpstore_uv" in _library_threads()
        assert not _can_fork(spec, placement)
        trainer = Trainer(tiny_model(), ds, ds)  # ranks come from the fork server
        trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=2, batch_size=8,
                    val_size=0, num_threads=1, **QUIET)
        assert len(trainer.history) == 4
    finally:
        del server


class Pipe:
    """Stands in for a rank's pipe: records each message sent."""

    def __init__(self):
        self.messages = []

    def send(self, message):
        self.messages.append(message)


def test_rank_events_travel_in_batches_in_order_and_never_wait_behind_other_events(monkeypatch):
    import exogym.run.trainer as trainer_module

    clock = [100.0]
    monkeypatch.setattr(trainer_module.time, "monotonic", lambda: clock[0])
    pipe = Pipe()
    emit = trainer_module._EventBatches(pipe, interval_s=0.1)
    emit({"event": "start", "rank": 0})
    assert pipe.messages == [[{"event": "start", "rank": 0}]]  # at once
    for step in (1, 2, 3):
        clock[0] += 0.03
        emit({"event": "step", "step": step})
    assert len(pipe.messages) == 1  # 0.09 s: the steps wait
    clock[0] += 0.02
    emit({"event": "step", "step": 4})  # 0.11 s since the last message: all four go
    assert [e["step"] for e in pipe.messages[1]] == [1, 2, 3, 4]
    emit({"event": "step", "step": 5})
    emit({"event": "result", "rank": 0})  # takes the waiting step with it, in order
    assert pipe.messages[2] == [{"event": "step", "step": 5}, {"event": "result", "rank": 0}]
    emit.flush()
    assert len(pipe.messages) == 3  # nothing left to send
    emit({"event": "step", "step": 6})
    emit({"event": "step", "step": 7, "checkpoint": True})  # a checkpoint's step: at once
    assert [e["step"] for e in pipe.messages[3]] == [6, 7]
    # Link figures wait as steps do (512 waiting ranks report theirs each second); the
    # host's figures go at once, with them.
    emit({"event": "link", "rank": 0})
    emit({"event": "link", "rank": 1})
    assert len(pipe.messages) == 4
    emit({"event": "system", "rank": 0})
    assert [e["event"] for e in pipe.messages[4]] == ["link", "link", "system"]


def test_the_rest_of_a_message_whose_handling_was_interrupted_still_reaches_the_trace():
    """Ctrl-C or SIGTERM raised while the parent hands on one event of a batch: the
    batch's later events are handed on on the way out, with what the pipes still hold."""
    import collections
    import multiprocessing as mp

    import exogym.run.trainer as trainer_module

    class Rank:  # a process that never exits while the parent collects
        def __init__(self):
            self._never, self._keep = os.pipe()
            self.sentinel = self._never
            self.exitcode = None

    first, second = mp.Pipe(duplex=False), mp.Pipe(duplex=False)
    first[1].send([{"event": "step", "rank": 0, "step": s} for s in (1, 2, 3)])
    handed = []

    def on_event(event):
        handed.append((event["rank"], event["step"]))
        if len(handed) == 1:
            raise KeyboardInterrupt

    inbox = collections.deque()
    rank = Rank()
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer_module.Trainer._collect([rank], [first[0]], on_event, inbox=inbox)
        second[1].send([{"event": "step", "rank": 1, "step": 1},
                        {"event": "error", "rank": 1, "traceback": ""}])
        trainer_module._forward_rest([first[0], second[0]], on_event, inbox)
    finally:
        os.close(rank._never)
        os.close(rank._keep)
    assert handed == [(0, 1), (0, 2), (0, 3), (1, 1)]


@pytest.mark.slow
def test_step_events_reach_a_live_display_while_the_ranks_train():
    """Batching delays a step event by a tenth of a second, not to the end of the run."""

    class Slow(TinyNet):
        def forward(self, batch):
            time.sleep(0.02)
            return super().forward(batch)

    class Arrivals:
        def __init__(self):
            self.first_step = None
            self.last_step = None

        def on_event(self, event):
            if event.get("event") == "step":
                now = time.monotonic()
                self.first_step = self.first_step or now
                self.last_step = now

        def close(self):
            pass

        def finish(self, summary, title="run summary"):
            pass

    ds = toy_dataset()
    arrivals = Arrivals()
    Trainer(Slow(), ds, ds).fit(strategy=DiLoCoStrategy(H=1000), num_nodes=2, max_steps=40,
                                batch_size=8, val_size=8, logger=None, progress=arrivals)
    # 40 steps of >= 20 ms: the first events arrive long before the last.
    assert arrivals.last_step - arrivals.first_step > 0.5


def test_tensor_dataset_batches_equal_what_a_dataloader_gives_across_epochs():
    from exogym.data.loading import MinibatchStream

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(50, 3, 4, generator=g), torch.randint(0, 5, (50,), generator=g))
    fast = MinibatchStream(ds, 8, rank=1, num_nodes=2, shard=True, shuffle=True, seed=4)
    # Any DataLoader argument takes the DataLoader path: the reference.
    slow = MinibatchStream(ds, 8, rank=1, num_nodes=2, shard=True, shuffle=True, seed=4,
                           dataloader_kwargs={"num_workers": 0})
    for _ in range(10):  # 4 minibatches per epoch: crosses two epoch boundaries
        a, b = next(fast), next(slow)
        assert len(a) == len(b) == 2
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))
