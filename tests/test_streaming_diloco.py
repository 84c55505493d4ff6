"""Streaming DiLoCo does what the paper says: fragments, overlap, mixing, bytes, resume."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from ranks import start_ranks, wait_all
from safetensors.torch import load_file
from toys import BNNet, CrashAt, assert_models_close, assert_models_differ, tiny_model, toy_dataset

from distributed.profiles.profile import parse_overrides
from distributed.worker.run_profile import run_profile
from exogym import RankFailedError, Trainer, comm
from exogym.run.checkpoint import checkpoint_path, list_steps, load_checkpoint
from exogym.strategy import (
    CommunicateOptimizeStrategy,
    DiLoCoStrategy,
    OptimSpec,
    StreamingDiLoCoStrategy,
)
from exogym.strategy.facts import fragment_offset, streaming_sync_bytes
from exogym.strategy.outer import OuterOptimizer
from exogym.strategy.streaming_diloco import StreamingDiLoCoCommunicator, model_layers

FIT = dict(batch_size=16, val_size=0, shuffle=False, logger=None, progress=False)


def sgd(lr=0.1):
    return OptimSpec(torch.optim.SGD, lr=lr)


class Deep(nn.Module):
    """Five linear layers of different widths, so fragments differ in size."""

    def __init__(self, d_in: int = 8, classes: int = 3):
        super().__init__()
        widths = [d_in, 12, 10, 14, 9, classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, batch):
        x, y = batch
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return F.cross_entropy(self.layers[-1](x), y)


def deep(seed=0):
    torch.manual_seed(seed)
    return Deep()


def streaming(**kwargs):
    settings = dict(inner_optim="adam", lr=0.01, H=4, num_fragments=2)
    return StreamingDiLoCoStrategy(**{**settings, **kwargs})


def fit(model, strategy, steps, nodes=3, ds=None, **kwargs):
    ds = ds if ds is not None else toy_dataset()
    trainer = Trainer(model, ds, ds)
    final = trainer.fit(strategy=strategy, num_nodes=nodes, max_steps=steps, **{**FIT, **kwargs})
    return trainer, final


def test_fragments_stride_over_the_layers_and_cover_the_model():
    model = deep()
    layers = model_layers(model)
    assert len(layers) == 5
    module = StreamingDiLoCoCommunicator(6, 2, OuterOptimizer().optim_spec())
    module._init_node(model, 0, 1)
    first, second = module.fragments
    weights = [layer.weight for layer in model.layers]
    assert [id(t) for t in first.params] == [id(t) for i in (0, 2, 4)
                                             for t in (weights[i], model.layers[i].bias)]
    assert [id(t) for t in second.params] == [id(t) for i in (1, 3)
                                              for t in (weights[i], model.layers[i].bias)]
    assert first.numel + second.numel == sum(p.numel() for p in model.parameters())
    # Offsets p*H//F, rounded down when H is not divisible by F.
    assert [fragment_offset(p, 6, 2) for p in range(2)] == [0, 3]
    assert [fragment_offset(p, 7, 3) for p in range(3)] == [0, 2, 4]


def test_bad_settings_fail_before_training_naming_the_value():
    with pytest.raises(ValueError, match="fragment_delay.*got 4"):
        StreamingDiLoCoStrategy(H=4, num_fragments=2, fragment_delay=4)
    with pytest.raises(ValueError, match="fragment_alpha.*got 1.5"):
        StreamingDiLoCoStrategy(H=4, num_fragments=2, fragment_alpha=1.5)
    with pytest.raises(ValueError, match="num_fragments=5 is more than H=4"):
        StreamingDiLoCoStrategy(H=4, num_fragments=5)
    with pytest.raises(ValueError, match="error_feedback"):
        StreamingDiLoCoStrategy(H=4, num_fragments=2, error_feedback=True)
    module = StreamingDiLoCoCommunicator(8, 3, OuterOptimizer().optim_spec())
    with pytest.raises(ValueError, match="num_fragments=3 is more than the model's 2 layers"):
        module._init_node(tiny_model(), 0, 1)


def test_one_fragment_without_delay_or_mixing_is_diloco_bitwise():
    ds = toy_dataset(96)
    torch.manual_seed(0)
    start = BNNet()
    common = dict(inner_optim="adam", lr=0.01, H=3)
    _, diloco = fit(start, DiLoCoStrategy(**common), 8, ds=ds)
    _, stream = fit(start, StreamingDiLoCoStrategy(num_fragments=1, **common), 8, ds=ds)
    a, b = diloco.state_dict(), stream.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert_models_differ(diloco, start)


def per_step_bytes(trainer, rank=0):
    counts = [r["comm_bytes"] for r in trainer.history
              if r.get("event", "step") == "step" and r["rank"] == rank and "comm_bytes" in r]
    return [b - a for a, b in zip([0] + counts, counts)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_each_sync_sends_exactly_its_fragment(dtype):
    H, F_ = 6, 3
    model = deep()
    module = StreamingDiLoCoCommunicator(H, F_, OuterOptimizer().optim_spec())
    module._init_node(model, 0, 1)
    sizes = [f.numel for f in module.fragments]
    trainer, _ = fit(deep(), streaming(H=H, num_fragments=F_, comm_dtype=dtype), 12, nodes=2)
    expected = []
    for step in range(1, 13):
        due = [p for p in range(F_) if step % H == fragment_offset(p, H, F_)]
        expected.append(sum(streaming_sync_bytes(sizes[p], dtype) for p in due))
    assert per_step_bytes(trainer) == expected
    if dtype == "float32":
        # Each sync carries 4 bytes per value of its fragment: about 1/F of DiLoCo's round.
        assert [e for e in expected if e] == [4 * n for n in (sizes[1], sizes[2], sizes[0])] * 2
        assert sum(expected[:H]) == 4 * sum(p.numel() for p in model.parameters())


class Checked(StreamingDiLoCoCommunicator):
    """After each fragment's update: its tensors and every global copy agree across ranks."""

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.model = model
        self.updates = 0

    def _apply(self, pending):
        super()._apply(pending)
        self.updates += 1
        fragment = self.fragments[pending.fragment]
        shared = fragment.params + fragment.buffers + [m for f in self.fragments for m in f.master]
        for tensor in shared:
            gathered = [torch.empty_like(tensor) for _ in range(self.num_nodes)]
            comm.side_all_gather(gathered, tensor.detach().contiguous())
            for other in gathered[1:]:
                assert torch.equal(other, gathered[0]), "ranks disagree after a fragment update"
        for p in self.model.parameters():
            assert torch.isfinite(p).all(), "non-finite parameter after a fragment update"

    def communicate(self, model, rank, num_nodes, local_step):
        self.num_nodes = num_nodes
        super().communicate(model, rank, num_nodes, local_step)
        if local_step == 9:
            assert self.updates == 5, self.updates  # fragment 0 after 4 and 8, 1 after 2, 6, 10


def test_after_each_fragment_update_without_delay_the_ranks_agree_and_are_finite():
    module = Checked(4, 2, OuterOptimizer().optim_spec())
    strategy = CommunicateOptimizeStrategy([module], optim_spec="adam", lr=0.01)
    _, final = fit(deep(), strategy, 10, ds=toy_dataset(96))
    assert all(torch.isfinite(p).all() for p in final.parameters())


@pytest.mark.slow
def test_a_delayed_fragment_applies_its_round_tau_steps_later():
    # Outer lr ~0 and no momentum: a round puts its fragment back at the start.
    def run(steps, delay):
        strategy = StreamingDiLoCoStrategy(optim_spec=sgd(), H=4, num_fragments=1,
                                           fragment_delay=delay, outer_lr=1e-12,
                                           outer_momentum=0.0)
        return fit(tiny_model(), strategy, steps, nodes=2)[1]
    start = tiny_model()
    assert_models_close(run(4, 0), start, atol=1e-6)  # the round ends at step 4
    assert_models_differ(run(4, 1), start)  # still in flight after step 4
    assert_models_close(run(5, 1), start, atol=1e-6)  # applied after step 5
    assert_models_differ(run(5, 0), start)


@pytest.mark.slow
def test_delay_one_trains_and_differs_from_no_delay():
    ds = toy_dataset(96)
    _, sync = fit(deep(), streaming(fragment_delay=0), 12, ds=ds)
    _, delayed = fit(deep(), streaming(fragment_delay=1), 12, ds=ds)
    assert all(torch.isfinite(p).all() for p in delayed.parameters())
    assert_models_differ(sync, delayed)
    assert_models_differ(delayed, deep())


@pytest.mark.slow
def test_alpha_one_keeps_the_local_values_and_moves_only_the_global_copy():
    # alpha=1: local = global + 1*(local - global) = local, so a sync leaves the model as
    # it was: one rank trains exactly as with no communication at all.
    strategy = StreamingDiLoCoStrategy(optim_spec=sgd(), H=2, num_fragments=2,
                                       fragment_alpha=1.0)
    _, mixed = fit(tiny_model(), strategy, 6, nodes=1)
    _, plain = fit(tiny_model(), CommunicateOptimizeStrategy([], optim_spec=sgd()), 6, nodes=1)
    assert_models_close(mixed, plain, atol=0)
    _, taken = fit(tiny_model(), StreamingDiLoCoStrategy(optim_spec=sgd(), H=2, num_fragments=2),
                   6, nodes=1)
    assert_models_differ(mixed, taken)


class Crash(CrashAt, Deep):
    """Deep whose training forward pass raises at step ``crash_at``."""


def resumable(ds, run, tmp_path, crash_at=None, **kwargs):
    torch.manual_seed(0)
    model = Crash()
    model.crash_at = crash_at
    strategy = streaming(H=4, num_fragments=2, fragment_delay=1, comm_dtype="int8",
                         error_feedback=True, lr_scheduler="cosine", warmup_steps=2)
    return fit(model, strategy, 14, nodes=2, ds=ds, save_dir=str(tmp_path), run_name=run,
               **kwargs)


@pytest.mark.slow
def test_resume_with_a_fragment_in_flight_equals_the_uninterrupted_run(tmp_path):
    ds = toy_dataset(96)
    _, uninterrupted = resumable(ds, "full", tmp_path)
    with pytest.raises(RankFailedError, match="simulated crash"):
        resumable(ds, "split", tmp_path, crash_at=10, checkpoint_interval=4)
    assert list_steps(tmp_path / "split", 0) == [4, 8]
    # Fragment 0 started after step 8 and applies after step 9: in flight at the checkpoint.
    saved = load_checkpoint(checkpoint_path(tmp_path / "split", 0, 8))
    pending = saved["strategy"]["modules"][0]["pending"]
    assert [(p["fragment"], p["apply_after"]) for p in pending] == [(0, 8)]
    trainer, resumed = resumable(ds, "split", tmp_path, checkpoint_interval=4,
                                 resume_from="auto")
    assert [r["step"] for r in trainer.history if r["rank"] == 0 and "step" in r][0] == 9
    a, b = uninterrupted.state_dict(), resumed.state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key


COMMON = ["max_steps=30", "val_interval=30", "num_threads=1", "checkpoint_interval=None",
          "H=6", "num_fragments=2", "fragment_delay=1"]


@pytest.mark.slow
def test_three_real_ranks_with_delay_one_end_with_the_simulated_model(tmp_path):
    procs = start_ranks("digits-streaming", 3,
                        COMMON + ["num_nodes=3", f"output_dir={tmp_path / 'net'}"],
                        tmp_path / "logs")
    codes = wait_all(procs, timeout=240)
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").iterdir()}
    assert codes == [0, 0, 0], logs
    real = load_file(tmp_path / "net" / "model.safetensors")
    run_profile("digits-streaming", overrides=parse_overrides(
        COMMON + ["num_nodes=3", f"output_dir={tmp_path / 'sim'}"]), progress=False, local=True)
    simulated = load_file(tmp_path / "sim" / "model.safetensors")
    assert real.keys() == simulated.keys()
    for key in real:
        assert torch.allclose(real[key].float(), simulated[key].float(), atol=1e-5), key


def test_the_planner_sees_diloco_bytes_cut_into_fragment_syncs():
    from distributed.planning.projection import relevant_settings, step_traffic

    P, H = 4096, 20
    diloco = step_traffic("diloco", P, 4, H=H)
    stream = step_traffic("streaming_diloco", P, 4, **relevant_settings(
        "streaming_diloco", {"H": H, "num_fragments": 4}))
    assert stream.payload == diloco.payload  # the same total per H steps
    assert stream.period == H // 4  # a sync every H/F steps
    assert stream.payload * stream.period == streaming_sync_bytes(P // 4)  # 1/F per sync
    int4 = step_traffic("streaming_diloco", P, 4, H=H, num_fragments=4, comm_dtype="int4")
    assert int4.payload * int4.period == streaming_sync_bytes(P // 4, "int4")
