"""DES-LOC: parameters and Adam's two moments averaged on their own periods, and counted."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from toys import TinyNet, assert_models_close, assert_models_differ, tiny_model, toy_dataset

from distributed.planning.projection import payload_bytes_per_step, step_traffic
from distributed.profiles.profile import load_profile
from distributed.worker.run_profile import run_profile
from exogym import RankFailedError, Trainer
from exogym.comm.wire import ModelFacts
from exogym.run.checkpoint import checkpoint_path, list_steps, load_checkpoint
from exogym.strategy import DESLOCStrategy, OptimSpec
from exogym.strategy.facts import desloc_sent_bytes

FIT = dict(batch_size=16, val_size=0, shuffle=False, logger=None, progress=False)
LR = 0.01


def desloc(**kwargs):
    return DESLOCStrategy(**{"inner_optim": "adamw", "lr": LR, **kwargs})


class WithIdleParts(TinyNet):
    """TinyNet with a trainable layer no loss reaches and a frozen one: the first is
    averaged (its state made on the spot), the second never travels."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(4, 4)
        self.frozen = nn.Linear(5, 5).requires_grad_(False)


def trainable_values(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("comm_dtype, value_bytes", [("float32", 4), ("bfloat16", 2)])
def test_counted_bytes_equal_the_formula_at_every_step(comm_dtype, value_bytes):
    torch.manual_seed(0)
    model = WithIdleParts()
    P = trainable_values(model)
    ds = toy_dataset()
    trainer = Trainer(model, ds, ds)
    trainer.fit(strategy=desloc(H_params=2, H_m1=3, H_m2=6, comm_dtype=comm_dtype),
                num_nodes=2, max_steps=12, **FIT)
    for row in trainer.history:
        assert row["comm_bytes"] == desloc_sent_bytes(row["step"], P, 2, 3, 6, comm_dtype), row
    # over a whole number of the longest period: v * (P/H_params + P/H_m1 + P/H_m2) a step
    (at_6,) = {r["comm_bytes"] for r in trainer.history if r["step"] == 6}
    assert at_6 == value_bytes * P * 6 == pytest.approx(value_bytes * (P/2 + P/3 + P/6) * 6)
    planned = payload_bytes_per_step("desloc", P, 2, H_params=2, H_m1=3, H_m2=6,
                                     comm_dtype=comm_dtype)
    (at_12,) = {r["comm_bytes"] for r in trainer.history if r["step"] == 12}
    assert at_12 == pytest.approx(planned * 12)


def test_the_traffic_statement_is_three_all_reduces_each_on_its_own_period():
    traffic = DESLOCStrategy(H_params=10, H_m1=30, H_m2=60).traffic(ModelFacts(1000, 20), 4)
    assert [(t.collective, t.payload, t.every) for t in traffic] == [
        ("all_reduce", 4 * 1020, 10), ("all_reduce", 4000, 30), ("all_reduce", 4000, 60)]
    # the defaults keep the paper's relation and send half of Local Adam's bytes
    default = step_traffic("desloc", 1_000_000, 4)
    local_adam = step_traffic("desloc", 1_000_000, 4, H_params=100, H_m1=100, H_m2=100)
    assert default.payload == pytest.approx(local_adam.payload / 2)
    assert default.payload == pytest.approx(4e6 * (1 / 100 + 1 / 300 + 1 / 600))


# --------------------------------------------------------------------------- what it computes


def shard(ds, rank, nodes=2):
    x, y = ds.tensors
    return x[rank::nodes], y[rank::nodes]


def batch(data, step, size=16):
    x, y = data
    lo = (step * size) % len(x)
    return x[lo:lo + size], y[lo:lo + size]


def reference_runs(start, ds, steps, average_every_step):
    """Two ranks' AdamW training done by hand, with every state averaged after each step
    (``average_every_step``) or never."""
    models = [copy.deepcopy(start) for _ in range(2)]
    optims = [OptimSpec("adamw", lr=LR).build(m) for m in models]
    data = [shard(ds, r) for r in range(2)]
    for step in range(steps):
        for model, optim, d in zip(models, optims, data):
            optim.zero_grad()
            model(batch(d, step)).backward()
            optim.step()
        if average_every_step:
            with torch.no_grad():
                for a, b in zip(models[0].parameters(), models[1].parameters()):
                    a.copy_((a + b) / 2)
                    b.copy_(a)
                    for key in ("exp_avg", "exp_avg_sq"):
                        sa, sb = optims[0].state[a][key], optims[1].state[b][key]
                        sa.copy_((sa + sb) / 2)
                        sb.copy_(sa)
    return models, optims


def fit_saving_the_end(strategy, steps, tmp_path, ds):
    start = tiny_model()
    trainer = Trainer(start, ds, ds)
    final = trainer.fit(strategy=strategy, num_nodes=2, max_steps=steps,
                        checkpoint_interval=steps, save_dir=str(tmp_path), run_name="run", **FIT)
    ends = [load_checkpoint(checkpoint_path(tmp_path / "run", rank, steps)) for rank in (0, 1)]
    return trainer, final, ends


def test_periods_of_one_leave_every_rank_with_the_averaged_parameters_and_moments(tmp_path):
    ds = toy_dataset()
    trainer, final, ends = fit_saving_the_end(desloc(H_params=1, H_m1=1, H_m2=1), 4, tmp_path, ds)
    models, optims = reference_runs(tiny_model(), ds, 4, average_every_step=True)
    for end in ends:  # both ranks: the hand-made averages, parameters and moments
        model = tiny_model()
        model.load_state_dict(end["model"])
        assert_models_close(model, models[0], atol=1e-6)
        state = end["strategy"]["optim"]["state"]
        for index, p in enumerate(models[0].parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(state[index][key], optims[0].state[p][key], atol=1e-7,
                                      rtol=1e-5), (index, key)
    a, b = (end["strategy"]["optim"]["state"] for end in ends)
    for index in a:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a[index][key], b[index][key]), (index, key)
    assert_models_close(final, models[0], atol=1e-6)
    assert_models_differ(final, tiny_model())


def test_periods_beyond_the_run_are_independent_adamw_on_each_rank_and_send_nothing(tmp_path):
    ds = toy_dataset()
    never = 10**6
    trainer, final, ends = fit_saving_the_end(desloc(H_params=never, H_m1=never, H_m2=never),
                                              5, tmp_path, ds)
    assert {r["comm_bytes"] for r in trainer.history} == {0}
    models, _ = reference_runs(tiny_model(), ds, 5, average_every_step=False)
    for end, reference in zip(ends, models):
        own = tiny_model()
        own.load_state_dict(end["model"])
        assert_models_close(own, reference, atol=1e-6)
    assert_models_differ(models[0], models[1])
    for name, p in final.named_parameters():  # the run's final model: the two averaged
        expected = sum(dict(m.named_parameters())[name] for m in models) / 2
        assert torch.allclose(p, expected, atol=1e-6), name


@pytest.mark.slow
def test_resumed_run_equals_an_uninterrupted_one(tmp_path):
    from test_checkpoint import Dropout

    ds = toy_dataset(96)

    def fit(run, crash_at=None, **kwargs):
        torch.manual_seed(0)
        model = Dropout()
        model.crash_at = crash_at
        strategy = desloc(H_params=2, H_m1=3, H_m2=5, lr_scheduler="cosine", warmup_steps=2)
        trainer = Trainer(model, ds, ds)
        final = trainer.fit(strategy=strategy, num_nodes=2, max_steps=14, batch_size=8,
                            val_size=16, val_interval=4, save_dir=str(tmp_path), run_name=run,
                            logger=None, progress=False, **kwargs)
        return trainer, final

    _, uninterrupted = fit("full")
    with pytest.raises(RankFailedError, match="simulated crash"):
        fit("split", crash_at=10, checkpoint_interval=4)
    assert list_steps(tmp_path / "split", 0) == [4, 8]
    trainer, resumed = fit("split", checkpoint_interval=4, resume_from="auto")
    assert [r["step"] for r in trainer.history if r["rank"] == 0 and "step" in r][0] == 9
    assert_models_close(uninterrupted, resumed, atol=1e-6)


# --------------------------------------------------------------------------- refused before a start


@pytest.mark.parametrize("kwargs, message", [
    (dict(H_params=0), r"H_params must be an integer >= 1 .*got 0"),
    (dict(H_m1=2.5), r"H_m1 must be an integer >= 1 .*got 2.5"),
    (dict(H_m2=True), r"H_m2 must be an integer >= 1 .*got True"),
    (dict(H_params="10"), r"H_params must be an integer >= 1 .*got '10'"),
    (dict(comm_dtype="int4"), r"comm_dtype='int4' would round small second moments to zero"),
    (dict(comm_dtype="float16"), r"comm_dtype='float16'.*use 'float32' or 'bfloat16'"),
    (dict(comm_dtype="float64"), r"comm_dtype must be one of 'float32', 'bfloat16', got 'float64'"),
    (dict(inner_optim="sgd"), r"inner optimizer SGD keeps no exp_avg or exp_avg_sq.*'adamw'"),
    (dict(inner_optim="muon"), r"inner optimizer MuonAdamW keeps no exp_avg"),
    (dict(optim_spec=OptimSpec("adamax")), r"Adamax keeps no exp_avg_sq"),
])
def test_bad_settings_are_refused_naming_the_value_and_what_to_give(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DESLOCStrategy(**kwargs)


def test_the_adam_family_is_accepted():
    for name in ("adamw", "adam", "nadam", "radam"):
        DESLOCStrategy(inner_optim=name)


# --------------------------------------------------------------------------- by name


def test_the_digits_desloc_profile_resolves_and_trains_with_the_counted_bytes(tmp_path):
    resolved = load_profile("digits-desloc").resolved
    assert resolved.strategy_cls is DESLOCStrategy
    assert {k: resolved.strategy_kwargs[k] for k in ("H_params", "H_m1", "H_m2")} == \
        {"H_params": 10, "H_m1": 30, "H_m2": 60}
    trainer = run_profile("digits-desloc", progress=False, local=True, overrides={
        "num_nodes": 2, "max_steps": 6, "H_params": 2, "H_m1": 3, "H_m2": 6, "val_size": 32,
        "val_interval": 6, "checkpoint_interval": None, "output_dir": str(tmp_path)})
    P = 64 * 128 + 128 + 128 * 10 + 10  # digits-base: hidden = 128
    assert {r["comm_bytes"] for r in trainer.history if r.get("step") == 6} == \
        {desloc_sent_bytes(6, P, 2, 3, 6)}
