"""Quantized payloads: exact sizes, bounded and unbiased rounding, and quantized all-reduces
that agree bitwise on every rank in every collectives mode, blocking or asynchronous."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch
from ranks import free_port

from exogym import comm
from exogym.comm.quantize import (
    DTYPES,
    dequantize,
    from_bytes,
    payload_bytes,
    quantize,
    to_bytes,
)
from exogym.comm.shared_memory import SharedMemoryCollectives
from exogym.strategy.facts import quantized_payload_bytes, value_bytes_of

CTX = mp.get_context("fork")
K = 3
LEVELS = {"int8": 127, "int4": 7, "int2": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_payload_is_packed_values_plus_a_float32_scale_per_chunk(dtype):
    bits = {"int8": 8, "float8_e4m3fn": 8, "int4": 4, "int2": 2}[dtype]
    for numel in (1, 3, 63, 64, 65, 130, 1001):
        for chunk in (1, 7, 64):
            q = quantize(torch.randn(numel), dtype, chunk=chunk)
            want = -(-numel * bits // 8) + 4 * -(-numel // chunk)
            assert payload_bytes(numel, dtype, chunk) == quantized_payload_bytes(
                numel, dtype, chunk) == want
            assert to_bytes(q).numel() == q.nbytes == want
            assert q.scales.dtype == torch.float32 and q.scales.numel() == -(-numel // chunk)
            back = from_bytes(to_bytes(q), numel, dtype, chunk)
            assert torch.equal(dequantize(back), dequantize(q))


@pytest.mark.parametrize("dtype", ["int8", "int4", "int2"])
def test_nearest_rounding_is_within_half_a_level_of_each_chunks_own_scale(dtype):
    gen = torch.Generator().manual_seed(0)
    # chunks of very different magnitudes, and a partial last chunk of 5 values
    x = torch.cat([torch.randn(64, generator=gen) * 1e-4, torch.randn(64, generator=gen) * 50,
                   torch.zeros(64), torch.randn(5, generator=gen)])
    q = quantize(x, dtype, chunk=64)
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == torch.float32
    for c in range(4):
        part = slice(64 * c, 64 * c + 64)
        scale = x[part].abs().max() / LEVELS[dtype]
        assert q.scales[c] == pytest.approx(float(scale), rel=1e-6)
        assert (y[part] - x[part]).abs().max() <= scale / 2 * (1 + 1e-5) + 1e-12
    assert torch.equal(y[128:192], torch.zeros(64))  # a zero chunk stays zero
    # the largest magnitude of every chunk is exact
    for c in range(4):
        i = 64 * c + int(x[64 * c:64 * c + 64].abs().argmax())
        assert y[i] == pytest.approx(float(x[i]), rel=1e-6, abs=1e-12)


def test_float8_keeps_three_mantissa_bits_of_each_value():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 1e-3
    y = dequantize(quantize(x, "float8_e4m3fn", chunk=64))
    assert ((y - x).abs() <= x.abs() / 16 + 1e-9).all()


def test_int4_and_int2_pack_two_and_four_values_to_a_byte():
    x = torch.tensor([-7.0, -1.0, 0.0, 7.0, 3.0])
    q4 = quantize(x, "int4", chunk=5)
    assert q4.values.dtype == torch.uint8 and q4.values.numel() == 3
    assert torch.equal(dequantize(q4), x)
    x2 = torch.tensor([-1.0, 0.0, 1.0, 1.0, -1.0, 0.0])
    q2 = quantize(x2, "int2", chunk=6)
    assert q2.values.numel() == 2
    assert torch.equal(dequantize(q2), x2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_rounding_is_unbiased(dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, generator=gen)
    x[0] = 4.0  # the chunk's largest magnitude: every other value lies between two levels
    trials = 4000
    # every copy of x is its own chunk with the same scale: independent roundings
    y = dequantize(quantize(x.repeat(trials), dtype, chunk=64, rounding="stochastic",
                            generator=gen)).view(trials, 64)
    level = 4.0 / LEVELS.get(dtype, 448.0) if dtype != "float8_e4m3fn" else 4.0 / 16
    # the mean of many roundings comes within a few standard errors of x ...
    assert ((y.mean(0) - x).abs() <= 5 * level / trials ** 0.5).all()
    # ... while rounding to nearest is biased for the same values
    if dtype in ("int4", "int2"):
        nearest = dequantize(quantize(x, dtype, chunk=64))
        assert (nearest - x).abs().max() > 20 * level / trials ** 0.5


def test_bad_arguments_name_the_choices():
    with pytest.raises(ValueError, match="int8, float8_e4m3fn, int4, int2"):
        quantize(torch.ones(3), "int3")
    with pytest.raises(ValueError, match="rounding must be one of nearest, stochastic"):
        quantize(torch.ones(3), "int8", rounding="up")
    with pytest.raises(ValueError, match="chunk .* integer >= 1, got 0"):
        quantize(torch.ones(3), "int8", chunk=0)
    with pytest.raises(ValueError, match="'int2'"):
        comm.resolve_dtype("int3")
    assert comm.resolve_dtype("INT4") == "int4"
    assert value_bytes_of("int8") == 1 + 4 / 64


# -- quantized all-reduce across real ranks -------------------------------------------


def contribution(rank: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * seed + rank)) * (rank + 1)


SHAPES = [(10, 7), (1,), (130,)]


def tensors_of(rank: int, seed: int) -> list[torch.Tensor]:
    return [contribution(rank, torch.Size(s).numel(), seed + i).view(s)
            for i, s in enumerate(SHAPES)]


def _rank_body(mode: str, shm, rank: int, port: int, out) -> None:
    try:
        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        store = comm.open_store("127.0.0.1", port, is_master=rank == 0, world_size=K,
                                timeout_s=60)
        comm.init_process_group(store, rank, K, "gloo", timeout_s=60)
        if mode == "shm":
            comm.use_local_collectives(shm.bind(rank))
        elif mode == "mirror":
            comm.use_mirror_collectives(True)
        got = {}
        for dtype in ("int8", "int4", "float8_e4m3fn", "int2"):
            comm.reset_counters()
            ts = tensors_of(rank, 1)
            comm.all_reduce_tensors(ts, average=True, dtype=dtype, chunk=16)
            got[dtype] = (ts, comm.comm_bytes())
        # error feedback: the residual holds what quantization lost, and is sent next round
        ts, residual = tensors_of(rank, 2), [torch.zeros(s) for s in SHAPES]
        comm.all_reduce_tensors(ts, dtype="int2", chunk=16, error_feedback=residual)
        ts2 = tensors_of(rank, 3)
        comm.all_reduce_tensors(ts2, dtype="int2", chunk=16, error_feedback=residual)
        got["feedback"] = (ts + ts2 + residual, 0)
        # stochastic rounding: each rank rounds its own way, all agree on the sum
        ts = tensors_of(rank, 4)
        comm.all_reduce_tensors(ts, dtype="int4", rounding="stochastic", average=True)
        got["stochastic"] = (ts, 0)
        # asynchronous: three rounds outstanding while this rank computes, then waited in order
        comm.reset_counters()
        handles, outs = [], []
        for seed, dtype in ((5, "int8"), (6, None), (7, "int4")):
            ts = tensors_of(rank, seed)
            handles.append(comm.all_reduce_tensors(ts, average=True, dtype=dtype,
                                                   async_op=True))
            outs.append(ts)
        started_bytes = comm.comm_bytes()
        busy = torch.randn(200, 200, generator=torch.Generator().manual_seed(rank))
        for _ in range(5):
            busy = torch.tanh(busy @ busy)
        for h in handles:
            h.wait()
            assert h.is_completed()
        blocking = []
        for seed, dtype in ((5, "int8"), (6, None), (7, "int4")):
            ts = tensors_of(rank, seed)
            comm.all_reduce_tensors(ts, average=True, dtype=dtype)
            blocking.append(ts)
        got["async"] = ([t for ts in outs for t in ts], started_bytes)
        # a blocking collective while one is outstanding runs after it, on every rank
        pending = tensors_of(rank, 8)
        handle = comm.all_reduce_tensors(pending, average=True, dtype="int4", async_op=True)
        blocking_now = tensors_of(rank, 9)
        comm.all_reduce_tensors(blocking_now, average=True)
        handle.wait()
        got["interleaved"] = (pending + blocking_now, 0)
        got["blocking"] = ([t for ts in blocking for t in ts], 0)
        out.put((rank, {k: ([t.tolist() for t in ts], nbytes) for k, (ts, nbytes) in got.items()}))
    except BaseException:
        out.put((rank, traceback.format_exc()))
    finally:
        comm.use_mirror_collectives(False)
        comm.use_local_collectives(None)
        comm.destroy_process_group()
    out.close()
    out.join_thread()
    os._exit(0)


def run_ranks(mode: str) -> dict[int, dict]:
    shm = SharedMemoryCollectives(K, 256, CTX, timeout_s=60) if mode == "shm" else None
    out, port = CTX.Queue(), free_port()
    procs = [CTX.Process(target=_rank_body, args=(mode, shm, r, port, out)) for r in range(K)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in range(K))
    for p in procs:
        p.join(30)
    for rank, result in got.items():
        assert not isinstance(result, str), result
        got[rank] = {k: ([torch.tensor(t) for t in ts], nbytes)
                     for k, (ts, nbytes) in result.items()}
    return got


def expected_mean(seed: int, dtype: str, chunk: int, ranks: list[int]) -> torch.Tensor:
    total = torch.zeros(sum(torch.Size(s).numel() for s in SHAPES))
    for r in ranks:
        flat = torch.cat([t.reshape(-1) for t in tensors_of(r, seed)])
        total += dequantize(quantize(flat, dtype, chunk=chunk))
    return total / len(ranks)


def flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


@pytest.mark.parametrize("mode", ["shm", "torch", "mirror"])
def test_quantized_all_reduce_is_bitwise_equal_on_every_rank_and_counts_its_payload(mode):
    got = run_ranks(mode)
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    for key in got[0] if mode != "mirror" else ():  # mirrored ranks each sum their own
        for rank in range(K):  # bitwise the same result everywhere (residuals are each rank's own)
            shared = got[rank][key][0][:6] if key == "feedback" else got[rank][key][0]
            assert all(torch.equal(a, b) for a, b in zip(shared, got[0][key][0])), key
    for dtype in ("int8", "int4", "float8_e4m3fn", "int2"):
        for rank in range(K):
            ts, nbytes = got[rank][dtype]
            assert nbytes == payload_bytes(numel, dtype, 16)
            # mirrored peers hold this rank's own tensors
            want = expected_mean(1, dtype, 16, [rank] * K if mode == "mirror" else list(range(K)))
            torch.testing.assert_close(flat(ts), want, rtol=1e-6, atol=1e-6)
            assert [t.shape for t in ts] == [torch.Size(s) for s in SHAPES]
    # error feedback: both rounds' sums carry what was sent, and sent plus residual is exact
    for rank in range(K):
        ts = got[rank]["feedback"][0]
        first, second, residual = flat(ts[:3]), flat(ts[3:6]), flat(ts[6:])
        peers = [rank] * K if mode == "mirror" else list(range(K))
        exact = sum(flat(tensors_of(r, 2)) + flat(tensors_of(r, 3)) for r in peers)
        if mode == "mirror":
            torch.testing.assert_close(first + second + K * residual, exact, rtol=1e-5, atol=1e-5)
        else:
            assert residual.abs().max() > 0
            # the sum of residuals over ranks is what the two rounds still owe
            lost = sum(flat(got[r]["feedback"][0][6:]) for r in range(K))
            torch.testing.assert_close(first + second + lost, exact, rtol=1e-5, atol=1e-5)
    stochastic = flat(got[0]["stochastic"][0])
    exact = sum(flat(tensors_of(r, 4)) for r in ([0] * K if mode == "mirror" else range(K))) / K
    assert (stochastic - exact).abs().max() < 0.5 * 3 * 4  # within a level of the largest scale
    peers = [0] * K if mode == "mirror" else list(range(K))
    for rank in range(K):
        ts = got[rank]["interleaved"][0] if mode != "mirror" else got[0]["interleaved"][0]
        torch.testing.assert_close(flat(ts[:3]), expected_mean(8, "int4", 64, peers),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(flat(ts[3:]), sum(flat(tensors_of(r, 9)) for r in peers) / K)
    # asynchronous rounds equal the blocking ones; bytes were counted at the start
    for rank in range(K):
        assert all(torch.equal(a, b)
                   for a, b in zip(got[rank]["async"][0], got[rank]["blocking"][0]))
        assert got[rank]["async"][1] == (payload_bytes(numel, "int8", 64) + 4 * numel
                                         + payload_bytes(numel, "int4", 64))


def test_quantized_all_reduce_refuses_what_it_cannot_do():
    t = [torch.ones(3)]
    with pytest.raises(ValueError, match="cannot reduce with"):
        comm.all_reduce_tensors(t, op=comm.ReduceOp.MAX, dtype="int8")
    with pytest.raises(ValueError, match="error_feedback needs a quantized dtype"):
        comm.all_reduce_tensors(t, dtype="bfloat16", error_feedback=[torch.zeros(3)])
    with pytest.raises(ValueError, match="one buffer per tensor"):
        comm.all_reduce_tensors(t, dtype="int8", error_feedback=[torch.zeros(4)])
    handle = comm.all_reduce_tensors(t, dtype="int8", async_op=True)  # a world of one
    assert handle.wait() and handle.is_completed() and torch.equal(t[0], torch.ones(3))


def test_demo_refuses_a_quantized_comm_dtype_with_the_float_choices():
    from exogym.strategy import DeMoStrategy

    with pytest.raises(ValueError, match="comm_dtype='int8' is a quantized type: use 'float32'"):
        DeMoStrategy(comm_dtype="int8")


# -- strategies sending quantized rounds -------------------------------------------------

FIT = dict(batch_size=16, val_size=32, val_interval=4, logger=None, progress=False)


def rank_bytes(trainer) -> set[int]:
    return {r["comm_bytes"] for r in trainer.history if r["step"] == trainer.summary["steps"]}


@pytest.mark.parametrize("dtype", DTYPES)
def test_diloco_rounds_send_the_quantized_payload_and_keep_ranks_identical(dtype):
    from toys import tiny_model, toy_dataset, trainable_count

    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy

    ds = toy_dataset(256)
    p = trainable_count(tiny_model())
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=DiLoCoStrategy(H=2, comm_dtype=dtype, inner_optim="adam", lr=0.02),
                num_nodes=2, max_steps=6, **FIT)
    assert rank_bytes(trainer) == {3 * payload_bytes(p, dtype)}
    assert trainer.summary["final_val_global_loss"] < trainer.history[0]["train_loss"]


@pytest.mark.slow
def test_fedavg_sparta_and_sparta_diloco_take_a_quantized_comm_dtype():
    from toys import tiny_model, toy_dataset, trainable_count

    from exogym import Trainer
    from exogym.strategy import FedAvgStrategy, SPARTADiLoCoStrategy, SPARTAStrategy

    ds = toy_dataset(256)
    p = trainable_count(tiny_model())
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=FedAvgStrategy(H=2, comm_dtype="int8"), num_nodes=2, max_steps=4, **FIT)
    assert rank_bytes(trainer) == {2 * payload_bytes(p, "int8")}
    trainer = Trainer(tiny_model(), ds, ds)  # islands: gathered over subgroups
    trainer.fit(strategy=FedAvgStrategy(H=1, island_size=2, client_sampling=0.5,
                                        comm_dtype="int8"), num_nodes=4, max_steps=2, **FIT)
    assert rank_bytes(trainer) == {2 * payload_bytes(p, "int8")}
    trainer = Trainer(tiny_model(), ds, ds)
    # SPARTA rounds off: only the DiLoCo rounds, quantized to int4
    trainer.fit(strategy=SPARTADiLoCoStrategy(H=2, p_sparta=0.0, comm_dtype="int4"),
                num_nodes=2, max_steps=4, **FIT)
    assert rank_bytes(trainer) == {2 * payload_bytes(p, "int4")}
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=SPARTAStrategy(p_sparta=0.5, comm_dtype="int8"), num_nodes=2,
                max_steps=3, **FIT)
    sizes = [t.numel() for t in tiny_model().parameters()]
    rounds = [sum((r + 1) * n // 2 - r * n // 2 for n in sizes) for r in range(3)]
    assert rank_bytes(trainer) == {sum(payload_bytes(e, "int8") for e in rounds)}


def test_error_feedback_needs_a_quantized_dtype():
    from exogym.strategy import DiLoCoStrategy

    with pytest.raises(ValueError, match="error_feedback=True needs a quantized comm_dtype"):
        DiLoCoStrategy(error_feedback=True)
    with pytest.raises(ValueError, match="int3"):
        DiLoCoStrategy(comm_dtype="int3")


def _residuals_in(state) -> list[torch.Tensor]:
    if isinstance(state, dict):
        if "residuals" in state:
            return list(state["residuals"])
        return [r for v in state.values() for r in _residuals_in(v)]
    if isinstance(state, (list, tuple)):
        return [r for v in state for r in _residuals_in(v)]
    return []


@pytest.mark.slow
def test_diloco_error_feedback_resumes_exactly_from_a_checkpoint(tmp_path):
    from test_checkpoint import Dropout
    from toys import assert_models_close, toy_dataset

    from exogym import RankFailedError, Trainer
    from exogym.run.checkpoint import checkpoint_path, load_checkpoint
    from exogym.strategy import DiLoCoStrategy

    ds = toy_dataset(96)

    def fit(run, crash_at=None, **kwargs):
        torch.manual_seed(0)
        model = Dropout()
        model.crash_at = crash_at
        strategy = DiLoCoStrategy(inner_optim="adam", lr=0.01, H=3, comm_dtype="int2",
                                  error_feedback=True)
        return Trainer(model, ds, ds).fit(strategy=strategy, num_nodes=2, max_steps=14,
                                          batch_size=8, val_size=16, val_interval=4,
                                          save_dir=str(tmp_path), run_name=run, logger=None,
                                          progress=False, **kwargs)

    uninterrupted = fit("full")
    with pytest.raises(RankFailedError, match="simulated crash"):
        fit("split", crash_at=10, checkpoint_interval=4)
    saved = _residuals_in(load_checkpoint(checkpoint_path(tmp_path / "split", 0, 8)))
    assert saved and any(r.abs().max() > 0 for r in saved)  # int2 loses plenty
    resumed = fit("split", checkpoint_interval=4, resume_from="auto")
    assert_models_close(uninterrupted, resumed, atol=1e-6)


def test_the_planner_predicts_the_quantized_payload_as_an_all_gather():
    from distributed.planning.projection import allgather_bytes, step_traffic

    traffic = step_traffic("diloco", 10_000, 4, H=10, comm_dtype="int4", num_buffers=16)
    assert traffic.payload == payload_bytes(10_016, "int4") / 10
    assert traffic.bytes_sent == allgather_bytes(payload_bytes(10_016, "int4"), 4) / 10
    assert traffic.collective == "all-gather"
    with pytest.raises(ValueError, match="DeMo sends its top-k coefficients in a float type"):
        step_traffic("demo", 100, 2, demo_payload=10.0, comm_dtype="int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantization_on_a_gpu_equals_the_cpu_result():
    x = torch.randn(1001, generator=torch.Generator().manual_seed(3))
    for dtype in DTYPES:
        on_gpu = quantize(x.cuda(), dtype, chunk=64)
        assert on_gpu.values.is_cuda
        torch.testing.assert_close(dequantize(on_gpu).cpu(), dequantize(quantize(x, dtype)))
