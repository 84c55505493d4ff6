"""Checkpoints: atomic, verified, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from toys import BNNet, CrashAt, assert_models_close, tiny_model, toy_dataset

from exogym import RankFailedError, Trainer
from exogym.run.checkpoint import (
    CheckpointError,
    checkpoint_path,
    list_steps,
    load_checkpoint,
    save_checkpoint,
)
from exogym.strategy import DiLoCoStrategy, FedAvgStrategy

QUIET = dict(logger=None, progress=False)


def strategy():
    return DiLoCoStrategy(inner_optim="adam", lr=0.01, H=3, lr_scheduler="cosine",
                          warmup_steps=2)


class DropoutBNNet(BNNet):
    """BatchNorm and dropout: resuming must restore buffers and the RNG too."""

    def forward(self, batch):
        x, y = batch
        return super().forward((torch.nn.functional.dropout(x, 0.2, self.training), y))


class Dropout(CrashAt, DropoutBNNet):
    """DropoutBNNet whose training forward pass raises at step ``crash_at``."""


def fit(ds, run, tmp_path, max_steps, crash_at=None, **kwargs):
    torch.manual_seed(0)
    model = Dropout()
    model.crash_at = crash_at
    trainer = Trainer(model, ds, ds)
    model = trainer.fit(strategy=strategy(), num_nodes=2, max_steps=max_steps, batch_size=8,
                        val_size=16, val_interval=4, save_dir=str(tmp_path), run_name=run,
                        **QUIET, **kwargs)
    return trainer, model


def test_resumed_run_ends_with_the_same_model_as_an_uninterrupted_one(tmp_path):
    ds = toy_dataset(96)  # 48 samples per rank: the resume lands mid-epoch
    _, uninterrupted = fit(ds, "full", tmp_path, 14)
    with pytest.raises(RankFailedError, match="simulated crash"):
        fit(ds, "split", tmp_path, 14, crash_at=10, checkpoint_interval=4)
    assert list_steps(tmp_path / "split", 0) == [4, 8]
    trainer, resumed = fit(ds, "split", tmp_path, 14, checkpoint_interval=4, resume_from="auto")
    assert [r["step"] for r in trainer.history if r["rank"] == 0] == list(range(9, 15))
    assert_models_close(uninterrupted, resumed, atol=1e-6)


def test_a_corrupt_checkpoint_is_skipped_for_the_previous_complete_one(tmp_path, capfd):
    ds = toy_dataset(96)
    with pytest.raises(RankFailedError):
        fit(ds, "run", tmp_path, 10, crash_at=9, checkpoint_interval=4)
    # Rank 1's newest checkpoint is truncated: both ranks must go back to step 4.
    newest = checkpoint_path(tmp_path / "run", 1, 8)
    newest.write_bytes(newest.read_bytes()[:100])
    trainer, _ = fit(ds, "run", tmp_path, 10, checkpoint_interval=4, resume_from="auto")
    assert [r["step"] for r in trainer.history if r["rank"] == 0] == list(range(5, 11))


def test_checkpoint_files_are_verified_and_pruned(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint({"step": step}, tmp_path, rank=0, step=step, keep=2)
    assert list_steps(tmp_path, 0) == [3, 4]
    assert load_checkpoint(checkpoint_path(tmp_path, 0, 4))["step"] == 4
    path = checkpoint_path(tmp_path, 0, 3)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path)
    (tmp_path / "rank0" / "step00000009.ckpt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="bad header"):
        load_checkpoint(tmp_path / "rank0" / "step00000009.ckpt")
    assert not list((tmp_path / "rank0").glob("*.tmp"))


@pytest.mark.slow
def test_resume_from_a_missing_folder_is_a_clear_error(tmp_path):
    ds = toy_dataset()
    with pytest.raises(Exception, match="not a checkpoint folder"):
        Trainer(tiny_model(), ds, ds).fit(strategy=FedAvgStrategy(), num_nodes=1, max_steps=1,
                                          resume_from=str(tmp_path / "nope"), **QUIET)


def test_checkpoints_carry_the_run_identity_and_resume_refuses_another_runs(tmp_path):
    ds = toy_dataset(64)
    ours = {"profile": "p", "fingerprint": "a" * 64, "started": "2024-01-01T00:00:00Z"}
    fit(ds, "run", tmp_path, 4, checkpoint_interval=4, run_identity=ours)
    state = load_checkpoint(checkpoint_path(tmp_path / "run", 1, 4))
    assert state["run"] == ours
    theirs = {**ours, "fingerprint": "b" * 64}
    with pytest.raises(RankFailedError, match="written by another run .*aaaaaaaaaaaa, this "
                                              "run's is bbbbbbbbbbbb"):
        fit(ds, "run", tmp_path, 8, resume_from="auto", run_identity=theirs)
    # The same settings (another start time, more steps) continue it.
    trainer, _ = fit(ds, "run", tmp_path, 6, resume_from="auto",
                     run_identity={**ours, "started": "2024-01-02T00:00:00Z"})
    assert [r["step"] for r in trainer.history if r["rank"] == 0] == [5, 6]


def test_run_identity_must_be_a_dict_of_json_values():
    from exogym.config.fit_args import RunArgs

    with pytest.raises(TypeError, match="run_identity must be a dict"):
        RunArgs(strategy=strategy(), run_identity="abc")
    with pytest.raises(TypeError, match=r"run_identity\['fingerprint'\] must be a string"):
        RunArgs(strategy=strategy(), run_identity={"fingerprint": 3})


def test_the_final_model_file_is_safetensors_written_tensor_by_tensor(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from exogym.base.io import atomic_save_safetensors

    shared = torch.randn(3, 4)
    state = {"w": shared, "tied": shared,  # two names, one memory
             "t": torch.randn(4, 3).t(),  # not contiguous
             "half": torch.randn(5, dtype=torch.bfloat16), "n": torch.tensor(7),
             "mask": torch.tensor([True, False]), "empty": torch.zeros(0, 2),
             "scalar": torch.tensor(2.5)}
    path = atomic_save_safetensors(state, tmp_path / "model.safetensors", {"profile": "x"})
    loaded = load_file(path)
    assert loaded.keys() == state.keys()
    for key, tensor in state.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"profile": "x"}
    with pytest.raises(TypeError, match="strings"):
        atomic_save_safetensors(state, tmp_path / "bad.safetensors", {"step": 3})
    assert not (tmp_path / "bad.safetensors").exists()
