"""SparseLoCo does what the paper says: error feedback, top-k, 2-bit values, counted bytes."""

from __future__ import annotations

import pytest
import torch
from toys import BNNet, CrashAt, TinyNet, assert_models_close, assert_models_differ, tiny_model, toy_dataset

from distributed.app.compare import plan_comparison
from distributed.profiles.profile import load_profile
from distributed.worker.run_profile import run_profile
from exogym import RankFailedError, Trainer
from exogym.strategy import DiLoCoStrategy, SparseLoCoStrategy
from exogym.strategy.facts import sparse_chunking, sparseloco_payload_bytes
from exogym.strategy.sparseloco import SparseLoCoCommunicator, SparsePlan, pack_bits, unpack_bits

FIT = dict(batch_size=16, val_size=0, shuffle=False, logger=None, progress=False)


class KeepRankStates(Trainer):
    """A Trainer that also keeps every rank's final state, in rank order."""

    def _execute(self, *args, **kwargs):
        self.rank_states = super()._execute(*args, **kwargs)
        return self.rank_states


def assert_ranks_identical(trainer: KeepRankStates) -> None:
    first, *others = trainer.rank_states
    for other in others:
        for name, value in first.items():
            assert torch.equal(value, other[name]), name


def test_index_and_value_bits_pack_tightly_and_round_trip():
    values = torch.randint(0, 4096, (1001,))
    packed = pack_bits(values, 12)
    assert packed.numel() == (1001 * 12 + 7) // 8
    assert torch.equal(unpack_bits(packed, 12, 1001), values)
    two = torch.randint(0, 4, (9,))
    assert pack_bits(two, 2).numel() == 3
    assert torch.equal(unpack_bits(pack_bits(two, 2), 2, 9), two)


def test_a_chunk_of_4096_takes_12_bit_indices_and_the_formula_counts_every_part():
    assert sparse_chunking(10_000, 4096, 64) == (3, 4096, 64, 12)
    assert sparse_chunking(10, 4096, 64) == (1, 10, 10, 4)
    # 3 chunks x 64 values: 12-bit indices, 2-bit values, a float32 low end and step per chunk.
    assert sparseloco_payload_bytes([10_000], 4096, 64, 2) == 192 * 12 // 8 + 192 * 2 // 8 + 3 * 8
    assert sparseloco_payload_bytes([10_000], 4096, 64, None) == 192 * 12 // 8 + 192 * 4
    plan = SparsePlan(10_000, 4096, 64, 2)
    payload, _, _ = plan.encode(torch.randn(10_000))
    assert payload.numel() == plan.nbytes == sparseloco_payload_bytes([10_000], 4096, 64, 2)


def test_two_bit_values_keep_each_chunks_extremes_and_four_levels():
    plan = SparsePlan(4096, 4096, 64, 2)
    e = torch.randn(4096)
    payload, idx, sent = plan.encode(e)
    chosen = e[idx.view(-1)]
    assert torch.equal(chosen.abs().sort().values, e.abs().topk(64).values.sort().values)
    assert sent.min() == chosen.min() and torch.isclose(sent.max(), chosen.max())
    assert sent.unique().numel() <= 4
    step = (chosen.max() - chosen.min()) / 3
    assert (sent.view(-1) - chosen).abs().max() <= step / 2 + 1e-6
    decoded_idx, decoded = plan.decode(payload)
    assert torch.equal(decoded_idx, idx) and torch.equal(decoded, sent)


def test_error_feedback_keeps_what_was_not_sent_and_the_step_moves_by_what_was():
    torch.manual_seed(0)
    model = TinyNet()
    module = SparseLoCoCommunicator(H=1, topk=4, chunk=16, quant_bits=2, error_decay=0.5,
                                    outer_lr=1.0)
    module._init_node(model, rank=0, num_nodes=1)
    start = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(torch.randn_like(p))
    drift = [s - p.detach() for s, p in zip(start, model.parameters())]
    module.communicate(model, rank=0, num_nodes=1, local_step=0)
    for s, d, e, p in zip(start, drift, module.errors, model.parameters()):
        sent = d - e  # e = 0.5 * 0 + drift - sent
        nonzero_per_chunk = (SparsePlan(d.numel(), 16, 4, 2).chunked(sent.reshape(-1)) != 0).sum(1)
        assert (nonzero_per_chunk <= 4).all()
        assert torch.allclose(p.detach(), s - sent, atol=1e-6)
    # The next round starts from 0.5 * what stayed behind.
    kept = [e.clone() for e in module.errors]
    module.communicate(model, rank=0, num_nodes=1, local_step=0)
    for k, e in zip(kept, module.errors):
        plan = SparsePlan(k.numel(), 16, 4, 2)
        assert (plan.chunked((0.5 * k - e).reshape(-1)) != 0).sum(1).le(4).all()


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [2, 3])
def test_dense_unquantized_memoryless_sparseloco_equals_diloco_with_outer_sgd(nodes):
    ds = toy_dataset()
    inner = dict(inner_optim="adam", lr=0.01)
    diloco = Trainer(tiny_model(), ds, ds).fit(
        strategy=DiLoCoStrategy(H=2, outer_lr=0.7, outer_momentum=0.0, nesterov=False, **inner),
        num_nodes=nodes, max_steps=6, **FIT)
    sparse = Trainer(tiny_model(), ds, ds).fit(
        strategy=SparseLoCoStrategy(H=2, topk=64, chunk=64, quant_bits=None, error_decay=0.0,
                                    outer_lr=0.7, **inner),
        num_nodes=nodes, max_steps=6, **FIT)
    if nodes == 2:  # a sum of two numbers is the same in any order: bitwise equal
        for a, b in zip(diloco.state_dict().values(), sparse.state_dict().values()):
            assert torch.equal(a, b)
    else:  # the all-reduce may add three ranks in another order than rank order
        assert_models_close(diloco, sparse, atol=1e-6)
    assert_models_differ(sparse, tiny_model())


@pytest.mark.parametrize("quant_bits", [2, None])
def test_counted_bytes_equal_the_formula_and_ranks_agree_bitwise(quant_bits):
    ds = toy_dataset()
    torch.manual_seed(0)
    model = BNNet()
    trainer = KeepRankStates(model, ds, ds)
    trainer.fit(strategy=SparseLoCoStrategy(H=2, topk=3, chunk=32, quant_bits=quant_bits,
                                            inner_optim="adam", lr=0.01),
                num_nodes=3, max_steps=4, **FIT)
    sizes = [p.numel() for p in model.parameters()]
    float_buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    per_round = sparseloco_payload_bytes(sizes, chunk=32, topk=3, quant_bits=quant_bits)
    per_round += 4 * float_buffers
    last = [r for r in trainer.history if r["step"] == 4]
    assert len(last) == 3
    assert all(r["comm_bytes"] == 2 * per_round for r in last)
    assert_ranks_identical(trainer)


class CrashingNet(CrashAt, BNNet):
    """BNNet whose training forward pass raises at step ``crash_at``."""


@pytest.mark.slow
def test_resumed_run_keeps_the_error_feedback_and_equals_an_uninterrupted_one(tmp_path):
    ds = toy_dataset(96)

    def fit(run, crash_at=None, **kwargs):
        torch.manual_seed(0)
        model = CrashingNet()
        model.crash_at = crash_at
        strategy = SparseLoCoStrategy(H=3, topk=4, chunk=32, quant_bits=2, error_decay=0.9,
                                      inner_optim="adam", lr=0.01)
        return Trainer(model, ds, ds).fit(strategy=strategy, num_nodes=2, max_steps=14,
                                          batch_size=8, val_size=0, save_dir=str(tmp_path),
                                          run_name=run, logger=None, progress=False, **kwargs)

    uninterrupted = fit("full")
    with pytest.raises(RankFailedError, match="simulated crash"):
        fit("split", crash_at=10, checkpoint_interval=4)
    resumed = fit("split", checkpoint_interval=4, resume_from="auto")
    assert_models_close(uninterrupted, resumed, atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(topk=65, chunk=64), "cannot exceed chunk"),
    (dict(quant_bits=9), "quant_bits"),
    (dict(error_decay=1.5), "error_decay"),
    (dict(H=0), "H must be"),
])
def test_bad_settings_fail_before_any_rank_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseLoCoStrategy(**kwargs)


def test_shipped_profiles_name_sparseloco_and_muon_and_compare_takes_sparseloco(tmp_path):
    digits = load_profile("digits-sparseloco").resolved
    assert digits.strategy_cls is SparseLoCoStrategy
    assert digits.strategy_kwargs["quant_bits"] == 2 and digits.strategy_kwargs["topk"] == 32
    chargpt = load_profile("chargpt-sparseloco").resolved
    assert chargpt.strategy_cls is SparseLoCoStrategy and chargpt.strategy_kwargs["chunk"] == 4096
    muon = load_profile("chargpt-diloco-muon").resolved
    assert muon.strategy_cls is DiLoCoStrategy and muon.strategy_kwargs["inner_optim"] == "muon"
    plans = plan_comparison("digits-diloco", ["diloco", "sparseloco"], output_root=tmp_path,
                            overrides={"topk": 16})
    assert plans[1].resolved.strategy_kwargs["topk"] == 16
    assert "outer_momentum" not in plans[1].values  # DiLoCo's own key is dropped


@pytest.mark.slow
def test_the_digits_sparseloco_profile_trains(tmp_path):
    trainer = run_profile("digits-sparseloco", progress=False, local=True, overrides={
        "num_nodes": 2, "max_steps": 4, "H": 2, "val_size": 32, "val_interval": 4,
        "checkpoint_interval": None, "output_dir": str(tmp_path)})
    sizes = [64 * 128, 128, 128 * 10, 10]
    per_round = sparseloco_payload_bytes(sizes, chunk=1024, topk=32, quant_bits=2)
    assert [r["comm_bytes"] for r in trainer.history if r["step"] == 4] == [2 * per_round] * 2
