"""Muon inner steps: Muon on the hidden matrices, AdamW on the rest, in every strategy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from toys import CrashAt, assert_models_close, assert_models_differ, toy_dataset

from exogym import RankFailedError, Trainer
from exogym.strategy import (
    DiLoCoStrategy,
    MuonAdamW,
    OptimSpec,
    SimpleReduceStrategy,
    SparseLoCoStrategy,
)
from exogym.strategy.muon import muon_param_groups

FIT = dict(batch_size=16, val_size=0, shuffle=False, logger=None, progress=False)


class TokenNet(nn.Module):
    """Embedding, a hidden matrix with a bias, a norm and an output head: every kind of part."""

    def __init__(self, d_in: int = 8, width: int = 16, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(4, width)
        self.inp = nn.Linear(d_in, width)
        self.hidden = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, classes)

    def forward(self, batch):
        x, y = batch
        h = torch.tanh(self.inp(x)) + self.embed.weight.mean(0)
        h = self.norm(torch.tanh(self.hidden(h)))
        return F.cross_entropy(self.out(h), y)


def token_net(seed: int = 0) -> TokenNet:
    torch.manual_seed(seed)
    return TokenNet()


def names(model: nn.Module, params) -> set[str]:
    ids = {id(p): n for n, p in model.named_parameters()}
    return {ids[id(p)] for p in params}


def test_hidden_matrices_go_to_muon_embeddings_norms_biases_and_the_head_to_adamw():
    model = token_net()
    muon, adamw = muon_param_groups(model)
    assert names(model, muon["params"]) == {"inp.weight", "hidden.weight"}
    assert names(model, adamw["params"]) == {"embed.weight", "inp.bias", "hidden.bias",
                                              "norm.weight", "norm.bias", "out.weight", "out.bias"}
    optimizer = OptimSpec("muon").build(model)
    assert isinstance(optimizer, MuonAdamW)
    assert names(model, optimizer.muon.param_groups[0]["params"]) == {"inp.weight", "hidden.weight"}


def test_one_step_is_a_muon_step_on_matrices_and_an_adamw_step_on_the_rest():
    model = token_net()
    reference = copy.deepcopy(model)
    x, y = toy_dataset(16).tensors
    optimizer = OptimSpec("muon", lr=0.02, adamw_lr=3e-3, adjust_lr_fn="original").build(model)
    ref_muon_params, ref_adamw_params = (g["params"] for g in muon_param_groups(reference))
    ref_muon = torch.optim.Muon(ref_muon_params, lr=0.02, weight_decay=0.01,
                                adjust_lr_fn="original")
    ref_adamw = torch.optim.AdamW(ref_adamw_params, lr=3e-3, weight_decay=0.01, fused=True)
    for _ in range(2):
        for m, opts in ((model, [optimizer]), (reference, [ref_muon, ref_adamw])):
            for o in opts:
                o.zero_grad()
            m((x, y)).backward()
            for o in opts:
                o.step()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name
    assert_models_differ(model, token_net())


def test_a_schedule_scales_both_learning_rates_and_adamw_lr_is_its_own():
    model = token_net()
    strategy = DiLoCoStrategy(inner_optim=OptimSpec("muon", adamw_lr=1e-3), lr=0.02,
                              warmup_steps=4, H=2)
    strategy._init_node(model, rank=0, num_nodes=1)
    optimizer = strategy.optim
    assert isinstance(optimizer, MuonAdamW)
    muon_group, adamw_group = optimizer.param_groups
    assert muon_group["lr"] == pytest.approx(0.02 / 4)
    assert adamw_group["lr"] == pytest.approx(1e-3 / 4)
    # Without adamw_lr the strategy's lr sets both.
    plain = SimpleReduceStrategy(inner_optim="muon", lr=0.005)
    plain._init_node(token_net(), rank=0, num_nodes=1)
    assert [g["lr"] for g in plain.optim.param_groups] == [0.005, 0.005]


def plain_muon_training(model, ds, steps, batch_size, lr):
    model = copy.deepcopy(model)
    optimizer = OptimSpec("muon", lr=lr).build(model)
    x, y = ds.tensors
    for i in range(steps):
        lo = (i * batch_size) % len(x)
        optimizer.zero_grad()
        model((x[lo:lo + batch_size], y[lo:lo + batch_size])).backward()
        optimizer.step()
    return model


@pytest.mark.slow
def test_ddp_with_muon_on_one_rank_is_plain_muon_training():
    ds = toy_dataset()
    start = token_net()
    trained = Trainer(start, ds, ds).fit(
        strategy=SimpleReduceStrategy(inner_optim="muon", lr=0.01), num_nodes=1, max_steps=4,
        **FIT)
    assert_models_close(trained, plain_muon_training(start, ds, 4, 16, 0.01), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [
    lambda: SimpleReduceStrategy(inner_optim="muon", lr=0.01),
    lambda: DiLoCoStrategy(inner_optim="muon", lr=0.01, H=2),
    lambda: SparseLoCoStrategy(inner_optim="muon", lr=0.01, H=2, topk=8, chunk=64),
], ids=["ddp", "diloco", "sparseloco"])
def test_muon_inner_steps_train_in_every_strategy(strategy):
    ds = toy_dataset()
    trainer = Trainer(token_net(), ds, ds)
    trained = trainer.fit(strategy=strategy(), num_nodes=2, max_steps=6, **FIT)
    assert all(torch.isfinite(p).all() for p in trained.parameters())
    assert_models_differ(trained, token_net())
    with torch.no_grad():
        assert trained(ds.tensors) < token_net()(ds.tensors)


class CrashingTokenNet(CrashAt, TokenNet):
    """TokenNet whose training forward pass raises at step ``crash_at``."""


@pytest.mark.slow
def test_diloco_with_muon_resumes_exactly_where_it_stopped(tmp_path):
    ds = toy_dataset(96)

    def fit(run, crash_at=None, **kwargs):
        torch.manual_seed(0)
        model = CrashingTokenNet()
        model.crash_at = crash_at
        strategy = DiLoCoStrategy(inner_optim="muon", lr=0.01, H=3, lr_scheduler="cosine",
                                  warmup_steps=2)
        return Trainer(model, ds, ds).fit(strategy=strategy, num_nodes=2, max_steps=12,
                                          batch_size=8, val_size=0, save_dir=str(tmp_path),
                                          run_name=run, logger=None, progress=False, **kwargs)

    uninterrupted = fit("full")
    with pytest.raises(RankFailedError, match="simulated crash"):
        fit("split", crash_at=9, checkpoint_interval=4)
    resumed = fit("split", checkpoint_interval=4, resume_from="auto")
    assert_models_close(uninterrupted, resumed, atol=1e-6)


def test_a_muon_group_with_a_vector_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="use_muon=False"):
        MuonAdamW([{"params": [nn.Parameter(torch.ones(3))], "use_muon": True}])
