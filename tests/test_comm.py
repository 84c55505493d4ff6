"""Byte counts equal each strategy's formula; bucketing and dtypes behave."""

from __future__ import annotations

import pytest
import torch
from toys import BNNet, tiny_model, toy_dataset, trainable_count

from exogym import Trainer, comm
from exogym.strategy import DiLoCoStrategy, FedAvgStrategy, SimpleReduceStrategy

FIT = dict(batch_size=16, val_size=32, val_interval=2, logger=None, progress=False)


def final_bytes(trainer):
    return {r["rank"]: r["comm_bytes"] for r in trainer.history if r["step"] == trainer.summary["steps"]}


def test_ddp_sends_4p_bytes_per_step():
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=3, max_steps=5, **FIT)
    p = trainable_count(tiny_model())
    for row in trainer.history:  # evaluation adds nothing to the training traffic
        assert row["comm_bytes"] == 4 * p * row["step"]


def test_diloco_sends_4p_bytes_per_round_and_nothing_between():
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=DiLoCoStrategy(H=3), num_nodes=2, max_steps=7, **FIT)
    p = trainable_count(tiny_model())
    for row in trainer.history:
        assert row["comm_bytes"] == 4 * p * (row["step"] // 3)


def test_diloco_bfloat16_halves_the_bytes_and_still_trains():
    ds = toy_dataset(512)
    p = trainable_count(tiny_model())
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=DiLoCoStrategy(H=2, comm_dtype="bfloat16", inner_optim="adam", lr=0.02),
                num_nodes=2, max_steps=20, batch_size=16, val_size=128, val_interval=20,
                logger=None, progress=False)
    assert set(final_bytes(trainer).values()) == {2 * p * 10}
    first = trainer.history[0]["train_loss"]
    assert trainer.summary["final_val_global_loss"] < first


def test_fedavg_full_islands_send_4p_bytes_per_round_including_float_buffers():
    ds = toy_dataset()
    model = tiny_model(cls=BNNet)
    floats = trainable_count(model) + sum(b.numel() for b in model.buffers()
                                          if b.is_floating_point())
    trainer = Trainer(model, ds, ds)
    trainer.fit(strategy=FedAvgStrategy(H=2), num_nodes=2, max_steps=6, **FIT)
    assert set(final_bytes(trainer).values()) == {4 * floats * 3}


def test_fedavg_islands_cost_no_more_than_an_island_all_reduce():
    ds = toy_dataset()
    p = trainable_count(tiny_model())
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=FedAvgStrategy(H=1, island_size=2, client_sampling=0.5), num_nodes=4,
                max_steps=4, **FIT)
    assert set(final_bytes(trainer).values()) == {4 * p * 4}


def test_comm_outside_a_process_group_is_a_world_of_one():
    comm.reset_counters()
    t = torch.ones(4)
    comm.all_reduce(t)
    comm.all_reduce_tensors([t, torch.ones(3)], average=True)
    assert torch.equal(t, torch.ones(4))
    assert comm.comm_bytes() == 0


def test_bucketing_groups_by_dtype_and_size():
    tensors = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(10),
               torch.zeros(300)]
    buckets = comm._buckets(tensors, bucket_bytes=100)
    assert sorted(map(sorted, buckets)) == [[0, 2], [1], [3]]
    assert len(comm._buckets(tensors, bucket_bytes=1 << 20)) == 2


def test_resolve_dtype_names_the_choices():
    assert comm.resolve_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="bfloat16"):
        comm.resolve_dtype("int4")


def test_staged_async_work_copies_back_only_after_wait():
    target = torch.zeros(3)
    staged = torch.ones(3)

    class Pending:
        waited = False

        def wait(self, timeout=None):
            Pending.waited = True

        def is_completed(self):
            return Pending.waited

    handle = comm._StagedWork(Pending(), [(target, staged)])
    assert torch.equal(target, torch.zeros(3))
    handle.wait()
    assert Pending.waited and torch.equal(target, torch.ones(3))


class ChecksMirror(SimpleReduceStrategy):
    """DDP that first checks what mirrored collectives return (fails the fit otherwise)."""

    def step(self) -> None:
        world = self.num_nodes
        t = torch.full((3,), float(self.rank + 1))
        comm.all_reduce(t)
        assert torch.equal(t, torch.full((3,), float(world * (self.rank + 1)))), t
        gathered = [torch.zeros(2) for _ in range(world)]
        comm.all_gather(gathered, torch.full((2,), float(self.rank)))
        assert all(torch.equal(g, torch.full((2,), float(self.rank))) for g in gathered)
        b = torch.full((2,), float(self.rank))
        comm.broadcast(b, src=0)
        assert torch.equal(b, torch.full((2,), float(self.rank)))
        super().step()


def test_mirrored_collectives_send_nothing_and_every_rank_trains_alone(monkeypatch):
    """EXOGYM_COLLECTIVES=mirror: DDP's ranks train as if alone, yet count DDP's bytes."""
    ds = toy_dataset()
    p = trainable_count(tiny_model())
    fit = dict(num_nodes=2, max_steps=6, batch_size=16, val_size=32, val_interval=6,
               logger=None, progress=False, seed=3)

    def losses(trainer):
        return {(r["rank"], r["step"]): r["train_loss"] for r in trainer.history
                if "train_loss" in r}

    alone = Trainer(tiny_model(), ds, ds)
    alone.fit(strategy=DiLoCoStrategy(H=10**6, inner_optim="sgd", lr=0.1), **fit)
    monkeypatch.setenv("EXOGYM_COLLECTIVES", "mirror")
    mirrored = Trainer(tiny_model(), ds, ds)
    mirrored.fit(strategy=ChecksMirror(optim_spec="sgd", lr=0.1), **fit)
    monkeypatch.delenv("EXOGYM_COLLECTIVES")
    ddp = Trainer(tiny_model(), ds, ds)
    ddp.fit(strategy=SimpleReduceStrategy(optim_spec="sgd", lr=0.1), **fit)

    got, want = losses(mirrored), losses(alone)
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(want[k], abs=1e-6) for k in got)
    # Real DDP couples the ranks, so the mirrored run is not DDP in disguise.
    assert any(abs(losses(ddp)[k] - got[k]) > 1e-4 for k in got if k[1] > 1)
    for row in mirrored.history:
        assert row["comm_bytes"] == 4 * p * row["step"] + 12 * row["step"] + 8 * row["step"] * 2


def test_an_unknown_collectives_mode_is_refused_before_any_rank_starts(monkeypatch):
    monkeypatch.setenv("EXOGYM_COLLECTIVES", "shared")
    ds = toy_dataset()
    with pytest.raises(ValueError, match="EXOGYM_COLLECTIVES='shared' is not one of auto, torch, mirror"):
        Trainer(tiny_model(), ds, ds).fit(strategy=SimpleReduceStrategy(), num_nodes=2,
                                          max_steps=2, **FIT)
