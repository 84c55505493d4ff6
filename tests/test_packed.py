"""Several ranks per process (exogym.comm.packed): the same run, fewer processes, many more ranks."""

from __future__ import annotations

import math

import pytest
import torch

from exogym import Trainer
from exogym.strategy import DiLoCoStrategy, FedAvgStrategy, SimpleReduceStrategy, SPARTAStrategy
from tests.toys import assert_models_close, tiny_model, toy_dataset, trainable_count

QUIET = dict(logger=None, progress=False)


def run(strategy, num_nodes=4, max_steps=6, processes=None, **kwargs):
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    model = trainer.fit(strategy=strategy, num_nodes=num_nodes, max_steps=max_steps,
                        batch_size=8, val_size=32, val_interval=3, processes=processes,
                        **QUIET, **kwargs)
    return trainer, model


def rows(trainer):
    return [(r["rank"], r["step"], r["train_loss"], r["comm_bytes"]) for r in trainer.history]


def evaluations(trainer):
    """(rank, step, validation loss of the global model) of every evaluation, in order."""
    return [(r["rank"], r["step"], r["val_global_loss"]) for r in trainer.history
            if "val_global_loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("make", [
    lambda: SimpleReduceStrategy(optim_spec="sgd", lr=0.1),
    lambda: DiLoCoStrategy(H=2, inner_optim="sgd", lr=0.1),
    lambda: FedAvgStrategy(H=2, island_size=2, inner_optim="sgd", lr=0.1),
    lambda: SPARTAStrategy(p_sparta=0.1, inner_optim="sgd", lr=0.1),
], ids=["ddp", "diloco", "fedavg-islands", "sparta"])
def test_packed_ranks_train_as_one_process_per_rank(make):
    separate, separate_model = run(make(), processes=4)
    packed, packed_model = run(make(), processes=2)
    alone, alone_model = run(make(), processes=1)
    for trainer in (packed, alone):
        assert len(trainer.history) == len(separate.history) == 4 * 6
        for a, b in zip(rows(separate), rows(trainer)):
            assert a[:2] == b[:2] and a[3] == b[3]  # same rows, same bytes counted
            assert math.isclose(a[2], b[2], rel_tol=1e-5, abs_tol=1e-6)
        # the global model scored at step 3, mid-round for DiLoCo and FedAvg, in one
        # evaluation model per process
        assert len(evaluations(trainer)) == len(evaluations(separate)) == 8
        for a, b in zip(evaluations(separate), evaluations(trainer)):
            assert a[:2] == b[:2] and math.isclose(a[2], b[2], rel_tol=1e-5, abs_tol=1e-6)
    assert_models_close(separate_model, packed_model, atol=1e-5)
    assert_models_close(packed_model, alone_model, atol=1e-5)


@pytest.mark.slow
def test_more_ranks_than_cores_are_packed_by_default():
    from exogym.run.devices import available_cores

    cores = available_cores()
    trainer, model = run(DiLoCoStrategy(H=3), num_nodes=cores + 2, max_steps=3)
    assert trainer.summary["processes"] == cores  # one process per core
    assert {r["rank"] for r in trainer.history} == set(range(cores + 2))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    separate, _ = run(DiLoCoStrategy(H=3), num_nodes=min(2, cores), max_steps=1)
    assert "processes" not in separate.summary  # ranks that fit the cores: one process each


@pytest.mark.slow
def test_128_ranks_train_diloco_with_exact_byte_counts():
    trainer, model = run(DiLoCoStrategy(H=5), num_nodes=128, max_steps=10)
    assert len(trainer.history) == 128 * 10
    # two outer rounds of 4 bytes per trainable parameter, on every rank
    expected = 2 * 4 * trainable_count(tiny_model())
    assert {r["comm_bytes"] for r in trainer.history if r["step"] == 10} == {expected}
    assert trainer.summary["bytes_per_node"] == expected
    # DiLoCo leaves every rank with the same model after a round: one validation loss
    assert len({round(r["val_loss"], 6) for r in trainer.history if r["step"] == 10}) == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_model_that_asks_torch_distributed_its_rank_gets_its_own():
    import torch.distributed as dist

    class Reports(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = tiny_model()
            self.ranks = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

        def forward(self, batch):
            self.ranks[dist.get_rank()] = dist.get_world_size()
            return self.inner(batch)

    ds = toy_dataset()
    final = Trainer(Reports(), ds, ds).fit(strategy=DiLoCoStrategy(H=2), num_nodes=4,
                                           max_steps=2, batch_size=8, val_size=0,
                                           processes=2, **QUIET)
    # each rank wrote the world size into its own slot; the average over ranks is 4/4 each
    torch.testing.assert_close(final.ranks, torch.ones(4))


def test_processes_is_checked_before_any_rank_starts(monkeypatch):
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    with pytest.raises(ValueError, match="processes=5 is more than num_nodes=4"):
        trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=4, max_steps=1, processes=5,
                    **QUIET)
    with pytest.raises(ValueError, match="processes must be"):
        trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=4, max_steps=1, processes=0,
                    **QUIET)
    monkeypatch.setenv("EXOGYM_COLLECTIVES", "torch")
    with pytest.raises(ValueError, match="processes=2 runs several ranks in a process.*"
                                         "EXOGYM_COLLECTIVES=torch"):
        trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=4, max_steps=1, processes=2,
                    **QUIET)
    assert trainer.history == []


def test_an_average_taken_in_parts_equals_one_taken_at_once():
    from exogym.comm.averaging import average_of_sums, average_state_dicts, state_sums

    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(3, 4, generator=g), "n": torch.tensor(i * 3, dtype=torch.int64),
               "on": torch.tensor([True, False])} for i in range(5)]
    parts = [(state_sums(states[:2]), 2), (state_sums(states[2:]), 3)]
    whole = average_state_dicts(states)
    split = average_of_sums(parts, states[0])
    assert split.keys() == whole.keys()
    torch.testing.assert_close(split["w"], whole["w"], atol=1e-7, rtol=0)
    assert split["n"].dtype == torch.int64 and split["n"].item() == whole["n"].item() == 6
    assert torch.equal(split["on"], states[0]["on"])


def _two_processes(target, timeout: float) -> tuple[list, str]:
    """Run ``target(index, store_port, run_id, out)`` in two forked processes over one
    store and one run's shared memory; what each put in ``out``, and the run's id."""
    import multiprocessing as mp

    from exogym import comm
    from exogym.comm.mailbox import new_run_id

    store = comm.open_store("127.0.0.1", 0, is_master=True)
    run_id = new_run_id()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(i, store.port, run_id, out)) for i in range(2)]
    for p in procs:
        p.start()
    reported = [out.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(10)
    return reported, run_id


def _run_ranks(world, body) -> None:
    """Run ``body(rank)`` for each of the world's ranks in a thread of its own, then close it."""
    import threading

    threads = [threading.Thread(target=body, args=(r,)) for r in world.here]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    world.close()


def _crossing_groups(index: int, port: int, run_id: str, out) -> None:
    from exogym import comm
    from exogym.comm.packed import PackedWorld

    world = PackedWorld(4, 2, index, lambda: comm.open_store("127.0.0.1", port, timeout_s=30),
                        30, run_id=run_id)
    comm.use_backend(world)
    wrong = []

    def body(rank: int) -> None:
        world.sit(rank)
        try:
            group = world.group([0, 2] if rank in (0, 2) else [1, 3])
            partner = {0: 2, 2: 0, 1: 3, 3: 1}[rank]
            for step in range(1, 150):
                world.enter_step(step, None)
                t = torch.full((100,), float(rank * 1000 + step))
                world.all_reduce_many([t], None, group)
                if not torch.all(t == float((rank + partner) * 1000 + 2 * step)):
                    wrong.append((rank, step, t[0].item()))
        finally:
            world.stand()

    _run_ranks(world, body)
    out.put(wrong)


def test_two_groups_meeting_at_once_across_processes_never_read_each_others_parts():
    """Each process runs one rank of each group: while one waits for the other process's
    part, its process's other rank posts its own. Neither may take the other's place in
    shared memory (a segment is reused only once its own process is done with it too)."""
    from exogym.comm.mailbox import remove_segments

    wrong, run_id = _two_processes(_crossing_groups, timeout=120)
    assert remove_segments(run_id) == 0  # every process removed its own segments
    assert wrong == [[], []]


def _many_ranks_in_windows(index: int, port: int, run_id: str, out) -> None:
    from exogym import comm
    from exogym.comm import packed
    from exogym.comm.mailbox import Mailbox
    from exogym.comm.packed import PackedWorld

    packed.POST_BYTES = 64 << 10  # 8 ranks of 40 KB each: several windows per exchange
    packed.MIN_WINDOW_BYTES = 1 << 10
    sizes = []
    take = Mailbox.take

    def recorded_take(self, nbytes, *args, **kwargs):
        sizes.append(nbytes)
        return take(self, nbytes, *args, **kwargs)

    Mailbox.take = recorded_take
    world = PackedWorld(16, 2, index, lambda: comm.open_store("127.0.0.1", port, timeout_s=30),
                        30, run_id=run_id)
    comm.use_backend(world)
    results = {}

    def values(rank: int) -> torch.Tensor:
        return torch.randn(10_000, generator=torch.Generator().manual_seed(rank))

    def body(rank: int) -> None:
        world.sit(rank)
        try:
            t = values(rank)
            world.all_reduce(t)
            gathered = [torch.empty(10_000) for _ in range(16)]
            world.all_gather(gathered, values(rank))
            b = torch.zeros(10_000) if rank != 11 else values(11)
            world.broadcast(b, 11)
            results[rank] = (t, gathered, b)
        finally:
            world.stand()

    _run_ranks(world, body)
    total = values(0).clone()
    for r in range(1, 16):
        total += values(r)  # in rank order, as every reduction adds
    wrong = [r for r, (t, gathered, b) in results.items()
             if not (torch.equal(t, total) and torch.equal(b, values(11))
                     and all(torch.equal(g, values(s)) for s, g in enumerate(gathered)))]
    out.put((sorted(results), wrong, max(sizes)))


@pytest.mark.slow
def test_a_process_of_many_ranks_posts_them_in_windows_of_bounded_size():
    """A process's part of an exchange is capped (POST_BYTES), however many ranks it runs:
    8 ranks of 40 KB post in windows of at most 64 KiB, and the sums, gathers and
    broadcasts come out exactly as one exchange would give them."""
    from exogym.comm.mailbox import remove_segments

    reported, run_id = _two_processes(_many_ranks_in_windows, timeout=120)
    assert remove_segments(run_id) == 0
    for ranks, wrong, largest in reported:
        assert len(ranks) == 8 and wrong == []
        assert largest <= 64 << 10  # not the 8 x 40 KB = 320 KB of one window per rank


def test_an_average_across_many_packed_ranks_goes_in_buckets_the_process_shares(monkeypatch):
    """A process of 16 ranks averages a model in side-channel calls of at most its share
    of the process's bucket each, splitting a tensor larger than that, and every rank
    gets the exact float64 mean, written into its targets when it gives them."""
    from exogym import comm
    from exogym.comm import averaging
    from exogym.comm.packed import PackedWorld

    monkeypatch.setattr(averaging, "BUCKET_ELEMENTS", 4096)
    monkeypatch.setattr(averaging, "MIN_BUCKET_ELEMENTS", 64)
    assert averaging.bucket_elements() == 4096  # one rank in this process
    ranks = 16
    world = PackedWorld(ranks, 1, 0, None, 30)
    sent: list[int] = []
    reduce = world.side_all_reduce

    def recorded(tensor, op=None):
        sent.append(tensor.numel())
        reduce(tensor, op)

    monkeypatch.setattr(world, "side_all_reduce", recorded)

    def tensors(rank: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(rank)
        return [torch.randn(50, 30, generator=g), torch.tensor([3 * rank, rank]),
                torch.tensor([rank == 0]), torch.zeros(0), torch.randn(7, generator=g)]

    def mean(i: int) -> torch.Tensor:  # summed in rank order, as every reduction is
        total = torch.zeros_like(tensors(0)[i], dtype=torch.float64)
        for rank in range(ranks):
            total += tensors(rank)[i]
        return total / ranks

    expected = [mean(i) for i in (0, 1, 4)]
    got: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], int]] = {}
    comm.use_backend(world)
    try:
        def body(rank: int) -> None:
            world.sit(rank)
            try:
                mine = tensors(rank)
                targets = [torch.full_like(t, 9) for t in mine]
                returned = averaging.average_across_ranks(mine, into=targets)
                assert returned == targets
                got[rank] = (targets, averaging.average_across_ranks(mine),
                             averaging.bucket_elements())
            finally:
                world.stand()

        _run_ranks(world, body)
    finally:
        comm.use_backend(None)
    assert sorted(got) == list(range(ranks))
    assert max(sent) == 4096 // ranks and sum(sent) == 2 * ranks * (1500 + 2 + 7)
    for rank, (into, fresh, bucket) in got.items():
        assert bucket == 4096 // ranks
        for results in (into, fresh):
            assert torch.equal(results[0], expected[0].float())
            assert torch.equal(results[1], expected[1].round().long())
            assert results[2].item() == (rank == 0)  # booleans keep their own value
            assert results[3].shape == (0,)
            assert torch.equal(results[4], expected[2].float())


def test_window_elements_shrink_with_the_ranks_a_process_posts_within_bounds():
    from exogym.comm.packed import MIN_WINDOW_BYTES, POST_BYTES, WINDOW_BYTES, window_elements

    assert window_elements(1, 4) == WINDOW_BYTES // 4  # few ranks: the per-rank cap
    assert window_elements(512, 4) * 4 * 512 <= POST_BYTES
    assert window_elements(1 << 20, 4) == MIN_WINDOW_BYTES // 4  # never below the floor
    assert window_elements(3, 1 << 30) == 1  # at least one element


def _mkl_memory() -> int | None:
    """Bytes MKL's memory manager holds now (None: this torch has no MKL to ask)."""
    import ctypes
    from pathlib import Path

    for path in Path(torch.__file__).parent.joinpath("lib").glob("libtorch_cpu.*"):
        stat = getattr(ctypes.CDLL(str(path)), "mkl_serv_mem_stat", None)
        if stat is not None:
            stat.restype = ctypes.c_int64
            stat.argtypes = [ctypes.POINTER(ctypes.c_int)]
            return stat(ctypes.byref(ctypes.c_int()))
    return None


def test_a_rank_thread_that_hands_its_turn_on_gives_back_its_blas_buffers(monkeypatch):
    """Each thread that ran a matrix product keeps MKL buffers of its own; in a process of
    more than BUFFERS_KEPT_UP_TO ranks a rank gives back what MKL lets go whenever it lets
    the others run."""
    import threading

    from exogym.base.blas_buffers import thread_buffers_releasable
    from exogym.comm import packed
    from exogym.comm.packed import PackedWorld

    if not thread_buffers_releasable() or _mkl_memory() is None:
        pytest.skip("this torch has no MKL: no per-thread BLAS buffers to give back")
    monkeypatch.setattr(packed, "BUFFERS_KEPT_UP_TO", 4)
    world = PackedWorld(8, 1, 0, None, 30)
    held = {}
    ran = threading.Barrier(8)

    def body(rank: int) -> None:
        world.sit(rank)
        try:
            if rank == 0:  # no rank has run a product yet
                held["start"] = _mkl_memory()
            torch.randn(32, 784) @ torch.randn(784, 256)
            if rank == 0:
                held["one rank"] = _mkl_memory()
            with world._aside():  # the rank lets the others run until all have had a turn
                ran.wait(30)
            if rank == 7:
                held["eight ranks"] = _mkl_memory()
            torch.randn(32, 784) @ torch.randn(784, 256)  # and takes buffers again
        finally:
            world.stand()

    # (measured by rank 0 itself: a thread of an earlier test may still be giving back
    # the buffer MKL kept for it as it ends)
    threads = [threading.Thread(target=body, args=(r,)) for r in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    before = held["start"]
    one = held["one rank"] - before
    assert one > 0  # a product took buffers
    # Once all eight ran a product and handed their turn on, each keeps only the buffer MKL
    # holds on to while its thread lives (half of a product's here), not all it took.
    assert held["eight ranks"] - before <= 0.6 * 8 * one, (held, before)


def _leave_after_barrier(index: int, port: int, run_id: str, out) -> None:
    import time

    from exogym import comm
    from exogym.comm.mailbox import Mailbox
    from exogym.comm.packed import PackedWorld

    if index == 1:  # the slow peer: it maps process 0's part only after a while
        read = Mailbox.read

        def late_read(self, *args, **kwargs):
            time.sleep(1.0)
            return read(self, *args, **kwargs)

        Mailbox.read = late_read
    world = PackedWorld(2, 2, index, lambda: comm.open_store("127.0.0.1", port, timeout_s=30),
                        30, run_id=run_id)
    comm.use_backend(world)
    world.sit(index)
    try:
        t = torch.full((10,), float(index + 1))
        world.all_reduce(t)
        world.side_barrier()
        outcome = ("ok", t[0].item())
    except Exception as exc:  # reported to the test, which names it
        outcome = ("failed", f"{type(exc).__name__}: {exc}")
    finally:
        world.stand()
    started = time.monotonic()
    world.close()
    out.put((index, outcome, time.monotonic() - started))


@pytest.mark.slow
def test_a_process_that_leaves_first_waits_until_its_last_part_is_read():
    """The process that finishes the last barrier first must not remove its shared
    memory while a slower peer has yet to read its part of that barrier."""
    from exogym.comm.mailbox import remove_segments

    reported, run_id = _two_processes(_leave_after_barrier, timeout=60)
    results = {index: (outcome, closing) for index, outcome, closing in reported}
    assert results[0][0] == ("ok", 3.0) and results[1][0] == ("ok", 3.0), results
    assert results[0][1] > 0.5  # process 0 waited for its reader before leaving
    assert remove_segments(run_id) == 0


def test_every_rank_has_one_process_and_a_process_shares_its_device():
    from types import SimpleNamespace

    from exogym.comm.packed import process_of, process_ranks
    from exogym.run.spec import Placement

    for world, processes in ((4, 1), (4, 3), (7, 2), (128, 5), (1024, 2)):
        for index in range(processes):
            for rank in process_ranks(world, processes, index):
                assert process_of(world, processes, rank) == index
    spec = SimpleNamespace(num_nodes=6, device_type="cuda")
    packed = Placement(ranks_per_machine=6, devices=[0, 1], processes=3)
    # processes 0, 1, 2 hold ranks 0-1, 2-3, 4-5; they take GPUs 0, 1, 0
    assert [packed.device_of(spec, r).index for r in range(6)] == [0, 0, 1, 1, 0, 0]
    alone = Placement(ranks_per_machine=6, devices=[0, 1])
    assert [alone.device_of(spec, r).index for r in range(6)] == [0, 1, 0, 1, 0, 1]
    # Packed without a count: one process per device, never more processes than ranks.
    from exogym.run.trainer import packed_processes

    assert packed_processes(spec, Placement(ranks_per_machine=6, devices=[0, 1])) == 2
    few = SimpleNamespace(num_nodes=2, device_type="cuda")
    assert packed_processes(few, Placement(ranks_per_machine=2, devices=[0, 1, 2, 3])) == 2


def _accelerators():
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return found or [pytest.param("none", marks=pytest.mark.skip(
        reason="needs a CUDA or MPS device: packed and stacked ranks on an accelerator"))]


@pytest.mark.parametrize("device", _accelerators())
def test_packed_and_stacked_ranks_on_an_accelerator_train_as_one_process_per_rank(device):
    make = lambda: DiLoCoStrategy(H=2, inner_optim="adamw", lr=0.01)  # noqa: E731
    separate, separate_model = run(make(), processes=4, device=device)
    packed, packed_model = run(make(), processes=1, device=device)
    stacked, stacked_model = run(make(), processes=1, device=device, stack=True)
    away, _ = run(make(), processes=1, device=device, rank_failures=[(1, 2, 5)])
    assert packed.summary["processes"] == 1 and stacked.summary["stacked"] is True
    for trainer in (packed, stacked):
        for a, b in zip(rows(separate), rows(trainer)):
            assert a[:2] == b[:2] and a[3] == b[3]
            assert math.isclose(a[2], b[2], rel_tol=1e-5, abs_tol=1e-6)
        # the global model scored at step 3, mid-round for DiLoCo and FedAvg, in one
        # evaluation model per process
        assert len(evaluations(trainer)) == len(evaluations(separate)) == 8
        for a, b in zip(evaluations(separate), evaluations(trainer)):
            assert a[:2] == b[:2] and math.isclose(a[2], b[2], rel_tol=1e-5, abs_tol=1e-6)
    assert_models_close(separate_model, packed_model, atol=1e-5)
    assert_models_close(separate_model, stacked_model, atol=1e-5)
    assert [r["step"] for r in away.history if r["rank"] == 1] == [1, 5, 6]


def _counted_fit(monkeypatch, scratch_bytes: int):
    """A DiLoCo fit of 66 ranks in two processes (33 each, more than BUFFERS_KEPT_UP_TO),
    two rounds of H=10 steps and no evaluation, with each rank's BLAS scratch counted as
    ``scratch_bytes``: its packed processes' account and notes."""
    from exogym.run import memory

    monkeypatch.setattr(memory, "SCRATCH_BYTES", scratch_bytes)
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=DiLoCoStrategy(H=10, inner_optim="sgd", lr=0.1), num_nodes=66,
                max_steps=20, batch_size=8, val_size=0, processes=2, **QUIET)
    return trainer.summary["packed"], trainer.summary["notes"]


@pytest.mark.slow
def test_packed_diloco_ranks_hand_their_turn_on_only_at_rounds_and_keep_scratch_when_memory_allows(
        monkeypatch):
    """The work a packed process does besides its ranks' steps, counted per rank-step: a
    rank hands its turn on at its rounds' collectives and the end, never once a step,
    and gives its BLAS scratch back only where memory is short (a scratch release once
    a hand-over cost K=1024 nothing measurable, but memory kept by no rank that waits is
    the only reason for it)."""
    from exogym.base.blas_buffers import thread_buffers_releasable

    if not thread_buffers_releasable():
        pytest.skip("this torch has no MKL: no per-thread BLAS scratch to keep or give back")
    ranks, steps, rounds = 66, 20, 2
    packed, notes = _counted_fit(monkeypatch, scratch_bytes=1)  # plenty of memory
    assert packed["scratch_releases"] == 0, packed
    assert "keep their BLAS scratch" in notes[0]
    # A round's all-reduce and the last barrier: a rank waits at each, once; the rank
    # acting for its process waits for the other's parts as well.
    assert ranks * (rounds + 1) <= packed["hand_overs"] <= ranks * (rounds + 1) + 4 * (rounds + 1)
    assert packed["hand_overs"] / (ranks * steps) < 0.2
    assert packed["turns"] == ranks + packed["hand_overs"]  # each sat once, came back each time
    assert packed["collectives"] == 2 * (rounds + 1)

    short, notes = _counted_fit(monkeypatch, scratch_bytes=1 << 50)  # no memory to keep it
    assert short["hand_overs"] == packed["hand_overs"]
    # given back at each hand-over, and as each rank ends
    assert short["scratch_releases"] == short["hand_overs"] + ranks
    assert notes[0].startswith("memory is short for packed ranks to keep BLAS scratch")


def test_the_scratch_plan_keeps_scratch_within_an_eighth_of_the_memory_free_beside_the_state():
    from exogym.run.memory import SCRATCH_BYTES, StateBytes, scratch_plan

    state = StateBytes(parameters=1 << 20, gradients=1 << 20, optimizer=2 << 20, strategy=0,
                       shared=2 << 20)
    need = state.on_machine(1024, 2)
    room = 8 * 1024 * SCRATCH_BYTES
    assert not scratch_plan(state, 1024, 2, available=need + room).releases
    short = scratch_plan(state, 1024, 2, available=need + room - 8)
    assert short.releases and "1024 x 4 MiB = 4.00 GiB" in short.note
    assert scratch_plan(state, 1024, 2, available=need // 2).releases  # nothing free at all


def _four_ranks_each_waiting_once(releases: bool) -> dict:
    """Four ranks of one packed process, each handing its turn on once until all four have
    had one, then timing a block: the process's account."""
    import threading
    import time

    from exogym.comm.packed import PackedWorld

    world = PackedWorld(4, 1, 0, None, 30)
    world.releases_scratch = releases
    ran = threading.Barrier(4)

    def body(rank: int) -> None:
        world.sit(rank)
        try:
            with world._aside():
                ran.wait(30)
            with world.timed("work"):
                with world.timed("inner"):
                    time.sleep(0.01)
        finally:
            world.stand()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return world.tally.as_dict()


def test_a_packed_world_counts_its_turns_hand_overs_and_scratch_releases():
    for releases in (False, True):
        tally = _four_ranks_each_waiting_once(releases)
        assert (tally["turns"], tally["hand_overs"]) == (8, 4)
        assert tally["scratch_releases"] == (8 if releases else 0)  # each hand-over, each end
        # a block within another counts as its own phase only
        phases = tally["phases_s"]
        assert set(phases) == {"work", "inner"} and phases["inner"] >= 0.04 > phases["work"]
        assert tally["running_s"] >= sum(phases.values())


def test_ranks_of_a_process_that_end_with_the_same_state_digest_it_once():
    from exogym import comm
    from exogym.comm.averaging import state_digest
    from exogym.comm.packed import PackedWorld
    from exogym.run import run_rank

    hashed = []

    def counted(state):
        hashed.append(1)
        return state_digest(state)

    previous = comm.use_backend(PackedWorld(4, 1, 0, None, 30))
    try:
        original = run_rank.state_digest
        run_rank.state_digest = counted
        try:
            one = {"w": torch.arange(6.0), "b": torch.ones(2)}
            same = {"w": torch.arange(6.0), "b": torch.ones(2)}
            other = {"w": torch.arange(6.0), "b": torch.zeros(2)}
            as_double = {"w": torch.arange(6.0, dtype=torch.float64), "b": torch.ones(2)}
            digests = [run_rank._digest(s) for s in (one, same, other, as_double)]
        finally:
            run_rank.state_digest = original
    finally:
        comm.use_backend(previous)
    assert digests[0] == digests[1] == state_digest(same)
    assert digests[2] == state_digest(other) != digests[0]
    assert digests[3] == state_digest(as_double) != digests[0]  # the same values, another dtype
    assert len(hashed) == 3  # the second state was compared, not hashed
