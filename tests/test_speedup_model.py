"""The cost model's formulas: ring all-reduce and all-gather bytes, per strategy, and the speedup."""

from __future__ import annotations

import math

import pytest

from distributed import speedup_model as sm

P = 1000  # values in the payload
K = 4  # hosts


def test_ring_all_reduce_sends_two_k_minus_one_over_k_of_the_payload():
    assert sm.ring_all_reduce_bytes(4000, 4) == pytest.approx(6000)
    assert sm.ring_all_reduce_bytes(4000, 2) == pytest.approx(4000)
    assert sm.ring_all_reduce_bytes(4000, 1) == 0.0


def test_ring_all_gather_sends_own_bytes_to_every_other_rank():
    assert sm.ring_all_gather_bytes(100, 5) == pytest.approx(400)
    assert sm.ring_all_gather_bytes(100, 1) == 0.0


def test_ddp_sends_the_full_gradient_every_step():
    t = sm.traffic("ddp", P, K)
    assert t.payload_bytes == 4 * P
    assert t.wire_bytes == pytest.approx(2 * 3 / 4 * 4 * P)
    assert t.hops == 2 * (K - 1)
    assert sm.bytes_per_step("allreduce", P, K) == t.wire_bytes


def test_diloco_divides_ddp_traffic_by_h():
    ddp = sm.bytes_per_step("ddp", P, K)
    assert sm.bytes_per_step("diloco", P, K, H=10) == pytest.approx(ddp / 10)
    assert sm.payload_bytes_per_step("diloco", P, K, H=10) == pytest.approx(4 * P / 10)
    assert sm.bytes_per_step("diloco", P, K) == pytest.approx(ddp / 100)  # the class default H


def test_fedavg_rings_only_over_its_island():
    island = sm.bytes_per_step("fedavg", P, K, H=5, island_size=2)
    assert island == pytest.approx(2 * 1 / 2 * 4 * P / 5)
    everyone = sm.bytes_per_step("fedavg", P, K, H=5)
    assert everyone == pytest.approx(2 * 3 / 4 * 4 * P / 5)
    assert sm.bytes_per_step("fedavg", P, K, H=5, island_size=99) == pytest.approx(everyone)


def test_sparta_sends_fraction_p_of_the_payload_every_step():
    t = sm.traffic("sparta", P, K, p_sparta=0.01)
    assert t.payload_bytes == pytest.approx(0.01 * 4 * P)
    assert t.wire_bytes == pytest.approx(2 * 3 / 4 * 0.01 * 4 * P)


def test_sparta_diloco_counts_sparse_rounds_not_replaced_by_a_diloco_round():
    # H=10, every 2nd step: sparse rounds at steps 2, 4, 6, 8 of 10 (10 is a DiLoCo round)
    t = sm.traffic("sparta_diloco", P, K, H=10, sparta_interval=2, p_sparta=0.01)
    assert t.payload_bytes == pytest.approx(4 / 10 * 0.01 * 4 * P + 4 * P / 10)


def test_demo_all_gathers_topk_values_and_narrow_indices_per_chunk():
    params = 10 * 64 * 64  # ten 64x64 chunks
    t = sm.traffic("demo", params, 3, compression_topk=32, compression_chunk=64)
    own = 10 * 32 * (4 + 2)  # chunk area 4096 needs 2-byte indices
    assert t.payload_bytes == own
    assert t.wire_bytes == pytest.approx(2 * own)
    small = sm.traffic("demo", 16 * 5, 2, compression_topk=32, compression_chunk=4)
    assert small.payload_bytes == 5 * 16 * (4 + 1)  # top-k capped at the chunk area of 16


def test_bf16_halves_every_strategys_bytes():
    for name in sm.STRATEGIES:
        if name == "demo":
            continue  # its index bytes do not shrink
        full = sm.bytes_per_step(name, P, K)
        assert sm.bytes_per_step(name, P, K, comm_dtype="bfloat16") == pytest.approx(full / 2)


def test_one_host_sends_nothing_and_gets_no_speedup():
    for name in sm.STRATEGIES:
        prediction = sm.predict(name, P, 1, compute_s_per_step=0.1, link_bytes_per_s=1e6)
        assert prediction.wire_bytes == 0.0
        assert prediction.speedup == pytest.approx(1.0)


def test_predict_adds_transfer_and_latency_to_compute():
    p = sm.predict("ddp", P, K, compute_s_per_step=0.1, link_bytes_per_s=1000, latency_s=0.01)
    assert p.comm_s == pytest.approx(6000 / 1000 + 6 * 0.01)
    assert p.step_s == pytest.approx(0.1 + p.comm_s)
    assert p.speedup == pytest.approx(K * 0.1 / p.step_s)
    assert p.efficiency == pytest.approx(p.speedup / K)


def test_on_a_slow_link_diloco_wins_and_on_a_free_link_all_reach_k():
    slow = {p.strategy: p for p in sm.predict_all(
        1_000_000, K, 0.05, sm.mbit_to_bytes_per_s(100), settings={"diloco": {"H": 100}})}
    # 1M float32 parameters: DDP moves 6 MB per step over 12.5 MB/s, DiLoCo 1/100 of that
    assert slow["ddp"].speedup < 1.0 < 3.5 < slow["diloco"].speedup
    assert slow["diloco"].speedup > slow["fedavg"].speedup  # FedAvg's default H is 1
    assert slow["sparta"].speedup > 3.5
    fast = sm.predict_all(1_000, K, 1.0, 1e15)
    assert all(math.isclose(p.speedup, K, rel_tol=1e-6) for p in fast)


def test_mbit_means_a_million_bits():
    assert sm.mbit_to_bytes_per_s(8) == 1_000_000


def test_relevant_settings_picks_a_profiles_keys_and_reads_p_as_p_sparta():
    profile = {"H": 20, "lr": 0.1, "num_nodes": 4, "p": 0.02, "island_size": 2}
    assert sm.relevant_settings("diloco", profile) == {"H": 20}
    assert sm.relevant_settings("sparta", profile) == {"p_sparta": 0.02}
    assert sm.relevant_settings("fedavg", profile) == {"H": 20, "island_size": 2}


@pytest.mark.parametrize("call, error, words", [
    (lambda: sm.traffic("gossip", P, K), ValueError, "no cost model"),
    (lambda: sm.traffic("ddp", P, K, H=3), TypeError, "unknown setting"),
    (lambda: sm.traffic("diloco", P, K, H=0), ValueError, "H must be"),
    (lambda: sm.traffic("sparta", P, K, p_sparta=1.5), ValueError, "p_sparta"),
    (lambda: sm.traffic("ddp", P, 0), ValueError, "num_hosts"),
    (lambda: sm.traffic("ddp", -1, K), ValueError, "num_params"),
    (lambda: sm.traffic("ddp", P, K, comm_dtype="int3"), ValueError, "comm_dtype"),
    (lambda: sm.predict("ddp", P, K, 0.0, 1e6), ValueError, "compute_s_per_step"),
    (lambda: sm.predict("ddp", P, K, 0.1, 0), ValueError, "link_bytes_per_s"),
])
def test_bad_arguments_are_named(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_payload_matches_the_comm_counters_of_a_real_run():
    from toys import tiny_model, toy_dataset

    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy, SimpleReduceStrategy

    model = tiny_model()
    params = sum(p.numel() for p in model.parameters())
    ds = toy_dataset()
    for name, strategy, settings in (("ddp", SimpleReduceStrategy(), {}),
                                     ("diloco", DiLoCoStrategy(H=2), {"H": 2})):
        trainer = Trainer(model, ds, None)
        trainer.fit(strategy=strategy, num_nodes=2, max_steps=4, batch_size=8, val_size=0,
                    logger=None, progress=False)
        sent = max(r["comm_bytes"] for r in trainer.history if r["step"] == 4)
        assert sent / 4 == pytest.approx(sm.payload_bytes_per_step(name, params, 2, **settings))
