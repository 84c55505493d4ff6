"""A strategy's public lifecycle: set up once from a rank context, hooks declared on the
base class, nothing set from outside; and a strategy written for exo gym, with
``_init_node`` and ``torch.distributed.get_rank()``, still trains, packed too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.utils.data import default_collate

from exogym import Trainer
from exogym.strategy import RankContext, SimpleReduceStrategy, Strategy
from exogym.strategy.communicate import all_reduce
from tests.toys import assert_models_close, tiny_model, toy_dataset

ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(logger=None, progress=False)
#: torch's own function, as a rank process finds it before anything is replaced.
TORCH_GET_RANK = dist.get_rank


class GymStyleAverage(Strategy):
    """Written as for exo gym: set up in ``_init_node``, asks torch.distributed who it is."""

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.asked = (dist.get_rank(), dist.get_world_size())
        if self.asked != (rank, num_nodes):
            raise RuntimeError(f"torch.distributed said {self.asked}, not {(rank, num_nodes)}")

    def step(self):
        world = dist.get_world_size()
        if dist.get_rank() != self.rank:
            raise RuntimeError("torch.distributed gave another rank's identity")
        for p in self.model.parameters():
            if p.grad is not None:
                all_reduce(p.grad)
                p.grad /= world
        self.optim.step()
        super().step()


def collate_where_torch_is_its_own(samples):
    """A batch, refused unless torch.distributed's get_rank is torch's own: the data of a
    step is read outside the model's forward, where a built-in strategy's run replaces
    nothing."""
    if dist.get_rank is not TORCH_GET_RANK:
        raise RuntimeError("torch.distributed was replaced outside a forward pass")
    return default_collate(samples)


def fit(strategy, processes, **kwargs):
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    model = trainer.fit(strategy=strategy, num_nodes=4, max_steps=4, batch_size=8, val_size=0,
                        processes=processes, **QUIET, **kwargs)
    return model


@pytest.mark.parametrize("processes", [4, 1], ids=["a-process-per-rank", "packed"])
def test_a_strategy_written_for_exo_gym_trains_unchanged(processes):
    gym = fit(GymStyleAverage(optim_spec="sgd", lr=0.1), processes)
    ddp = fit(SimpleReduceStrategy(optim_spec="sgd", lr=0.1), processes)
    # the same averaged gradient as DDP's, so the same model
    assert_models_close(gym, ddp, atol=1e-6)


def test_built_in_strategies_run_without_torch_replaced():
    # Packed ranks of a built-in strategy: each rank's identity comes from its context, and
    # torch answers for a rank only inside the model's forward pass.
    fit(SimpleReduceStrategy(optim_spec="sgd", lr=0.1), processes=1,
        dataloader_kwargs={"collate_fn": collate_where_torch_is_its_own})
    assert dist.get_rank is TORCH_GET_RANK
    with pytest.raises(Exception, match="replaced outside a forward pass"):
        fit(GymStyleAverage(optim_spec="sgd", lr=0.1), processes=1,
            dataloader_kwargs={"collate_fn": collate_where_torch_is_its_own})


def test_a_strategy_is_set_up_from_its_context():
    model = tiny_model()
    strategy = SimpleReduceStrategy(lr=0.1)
    context = RankContext(model=model, rank=2, num_nodes=4, max_steps=30, seed=7,
                          samples_per_step=16)
    strategy.setup(context)
    assert (strategy.model, strategy.rank, strategy.num_nodes) == (model, 2, 4)
    assert (strategy.max_steps, strategy.seed, strategy.step_samples()) == (30, 7, 16)
    assert strategy.context is context and strategy.collectives is context.collectives
    strategy.set_max_steps(50)
    assert strategy.max_steps == 50 and strategy.context.max_steps == 50
    with pytest.raises(ValueError, match=r"rank must be within \[0, num_nodes=4\), got 4"):
        RankContext(model=model, rank=4, num_nodes=4)


def test_every_optional_hook_is_declared_on_the_base_class_with_a_default():
    strategy = SimpleReduceStrategy()
    strategy.setup(RankContext.alone(tiny_model(), samples_per_step=8))
    assert strategy.paces_steps is False
    assert strategy.begin_step(1, [0]) is True and strategy.step_samples() == 8
    assert strategy.record_step(8, 0.1) is None and strategy.step_fields() == {}
    assert strategy.global_model_tensors() is None
    for hook in ("setup", "begin_step", "step_samples", "record_step", "step_fields",
                 "global_model_tensors", "idle_step", "validate", "traffic",
                 "set_max_steps", "set_average_weight", "mark_synced"):
        assert getattr(Strategy, hook).__doc__, hook


#: Outside exogym/strategy: a strategy's private method called, or its attribute set.
_REACHES_IN = re.compile(
    r"\b(?:strategy|pacer|module)\.(?:_[a-z]\w*\(|[a-z_]\w*\s*=[^=])")


def test_nothing_outside_the_strategies_sets_their_attributes_or_calls_private_methods():
    offenders = []
    for path in [*ROOT.joinpath("exogym").rglob("*.py"),
                 *ROOT.joinpath("distributed").rglob("*.py")]:
        if "strategy" in path.relative_to(ROOT).parts[:2]:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            asks = 'getattr(self.strategy, "' in line and "config" not in path.parts
            if _REACHES_IN.search(line) or asks:  # (fit's argument checks take any object)
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []
