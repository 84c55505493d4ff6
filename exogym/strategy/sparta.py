"""SPARTA: sparse parameter averaging after every local step.

Algorithm. Every rank trains with its own inner optimizer on its own data.
After every local step, a fraction ``p`` of the entries of each trainable
tensor is replaced, on every rank, by its mean over the ranks:

1. an index selector picks the entries of round ``r`` as a pure function of
   the run's seed, the tensor's position in the model and ``r``
   (a ``torch.Generator`` seeded from those three numbers; never the global
   RNG). Every rank computes the same selection, so no mask or index is sent;
2. the selected values of all tensors travel in ONE bucketed all-reduce;
3. each rank writes the means back into the same entries.

Guarantees:

- after a round, the selected entries are identical on every rank;
- a rank sends exactly ``element_size(comm_dtype)`` bytes per selected entry:
  4 in float32, 2 in bfloat16/float16. The model keeps its own precision;
  only the values on the wire (and hence the means written back) are rounded;
- with ``p = 0`` nothing is sent and the ranks train independently; with
  ``p = 1`` every entry is averaged every step (FedAvg with ``H = 1``);
- per round a tensor of ``n`` entries has ``floor((r+1)·p·n) − floor(r·p·n)``
  entries selected (random and shuffled-sequential selectors), so over ``R``
  rounds exactly ``floor(R·p·n)`` entries are averaged: small tensors such as
  biases are synchronised too, at the same average rate. The partitioned
  selector averages each entry exactly once per ``ceil(1/p)`` rounds;
- the work per round is proportional to the selected entries (index_select
  and index_copy on flat views; random selections are drawn without a full
  permutation when ``p`` is small). Selectors that need a permutation of a
  tensor compute it once (shuffled-sequential) or once per cycle (partitioned);
- selections depend only on (seed, tensor, round), so a run resumed from a
  checkpoint selects exactly what the uninterrupted run would have.

Reference: Beton, Baioumy, van der Ouderaa, Reed, Howes, Cheema, Vrabie, "Improving the
Efficiency of Distributed Training using Sparse Parameter Averaging" (EXO Labs, 2025).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from fractions import Fraction
from typing import Any

import torch

from exogym import comm
from exogym.comm.wire import ModelFacts, Traffic, wire_bytes, wire_collective

from .communicate_optimize_strategy import CommunicateOptimizeStrategy, CommunicationModule
from .context import RankContext
from .optim import OptimSpec
from .settings import SPARTA, SPARTA_DILOCO

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def shared_generator(*numbers: int) -> torch.Generator:
    """A CPU generator seeded from integers; the same numbers give the same stream on every rank.

    The numbers are mixed (splitmix64) so that neighbouring inputs, e.g. rounds
    ``r`` and ``r + 1``, start unrelated streams.
    """
    state = 0
    for n in numbers:
        state = _splitmix64(state ^ (int(n) & _MASK64))
    return torch.Generator().manual_seed(state & ((1 << 63) - 1))


def sample_distinct(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct indices drawn uniformly from ``range(n)``, in O(k log k) when k << n.

    Takes the first ``k`` distinct values of a stream of uniform draws, which
    is a uniform random ``k``-subset; falls back to a permutation when ``k``
    is a large share of ``n`` (then the permutation costs about the same).
    """
    if k <= 0:
        return torch.empty(0, dtype=torch.long)
    if k * 4 >= n:
        return torch.randperm(n, generator=generator)[:k]
    picked = torch.empty(0, dtype=torch.long)
    while picked.numel() < k:
        need = k - picked.numel()
        draws = torch.randint(n, (need + need // 8 + 8,), generator=generator)
        stream = torch.cat([picked, draws])
        uniq, inverse = torch.unique(stream, return_inverse=True)
        first = torch.full((uniq.numel(),), stream.numel(), dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(stream.numel()), reduce="amin")
        picked = stream[first.sort().values][:k]
    return picked


class IndexSelector(ABC):
    """Chooses which entries of each tensor SPARTA averages in a round.

    A selection is a pure function of ``(seed, tensor_index, numel, round_index)``:
    every rank computes the same one, so nothing but the values is sent.
    Subclass it and implement :meth:`indices` for a selection scheme of your own.

    Args:
        p: fraction of each tensor's entries averaged per round, within [0, 1].
    """

    name = "custom"

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if "get_indices" in cls.__dict__ and "indices" not in cls.__dict__:
            raise TypeError(
                f"{cls.__name__} defines get_indices(param, iteration), which returns a mask; "
                "exogym selectors implement indices(seed, tensor_index, numel, round_index) "
                "returning flat indices that every rank derives from the shared seed, so no "
                "mask is ever sent")

    def __init__(self, p: float = SPARTA.p_sparta.default):
        SPARTA.p_sparta.check(p, self, name="p")
        self.p = float(p)
        # Exact arithmetic for the per-round counts: 0.005 means 1/200, not a binary float.
        self._fraction = Fraction(self.p).limit_denominator(1_000_000)

    def count(self, numel: int, round_index: int) -> int:
        """Entries of a tensor of ``numel`` entries selected in ``round_index``.

        ``floor((r+1)·p·n) − floor(r·p·n)``: over ``R`` rounds exactly ``floor(R·p·n)``.
        """
        f = self._fraction * numel
        return math.floor(f * (round_index + 1)) - math.floor(f * round_index)

    @abstractmethod
    def indices(self, seed: int, tensor_index: int, numel: int, round_index: int) -> torch.Tensor:
        """Distinct flat indices (int64, CPU) of the entries averaged in ``round_index``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p})"


class RandomIndexSelector(IndexSelector):
    """A fresh uniform random subset of each tensor every round.

    Args:
        p: fraction of each tensor's entries averaged per round.
    """

    name = "random"

    def indices(self, seed: int, tensor_index: int, numel: int, round_index: int) -> torch.Tensor:
        k = self.count(numel, round_index)
        if k == 0:
            return torch.empty(0, dtype=torch.long)
        return sample_distinct(numel, k, shared_generator(seed, 1, tensor_index, round_index))


class ShuffledSequentialIndexSelector(IndexSelector):
    """Walks through one fixed random permutation of each tensor, a window per round.

    Every entry is averaged once per ``1/p`` rounds (within one round), in an
    order drawn once per tensor from the seed.

    Args:
        p: fraction of each tensor's entries averaged per round.
    """

    name = "shuffled"

    def __init__(self, p: float = SPARTA.p_sparta.default):
        super().__init__(p)
        self._perms: dict[tuple[int, int, int], torch.Tensor] = {}

    def _perm(self, seed: int, tensor_index: int, numel: int) -> torch.Tensor:
        key = (seed, tensor_index, numel)
        perm = self._perms.get(key)
        if perm is None:
            perm = torch.randperm(numel, generator=shared_generator(seed, 2, tensor_index))
            # int32 halves the memory of the cache; slices are widened when used.
            perm = perm.to(torch.int32) if numel < 2**31 else perm
            self._perms[key] = perm
        return perm

    def indices(self, seed: int, tensor_index: int, numel: int, round_index: int) -> torch.Tensor:
        k = self.count(numel, round_index)
        if k == 0:
            return torch.empty(0, dtype=torch.long)
        perm = self._perm(seed, tensor_index, numel)
        start = math.floor(self._fraction * numel * round_index) % numel
        end = start + k
        if end <= numel:
            return perm[start:end].long()
        return torch.cat([perm[start:], perm[:end - numel]]).long()


class PartitionedIndexSelector(IndexSelector):
    """A random partition of each tensor into ``ceil(1/p)`` disjoint parts, one part per round.

    After ``ceil(1/p)`` rounds every entry has been averaged exactly once; the
    next cycle uses a new random partition. A round averages ``1/ceil(1/p)`` of
    the entries (at most ``p``).

    Args:
        p: fraction of each tensor's entries averaged per round (> 0 selects anything).
    """

    name = "partitioned"

    def __init__(self, p: float = SPARTA.p_sparta.default):
        super().__init__(p)
        self.parts = math.ceil(1 / self._fraction) if self._fraction > 0 else 0
        self._cycle: dict[tuple[int, int, int], tuple[int, torch.Tensor]] = {}

    def count(self, numel: int, round_index: int) -> int:
        if self.parts == 0:
            return 0
        part = round_index % self.parts
        return (part + 1) * numel // self.parts - part * numel // self.parts

    def indices(self, seed: int, tensor_index: int, numel: int, round_index: int) -> torch.Tensor:
        if self.parts == 0 or numel == 0:
            return torch.empty(0, dtype=torch.long)
        cycle, part = divmod(round_index, self.parts)
        key = (seed, tensor_index, numel)
        cached = self._cycle.get(key)
        if cached is None or cached[0] != cycle:
            perm = torch.randperm(numel, generator=shared_generator(seed, 3, tensor_index, cycle))
            cached = (cycle, perm.to(torch.int32) if numel < 2**31 else perm)
            self._cycle[key] = cached
        start = part * numel // self.parts
        end = (part + 1) * numel // self.parts
        return cached[1][start:end].long()


SELECTORS: dict[str, type[IndexSelector]] = {
    "random": RandomIndexSelector,
    "shuffled": ShuffledSequentialIndexSelector,
    "partitioned": PartitionedIndexSelector,
}


def make_selector(index_selector: str | IndexSelector, p: float | None,
                  owner: object) -> IndexSelector:
    """An index selector from a name (with fraction ``p``, None: the default) or an instance;
    ``owner`` (the strategy given them) is named in errors."""
    if p is not None:
        SPARTA.p_sparta.check(p, owner)
    if isinstance(index_selector, IndexSelector):
        if p is not None and float(p) != index_selector.p:
            raise ValueError(
                f"p_sparta={p} disagrees with the index selector's p={index_selector.p}; "
                "give the fraction in one place")
        return index_selector
    SPARTA.index_selector.check(index_selector, owner)
    return SELECTORS[index_selector.lower()](SPARTA.p_sparta.default if p is None else p)


class SparseCommunicator(CommunicationModule):
    """Average the selected entries of every trainable tensor over the ranks.

    Usable on its own in a :class:`CommunicateOptimizeStrategy` (its ``seed``
    is read from the owning strategy).

    Args:
        index_selector: which entries a round averages (an :class:`IndexSelector`).
        comm_dtype: type the values travel in (``'float32'``, ``'bfloat16'``, ``'float16'``).
        interval: average after every ``interval``-th local step (default every step).
            Round ``r`` is the ``r``-th averaging, so the selectors' guarantees
            hold per round.
    """

    def __init__(self, index_selector: IndexSelector,
                 comm_dtype: str = SPARTA.comm_dtype.default,
                 interval: int = SPARTA_DILOCO.sparta_interval.default):
        super().__init__()
        if not isinstance(index_selector, IndexSelector):
            raise TypeError(f"SparseCommunicator takes an IndexSelector instance as "
                            f"index_selector (make_selector turns a name into one), "
                            f"got {index_selector!r}")
        SPARTA_DILOCO.sparta_interval.check(interval, self, name="interval")
        SPARTA.comm_dtype.check(comm_dtype, self)
        comm.resolve_dtype(comm_dtype)
        self.index_selector = index_selector
        self.comm_dtype = comm_dtype
        self.interval = interval

    def setup(self, context: RankContext) -> None:
        super().setup(context)
        model = context.model
        self.params = [p for p in model.parameters() if p.requires_grad]

    def selection(self, round_index: int) -> list[torch.Tensor]:
        """The flat indices of every trainable tensor averaged in ``round_index``."""
        seed = self.strategy.seed if self.strategy is not None else 0
        return [self.index_selector.indices(seed, i, p.numel(), round_index)
                for i, p in enumerate(self.params)]

    @torch.no_grad()
    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int,
                    local_step: int) -> None:
        if (local_step + 1) % self.interval != 0 or num_nodes == 1:
            return
        round_index = (local_step + 1) // self.interval - 1
        picks = []
        for param, idx in zip(self.params, self.selection(round_index)):
            if idx.numel():
                picks.append((param, idx.to(param.device)))
        if not picks:
            return
        values = [_flat(p).index_select(0, idx) for p, idx in picks]
        self.collectives.all_reduce_tensors(values, average=True, dtype=self.comm_dtype)
        for (param, idx), mean in zip(picks, values):
            if param.data.is_contiguous():
                param.data.view(-1).index_copy_(0, idx, mean)
            else:  # e.g. channels_last: write through a contiguous copy
                flat = param.data.reshape(-1).index_copy(0, idx, mean)
                param.data.copy_(flat.view(param.shape))


def _flat(param: torch.Tensor) -> torch.Tensor:
    data = param.data
    return data.view(-1) if data.is_contiguous() else data.reshape(-1)


class SPARTAStrategy(CommunicateOptimizeStrategy):
    """SPARTA: local inner-optimizer steps, each followed by averaging a fraction of every tensor.

    Args:
        optim_spec: the inner optimizer (default AdamW); ``inner_optim=`` is the same.
        p_sparta: fraction of each tensor's entries averaged per step (None: the selector's
            ``p`` when it is an instance, else the default).
        index_selector: ``'random'``, ``'shuffled'``, ``'partitioned'``, or an
            :class:`IndexSelector` instance (then its ``p`` is used).
        comm_dtype: type the values travel in (``'float32'``, ``'bfloat16'``, ``'float16'``,
            or quantized).
        **kwargs: optimizer, schedule and clipping arguments of ``Strategy``.

    Defaults and accepted values: :data:`exogym.strategy.settings.SPARTA` (the settings
    table in ``docs/strategies.md``).
    """

    stackable = True

    def __init__(
        self,
        optim_spec: OptimSpec | str | None = None,
        p_sparta: float | None = None,
        index_selector: str | IndexSelector = SPARTA.index_selector.default,
        comm_dtype: str = SPARTA.comm_dtype.default,
        **kwargs: Any,
    ):
        SPARTA.check(self, comm_dtype=comm_dtype)
        selector = make_selector(index_selector, p_sparta, self)
        self.p_sparta = selector.p
        self.index_selector = selector
        self.comm_dtype = comm_dtype
        self.sparta = SparseCommunicator(selector, comm_dtype)
        super().__init__(communication_modules=[self.sparta], optim_spec=optim_spec, **kwargs)

    def traffic(self, model: ModelFacts, num_nodes: int) -> list[Traffic]:
        """A fraction ``p_sparta`` of every tensor averaged every step (indices are never sent)."""
        return [Traffic(wire_collective(self.comm_dtype),
                        wire_bytes(self.p_sparta * model.num_params, self.comm_dtype))]

    def __config__(self) -> dict[str, Any]:
        config = super().__config__()
        config.update(p_sparta=self.p_sparta, index_selector=type(self.index_selector).__name__)
        return config
