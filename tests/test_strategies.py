"""The strategies do what their algorithms say: equivalences that fail if one is wrong."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from toys import BNNet, assert_models_close, assert_models_differ, tiny_model, toy_dataset

from exogym import LocalTrainer, Trainer
from exogym.strategy import (
    DiLoCoStrategy,
    FedAvgStrategy,
    OptimSpec,
    SimpleReduceStrategy,
    SPARTADiLoCoStrategy,
)
from exogym.strategy.federated_averaging import island_plan

FIT = dict(batch_size=16, val_size=0, shuffle=False, logger=None, progress=False)


def sgd(lr=0.1):
    return OptimSpec(torch.optim.SGD, lr=lr)


def test_diloco_h1_sgd_matches_ddp():
    ds = toy_dataset()
    ddp = Trainer(tiny_model(), ds, ds).fit(
        strategy=SimpleReduceStrategy(optim_spec=sgd()), num_nodes=3, max_steps=6, **FIT)
    diloco = Trainer(tiny_model(), ds, ds).fit(
        strategy=DiLoCoStrategy(optim_spec=sgd(), H=1, outer_lr=1.0, outer_momentum=0.0),
        num_nodes=3, max_steps=6, **FIT)
    assert_models_close(ddp, diloco)
    assert_models_differ(ddp, tiny_model())


def test_fedavg_h1_full_island_sgd_matches_ddp():
    ds = toy_dataset()
    ddp = Trainer(tiny_model(), ds, ds).fit(
        strategy=SimpleReduceStrategy(optim_spec=sgd()), num_nodes=4, max_steps=5, **FIT)
    fedavg = Trainer(tiny_model(), ds, ds).fit(
        strategy=FedAvgStrategy(optim_spec=sgd(), H=1, island_size=4),
        num_nodes=4, max_steps=5, **FIT)
    assert_models_close(ddp, fedavg)


def plain_training(model, ds, steps, batch_size, lr):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = ds.tensors
    for i in range(steps):
        lo = (i * batch_size) % len(x)
        opt.zero_grad()
        model((x[lo:lo + batch_size], y[lo:lo + batch_size])).backward()
        opt.step()
    return model


def test_diloco_single_node_outer_sgd_lr1_equals_plain_training():
    ds = toy_dataset()
    start = tiny_model()
    diloco = Trainer(start, ds, ds).fit(
        strategy=DiLoCoStrategy(optim_spec=sgd(0.2), H=3, outer_lr=1.0, outer_momentum=0.0),
        num_nodes=1, max_steps=7, **FIT)
    assert_models_close(diloco, plain_training(start, ds, 7, 16, 0.2))


def test_diloco_inner_optim_adam_is_really_adam():
    ds = toy_dataset()
    start = tiny_model()
    strategy = DiLoCoStrategy(inner_optim="adam", H=100, lr=0.01)
    trained = Trainer(start, ds, ds).fit(strategy=strategy, num_nodes=1, max_steps=5, **FIT)
    # No outer round ran (H=100 > 5 steps): the result is five plain Adam steps.
    reference = copy.deepcopy(start)
    opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    x, y = ds.tensors
    for i in range(5):
        opt.zero_grad()
        reference((x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16])).backward()
        opt.step()
    assert_models_close(trained, reference)


@pytest.mark.slow
def test_diloco_round_runs_after_exactly_h_steps():
    ds = toy_dataset()
    start = tiny_model()
    # outer lr 0: a round resets every rank to the start; after 4 steps with H=4
    # the model is the start again, after 5 it is one inner step away.
    s4 = Trainer(start, ds, ds).fit(
        strategy=DiLoCoStrategy(optim_spec=sgd(), H=4, outer_lr=1e-12, outer_momentum=0.0),
        num_nodes=2, max_steps=4, **FIT)
    assert_models_close(s4, start, atol=1e-6)
    s5 = Trainer(start, ds, ds).fit(
        strategy=DiLoCoStrategy(optim_spec=sgd(), H=4, outer_lr=1e-12, outer_momentum=0.0),
        num_nodes=2, max_steps=5, **FIT)
    assert_models_differ(s5, start)


@pytest.mark.slow
def test_model_averaging_preserves_the_mean_of_ranks():
    """Islands of one rank never average; the final model is the mean of the ranks' models."""
    ds = toy_dataset()
    start = tiny_model()
    solo = Trainer(start, ds, ds)
    solo.fit(strategy=FedAvgStrategy(optim_spec=sgd(), H=1, island_size=1), num_nodes=2,
             max_steps=3, **FIT)
    # Reproduce each rank's independent training on its shard (rank r gets r::2).
    x, y = ds.tensors
    finals = []
    for rank in range(2):
        shard = torch.utils.data.TensorDataset(x[rank::2], y[rank::2])
        finals.append(plain_training(start, shard, 3, 16, 0.1))
    averaged = Trainer(start, ds, ds).fit(
        strategy=FedAvgStrategy(optim_spec=sgd(), H=3, island_size=2), num_nodes=2,
        max_steps=3, **FIT)
    for name, p in averaged.named_parameters():
        expected = sum(dict(f.named_parameters())[name] for f in finals) / 2
        assert torch.allclose(p, expected, atol=1e-5), name


def test_fedavg_islands_and_sampling_are_shared_and_cover_every_rank():
    for round_index in range(5):
        islands, taking_part = island_plan(8, 3, 0.5, seed=7, round_index=round_index)
        assert sorted(r for i in islands for r in i) == list(range(8))
        assert [len(i) for i in islands] == [3, 3, 2]
        for island in islands:
            assert any(r in taking_part for r in island)
        assert island_plan(8, 3, 0.5, seed=7, round_index=round_index) == (islands, taking_part)
    assert island_plan(8, 3, 0.5, 7, 0) != island_plan(8, 3, 0.5, 7, 1)


def test_fedavg_with_islands_and_client_sampling_trains():
    ds = toy_dataset(512)
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=FedAvgStrategy(inner_optim="adam", lr=0.02, H=2, island_size=2,
                                        client_sampling=0.5),
                num_nodes=4, max_steps=20, batch_size=16, val_size=128, val_interval=10,
                logger=None, progress=False)
    first = [r["train_loss"] for r in trainer.history if r["step"] == 1]
    last = [r["val_global_loss"] for r in trainer.history if r["step"] == 20]
    assert sum(last) / len(last) < sum(first) / len(first)


def test_float_buffers_are_averaged_and_integer_buffers_keep_their_dtype():
    ds = toy_dataset()
    model = tiny_model(cls=BNNet)
    trained = LocalTrainer(model, ds, ds).fit(
        strategy=DiLoCoStrategy(optim_spec=sgd(), H=2), num_nodes=2, max_steps=4, **FIT)
    assert trained.bn.num_batches_tracked.dtype == torch.long
    assert int(trained.bn.num_batches_tracked) == 4
    assert trained.bn.running_mean.dtype == torch.float32
    assert not torch.equal(trained.bn.running_mean, model.bn.running_mean)


@pytest.mark.slow
def test_gradient_accumulation_matches_the_full_batch():
    ds = toy_dataset()
    kwargs = dict(strategy=SimpleReduceStrategy(optim_spec=sgd()), num_nodes=2, max_steps=4,
                  **FIT)
    full = Trainer(tiny_model(), ds, ds).fit(**kwargs)
    accumulated = Trainer(tiny_model(), ds, ds).fit(minibatch_size=4, **kwargs)
    by_count = Trainer(tiny_model(), ds, ds).fit(gradient_accumulation=2, **kwargs)
    assert_models_close(full, accumulated)
    assert_models_close(full, by_count)


def test_lr_schedule_warmup_never_starts_at_zero_and_cosine_decays():
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=SimpleReduceStrategy(lr=0.1, lr_scheduler="cosine", warmup_steps=4,
                                              min_lr_factor=0.1),
                num_nodes=1, max_steps=12, **FIT)
    lrs = [r["lr"] for r in trainer.history]
    assert lrs[0] == pytest.approx(0.025)
    assert lrs[3] == pytest.approx(0.1)
    assert lrs[-1] < 0.03 and all(a >= b for a, b in zip(lrs[3:], lrs[4:]))


def test_lambda_cosine_with_scheduler_kwargs_dict_is_honoured():
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=SimpleReduceStrategy(
        lr=0.1, lr_scheduler="lambda_cosine",
        lr_scheduler_kwargs={"warmup_steps": 2, "cosine_anneal": True}),
        num_nodes=1, max_steps=6, **FIT)
    lrs = [r["lr"] for r in trainer.history]
    assert lrs[:2] == pytest.approx([0.05, 0.1])
    assert lrs[-1] < lrs[2]


def test_max_norm_clips_the_averaged_gradient():
    ds = toy_dataset()
    start = tiny_model()
    clipped = Trainer(start, ds, ds).fit(
        strategy=SimpleReduceStrategy(optim_spec=sgd(1.0), max_norm=1e-3), num_nodes=2,
        max_steps=1, **FIT)
    moved = torch.cat([(a - b).reshape(-1) for a, b in zip(clipped.parameters(),
                                                            start.parameters())])
    assert moved.norm().item() == pytest.approx(1e-3, rel=1e-3)


def test_custom_strategy_from_the_gym_readme_runs():
    """The int8 quantization example from exo-explore/gym's README, unchanged in spirit."""
    from exogym.strategy import Strategy
    from exogym.strategy.communicate import all_reduce

    class QuantizationStrategy(Strategy):
        def __init__(self, optim_spec):
            super().__init__()
            self.optim_spec = optim_spec
            self.scale = 0.024
            self.zero_point = 0

        def step(self):
            for param in self.model.parameters():
                if param.grad is not None:
                    q = torch.round(param.grad / self.scale + self.zero_point).clamp(0, 255)
                    q = q.to(torch.uint8).to(torch.int32)
                    all_reduce(q)
                    param.grad = (q.to(torch.float32) * self.scale) / self.num_nodes
            self.optim.step()
            super().step()

    ds = toy_dataset()
    start = tiny_model()
    trainer = Trainer(start, ds, ds)
    # Two threads per rank: ranks start from the fork server, so the strategy class,
    # defined inside this function, must travel by value.
    trained = trainer.fit(strategy=QuantizationStrategy(sgd()), num_nodes=2, max_steps=2,
                          num_threads=2, **FIT)
    assert_models_differ(trained, start)
    assert trainer.history[-1]["comm_bytes"] == 2 * 4 * sum(p.numel() for p in start.parameters())


def test_cross_entropy_toy_is_learnable():
    ds = toy_dataset(512)
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=DiLoCoStrategy(inner_optim="adam", lr=0.02, H=5), num_nodes=2,
                max_steps=30, batch_size=16, val_size=128, val_interval=15, logger=None,
                progress=False)
    evals = [r["val_global_loss"] for r in trainer.history if "val_global_loss" in r]
    assert evals[-1] < 0.8 * F.cross_entropy(torch.zeros(1, 3), torch.zeros(1).long()).item()


@pytest.mark.slow
def test_cpu_optimizers_take_the_fused_or_foreach_kernel_unless_the_user_chose():
    model = tiny_model()
    assert OptimSpec("adamw").build(model).defaults["fused"] is True
    assert OptimSpec("sgd", lr=0.1).build(model).defaults["fused"] is True
    assert OptimSpec("rmsprop").build(model).defaults["foreach"] is True  # no fused kernel
    chosen = OptimSpec("adamw", fused=False).build(model).defaults
    assert not chosen["fused"] and not chosen["foreach"]
    chosen = OptimSpec("adamw", foreach=False).build(model).defaults
    assert not chosen["fused"] and chosen["foreach"] is False

    # The same update as torch's default loop, to float rounding.
    ours, torchs = copy.deepcopy(model), copy.deepcopy(model)
    opt_ours = OptimSpec("adamw", lr=0.01).build(ours)
    opt_torch = torch.optim.AdamW(torchs.parameters(), lr=0.01)
    x, y = toy_dataset().tensors
    for _ in range(5):
        for net, opt in ((ours, opt_ours), (torchs, opt_torch)):
            opt.zero_grad()
            net((x[:32], y[:32])).backward()
            opt.step()
    assert_models_close(ours, torchs)
    assert_models_differ(ours, model)


@pytest.mark.parametrize("strategy", [
    DiLoCoStrategy(optim_spec="adam", lr=0.02, H=4),
    SPARTADiLoCoStrategy(optim_spec="adam", lr=0.02, H=4, p_sparta=0.1),
], ids=["diloco", "sparta-diloco"])
def test_at_a_round_end_the_ranks_are_identical_and_the_average_model_is_each_rank_s(strategy):
    ds = toy_dataset(512)
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=strategy, num_nodes=3, max_steps=8, batch_size=16, val_size=128,
                val_interval=2, logger=None, progress=False)
    rows = {(r["rank"], r["step"]): r for r in trainer.history if "val_loss" in r}
    for step in (4, 8):  # round ends: one model on every rank, scored without averaging
        losses = {rows[rank, step]["val_loss"] for rank in range(3)}
        assert len(losses) == 1
        assert {rows[rank, step]["val_global_loss"] for rank in range(3)} == losses
    for step in (2, 6):  # inside a round the ranks differ; the average model is another
        losses = [rows[rank, step]["val_loss"] for rank in range(3)]
        assert len(set(losses)) == 3
        assert rows[0, step]["val_global_loss"] not in losses


# --------------------------------------------------------------------------- checks before the start


def refuse_any_start(monkeypatch):
    """Make every path past the strategies' checks fail the test: the memory accounting
    (which sets a strategy up on a meta copy) and the start of the ranks."""
    import exogym.run.trainer

    def started(*args, **kwargs):
        raise AssertionError("the run got past the strategy's checks")

    monkeypatch.setattr(exogym.run.trainer, "check_memory", started)
    monkeypatch.setattr(exogym.run.trainer.Trainer, "_execute", started)


def test_streaming_diloco_with_more_fragments_than_layers_is_refused_before_any_rank_starts(
        monkeypatch):
    from exogym.strategy import StreamingDiLoCoStrategy

    refuse_any_start(monkeypatch)
    ds = toy_dataset()
    strategy = StreamingDiLoCoStrategy(H=10, num_fragments=4)
    with pytest.raises(ValueError, match=r"num_fragments=4 is more than the model's 2 layers "
                                         r".*use num_fragments <= 2"):
        Trainer(tiny_model(), ds, ds).fit(strategy=strategy, num_nodes=2, max_steps=5, **FIT)
    with pytest.raises(ValueError, match=r"model's 1 layer \("):
        strategy.validate(torch.nn.Linear(8, 3), 2)
    StreamingDiLoCoStrategy(H=10, num_fragments=2).validate(tiny_model(), 2)  # fits: no error


def test_fit_calls_a_strategys_own_checks_with_the_model_and_the_ranks_before_any_start(
        monkeypatch):
    seen = []

    class EvenRanksOnly(SimpleReduceStrategy):
        def validate(self, model, num_nodes):
            super().validate(model, num_nodes)
            seen.append((type(model).__name__, num_nodes))
            if num_nodes % 2:
                raise ValueError(f"EvenRanksOnly pairs ranks: num_nodes={num_nodes} is odd")

    refuse_any_start(monkeypatch)
    ds = toy_dataset()
    with pytest.raises(ValueError, match="num_nodes=3 is odd"):
        Trainer(tiny_model(), ds, ds).fit(strategy=EvenRanksOnly(), num_nodes=3, max_steps=2,
                                          **FIT)
    assert seen == [("TinyNet", 3)]


def test_a_scheduler_class_is_checked_with_its_arguments_when_the_strategy_is_made():
    step_lr = torch.optim.lr_scheduler.StepLR
    with pytest.raises(TypeError, match=r"lr_scheduler=StepLR cannot be built .*step_size"):
        SimpleReduceStrategy(lr_scheduler=step_lr)
    with pytest.raises(TypeError, match="lr_scheduler class must be a torch LRScheduler"):
        SimpleReduceStrategy(lr_scheduler=dict)
    made = SimpleReduceStrategy(lr_scheduler=step_lr, lr_scheduler_kwargs={"step_size": 3})
    assert made.lr_scheduler is step_lr


def test_the_diloco_family_shares_one_outer_optimizer_spec():
    """DiLoCo, SPARTA-DiLoCo and Streaming DiLoCo read their outer arguments through one spec."""
    from exogym.strategy import StreamingDiLoCoStrategy
    from exogym.strategy.outer import OuterOptimizer

    classes = (DiLoCoStrategy, SPARTADiLoCoStrategy, StreamingDiLoCoStrategy)
    expected = OuterOptimizer(None, 0.5, 0.8, False).optim_spec()
    for cls in classes:
        built = cls(outer_lr=0.5, outer_momentum=0.8, nesterov=False).outer_optim_spec
        assert (built.cls, built.kwargs) == (expected.cls, expected.kwargs), cls.__name__
        with pytest.raises(TypeError, match=rf"^{cls.__name__}: give outer_optim_spec= or "
                                            r"outer_optim=, not both$"):
            cls(outer_optim_spec="sgd", outer_optim="adam")
        adam = cls(outer_optim="adam", outer_lr=0.01).outer_optim_spec
        assert adam.cls is torch.optim.Adam and adam.kwargs["lr"] == 0.01, cls.__name__
