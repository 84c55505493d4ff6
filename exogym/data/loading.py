"""Data for one rank: shards, endless minibatch streams, the validation subset.

A dataset given to the trainer is sharded across ranks with a
``DistributedSampler`` (reshuffled every epoch via ``set_epoch``). A factory
``f(rank, num_nodes, is_train) -> Dataset`` builds each rank's own dataset
instead (no sampler, shuffled per rank). The stream keeps its position
(epoch, minibatches taken) so a checkpoint can resume exactly where it was.
Under ``fit(balance='batch')`` a rank's samples per step change with its
speed (:meth:`MinibatchStream.set_step_samples`); the position is then kept
in samples.
"""

from __future__ import annotations

import collections
import math
import numbers
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    TensorDataset,
    default_collate,
)

DatasetOrFactory = Any  # a Dataset, or f(rank, num_nodes, is_train) -> Dataset

def is_factory(obj: Any) -> bool:
    """True for a dataset factory: a callable that is not itself a dataset."""
    return callable(obj) and not isinstance(obj, Dataset)

def build_dataset(source: DatasetOrFactory, rank: int, num_nodes: int, is_train: bool):
    """The dataset this rank reads: ``source`` itself, or what the factory returns."""
    if not is_factory(source):
        return source
    dataset = source(rank, num_nodes, is_train)
    if dataset is None:
        kind = "train" if is_train else "validation"
        raise ValueError(f"the {kind} dataset factory returned None for rank {rank}")
    return dataset

def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    return batch

def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch: the leading size of its first tensor (a dict's first
    entry that holds one), else the length of its first list (a column of strings)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        values = list(batch.values())
        held = [v for v in values if _holds_tensor(v)]
        return batch_size_of((held or values or [None])[0])
    if isinstance(batch, (list, tuple)) and batch:
        if _holds_tensor(batch[0]) or isinstance(batch[0], (list, tuple, Mapping)):
            return batch_size_of(batch[0])
        return len(batch)  # a column of plain values (strings), one per sample
    return 1


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _numbers(value: Any) -> bool:
    """True for a list (or tuple) of numbers, or of such lists: a column torch can hold."""
    if not isinstance(value, (list, tuple)) or not value:
        return False
    first = value[0]
    if isinstance(first, (list, tuple)):
        return _numbers(first)
    return isinstance(first, numbers.Number)


def _lengths(values: list[Any]) -> list[int]:
    return sorted({len(v) if not isinstance(v, torch.Tensor) else tuple(v.shape)  # type: ignore[misc]
                   for v in values}, key=str)


def _column(name: str, values: list[Any]) -> Any:
    """One entry of a batch of dicts: ``values`` (one per sample) collated."""
    if _numbers(values[0]):
        try:
            return torch.tensor(values)
        except (ValueError, TypeError):  # ragged: samples of different lengths
            shapes = _lengths(values)
            raise ValueError(
                f"the samples' {name!r} have different lengths ({', '.join(map(str, shapes))})"
                " and cannot be stacked into one batch: pad or cut them to one length when "
                "building the dataset, or give fit dataloader_kwargs={'collate_fn': ...} "
                "that pads them (e.g. transformers' DataCollatorWithPadding)") from None
    if isinstance(values[0], torch.Tensor) and \
            any(v.shape != values[0].shape for v in values if isinstance(v, torch.Tensor)):
        raise ValueError(
            f"the samples' {name!r} have different shapes ({', '.join(map(str, _lengths(values)))})"
            " and cannot be stacked into one batch: pad or cut them to one shape when "
            "building the dataset, or give fit dataloader_kwargs={'collate_fn': ...} that "
            "pads them")
    return default_collate(values)


def collate_samples(samples: list[Any]) -> Any:
    """The default collate of every loader: torch's, except that samples that are dicts
    (a Hugging Face ``datasets.Dataset``, a list of dicts, a Dataset returning dicts)
    give a dict with one batch per key, lists of numbers becoming tensors (torch's own
    would give a list of tensors, one per position), strings a list.

    Raises:
        ValueError: the samples' keys differ, or an entry's lengths differ (naming them).
    """
    if not samples or not isinstance(samples[0], Mapping):
        return default_collate(samples)
    keys = list(samples[0])
    for index, sample in enumerate(samples[1:], 1):
        if not isinstance(sample, Mapping) or list(sample) != keys:
            theirs = list(sample) if isinstance(sample, Mapping) else type(sample).__name__
            raise ValueError(f"the samples of one batch differ: the first has keys {keys}, "
                             f"sample {index} of the batch {theirs}; give every sample the "
                             "same keys")
    return {key: _column(key, [sample[key] for sample in samples]) for key in keys}

def shard_length(dataset: Dataset, num_nodes: int) -> int:
    """Samples each rank sees per epoch under a DistributedSampler (it pads evenly)."""
    return math.ceil(len(dataset) / num_nodes)

class MinibatchStream:
    """An endless, resumable stream of minibatches for one rank.

    Args:
        dataset: this rank's dataset (the shared one when ``shard`` is True).
        minibatch_size: samples per minibatch.
        rank, num_nodes: this rank and the number of ranks.
        shard: split ``dataset`` across ranks with a DistributedSampler.
        shuffle: reshuffle every epoch (seeded, so every run sees the same order).
        seed: the run's seed.
        dataloader_kwargs: extra DataLoader arguments (``collate_fn``, ``num_workers``, ...).
        partition: how a sharded ``dataset`` is split (:mod:`exogym.data.partition`): ``'iid'``
            (a DistributedSampler's even random shards) or a split by label.
    """

    def __init__(self, dataset: Dataset, minibatch_size: int, rank: int, num_nodes: int,
                 shard: bool, shuffle: bool, seed: int,
                 dataloader_kwargs: dict[str, Any] | None = None, partition: str = "iid"):
        self.dataset = dataset
        self.minibatch_size = minibatch_size
        self.rank = rank
        self.num_nodes = num_nodes
        self.shard = shard
        self.shuffle = shuffle
        self.seed = seed
        self.loader_kwargs = loader_kwargs(dataset, dataloader_kwargs)
        self.iterable = isinstance(dataset, IterableDataset)
        self.epoch = 0
        self.taken = 0  # minibatches taken in the current epoch
        self._iter: Iterator | None = None
        self.step_samples: int | None = None  # samples per step (set_step_samples)
        self.position = 0  # with step_samples: samples handed out in the current epoch
        self.last_size = 0  # with step_samples: samples in the minibatch last handed out
        self._step_taken = 0  # with step_samples: samples of the current step handed out
        self._sizes: deque[int] = deque()  # sizes of the minibatches still to come
        self.part: list[int] | None = None  # this rank's indices under a split by label
        self.labels_held: list[int] | None = None  # how many of each label it holds
        self.labels_by_rank: list[list[int]] | None = None  # the same for every rank
        self._places: tuple[tuple[int, int, int], torch.Tensor] | None = None  # shard_places
        if shard and partition != "iid" and not self.iterable:
            # a split by label only when asked for one (iid runs never load it)
            from exogym.data.partition import dataset_labels, label_histogram, split_by_label

            labels = dataset_labels(dataset)
            parts = split_by_label(labels, partition, num_nodes, seed)
            self.part = parts[rank]
            self.labels_by_rank = [label_histogram(labels, part) for part in parts]
            self.labels_held = self.labels_by_rank[rank]

    def batches_per_epoch(self) -> int | None:
        """Minibatches in one epoch of this rank's data (None for an iterable dataset)."""
        if self.iterable:
            return None
        if self.part is not None:
            n = len(self.part)
        elif self.shard:
            n = shard_length(self.dataset, self.num_nodes)
        else:
            n = len(self.dataset)
        return math.ceil(n / self.minibatch_size)

    def _indices(self, epoch: int) -> list[int]:
        if self.part is not None:
            if not self.shuffle:
                return self.part
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 7919 + epoch)
            return [self.part[i] for i in torch.randperm(len(self.part), generator=gen).tolist()]
        if self.shard:
            return shard_indices(len(self.dataset), self.num_nodes, self.rank, self.shuffle,
                                 self.seed, epoch)
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 7919 + epoch)
            return torch.randperm(len(self.dataset), generator=gen).tolist()
        return list(range(len(self.dataset)))

    def _shard_order(self, epoch: int) -> torch.Tensor:
        """:func:`shard_indices` of this rank in ``epoch``, as a tensor of indices."""
        n = len(self.dataset)
        key = (n, self.num_nodes, self.rank)
        if self._places is None or self._places[0] != key:
            self._places = (key, shard_places(n, self.num_nodes, self.rank))
        places = self._places[1]
        return _permutation(n, self.seed + epoch)[places] if self.shuffle else places

    def _start_epoch(self) -> None:
        if self.iterable:
            loader = DataLoader(self.dataset, batch_size=self.minibatch_size,
                                **_with_generator(self.loader_kwargs, self.seed + self.epoch))
            it = iter(loader)
            for _ in range(self.taken):
                next(it)
        elif self.step_samples is not None:
            self._start_steps()
            return
        else:
            fast = type(self.dataset) is TensorDataset and not self.loader_kwargs
            if fast and self.shard and self.part is None:
                # the shard as a tensor: a rank whose share is smaller than its batch starts
                # an epoch every step, and each conversion costs it (1024 ranks did).
                order = self._shard_order(self.epoch)[self.taken * self.minibatch_size:]
                self._iter = _tensor_batches(self.dataset, order, self.minibatch_size)
                return
            indices = self._indices(self.epoch)[self.taken * self.minibatch_size:]
            if fast:
                self._iter = _tensor_batches(self.dataset, indices, self.minibatch_size)
                return
            loader = DataLoader(self.dataset, batch_size=self.minibatch_size, sampler=indices,
                                **_with_generator(self.loader_kwargs, self.seed + self.epoch))
            it = iter(loader)
        self._iter = it

    def _start_steps(self) -> None:
        """Go on through this epoch in minibatches that end where each step's
        ``step_samples`` end (and at the end of the epoch)."""
        indices = self._indices(self.epoch)[self.position:]
        chunks: list[list[int]] = []
        start, need = 0, self.step_samples - self._step_taken
        while start < len(indices):
            size = min(self.minibatch_size, need, len(indices) - start)
            chunks.append(indices[start:start + size])
            start += size
            need -= size
            if need == 0:
                need = self.step_samples
        self._sizes = deque(len(chunk) for chunk in chunks)
        if type(self.dataset) is TensorDataset and not self.loader_kwargs:
            self._iter = _tensor_chunks(self.dataset, chunks)
            return
        kwargs = {k: v for k, v in self.loader_kwargs.items() if k != "drop_last"}
        self._iter = iter(DataLoader(self.dataset, batch_sampler=chunks,
                                     **_with_generator(kwargs, self.seed + self.epoch)))

    def set_step_samples(self, samples: int) -> None:
        """Hand out ``samples`` samples per step from now on (``fit(balance='batch')``,
        :mod:`exogym.run.balance`); call between steps.

        A step's samples come in minibatches of at most ``minibatch_size``: the
        last may be smaller, and so is one cut by the end of an epoch (the step
        then goes on in the next epoch, so it always gets ``samples``).
        ``drop_last`` in ``dataloader_kwargs`` does not apply. The position is
        kept in samples, so a checkpoint resumes at the same sample whatever the
        step's size.

        Raises:
            ValueError: the dataset is iterable (it streams fixed minibatches).
        """
        if self.iterable:
            raise ValueError("balance='batch' needs a training dataset with len() and indexing: "
                             f"rank {self.rank}'s is an IterableDataset, which streams fixed "
                             "minibatches; use a map-style Dataset or balance='none'")
        if samples == self.step_samples:
            return
        if self.step_samples is None:  # from fixed minibatches, at a step's end
            self.position = self.taken * self.minibatch_size
        self.step_samples = samples
        self._step_taken = 0
        self._iter = None

    def __iter__(self) -> MinibatchStream:
        return self

    def __next__(self) -> Any:
        for _ in range(2):
            if self._iter is None:
                self._start_epoch()
            try:
                batch = next(self._iter)
            except StopIteration:
                self._iter = None
                self.epoch += 1
                self.taken = 0
                self.position = 0
                continue
            self.taken += 1
            if self.step_samples is not None:
                self.last_size = self._sizes.popleft()
                self.position += self.last_size
                self._step_taken = (self._step_taken + self.last_size) % self.step_samples
            return batch
        raise ValueError(
            f"rank {self.rank}'s training data is empty: no minibatch in a whole epoch"
        )

    def reshard(self, index: int, count: int) -> None:
        """Read shard ``index`` of ``count`` from now on (ranks that come and go).

        The epoch goes on: the new shard is entered at the fraction of an epoch
        the old one had reached, so samples near the change may be seen twice or
        skipped in that epoch; the next epoch is whole. A split by label, a
        dataset that is not sharded (a factory) and an iterable dataset keep
        what they read.
        """
        if (index, count) == (self.rank, self.num_nodes) or not self.shard \
                or self.part is not None or self.iterable:
            return
        done = self.taken / max(1, self.batches_per_epoch() or 1)
        self.rank, self.num_nodes = index, count
        self.taken = int(done * (self.batches_per_epoch() or 1))
        self._iter = None

    def state(self) -> dict[str, int]:
        """Position to resume from (with ``step_samples``, in samples too)."""
        state = {"epoch": self.epoch, "taken": self.taken}
        if self.step_samples is not None:
            state["position"] = self.position
        return state

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a position returned by :meth:`state`.

        A position in samples read without ``step_samples`` continues at the
        next whole minibatch.
        """
        self.epoch = int(state["epoch"])
        self.taken = int(state["taken"])
        self.position = int(state.get("position", self.taken * self.minibatch_size))
        if "position" in state and self.step_samples is None:
            self.taken = -(-self.position // self.minibatch_size)
        self._step_taken = 0
        self._iter = None

#: Bytes of the epochs' permutations a process keeps for its ranks (:func:`shard_indices`).
PERMUTATIONS_KEPT_BYTES = 32 << 20

_permutations: collections.OrderedDict[tuple[int, int], torch.Tensor] = collections.OrderedDict()
_permutations_lock = threading.Lock()
_permutations_bytes = 0  # what they hold


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _permutation(n: int, seed: int) -> torch.Tensor:
    """``torch.randperm(n)`` seeded with ``seed``, shared by the ranks a process runs.

    The most recent permutations are kept, up to :data:`PERMUTATIONS_KEPT_BYTES` (at
    least one), in the smallest integer type that holds ``n``: ranks packed in a
    process (:mod:`exogym.comm.packed`) each run many steps in their turn, and a rank
    whose share of the data is smaller than a step's batch starts an epoch every step,
    so a process of 512 such ranks went through one epoch after another 512 times over
    (eight epochs kept by number drew each permutation again for every rank).
    """
    global _permutations_bytes
    key = (n, seed)
    with _permutations_lock:
        order = _permutations.get(key)
        if order is not None:
            _permutations.move_to_end(key)
            return order
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    if n <= torch.iinfo(torch.int32).max:
        order = order.to(torch.int32)
    with _permutations_lock:
        if key not in _permutations:
            _permutations[key] = order
            _permutations_bytes += _nbytes(order)
            while len(_permutations) > 1 and _permutations_bytes > PERMUTATIONS_KEPT_BYTES:
                _, dropped = _permutations.popitem(last=False)
                _permutations_bytes -= _nbytes(dropped)
        return _permutations[key]


def shard_places(n: int, num_replicas: int, rank: int) -> torch.Tensor:
    """The places in an epoch's order of ``n`` samples that ``DistributedSampler
    (drop_last=False)`` gives ``rank``: every ``num_replicas``-th from ``rank``, the order
    padded by repeating it from its start (place i of the padded order is i % n)."""
    total = -(-n // num_replicas) * num_replicas
    places = torch.arange(rank, total, num_replicas)
    if total > n:
        places %= n
    return places


def shard_indices(n: int, num_replicas: int, rank: int, shuffle: bool, seed: int,
                  epoch: int) -> list[int]:
    """The indices ``DistributedSampler(drop_last=False)`` gives ``rank`` in ``epoch``.

    The same list, computed from one permutation of the dataset per epoch that
    the ranks of a process share (each rank would otherwise draw and convert
    the whole permutation, a cost that grows with the number of ranks).
    """
    places = shard_places(n, num_replicas, rank)
    if not shuffle:
        return places.tolist()
    return _permutation(n, seed + epoch)[places].tolist()


def _tensor_batches(dataset: TensorDataset, indices: list[int] | torch.Tensor,
                    minibatch_size: int) -> Iterator[list[torch.Tensor]]:
    """Minibatches of a plain TensorDataset, each gathered by one indexing per tensor.

    The same list of stacked tensors a DataLoader with the default collate gives,
    without fetching and stacking one sample at a time.
    """
    if not len(indices):  # split() would give one empty minibatch: a step of no samples
        return
    order = indices if isinstance(indices, torch.Tensor) else \
        torch.as_tensor(indices, dtype=torch.long)
    for chunk in (order,) if len(order) <= minibatch_size else order.split(minibatch_size):
        # index_select on dim 0 is t[chunk], without advanced indexing's general machinery.
        yield [t.index_select(0, chunk) for t in dataset.tensors]


def _tensor_chunks(dataset: TensorDataset,
                   chunks: list[list[int]]) -> Iterator[list[torch.Tensor]]:
    """Minibatches of a plain TensorDataset, one per list of indices in ``chunks``."""
    for chunk in chunks:
        index = torch.as_tensor(chunk, dtype=torch.long)
        yield [t.index_select(0, index) for t in dataset.tensors]


def validation_subset(dataset: Dataset, val_size: int, seed: int) -> list[int]:
    """A fixed random subset of ``val_size`` indices, the same at every evaluation."""
    if isinstance(dataset, IterableDataset):
        raise TypeError("the validation dataset must support len() and indexing")
    n = len(dataset)
    # torch.randperm(n) seeded with ``seed``, drawn once for the ranks of a process
    return _permutation(n, seed)[: min(val_size, n)].tolist()

def loader_kwargs(dataset: Any, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """DataLoader arguments: ``kwargs``, plus the dataset's own ``collate_fn`` if it has one.

    A dataset whose samples need a special collate (e.g. speech with labels of
    different lengths) can carry it, so a profile needs no code to name it.
    """
    kwargs = dict(kwargs or {})
    own = getattr(dataset, "collate_fn", None)
    if "collate_fn" not in kwargs and callable(own):
        kwargs["collate_fn"] = own
    return kwargs


def _collated(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with :func:`collate_samples` as the collate unless one is given."""
    return kwargs if kwargs.get("collate_fn") is not None else \
        {**kwargs, "collate_fn": collate_samples}


def data_loader(dataset: Any, kwargs: dict[str, Any] | None, **given: Any) -> DataLoader:
    """A DataLoader over ``dataset`` with ``kwargs`` (:func:`loader_kwargs`: the dataset's
    own collate, else :func:`collate_samples`) and ``given``."""
    return DataLoader(dataset, **given, **_collated(loader_kwargs(dataset, kwargs)))


def _with_generator(kwargs: dict[str, Any], seed: int) -> dict[str, Any]:
    # A DataLoader draws its workers' base seed from the global RNG unless it has a
    # generator of its own; giving it one keeps the training RNG (dropout, ...)
    # independent of how often loaders are created, so a resumed run matches.
    kwargs = _collated(kwargs)
    if "generator" in kwargs:
        return kwargs
    return {**kwargs, "generator": torch.Generator().manual_seed(seed)}


class _TensorBatchLoader:
    """The minibatches of ``indices`` of a plain TensorDataset, in order, each time it is
    iterated: what a DataLoader with the default collate gives, gathered by one indexing
    per tensor (:func:`_tensor_batches`) instead of sample by sample."""

    def __init__(self, dataset: TensorDataset, indices: list[int], minibatch_size: int):
        self.dataset = dataset
        self.indices = indices
        self.minibatch_size = minibatch_size

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        return _tensor_batches(self.dataset, self.indices, self.minibatch_size)

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.minibatch_size)


def eval_loader(dataset: Dataset, indices: list[int], minibatch_size: int,
                dataloader_kwargs: dict[str, Any] | None = None
                ) -> DataLoader | _TensorBatchLoader:
    """A DataLoader over ``indices`` of ``dataset`` in order (for a plain TensorDataset with
    no loader arguments, the same minibatches gathered a tensor at a time)."""
    kwargs = {k: v for k, v in loader_kwargs(dataset, dataloader_kwargs).items() if k != "shuffle"}
    if type(dataset) is TensorDataset and not kwargs:
        return _TensorBatchLoader(dataset, indices, minibatch_size)
    return DataLoader(dataset, batch_size=minibatch_size, sampler=indices,
                      **_with_generator(kwargs, 0))
