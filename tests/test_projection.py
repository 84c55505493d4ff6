"""The projection's formulas: collective costs, bytes per strategy, step time and speedup."""

from __future__ import annotations

import math

import pytest

from distributed.projection import (
    STRATEGIES,
    allgather_bytes,
    allgather_rounds,
    bytes_per_step,
    demo_payload_bytes,
    expected_max_of_normals,
    predict_step_time,
    project,
    ring_allreduce_bytes,
    ring_allreduce_rounds,
    single_host_step_time,
    skew_per_step,
    speedup,
    step_traffic,
)

P = 3_257_856  # the 4-layer, 256-wide chargpt model


def test_ring_allreduce_sends_twice_the_payload_share_of_the_other_hosts():
    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 2) == 1000
    assert ring_allreduce_bytes(1000, 4) == 1500
    assert ring_allreduce_bytes(1000, 64) == pytest.approx(2 * 63 / 64 * 1000)
    assert ring_allreduce_rounds(2) == 2 and ring_allreduce_rounds(8, calls=3) == 42


def test_allgather_sends_the_own_contribution_to_every_other_host():
    assert allgather_bytes(100, 1) == 0
    assert allgather_bytes(100, 2) == 100
    assert allgather_bytes(100, 64) == 6300
    assert allgather_rounds(64) == 63


def test_ddp_sends_every_gradient_each_step_and_bf16_halves_it():
    assert bytes_per_step("ddp", P, 2) == 4 * P
    assert bytes_per_step("allreduce", P, 2, value_bytes=2) == 2 * P
    assert bytes_per_step("ddp", P, 8) == pytest.approx(2 * 7 / 8 * 4 * P)


def test_diloco_spreads_one_all_reduce_over_h_steps_with_its_buffers():
    traffic = step_traffic("diloco", P, 2, H=100, num_buffers=10)
    assert traffic.payload == pytest.approx(4 * (P + 10) / 100)
    assert traffic.bytes_sent == pytest.approx(4 * (P + 10) / 100)
    assert traffic.rounds == pytest.approx(2 / 100)
    assert bytes_per_step("diloco", P, 2, H=1) == bytes_per_step("ddp", P, 2)


def test_diloco_without_h_is_an_error_that_says_what_to_give():
    with pytest.raises(ValueError, match="diloco needs H"):
        bytes_per_step("diloco", P, 2)


def test_sparta_sends_its_fraction_of_the_parameters():
    assert bytes_per_step("sparta", P, 2, p_sparta=0.005) == pytest.approx(4 * 0.005 * P)
    assert bytes_per_step("sparta", P, 2, p_sparta=1.0) == bytes_per_step("ddp", P, 2)
    assert bytes_per_step("sparta", P, 2, p_sparta=0.0) == 0
    with pytest.raises(ValueError, match="p_sparta"):
        bytes_per_step("sparta", P, 2, p_sparta=1.5)


def test_demo_payload_follows_the_chunk_rule_of_exogym():
    torch = pytest.importorskip("torch")
    from exogym.strategy.demo import ChunkPlan

    shapes = [(160, 256), (64, 256), (768, 256), (768,), (1024, 256), (256,), (7, 13), (3, 4, 5, 6)]
    for chunk, topk in ((64, 32), (16, 8), (8, 100)):
        expected = sum(ChunkPlan.for_shape(torch.Size(s), chunk, topk).bytes_per_step(4)
                       for s in shapes)
        assert demo_payload_bytes(shapes, chunk, topk) == expected


def test_demo_all_gathers_so_its_bytes_grow_with_the_hosts():
    two = bytes_per_step("demo", P, 2, demo_payload=1000)
    assert two == 1000
    assert bytes_per_step("demo", P, 64, demo_payload=1000) == 63 * two
    assert bytes_per_step("demo", P, 2, shapes=[(64, 64)], compression_topk=32) == 32 * (4 + 2)
    with pytest.raises(ValueError, match="demo needs"):
        bytes_per_step("demo", P, 2)


def test_unknown_strategy_lists_the_known_ones():
    with pytest.raises(ValueError, match="knows ddp, diloco, sparta, demo, none"):
        bytes_per_step("fedsgd", P, 2)
    assert set(STRATEGIES) == {"ddp", "diloco", "sparta", "demo", "none"}


def test_bad_host_counts_are_rejected():
    for hosts in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="hosts must be an integer"):
            bytes_per_step("ddp", P, hosts)


def test_step_time_is_compute_plus_bytes_over_throughput_plus_rounds_times_latency():
    t = predict_step_time("ddp", 1_000_000, 2, compute_s=0.3, throughput_bytes_per_s=4e6,
                          latency_s=0.001)
    assert t == pytest.approx(0.3 + 4e6 / 4e6 + 2 * 0.001)
    assert predict_step_time("none", P, 8, 0.3, 1e6) == 0.3
    with pytest.raises(ValueError, match="throughput_bytes_per_s"):
        predict_step_time("ddp", P, 2, 0.3, 0)


def test_a_payload_beyond_one_bucket_pays_the_rounds_of_every_call():
    traffic = step_traffic("ddp", 20_000_000, 4)  # 80 MB: three 32 MiB calls
    assert traffic.rounds == 3 * ring_allreduce_rounds(4)


def test_speedup_compares_with_one_host_doing_every_minibatch():
    assert single_host_step_time(4, 0.5) == 2.0
    # no communication: N hosts are N times faster
    assert speedup("none", P, 8, compute_s=0.3, throughput_bytes_per_s=1e6) == pytest.approx(8)
    # DDP at 100 Mbit/s on a 3.3M-parameter model: communication dominates
    ddp = speedup("ddp", P, 2, 0.3, 12.5e6)
    assert ddp == pytest.approx(0.6 / (0.3 + 4 * P / 12.5e6))
    assert ddp < 1
    diloco = speedup("diloco", P, 2, 0.3, 12.5e6, H=100)
    assert 1.9 < diloco < 2
    # a strategy with local overhead against plain single-host training
    assert speedup("none", P, 2, compute_s=0.4, throughput_bytes_per_s=1e6,
                   minibatch_s=0.3) == pytest.approx(1.5)


def test_projection_rows_cover_every_host_count_and_split_the_step():
    rows = project("diloco", P, (2, 4, 64), 0.3, 12.5e6, H=100, label="diloco H=100")
    assert [r.hosts for r in rows] == [2, 4, 64]
    assert all(r.strategy == "diloco H=100" for r in rows)
    for r in rows:
        assert r.step_s == pytest.approx(0.3 + r.comm_s)
        assert r.speedup == pytest.approx(r.hosts * 0.3 / r.step_s)
        assert 0 < r.comm_fraction < 1
    # ring all-reduce: bytes per host approach 2x the payload, so speedup keeps growing
    assert rows[-1].bytes_sent < 2 * 4 * P / 100
    assert rows[-1].speedup > rows[0].speedup
    assert not math.isinf(rows[0].speedup)


def test_expected_maximum_of_normals_matches_known_values():
    assert expected_max_of_normals(1) == 0
    assert expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert expected_max_of_normals(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-6)
    assert expected_max_of_normals(64) == pytest.approx(2.3437, abs=1e-3)


def test_waiting_for_the_slowest_host_shrinks_with_the_period():
    assert skew_per_step(0.02, 1) == 0
    assert skew_per_step(0.02, 2) == pytest.approx(0.02 / math.sqrt(math.pi), rel=1e-6)
    assert skew_per_step(0.02, 2, period=100) == pytest.approx(skew_per_step(0.02, 2) / 10)
    with pytest.raises(ValueError, match="period"):
        skew_per_step(0.02, 2, period=0)


def test_step_time_adds_the_skew_of_the_strategy_period():
    plain = predict_step_time("sparta", P, 4, 0.3, 1e7, p_sparta=0.005)
    skewed = predict_step_time("sparta", P, 4, 0.3, 1e7, compute_sd_s=0.02, p_sparta=0.005)
    assert skewed - plain == pytest.approx(skew_per_step(0.02, 4))
    diloco = predict_step_time("diloco", P, 4, 0.3, 1e7, compute_sd_s=0.02, H=100)
    assert diloco - predict_step_time("diloco", P, 4, 0.3, 1e7, H=100) == pytest.approx(
        skew_per_step(0.02, 4, period=100))
    assert predict_step_time("none", P, 4, 0.3, 1e7, compute_sd_s=0.02) == 0.3
