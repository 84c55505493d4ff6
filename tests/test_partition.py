"""Non-IID data: fit(partition='iid' | 'dirichlet:ALPHA' | 'shards:N')."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from exogym import Trainer
from exogym.config.parsers import parse_partition
from exogym.data.digits import DigitsMLP, digits_datasets
from exogym.data.loading import MinibatchStream
from exogym.data.partition import dataset_labels, label_histogram, split_by_label
from exogym.strategy import DiLoCoStrategy


@pytest.fixture(scope="module")
def digits():
    return digits_datasets()


def top_label_share(labels: torch.Tensor, parts: list[list[int]]) -> float:
    """Mean over ranks of the share of a rank's samples that carry its most common label."""
    shares = []
    for part in parts:
        counts = label_histogram(labels, part)
        shares.append(max(counts) / sum(counts))
    return sum(shares) / len(shares)


@pytest.mark.parametrize("bad", ["dirichlet:0", "dirichlet:-1", "dirichlet:abc", "dirichlet",
                                 "shards:0", "shards:1.5", "iid:2", "noniid", 3, None])
def test_a_bad_partition_is_refused_before_any_rank_starts(bad, digits):
    with pytest.raises(ValueError, match="partition"):
        parse_partition(bad)
    train, val = digits
    with pytest.raises(ValueError, match="partition"):
        Trainer(DigitsMLP(), train, val).fit(strategy=DiLoCoStrategy(H=2), num_nodes=2,
                                             max_steps=1, partition=bad, progress=False,
                                             logger=None)


def test_dirichlet_partitions_are_reproducible_and_use_every_sample_once(digits):
    labels = dataset_labels(digits[0])
    first = split_by_label(labels, "dirichlet:0.5", 4, seed=7)
    again = split_by_label(labels, "dirichlet:0.5", 4, seed=7)
    other = split_by_label(labels, "dirichlet:0.5", 4, seed=8)
    assert first == again
    assert first != other
    assert sorted(i for part in first for i in part) == list(range(len(labels)))


def test_dirichlet_alpha_sets_the_skew(digits):
    labels = dataset_labels(digits[0])
    skewed = top_label_share(labels, split_by_label(labels, "dirichlet:0.1", 8, seed=42))
    mild = top_label_share(labels, split_by_label(labels, "dirichlet:1", 8, seed=42))
    even = top_label_share(labels, split_by_label(labels, "dirichlet:100", 8, seed=42))
    assert skewed > 0.45 > mild > 0.2 > even  # 10 labels: 0.1 would be perfectly even
    assert even < 0.14


def test_shards_give_each_rank_n_label_sorted_shards(digits):
    labels = dataset_labels(digits[0])
    for n in (1, 2):
        parts = split_by_label(labels, f"shards:{n}", 16, seed=42)
        assert sorted(i for part in parts for i in part) == list(range(len(labels)))
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= n  # equal shards, dealt n per rank
        for part in parts:
            held = sum(1 for c in label_histogram(labels, part) if c)
            # a shard of <= 90 samples covers one label (~144 samples each), or two where
            # it straddles a boundary
            assert held <= 2 * n
    one_each = split_by_label(labels, "shards:1", 16, seed=42)
    assert top_label_share(labels, one_each) > 0.7
    with pytest.raises(ValueError, match="needs 16 shards"):
        split_by_label(labels[:10], "shards:2", 8, seed=0)


class PairSamples(Dataset):
    def __init__(self, labels):
        self.y = labels

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.zeros(2), self.y[i]


class DictSamples(PairSamples):
    def __getitem__(self, i):
        return {"x": torch.zeros(2), "label": torch.tensor(self.y[i])}


class Unlabelled(PairSamples):
    def __getitem__(self, i):
        return torch.zeros(2)


def test_labels_are_found_where_datasets_keep_them():
    y = [3, 1, 2, 1]
    with_targets = PairSamples(y)
    with_targets.targets = torch.tensor(y)
    tensors = TensorDataset(torch.zeros(4, 2), torch.tensor(y))
    for dataset in (with_targets, tensors, PairSamples(y), DictSamples(y)):
        assert dataset_labels(dataset).tolist() == y
    assert dataset_labels(Subset(tensors, [3, 0])).tolist() == [1, 3]
    with pytest.raises(ValueError, match="has none: give the dataset a `targets` attribute"):
        dataset_labels(Unlabelled(y))
    # float "labels" (a regression target) are not labels
    with pytest.raises(ValueError, match="has none"):
        dataset_labels(TensorDataset(torch.zeros(4, 2), torch.rand(4)))


def test_a_rank_reads_only_its_part_reshuffled_every_epoch(digits):
    train = digits[0]
    labels = dataset_labels(train)
    parts = split_by_label(labels, "shards:1", 4, seed=3)
    stream = MinibatchStream(train, 45, rank=2, num_nodes=4, shard=True, shuffle=True, seed=3,
                             partition="shards:1")
    assert stream.labels_held == label_histogram(labels, parts[2])
    assert stream.batches_per_epoch() == -(-len(parts[2]) // 45)
    epochs = []
    for _ in range(2):
        seen = []
        for _ in range(stream.batches_per_epoch()):
            seen += next(stream)[1].tolist()
        epochs.append(seen)
    expected = sorted(labels[parts[2]].tolist())
    assert sorted(epochs[0]) == expected and sorted(epochs[1]) == expected
    assert epochs[0] != epochs[1]


@pytest.mark.slow
def test_fit_trains_on_label_skewed_shards_and_reports_each_ranks_labels(digits, tmp_path):
    train, val = digits
    trainer = Trainer(DigitsMLP(), train, val)
    trainer.fit(strategy=DiLoCoStrategy(H=2), num_nodes=3, max_steps=4, batch_size=8,
                val_size=32, partition="dirichlet:0.3", progress=False, logger="csv",
                log_dir=str(tmp_path), run_name="skewed")
    labels = dataset_labels(train)
    parts = split_by_label(labels, "dirichlet:0.3", 3, seed=42)  # fit's default seed
    expected = {str(r): label_histogram(labels, parts[r]) for r in range(3)}
    assert trainer.summary["label_histogram"] == expected
    saved = json.loads((tmp_path / "skewed" / "summary.json").read_text())
    assert saved["label_histogram"] == expected
    assert trainer.summary["steps"] == 4


def test_a_factory_cannot_be_partitioned(digits):
    train, val = digits

    def factory(rank, num_nodes, is_train):
        return train if is_train else val

    with pytest.raises(ValueError, match="factory"):
        Trainer(DigitsMLP(), factory, factory).fit(strategy=DiLoCoStrategy(H=2), num_nodes=2,
                                                   max_steps=1, partition="shards:1",
                                                   progress=False, logger=None)


@pytest.mark.parametrize("n", [1, 7, 100, 2000])
@pytest.mark.parametrize("ranks", [1, 3, 8, 128])
def test_iid_shards_are_the_distributed_samplers(n, ranks):
    from torch.utils.data import DistributedSampler

    from exogym.data.loading import shard_indices

    for shuffle in (True, False):
        for epoch in (0, 3):
            for rank in sorted({0, ranks // 2, ranks - 1}):
                sampler = DistributedSampler(range(n), num_replicas=ranks, rank=rank,
                                             shuffle=shuffle, seed=42)
                sampler.set_epoch(epoch)
                assert shard_indices(n, ranks, rank, shuffle, 42, epoch) == list(sampler)


def test_ranks_in_turn_through_many_epochs_draw_each_epochs_permutation_once(monkeypatch):
    """512 ranks of a packed process, each starting an epoch every step in its turn (its
    share of the data smaller than a batch), as K=1024 runs: one permutation of the data
    per epoch for them all, not one per rank and epoch."""
    from exogym.data import loading

    drawn = []
    randperm = torch.randperm

    def counted(*args, **kwargs):
        drawn.append(args[0])
        return randperm(*args, **kwargs)

    monkeypatch.setattr(torch, "randperm", counted)
    monkeypatch.setattr(loading, "_permutations", type(loading._permutations)())
    monkeypatch.setattr(loading, "_permutations_bytes", 0)
    for rank in range(512):
        for epoch in range(20):
            loading.shard_indices(20_000, 1024, rank, True, 42, epoch)
    assert drawn == [20_000] * 20
    kept = sum(t.numel() * t.element_size() for t in loading._permutations.values())
    assert kept == loading._permutations_bytes == 20 * 20_000 * 4  # int32
    assert kept <= loading.PERMUTATIONS_KEPT_BYTES


def test_a_plain_tensor_datasets_evaluation_batches_are_the_dataloaders():
    """Evaluation gathers a TensorDataset's minibatches a tensor at a time (a DataLoader
    fetched and stacked 64 samples one by one, for each of a thousand packed ranks)."""
    from torch.utils.data import DataLoader

    from exogym.data.loading import eval_loader, validation_subset

    data = TensorDataset(torch.randn(100, 3), torch.arange(100))
    picked = validation_subset(data, 37, 42)
    assert picked == torch.randperm(100, generator=torch.Generator().manual_seed(42))[:37].tolist()
    fast = eval_loader(data, picked, 8)
    slow = DataLoader(data, batch_size=8, sampler=picked)
    for _ in range(2):  # again and again, as each evaluation iterates it
        got, want = list(fast), list(slow)
        assert len(got) == len(want) == len(fast) == 5
        assert all(type(g) is type(w) and all(torch.equal(a, b) for a, b in zip(g, w))
                   for g, w in zip(got, want))
    assert isinstance(eval_loader(data, picked, 8, {"num_workers": 0}), DataLoader)


def test_a_shard_entered_at_its_end_after_ranks_changed_gives_no_empty_minibatch():
    """Resharded over more ranks at the end of an epoch, the new shard's position lies at
    or past its end: the stream goes on in the next epoch, never with a minibatch of no
    samples (a step of NaN loss)."""
    data = TensorDataset(torch.arange(100.0).unsqueeze(1), torch.zeros(100))
    stream = MinibatchStream(data, 10, rank=0, num_nodes=2, shard=True, shuffle=False, seed=0)
    for _ in range(5):  # the whole epoch of 5 minibatches, its end not yet seen
        assert len(next(stream)[0]) == 10
    stream.reshard(0, 4)  # 25 samples each now: 3 minibatches, the position past them
    sizes = [len(next(stream)[0]) for _ in range(4)]
    assert sizes == [10, 10, 5, 10] and stream.epoch == 2  # epoch 1 whole, then the next
