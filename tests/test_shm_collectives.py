"""Shared-memory collectives: same results as the definitions, on every rank, in a real fit."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from toys import BNNet, tiny_model, toy_dataset

from exogym import Trainer, comm
from exogym.comm.shared_memory import (
    PeerTimeoutError,
    SharedMemoryBackend,
    SharedMemoryCollectives,
)
from exogym.strategy import DiLoCoStrategy, SimpleReduceStrategy

CTX = mp.get_context("fork")
K = 3


def contribution(rank: int, dtype: torch.dtype, n: int = 1000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=gen) * 10).to(dtype)
    return torch.randint(-50, 50, (n,), generator=gen).to(dtype)


def _rank_body(shm: SharedMemoryCollectives, rank: int, out) -> None:
    try:
        shm.bind(rank)
        results = {}
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for op in ("SUM", "AVG", "MAX", "MIN"):
                if op == "AVG" and not dtype.is_floating_point:
                    continue
                t = contribution(rank, dtype).clone()
                shm.all_reduce(t, getattr(dist.ReduceOp, op))
                results[(str(dtype), op)] = t
        grid = contribution(rank, torch.float32, 60).view(6, 10)
        view = grid.t()  # not contiguous: the result must land in the viewed storage
        shm.all_reduce(view)
        results["non-contiguous"] = grid
        # Several tensors packed into shared chunks, crossing chunk edges, reduced in
        # bfloat16 and averaged in their own float32.
        many = [contribution(rank, torch.float32, n).clone() for n in (700, 1, 333)]
        shm.all_reduce_many(many, wire_dtype=torch.bfloat16, divide_by=K)
        results["many"] = torch.cat(many)
        gathered = [torch.empty(1000) for _ in range(K)]
        shm.all_gather(gathered, contribution(rank, torch.float32))
        results["gather"] = torch.stack(gathered)
        b = contribution(rank, torch.float32).clone()
        shm.broadcast(b, src=1)
        results["broadcast"] = b
        # Plain lists: a tensor in a queue would need this process alive to be read.
        out.put((rank, {k: (v.dtype, tuple(v.shape), v.double().reshape(-1).tolist())
                        for k, v in results.items()}))
    except BaseException:
        out.put((rank, traceback.format_exc()))
    out.close()
    out.join_thread()
    os._exit(0)


def test_collectives_match_their_definitions_on_every_rank_with_chunking():
    # 256-byte slots: a 1000-element tensor passes in many chunks.
    shm = SharedMemoryCollectives(K, 256, CTX, timeout_s=30)
    out = CTX.Queue()
    procs = [CTX.Process(target=_rank_body, args=(shm, r, out)) for r in range(K)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in range(K))
    for p in procs:
        p.join(10)
    for rank, result in got.items():
        assert not isinstance(result, str), result
        got[rank] = {k: torch.tensor(values, dtype=torch.float64).view(shape).to(dtype)
                     for k, (dtype, shape, values) in result.items()}

    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        parts = torch.stack([contribution(r, dtype) for r in range(K)])
        wide = parts.double()
        expected = {"SUM": wide.sum(0), "AVG": wide.mean(0), "MAX": wide.amax(0),
                    "MIN": wide.amin(0)}
        for op, want in expected.items():
            key = (str(dtype), op)
            if key not in got[0]:
                continue
            for rank in range(K):  # bitwise the same on every rank
                assert torch.equal(got[rank][key], got[0][key]), key
            tol = 0.0 if op in ("MAX", "MIN") or not dtype.is_floating_point else (
                1e-4 if dtype == torch.float32 else 0.5)
            torch.testing.assert_close(got[0][key].double(), want, atol=tol, rtol=0.02 if tol else 0)
    many = torch.stack([torch.cat([contribution(r, torch.float32, n) for n in (700, 1, 333)])
                        for r in range(K)]).double().mean(0)
    for rank in range(K):
        assert torch.equal(got[rank]["many"], got[0]["many"])
    torch.testing.assert_close(got[0]["many"].double(), many, atol=0.3, rtol=0.02)
    grids = sum(contribution(r, torch.float32, 60) for r in range(K)).view(6, 10)
    for rank in range(K):
        torch.testing.assert_close(got[rank]["non-contiguous"], grids)
        assert torch.equal(got[rank]["gather"],
                           torch.stack([contribution(r, torch.float32) for r in range(K)]))
        assert torch.equal(got[rank]["broadcast"], contribution(1, torch.float32))


def _back_to_back_body(shm: SharedMemoryCollectives, rank: int, out, rounds: int, n: int) -> None:
    torch.set_num_threads(1)
    shm.bind(rank)
    wrong = 0
    for i in range(rounds):
        gathered = [torch.empty(n) for _ in range(4)]
        shm.all_gather(gathered, torch.full((n,), float(rank * 1000 + i)))
        wrong += sum(int((g != r * 1000 + i).any()) for r, g in enumerate(gathered))
        total = torch.full((n,), float(rank + i))
        shm.all_reduce(total)
        wrong += int((total != sum(r + i for r in range(4))).any())
    out.put(wrong)
    out.close()
    out.join_thread()
    os._exit(0)


def test_back_to_back_collectives_never_overwrite_what_a_slower_rank_still_reads():
    # One meeting per chunk is safe only because the buffer's two halves alternate:
    # with a single half, a rank that races into the next collective overwrites its
    # slot while a slower peer is still copying it (hundreds of wrong results here).
    shm = SharedMemoryCollectives(4, 20000 * 4, CTX, timeout_s=60)
    out = CTX.Queue()
    procs = [CTX.Process(target=_back_to_back_body, args=(shm, r, out, 150, 20000))
             for r in range(4)]
    for p in procs:
        p.start()
    wrong = sum(out.get(timeout=120) for _ in range(4))
    for p in procs:
        p.join(10)
    assert wrong == 0


def test_a_missing_peer_times_out_with_a_clear_error():
    shm = SharedMemoryCollectives(2, 1024, CTX, timeout_s=0.3).bind(0)
    with pytest.raises(PeerTimeoutError, match="rank 0: a peer did not reach the collective"):
        shm.all_reduce(torch.ones(4))


def test_unsupported_calls_are_left_to_torch_distributed():
    shm = SharedMemoryCollectives(2, 1024, CTX).bind(0)
    assert shm.supports(torch.ones(3))
    assert not shm.supports(torch.ones(3), dist.ReduceOp.PRODUCT)
    assert not shm.supports(torch.ones(3, dtype=torch.int64), dist.ReduceOp.AVG)
    assert not shm.supports(torch.ones(3, dtype=torch.bool))
    assert not shm.supports(torch.ones(3, dtype=torch.complex64))


def test_sized_within_the_budget_and_off_when_asked(monkeypatch):
    big = torch.nn.Linear(4000, 4000)  # 64 MB of parameters: chunked, not one huge buffer
    shm = SharedMemoryCollectives.for_model(big, 4, CTX)
    assert shm is not None and (4 + 1) * shm.slot_bytes <= 32 * 2**20
    assert SharedMemoryCollectives.for_model(big, 1, CTX) is None
    monkeypatch.setenv("EXOGYM_COLLECTIVES", "torch")
    assert SharedMemoryCollectives.for_model(big, 4, CTX) is None


class RecordsPath(SimpleReduceStrategy):
    """DDP that fails unless the collectives take the path the test expects."""

    def __init__(self, want_shared_memory: bool, **kwargs):
        super().__init__(**kwargs)
        self.want_shared_memory = want_shared_memory

    def step(self):
        shared = isinstance(comm.backend(), SharedMemoryBackend)
        if shared != self.want_shared_memory:
            raise AssertionError(f"shared-memory collectives in use: {shared}")
        super().step()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "diloco"])
def test_a_fit_through_shared_memory_equals_one_through_gloo(monkeypatch, strategy):
    ds = toy_dataset()
    # processes=3: one process per rank, so the ranks meet in shared memory, not packed.
    fit = dict(num_nodes=3, max_steps=6, batch_size=16, val_size=32, val_interval=3,
               logger=None, progress=False, num_threads=1, processes=3)

    def make(shared: bool):
        if strategy == "ddp":
            return RecordsPath(shared, optim_spec="sgd", lr=0.1)
        return DiLoCoStrategy(H=2, inner_optim="sgd", lr=0.1)

    models, bytes_ = [], []
    for shared in (True, False):
        if not shared:
            monkeypatch.setenv("EXOGYM_COLLECTIVES", "torch")
        trainer = Trainer(tiny_model(cls=BNNet), ds, ds)
        models.append(trainer.fit(strategy=make(shared), **fit))
        bytes_.append([r["comm_bytes"] for r in trainer.history])
    assert bytes_[0] == bytes_[1]
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
