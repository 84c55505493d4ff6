"""Ranks that leave and rejoin in a simulation: fit(rank_failures=...)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from exogym import Trainer
from exogym.membership.simulated import Membership
from exogym.strategy import (
    DiLoCoStrategy,
    FedAvgStrategy,
    SimpleReduceStrategy,
    SparseLoCoStrategy,
)
from tests.toys import assert_models_close, tiny_model, toy_dataset, trainable_count

QUIET = dict(logger=None, progress=False)


# -- the schedule -----------------------------------------------------------------------


def test_a_returning_rank_joins_at_the_next_round_boundary():
    m = Membership([(2, 3, 6)], num_nodes=3, round_steps=4)
    assert [m.is_present(2, s) for s in range(1, 11)] == [True, True] + [False] * 6 + [True] * 2
    assert m.next_join(2, 3) == 9 and m.joiners(9) == [2] and m.source(9) == 0
    per_step = Membership([(2, 3, 6)], num_nodes=3, round_steps=1)
    assert per_step.next_join(2, 4) == 6 and per_step.joiners(6) == [2]


def test_membership_changes_name_each_step_and_reason():
    m = Membership([(1, 5, None), (2, 3, 6)], num_nodes=3, round_steps=1)
    assert m.changes(10) == [
        {"step": 1, "ranks": [0, 1, 2], "reason": "start"},
        {"step": 3, "ranks": [0, 1], "reason": "rank 2 left"},
        {"step": 5, "ranks": [0], "reason": "rank 1 left"},
        {"step": 6, "ranks": [0, 2], "reason": "rank 2 rejoined"},
    ]


@pytest.mark.parametrize("failures, message", [
    ([(0, 1, None), (1, 2, None)], "every rank is away at step 2"),
    ([(0, 2, 5), (0, 4, 8)], "rank 0 leaves at step 4 before it is back"),
    ([(0, 2, 5), (1, 5, None)], "at step 5 rank 0 rejoins, but no rank that stayed"),
    ([(2, 1, None)], "rank must be an integer in 0..1"),
    ([(0, 0, None)], "at_step must be an integer >= 1"),
    ([(0, 3, 3)], "back_at_step must be None .* or an integer > at_step=3"),
    ([(0, 3)], r"rank_failures\[0\] must be \(rank, at_step, back_at_step or None\)"),
    ("0,1,2", "must be a list"),
])
def test_bad_rank_failures_are_refused_before_any_rank_starts(failures, message):
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    with pytest.raises(ValueError, match=message):
        trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=6,
                    rank_failures=failures, **QUIET)
    assert trainer.history == []


def test_rank_failures_cannot_resume_from_a_checkpoint():
    ds = toy_dataset()
    with pytest.raises(ValueError, match="rank_failures and resume_from cannot be combined"):
        Trainer(tiny_model(), ds, ds).fit(strategy=SimpleReduceStrategy(), num_nodes=2,
                                          max_steps=4, rank_failures=[(1, 2, 3)],
                                          resume_from="auto", **QUIET)


# -- runs -------------------------------------------------------------------------------


def run(strategy, failures, num_nodes=3, max_steps=12, dataset=None, **kwargs):
    ds = dataset or toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    model = trainer.fit(strategy=strategy, num_nodes=num_nodes, max_steps=max_steps,
                        batch_size=8, rank_failures=failures, **QUIET, **kwargs)
    return trainer, model


def steps_of(trainer, rank):
    return [r["step"] for r in trainer.history if r["rank"] == rank]


def test_diloco_round_completes_among_present_ranks_and_the_returning_rank_takes_the_state():
    # H=4: rank 2 leaves before step 3 and is back for step 6, so it rejoins at step 9.
    trainer, model = run(DiLoCoStrategy(H=4, inner_optim="sgd", lr=0.05), [(2, 3, 6)],
                         val_size=32, val_interval=12)
    assert steps_of(trainer, 2) == [1, 2, 9, 10, 11, 12]
    assert steps_of(trainer, 0) == list(range(1, 13))
    per_round = 4 * trainable_count(tiny_model())
    final = {r["rank"]: r for r in trainer.history if r["step"] == 12}
    # rounds after steps 4, 8, 12; rank 2 left during the first and took part in the last only
    assert final[0]["comm_bytes"] == final[1]["comm_bytes"] == 3 * per_round
    assert final[2]["comm_bytes"] == per_round
    # had rank 2 not received the outer parameters at step 9, its model would differ after
    # the round at step 12; every rank evaluates the same validation samples
    assert len({round(r["val_loss"], 6) for r in final.values()}) == 1
    assert [c["step"] for c in trainer.summary["membership"]] == [1, 3, 9]
    assert trainer.summary["membership"][1]["ranks"] == [0, 1]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_ddp_survivors_continue_and_a_returning_rank_joins_at_its_step():
    trainer, model = run(SimpleReduceStrategy(optim_spec="sgd", lr=0.05), [(1, 3, 6)],
                         max_steps=8, val_size=32, val_interval=8)
    assert steps_of(trainer, 1) == [1, 2, 6, 7, 8]
    final = {r["rank"]: r for r in trainer.history if r["step"] == 8}
    grads = 4 * trainable_count(tiny_model())
    assert final[0]["comm_bytes"] == 8 * grads and final[1]["comm_bytes"] == 5 * grads
    # DDP keeps every rank's model the same: so must the hand-over at step 6
    assert len({round(r["val_loss"], 6) for r in final.values()}) == 1


def per_rank_data(rank: int, num_nodes: int, is_train: bool) -> TensorDataset:
    """Each rank's data depends on its rank alone, whatever the number of ranks."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 8, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


@pytest.mark.slow
@pytest.mark.parametrize("dataset", [per_rank_data, None], ids=["per-rank-data", "resharded"])
@pytest.mark.parametrize("make", [
    lambda: SimpleReduceStrategy(optim_spec="sgd", lr=0.1),
    lambda: DiLoCoStrategy(H=2, inner_optim="sgd", lr=0.1),
], ids=["ddp", "diloco"])
def test_a_rank_away_from_the_start_leaves_the_others_training_as_a_smaller_run(make, dataset):
    # A shared dataset is re-sharded over the two present ranks: the same shards as a run
    # of two; per-rank datasets (a factory) are each rank's own anyway.
    shared = toy_dataset() if dataset is None else dataset
    away, away_model = run(make(), [(2, 1, None)], max_steps=6, dataset=shared, val_size=0)
    two, two_model = run(make(), None, num_nodes=2, max_steps=6, dataset=shared, val_size=0)
    assert steps_of(away, 2) == []
    assert [(r["rank"], r["step"], r["comm_bytes"]) for r in away.history] == \
        [(r["rank"], r["step"], r["comm_bytes"]) for r in two.history]
    for a, b in zip(away.history, two.history):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    assert_models_close(away_model, two_model, atol=1e-5)


def test_a_rank_that_never_returns_is_left_out_of_the_final_model():
    trainer, model = run(DiLoCoStrategy(H=2), [(0, 3, None)], max_steps=6, val_size=16,
                         val_interval=6)
    assert steps_of(trainer, 0) == [1, 2]
    assert trainer.summary["steps"] == 6
    assert trainer.summary["final_val_loss"] is not None
    assert trainer.summary["membership"][-1] == {"step": 3, "ranks": [1, 2],
                                                  "reason": "rank 0 left"}
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("make", [
    lambda: FedAvgStrategy(H=2, island_size=2),
    lambda: SparseLoCoStrategy(H=2),
], ids=["fedavg-islands", "sparseloco"])
def test_strategies_that_size_by_ranks_average_over_the_present_ones(make):
    trainer, model = run(make(), [(1, 2, 5)], num_nodes=4, max_steps=8, val_size=0)
    assert steps_of(trainer, 1) == [1, 5, 6, 7, 8]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_returning_rank_takes_the_simulated_clock_of_the_others():
    trainer, _ = run(DiLoCoStrategy(H=2), [(1, 2, 4)], num_nodes=2, max_steps=6, val_size=0,
                     network="100mbit", compute_time_s=0.1)
    clock = {(r["rank"], r["step"]): r["sim_time_s"] for r in trainer.history}
    assert (1, 2) not in clock and (1, 3) not in clock
    # back at step 5 (the round after step 4 begins there) with rank 0's time at step 4
    assert clock[(1, 5)] == pytest.approx(clock[(0, 5)])
    assert clock[(1, 6)] == pytest.approx(clock[(0, 6)])
    # while rank 1 was away, rank 0's round at step 4 had no peer to wait for or send to
    assert clock[(0, 4)] - clock[(0, 3)] == pytest.approx(0.1)


def test_a_handed_over_state_sends_a_repeated_tensor_once_and_rebuilds_it_unshared():
    from exogym.membership.handover import BUCKET_BYTES, _buckets, flatten_tensors, unflatten_tensors

    weight = torch.randn(4, 3)
    state = {"model": {"w": weight, "n": torch.tensor(7, dtype=torch.int64)},
             "strategy": {"master": [weight.clone()], "moments": [torch.zeros(5), torch.zeros(5)],
                          "step": torch.tensor(3.0), "flag": torch.tensor([True, False])},
             "step": 12}
    tensors, skeleton = flatten_tensors(state)
    # the master equals the weight and the two zero moments are alike: each is sent once
    assert len(tensors) == 5
    rebuilt = unflatten_tensors(skeleton, [t.clone() for t in tensors])
    assert torch.equal(rebuilt["strategy"]["master"][0], weight) and rebuilt["step"] == 12
    a, b = rebuilt["strategy"]["moments"]
    a.add_(1.0)  # a tensor that stood in two places arrives as two tensors
    assert torch.equal(b, torch.zeros(5))
    assert rebuilt["model"]["n"].dtype == torch.int64 and rebuilt["model"]["n"].item() == 7
    assert _buckets([1, 2, BUCKET_BYTES, 3]) == [[0, 1], [2], [3]]


def test_a_joiner_takes_the_handed_state_into_its_own_tensors():
    from exogym.membership.handover import _targets, flatten_tensors, unflatten_tensors

    weight = torch.randn(256, 64)
    sent = {"model": {"w": weight}, "strategy": {"master": [weight.clone()],
                                                 "moments": [torch.randn(256, 64)]}}
    tensors, skeleton = flatten_tensors(sent)
    # the joiner's own state: its model's weight and master, but no moments yet
    own_w, own_master = torch.zeros(256, 64), torch.zeros(256, 64)
    mine = {"model": {"w": own_w}, "strategy": {"master": [own_master], "moments": []}}
    targets = _targets(skeleton, mine)
    assert targets[0] is not None and targets[0].data_ptr() == own_w.data_ptr()
    received = [targets.get(i, torch.empty_like(t)) for i, t in enumerate(tensors)]
    for buffer, t in zip(received, tensors):
        buffer.copy_(t)  # what the broadcast does
    rebuilt = unflatten_tensors(skeleton, received, mine)
    assert rebuilt["model"]["w"] is own_w and torch.equal(own_w, weight)
    # the master, sent once with the weight, is copied into the joiner's own master
    assert rebuilt["strategy"]["master"][0] is own_master and torch.equal(own_master, weight)
    assert torch.equal(rebuilt["strategy"]["moments"][0], sent["strategy"]["moments"][0])
    own_w.add_(1.0)
    assert torch.equal(own_master, weight)  # two tensors, not one
