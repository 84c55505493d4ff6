"""The projection's formulas: collective costs, bytes per strategy, step time and speedup."""

from __future__ import annotations

import math

import pytest

from distributed.planning.projection import (
    BUCKET_BYTES,
    DEFAULTS,
    STRATEGIES,
    allgather_bytes,
    allgather_rounds,
    bytes_per_step,
    demo_payload_bytes,
    expected_max_of_normals,
    mbit_to_bytes_per_s,
    payload_bytes_per_step,
    predict,
    predict_all,
    predict_step_time,
    project,
    relevant_settings,
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
    with pytest.raises(ValueError, match="knows ddp, diloco, sparta, fedavg, demo, sparta_diloco"):
        bytes_per_step("fedsgd", P, 2)
    assert set(STRATEGIES) == {"ddp", "diloco", "sparta", "fedavg", "demo", "sparta_diloco",
                               "streaming_diloco", "sparseloco", "desloc", "muloco",
                               "async_diloco", "none"}


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


# --------------------------------------------------------------------------- the faces' use


def test_fedavg_rings_only_over_its_island_and_averages_float_buffers():
    island = bytes_per_step("fedavg", 1000, 4, H=5, island_size=2)
    assert island == pytest.approx(2 * 1 / 2 * 4 * 1000 / 5)
    everyone = bytes_per_step("fedavg", 1000, 4, H=5)
    assert everyone == pytest.approx(2 * 3 / 4 * 4 * 1000 / 5)
    assert bytes_per_step("fedavg", 1000, 4, H=5, island_size=99) == pytest.approx(everyone)
    assert payload_bytes_per_step("fedavg", 1000, 4, H=5, num_buffers=10) == 4 * 1010 / 5


def test_sparta_diloco_counts_sparse_rounds_not_replaced_by_a_diloco_round():
    # H=10, every 2nd step: sparse rounds at steps 2, 4, 6, 8 of 10 (10 is a DiLoCo round)
    t = step_traffic("sparta_diloco", 1000, 4, H=10, sparta_interval=2, p_sparta=0.01)
    assert t.payload == pytest.approx(4 / 10 * 0.01 * 4 * 1000 + 4 * 1000 / 10)
    assert t.bytes_sent == pytest.approx(2 * 3 / 4 * t.payload)


def test_bf16_halves_every_all_reduce_strategys_bytes():
    for name in ("ddp", "diloco", "fedavg", "sparta", "sparta_diloco"):
        settings = {k: v for k, v in DEFAULTS[name].items() if k != "comm_dtype"}
        full = bytes_per_step(name, P, 4, **settings)
        assert bytes_per_step(name, P, 4, comm_dtype="bfloat16", **settings) == \
            pytest.approx(full / 2)


def test_relevant_settings_reads_a_profile_and_fills_the_class_defaults():
    profile = {"H": 20, "lr": 0.1, "num_nodes": 4, "p": 0.02, "island_size": 2}
    assert relevant_settings("diloco", profile) == {"H": 20, "comm_dtype": "float32"}
    assert relevant_settings("sparta", profile) == {"p_sparta": 0.02, "comm_dtype": "float32"}
    assert relevant_settings("fedavg", profile) == {"H": 20, "island_size": 2,
                                                    "comm_dtype": "float32"}
    assert relevant_settings("diloco", {})["H"] == 100  # DiLoCoStrategy's default


def test_one_host_sends_nothing_and_gets_no_speedup():
    for name in ("ddp", "diloco", "sparta", "fedavg", "sparta_diloco"):
        p = predict(name, 1000, 1, 0.1, 1e6, **relevant_settings(name, {}))
        assert p.wire_bytes == 0.0 and p.speedup == pytest.approx(1.0)


def test_predict_is_the_projection_in_one_object():
    p = predict("ddp", 1000, 4, 0.1, 1000, latency_s=0.01, compute_sd_s=0.02)
    step = predict_step_time("ddp", 1000, 4, 0.1, 1000, 0.01, 0.02)
    assert p.step_s == pytest.approx(step)
    assert p.comm_s == pytest.approx(step - 0.1)
    assert p.speedup == pytest.approx(speedup("ddp", 1000, 4, 0.1, 1000, latency_s=0.01,
                                              compute_sd_s=0.02))
    assert p.wire_bytes == bytes_per_step("ddp", 1000, 4) and p.payload_bytes == 4000
    assert p.efficiency == pytest.approx(p.speedup / 4)


def test_on_a_slow_link_diloco_wins_and_on_a_free_link_all_reach_k():
    slow = {p.strategy: p for p in predict_all(
        1_000_000, 4, 0.05, mbit_to_bytes_per_s(100), settings={"diloco": {"H": 100}})}
    # 1M float32 parameters: DDP moves 6 MB per step over 12.5 MB/s, DiLoCo 1/100 of that
    assert slow["ddp"].speedup < 1.0 < 3.5 < slow["diloco"].speedup
    assert slow["diloco"].speedup > slow["fedavg"].speedup  # FedAvg's default H is 1
    assert slow["sparta"].speedup > 3.5
    fast = predict_all(1_000, 4, 1.0, 1e15)
    assert all(math.isclose(p.speedup, 4, rel_tol=1e-6) for p in fast)
    assert mbit_to_bytes_per_s(8) == 1_000_000


@pytest.mark.parametrize("call, error, words", [
    (lambda: step_traffic("fedavg", 1000, 4), ValueError, "fedavg needs H"),
    (lambda: step_traffic("fedavg", 1000, 4, H=2, island_size=0), ValueError, "island_size"),
    (lambda: step_traffic("sparta_diloco", 1000, 4, H=2, sparta_interval=0), ValueError,
     "sparta_interval"),
    (lambda: step_traffic("ddp", 1000, 4, comm_dtype="int3"), ValueError, "comm_dtype"),
    (lambda: step_traffic("ddp", 1000, 4, Hx=3), TypeError, "Hx"),
    (lambda: predict("ddp", 1000, 4, 0.0, 1e6), ValueError, "compute_s"),
    (lambda: predict("ddp", 1000, 4, 0.1, 0), ValueError, "throughput"),
    (lambda: mbit_to_bytes_per_s(0), ValueError, "mbit_per_s"),
])
def test_bad_arguments_are_named(call, error, words):
    with pytest.raises(error, match=words):
        call()


@pytest.mark.slow
def test_payload_matches_the_comm_counters_of_a_real_run():
    from toys import BNNet, tiny_model, toy_dataset

    from exogym import Trainer
    from exogym.strategy import (
        AsyncDiLoCoStrategy,
        DESLOCStrategy,
        DiLoCoStrategy,
        FedAvgStrategy,
        MuLoCoStrategy,
        SimpleReduceStrategy,
        SparseLoCoStrategy,
    )

    model = tiny_model(cls=BNNet)
    params = sum(p.numel() for p in model.parameters())
    shapes = [tuple(p.shape) for p in model.parameters()]
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    ds = toy_dataset()
    for name, strategy, settings in (
            ("ddp", SimpleReduceStrategy(), {}),
            ("diloco", DiLoCoStrategy(H=2), {"H": 2, "num_buffers": buffers}),
            ("fedavg", FedAvgStrategy(H=2), {"H": 2, "num_buffers": buffers}),
            ("sparseloco", SparseLoCoStrategy(H=2, topk=4, chunk=16),
             {"H": 2, "topk": 4, "chunk": 16, "shapes": shapes, "num_buffers": buffers}),
            # parameters every 2 steps (with the buffers), first moment every 2, second every 4
            ("desloc", DESLOCStrategy(H_params=2, H_m1=2, H_m2=4),
             {"H_params": 2, "H_m1": 2, "H_m2": 4, "num_buffers": buffers}),
            ("muloco", MuLoCoStrategy(H=2), {"H": 2, "num_buffers": buffers}),
            # equal speeds: a merge of every worker every H steps, as a DiLoCo round
            ("async_diloco", AsyncDiLoCoStrategy(H=2, quorum=2),
             {"H": 2, "num_buffers": buffers})):
        trainer = Trainer(model, ds, None)
        trainer.fit(strategy=strategy, num_nodes=2, max_steps=4, batch_size=8, val_size=0,
                    logger=None, progress=False)
        sent = max(r["comm_bytes"] for r in trainer.history if r["step"] == 4)
        assert sent / 4 == pytest.approx(payload_bytes_per_step(name, params, 2, **settings))


def test_the_strategy_facts_and_the_projection_import_without_torch():
    import subprocess
    import sys

    from ranks import ROOT

    code = ("import sys\n"
            "import exogym.strategy.facts, distributed.planning.projection\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


def test_the_projections_defaults_are_the_strategy_classes_own():
    import inspect

    from exogym.strategy import (
        AsyncDiLoCoStrategy,
        DeMoStrategy,
        DESLOCStrategy,
        DiLoCoStrategy,
        FedAvgStrategy,
        MuLoCoStrategy,
        SimpleReduceStrategy,
        SparseLoCoStrategy,
        SPARTADiLoCoStrategy,
        SPARTAStrategy,
        StreamingDiLoCoStrategy,
    )

    classes = {"ddp": SimpleReduceStrategy, "diloco": DiLoCoStrategy, "fedavg": FedAvgStrategy,
               "sparta": SPARTAStrategy, "sparta_diloco": SPARTADiLoCoStrategy,
               "demo": DeMoStrategy, "streaming_diloco": StreamingDiLoCoStrategy,
               "sparseloco": SparseLoCoStrategy, "desloc": DESLOCStrategy,
               "muloco": MuLoCoStrategy, "async_diloco": AsyncDiLoCoStrategy}
    assert set(classes) == set(DEFAULTS) - {"none"}
    for name, cls in classes.items():
        parameters = inspect.signature(cls.__init__).parameters
        for key, value in DEFAULTS[name].items():
            default = parameters[key].default
            if default is None:  # chosen inside the class (SPARTA's p_sparta): what it chose
                default = getattr(cls(), key)
            assert value == default, (name, key, value, default)


def test_wire_value_sizes_and_the_bucket_are_the_comm_modules():
    from exogym import comm
    from exogym.strategy.facts import VALUE_BYTES

    for name in ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half"):
        assert VALUE_BYTES[name] == comm.resolve_dtype(name).itemsize, name
    assert BUCKET_BYTES == comm.BUCKET_BYTES


@pytest.mark.parametrize("settings", [{}, {"compression_topk": 8, "compression_chunk": 16,
                                           "comm_dtype": "bfloat16"}])
def test_demo_payload_matches_the_comm_counters_of_a_real_run(settings):
    import torch
    from toys import TinyCNN, toy_images

    from exogym import Trainer
    from exogym.strategy import DeMoStrategy

    torch.manual_seed(0)
    model = TinyCNN()
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    ds = toy_images(128)
    trainer = Trainer(model, ds, None)
    trainer.fit(strategy=DeMoStrategy(lr=0.01, **settings), num_nodes=2, max_steps=3,
                batch_size=16, val_size=0, logger=None, progress=False)
    expected = payload_bytes_per_step("demo", sum(p.numel() for p in model.parameters()), 2,
                                      shapes=shapes, **relevant_settings("demo", settings))
    for row in trainer.history:
        assert row["comm_bytes"] == expected * row["step"]
