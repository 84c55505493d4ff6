"""The research metric (rank correlation) and the non-IID partition helper."""

from __future__ import annotations

import pytest
import torch
from toys import tiny_model, toy_dataset, trainable_count

from exogym import Trainer
from exogym.data.partition import dirichlet_partition
from exogym.strategy import FedAvgStrategy, OptimSpec, SimpleReduceStrategy

FIT = dict(batch_size=16, val_size=0, logger=None, progress=False)


def test_correlation_is_one_for_ddp_and_costs_no_training_bytes():
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=SimpleReduceStrategy(optim_spec=OptimSpec(torch.optim.SGD, lr=0.5)),
                num_nodes=2, max_steps=6, correlation_interval=3, **FIT)
    p = trainable_count(tiny_model())
    for row in trainer.history:
        assert ("correlation" in row) == (row["step"] % 3 == 0)
        if "correlation" in row:
            assert row["correlation"] == pytest.approx(1.0, abs=1e-6)
        assert row["comm_bytes"] == 4 * p * row["step"]  # the gather is not training traffic


@pytest.mark.slow
def test_correlation_falls_below_one_for_independent_ranks():
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=FedAvgStrategy(optim_spec=OptimSpec(torch.optim.SGD, lr=0.5), H=1,
                                        island_size=1),
                num_nodes=3, max_steps=8, correlation_interval=4, **FIT)
    values = {(r["rank"], r["step"]): r["correlation"] for r in trainer.history
              if "correlation" in r}
    assert sorted(values) == [(rank, step) for rank in range(3) for step in (4, 8)]
    for step in (4, 8):
        per_rank = [values[(rank, step)] for rank in range(3)]
        assert max(per_rank) == min(per_rank)  # one figure for the run, on every rank
        assert per_rank[0] < 1 - 1e-4
    assert values[(0, 8)] < values[(0, 4)]  # independent ranks drift further apart
    assert all(r["comm_bytes"] == 0 for r in trainer.history)


def test_dirichlet_partition_places_every_index_once_and_is_seeded():
    labels = torch.arange(1000) % 10
    parts = dirichlet_partition(labels, num_clients=8, alpha=0.5, seed=3)
    assert len(parts) == 8
    assert sorted(i for part in parts for i in part) == list(range(1000))
    assert parts == dirichlet_partition(labels, 8, 0.5, seed=3)
    assert parts != dirichlet_partition(labels, 8, 0.5, seed=4)


def test_dirichlet_partition_skews_labels_more_for_small_alpha():
    labels = torch.arange(2000) % 10

    def mean_classes_per_client(alpha):
        parts = dirichlet_partition(labels, num_clients=10, alpha=alpha, seed=0)
        # classes holding at least 5% of a client's samples
        counts = [torch.bincount(labels[part], minlength=10) for part in parts if part]
        return sum(int((c >= 0.05 * c.sum()).sum()) for c in counts) / len(counts)

    assert mean_classes_per_client(0.1) < 4 < 9 < mean_classes_per_client(100.0)


def test_dirichlet_partition_rejects_bad_arguments():
    with pytest.raises(ValueError, match="alpha must be > 0"):
        dirichlet_partition([0, 1], 2, alpha=0)
    with pytest.raises(ValueError, match="num_clients must be >= 1"):
        dirichlet_partition([0, 1], 0, alpha=1.0)
