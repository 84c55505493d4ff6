"""What a strategy is set up with on one rank: :class:`RankContext`.

The trainer builds one per rank and hands it to :meth:`Strategy.setup
<exogym.strategy.strategy.Strategy.setup>`; the strategy reads everything it
knows about its rank from it, never from the trainer or from process-wide
state:

- the rank's model, its rank and the number of ranks;
- the run's length, its seed and the samples each rank trains a step;
- :class:`RankCollectives`, the collectives bound to this rank (a packed rank's
  identity comes with them: nothing in torch is replaced for a built-in strategy);
- :class:`MembershipView`, the ranks present at this rank's step (ranks that
  leave and rejoin, hosts that come and go);
- the simulated clock, when the run has one;
- :meth:`RankContext.held_once`: state every rank of a process holds the same,
  kept once for them all (DiLoCo's outer parameters).

A context for one rank alone (:meth:`RankContext.alone`) is what a strategy gets
when it is set up outside a run, e.g. by ``_init_node`` called directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from exogym import comm

__all__ = ["MembershipView", "RankCollectives", "RankContext"]


class RankCollectives:
    """The collectives one rank calls: what :mod:`exogym.comm` carries for this process,
    bound to the calling rank (threads of a packed process each get their own answers).

    Every method counts the bytes it sends, as :mod:`exogym.comm`'s functions of the same
    names do (their arguments are the same).
    """

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None) -> Any:
        """Sum (or ``op``) ``tensor`` across the ranks of ``group``, in place."""
        return comm.all_reduce(tensor, op=op, group=group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, group: Any = None) -> Any:
        """Copy rank ``src``'s ``tensor`` to every rank of ``group``, in place."""
        return comm.broadcast(tensor, src=src, group=group)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                   group: Any = None) -> Any:
        """Every rank's ``tensor`` into ``tensor_list``, in rank order."""
        return comm.all_gather(tensor_list, tensor, group=group)

    def all_reduce_tensors(self, tensors: Sequence[torch.Tensor], **kwargs: Any) -> Any:
        """Many tensors in one bucketed call (see :func:`exogym.comm.all_reduce_tensors`:
        ``average``, ``group``, ``dtype``, ``residuals``, ...)."""
        return comm.all_reduce_tensors(tensors, **kwargs)

    def new_group(self, ranks: Sequence[int]) -> Any:
        """A group of ``ranks`` (collective: every rank makes every group, in order)."""
        return comm.new_group(ranks)

    def group_size(self, group: Any = None) -> int:
        """Ranks in ``group`` (default: the world); 1 outside a process group."""
        return comm.group_size(group)

    def side_all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        """An all-reduce on the uncounted side channel (agreements, not training traffic)."""
        comm.side_all_reduce(tensor, op=op)

    @property
    def active(self) -> bool:
        """True when the rank has peers to talk to (False: a world of one)."""
        return comm.is_initialized()


class MembershipView:
    """The ranks present at this rank's step: every rank, unless some are away
    (``rank_failures`` in a simulation, hosts that come and go)."""

    def present(self, group: Any = None) -> list[int]:
        """The ranks of ``group`` (default: the world) present at this rank's step."""
        return comm.present_ranks(group)


def _held_by_process(key: Any, make: Callable[[], Any]) -> Any:
    return comm.held_once(key, make)


@dataclass(frozen=True)
class RankContext:
    """Everything a strategy is set up with on one rank (:meth:`Strategy.setup`).

    Args:
        model: this rank's model (its own copy; the strategy updates it in place).
        rank: this rank, ``0 <= rank < num_nodes``.
        num_nodes: the ranks of the run.
        max_steps: the run's optimizer steps per rank.
        seed: the run's seed, shared by every rank (shared randomness comes from it).
        samples_per_step: samples each rank trains a step (``batch_size``).
        collectives: the collectives bound to this rank.
        membership: the ranks present at this rank's step.
        clock: the simulated clock (``fit(network=...)``, an
            :class:`exogym.sim.clock.SimClock`); None without one.
        share: how state identical on every rank of a process is held once
            (``share(key, make)``); default: :mod:`exogym.comm`'s, per process.
    """

    model: torch.nn.Module
    rank: int
    num_nodes: int
    max_steps: int = 1
    seed: int = 0
    samples_per_step: int = 1
    collectives: RankCollectives = field(default_factory=RankCollectives)
    membership: MembershipView = field(default_factory=MembershipView)
    clock: Any = None
    share: Callable[[Any, Callable[[], Any]], Any] = _held_by_process

    def __post_init__(self) -> None:
        for name in ("rank", "num_nodes", "max_steps", "seed", "samples_per_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"RankContext.{name} must be an integer, got {value!r}")
        if not 0 <= self.rank < self.num_nodes:
            raise ValueError(f"RankContext.rank must be within [0, num_nodes={self.num_nodes}),"
                             f" got {self.rank}")
        if self.max_steps < 1 or self.samples_per_step < 1:
            raise ValueError("RankContext.max_steps and samples_per_step must be >= 1, got "
                             f"{self.max_steps} and {self.samples_per_step}")

    def held_once(self, key: Any, make: Callable[[], Any]) -> Any:
        """State identical on every rank of this process, made by the first of them with
        ``make()`` and the same object for the rest (a process of one rank: its own)."""
        return self.share(key, make)

    def describes(self, model: torch.nn.Module, rank: int, num_nodes: int) -> bool:
        """Whether this is the context of ``model`` as ``rank`` of ``num_nodes``."""
        return self.model is model and self.rank == rank and self.num_nodes == num_nodes

    def with_max_steps(self, max_steps: int) -> RankContext:
        """The same context for a run of ``max_steps`` steps (a rank that rejoins learns
        the run's length from the hand-over)."""
        return replace(self, max_steps=max_steps)

    @classmethod
    def alone(cls, model: torch.nn.Module, rank: int = 0, num_nodes: int = 1,
              **kwargs: Any) -> RankContext:
        """A context outside a run: the collectives of this process as they are."""
        return cls(model=model, rank=rank, num_nodes=num_nodes, **kwargs)
