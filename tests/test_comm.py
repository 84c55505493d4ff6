"""Byte counts equal each strategy's formula; bucketing and dtypes behave."""

from __future__ import annotations

import pytest
import torch
from toys import BNNet, tiny_model, toy_dataset, trainable_count

from exogym import Trainer, comm
from exogym.comm.torch_group import StagedWork
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
        comm.resolve_dtype("int3")  # int4 is a quantized type now


def test_staged_async_work_copies_back_only_after_wait():
    target = torch.zeros(3)
    staged = torch.ones(3)

    class Pending:
        waited = False

        def wait(self, timeout=None):
            Pending.waited = True

        def is_completed(self):
            return Pending.waited

    handle = StagedWork(Pending(), [(target, staged)])
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


@pytest.mark.parametrize("start", ["as the machine allows", "fork server"])
def test_mirrored_collectives_send_nothing_and_every_rank_trains_alone(monkeypatch, start):
    """EXOGYM_COLLECTIVES=mirror: DDP's ranks train as if alone, yet count DDP's bytes.

    Set after the fork server started (it starts with the first fit), the variable still
    reaches ranks the server starts: they take the fit's environment, not the server's.
    """
    import exogym.run.trainer as trainer_module

    if start == "fork server":
        monkeypatch.setattr(trainer_module, "_can_fork", lambda spec, placement: False)
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


@pytest.mark.slow
def test_only_the_comm_package_touches_torch_distributed():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for path in [*root.glob("exogym/**/*.py"), *root.glob("distributed/**/*.py")]:
        if path.is_relative_to(root / "exogym" / "comm"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                names = [f"{node.value.id}.{node.attr}"]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, "torch.distributed outside exogym/comm/: " + ", ".join(found)


def _side_channel_rank(rank: int, port: int, results) -> None:
    import os

    from exogym.comm.averaging import average_across_ranks

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = comm.open_store("127.0.0.1", port, is_master=rank == 0, world_size=2, timeout_s=60)
    comm.init_process_group(store, rank, 2, "gloo", timeout_s=60)
    try:
        comm.reset_counters()
        total = torch.tensor([rank + 1.0])
        comm.side_all_reduce(total)
        gathered = [torch.zeros(1), torch.zeros(1)]
        comm.side_all_gather(gathered, torch.tensor([rank * 10.0]))
        shared = torch.tensor([rank + 7.0])
        comm.side_broadcast(shared, src=1)
        means = average_across_ranks([torch.tensor([2.0 * rank]), torch.tensor([3 * rank]),
                                      torch.tensor([rank == 0])])
        comm.side_barrier()
        results.put((rank, total.item(), [g.item() for g in gathered], shared.item(),
                     [m.tolist() for m in means], [m.dtype for m in means],
                     comm.comm_bytes(), comm.comm_calls()))
    finally:
        comm.destroy_process_group()


@pytest.mark.slow
def test_side_channel_reduces_gathers_broadcasts_averages_and_is_never_counted():
    import multiprocessing as mp

    from ranks import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_side_channel_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((row[0], row[1:]) for row in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=30)
    for rank in (0, 1):
        total, gathered, shared, means, dtypes, nbytes, calls = got[rank]
        assert total == 3.0 and gathered == [0.0, 10.0] and shared == 8.0
        # float mean; integer mean rounded in its own dtype; a boolean keeps its own value
        assert means == [[1.0], [2], [rank == 0]]
        assert dtypes == [torch.float32, torch.int64, torch.bool]
        assert nbytes == 0 and calls == 0


def test_restored_counters_continue_from_a_checkpoint():
    comm.restore_counters(1234, 5)
    assert (comm.comm_bytes(), comm.comm_calls()) == (1234, 5)
    comm.reset_counters()
    assert (comm.comm_bytes(), comm.comm_calls()) == (0, 0)
