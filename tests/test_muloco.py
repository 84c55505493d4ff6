"""MuLoCo: DiLoCo with Muon inner steps and an int4, error-fed outer delta."""

from __future__ import annotations

import pytest
import torch
from toys import tiny_model, toy_dataset, trainable_count

from distributed.planning.projection import payload_bytes_per_step
from distributed.profiles.profile import load_profile
from distributed.worker.run_profile import run_profile
from exogym import Trainer
from exogym.comm.quantize import payload_bytes
from exogym.data.digits import DigitsMLP, digits_datasets
from exogym.strategy import DiLoCoStrategy, MuLoCoStrategy, MuonAdamW


def test_the_defaults_are_muon_inner_steps_and_an_int4_error_fed_delta():
    muloco = MuLoCoStrategy()
    assert muloco.optim_spec.cls is MuonAdamW
    assert (muloco.comm_dtype, muloco.error_feedback, muloco.H) == ("int4", True, 100)
    assert isinstance(muloco, DiLoCoStrategy)
    # error feedback follows the wire type unless given; the inner optimizer can be changed
    assert MuLoCoStrategy(comm_dtype="float32").error_feedback is False
    assert MuLoCoStrategy(inner_optim="adamw").optim_spec.cls is torch.optim.AdamW
    with pytest.raises(ValueError, match="error_feedback=True needs a quantized comm_dtype"):
        MuLoCoStrategy(comm_dtype="bfloat16", error_feedback=True)


@pytest.mark.slow
@pytest.mark.parametrize("comm_dtype", ["int4", "int2"])
def test_each_round_sends_dilocos_quantized_payload(comm_dtype):
    ds = toy_dataset(256)
    P = trainable_count(tiny_model())
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=MuLoCoStrategy(lr=0.01, H=2, comm_dtype=comm_dtype), num_nodes=2,
                max_steps=6, batch_size=16, val_size=0, logger=None, progress=False)
    # ceil(P * bits / 8) packed values + a float32 scale per 64 values, per round
    expected = 3 * payload_bytes(P, comm_dtype)
    assert {r["comm_bytes"] for r in trainer.history if r["step"] == 6} == {expected}
    planned = payload_bytes_per_step("muloco", P, 2, H=2, comm_dtype=comm_dtype)
    assert planned * 6 == pytest.approx(expected)


@pytest.mark.slow
def test_muloco_trains_digits_on_two_ranks():
    train, val = digits_datasets()
    torch.manual_seed(0)
    trainer = Trainer(DigitsMLP(), train, val)
    trainer.fit(strategy=MuLoCoStrategy(lr=3e-3, H=10), num_nodes=2, max_steps=60,
                batch_size=32, val_size=len(val), val_interval=60, logger=None, progress=False)
    first = [r["train_loss"] for r in trainer.history if r["step"] == 1]
    assert min(first) > 2.0  # ln 10: a fresh classifier of ten digits
    assert trainer.summary["final_val_global_loss"] < 1.2  # 0.78 here: well under half


def test_the_digits_muloco_profile_resolves_and_sends_the_int4_rounds(tmp_path):
    resolved = load_profile("digits-muloco").resolved
    assert resolved.strategy_cls is MuLoCoStrategy
    kwargs = resolved.strategy_kwargs
    assert (kwargs["inner_optim"], kwargs["comm_dtype"], kwargs["error_feedback"]) == \
        ("muon", "int4", True)
    assert resolved.strategy_cls(**kwargs).optim_spec.cls is MuonAdamW
    trainer = run_profile("digits-muloco", progress=False, local=True, overrides={
        "num_nodes": 2, "max_steps": 4, "H": 2, "val_size": 32, "val_interval": 4,
        "checkpoint_interval": None, "output_dir": str(tmp_path)})
    P = 64 * 128 + 128 + 128 * 10 + 10  # digits-base: hidden = 128
    assert {r["comm_bytes"] for r in trainer.history if r.get("step") == 4} == \
        {2 * payload_bytes(P, "int4")}
