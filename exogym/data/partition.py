"""Non-IID splits of a training set across ranks, by label (``fit(partition=...)``).

- ``'iid'``: no split here; the trainer's ``DistributedSampler`` deals every
  rank an even random shard, reshuffled each epoch (the default).
- ``'dirichlet:ALPHA'``: for every label, its samples are spread over the ranks
  in proportions drawn from Dirichlet(ALPHA) (Hsu et al., 2019). A small ALPHA
  (0.1) gives each rank mostly a few labels; a large one (100) is close to iid.
- ``'shards:N'``: the samples are sorted by label, cut into ``N * num_nodes``
  shards of equal size, and every rank gets ``N`` of them at random
  (McMahan et al., 2017): with ``N = 2`` most ranks see two labels.

Every sample goes to exactly one rank. The split depends only on the labels,
the number of ranks and the run's seed, so every rank computes the same split
on its own: in a simulation and on real hosts alike, nothing is sent. A rank
reads only its part, reshuffled every epoch; ranks may hold parts of different
sizes, and an epoch is then counted on the smallest part (all ranks stop
together).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from exogym.base.plural import plural, plural_noun
from exogym.config.parsers import parse_partition


def dataset_labels(dataset: Dataset) -> torch.Tensor:
    """One integer label per sample of ``dataset``.

    Taken from a ``targets`` or ``labels`` attribute (as torchvision's datasets
    have), the second tensor of a ``TensorDataset``, through a ``Subset``, or
    else from every sample: the second item of an ``(input, label)`` pair, or
    the ``"label"``/``"labels"`` entry of a dict.

    Raises:
        ValueError: the dataset has no labels to split by.
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError("a non-iid partition needs a dataset with len() and indexing, got "
                         f"the iterable {type(dataset).__name__}")
    n = len(dataset)
    for attr in ("targets", "labels"):
        value = getattr(dataset, attr, None)
        if value is not None and not callable(value):
            labels = _as_labels(value)
            if labels is not None and len(labels) == n:
                return labels
    if isinstance(dataset, Subset):
        return dataset_labels(dataset.dataset)[torch.as_tensor(list(dataset.indices),
                                                               dtype=torch.long)]
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) >= 2:
        labels = _as_labels(dataset.tensors[1])
        if labels is not None:
            return labels
    found = []
    for index in range(n):
        sample = dataset[index]
        if isinstance(sample, dict):
            value = sample.get("label", sample.get("labels"))
        elif isinstance(sample, (tuple, list)) and len(sample) >= 2:
            value = sample[1]
        else:
            value = None
        label = _one_label(value)
        if label is None:
            raise ValueError(
                f"a non-iid partition splits by label, but sample {index} of the training "
                f"dataset ({type(dataset).__name__}) has none: give the dataset a `targets` "
                "attribute (one integer class per sample), or samples (input, label) or "
                f"{{'label': ...}}; got {type(sample).__name__}")
        found.append(label)
    return torch.tensor(found, dtype=torch.long)


def _as_labels(value: Any) -> torch.Tensor | None:
    try:
        labels = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    if labels.dim() != 1 or labels.is_floating_point() or labels.is_complex():
        return None
    return labels.long()


def _one_label(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value)
    return None


def dirichlet_partition(labels: Sequence[int] | torch.Tensor, num_clients: int, alpha: float,
                        seed: int = 0) -> list[list[int]]:
    """Split sample indices across clients with label skew drawn from Dirichlet(alpha).

    Smaller ``alpha`` gives each client fewer classes (more non-IID); large alpha
    approaches an even split. Every index lands with exactly one client.

    Args:
        labels: one class label per sample (sequence or tensor of ints).
        num_clients: number of parts.
        alpha: Dirichlet concentration (> 0).
        seed: seed of the draw.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    labels = torch.as_tensor(labels).reshape(-1)
    gen = torch.Generator().manual_seed(seed)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    dirichlet = torch.distributions.Dirichlet(torch.full((num_clients,), float(alpha)))
    for cls in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == cls).reshape(-1)
        idx = idx[torch.randperm(len(idx), generator=gen)]
        # torch.distributions has no generator argument: seed the draw explicitly.
        state = torch.random.get_rng_state()
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        share = dirichlet.sample()
        torch.random.set_rng_state(state)
        cuts = (torch.cumsum(share, 0) * len(idx)).round().long().tolist()[:-1]
        for client, chunk in enumerate(torch.tensor_split(idx, cuts)):
            parts[client].extend(chunk.tolist())
    return parts


def shard_partition(labels: Sequence[int] | torch.Tensor, num_clients: int,
                    shards_per_client: int, seed: int = 0) -> list[list[int]]:
    """Sort by label, cut into ``shards_per_client * num_clients`` equal shards, deal them out.

    Args:
        labels: one class label per sample.
        num_clients: number of parts.
        shards_per_client: shards each part gets.
        seed: seed of the order within a label and of the dealing.
    """
    labels = torch.as_tensor(labels).reshape(-1)
    count = num_clients * shards_per_client
    if count > len(labels):
        raise ValueError(f"partition 'shards:{shards_per_client}' over "
                         f"{plural(num_clients, 'rank')} needs {plural(count, 'shard')}, but the "
                         f"training set has {plural(len(labels), 'sample')}")
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(labels), generator=gen)
    order = order[torch.sort(labels[order], stable=True).indices]
    shards = torch.tensor_split(order, count)
    dealt = torch.randperm(count, generator=gen).tolist()
    return [torch.cat([shards[s] for s in dealt[c * shards_per_client:
                                                 (c + 1) * shards_per_client]]).tolist()
            for c in range(num_clients)]


def split_by_label(labels: torch.Tensor, partition: str, num_nodes: int,
                   seed: int) -> list[list[int]] | None:
    """Every rank's sample indices under ``partition`` (None for ``'iid'``).

    Args:
        labels: one label per sample (:func:`dataset_labels`).
        partition: ``'iid'``, ``'dirichlet:ALPHA'`` or ``'shards:N'``.
        num_nodes: ranks to split over.
        seed: the run's seed.

    Raises:
        ValueError: a rank would get no sample.
    """
    kind, param = parse_partition(partition)
    if kind == "iid":
        return None
    if kind == "dirichlet":
        parts = dirichlet_partition(labels, num_nodes, param, seed)
    else:
        parts = shard_partition(labels, num_nodes, int(param), seed)
    empty = [rank for rank, part in enumerate(parts) if not part]
    if empty:
        raise ValueError(f"partition {partition!r} with seed {seed} leaves "
                         f"{plural_noun(len(empty), 'rank')} "
                         f"{', '.join(map(str, empty))} of {num_nodes} without training data "
                         f"({plural(len(labels), 'sample')}): raise ALPHA, use fewer ranks or another seed")
    return parts


def label_histogram(labels: torch.Tensor, indices: list[int]) -> list[int]:
    """How many of ``indices`` carry each label 0..max(labels)."""
    mine = labels[torch.as_tensor(indices, dtype=torch.long)]
    return torch.bincount(mine, minlength=int(labels.max()) + 1).tolist()
