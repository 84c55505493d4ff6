"""Which ranks take part in each step when ranks leave and rejoin (``rank_failures``).

``fit(rank_failures=[(rank, at_step, back_at_step), ...])`` simulates hosts
that drop out and come back. The rules, the same for every strategy:

- Steps are numbered from 1. ``(r, a, b)``: rank ``r`` completes steps up to
  ``a - 1``, then is away: it runs no step and takes part in no collective.
  ``b=None``: it never comes back.
- It becomes reachable again before step ``b`` and joins at the next round
  boundary: the first step ``>= b`` that begins a round of the strategy
  (``Strategy.round_steps``: H for DiLoCo, FedAvg, SPARTA-DiLoCo, SparseLoCo;
  1 for per-step strategies such as DDP, SPARTA and DeMo, which it joins at
  step ``b`` itself).
- Before its first step back it receives the current state (the model, the
  strategy's state such as DiLoCo's outer parameters and optimizers, the step
  counter and the simulated clock) from the lowest-numbered rank that was
  present at the step before, over the side channel (not counted as training
  traffic), and its place in the epoch.
- The data is re-sharded over the present ranks whenever they change: each
  takes the shard of its place among them (the first of 3 present ranks
  reads shard 0 of 3), entered at the fraction of the epoch already done
  (:meth:`exogym.data.loading.MinibatchStream.reshard`). A split by label and
  per-rank datasets (a factory) are not re-sharded.
- While ranks are away, every collective meets among the present ranks only:
  averages are over them, so a round that loses a rank mid-way completes
  among the others, and every survivor applies the same outer step.
- The run's final model is the average of the ranks present at the last step.

At least one rank must be present at every step, and a rank that rejoins must
find a rank that stayed to take the state from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from exogym.base.plural import plural, plural_noun

Failure = tuple[int, int, int | None]


class MembershipStop(RuntimeError):
    """Fewer than ``min_nodes`` ranks remain: the run stops.

    Args:
        message: which hosts were lost and why, and what remains.
        lost: the ranks lost.
    """

    def __init__(self, message: str, lost: Sequence[int]):
        super().__init__(message)
        self.lost = list(lost)


class RunMembership(Protocol):
    """Which ranks train each step of a run whose ranks come and go.

    Two implementations answer the same questions: :class:`Membership`, fixed in
    advance by a simulation's ``rank_failures``, and
    :class:`exogym.membership.hosts.ElasticMembership`, decided as a run across hosts
    goes. The training loop (:class:`exogym.run.train_node.TrainNode`) asks only these.
    """

    #: Present ranks read the data shard of their place among them.
    reshards: bool
    #: This process starts while its run is under way: it joins a running round.
    joining: bool
    #: A rank that comes back may join a round under way, at a step boundary, taking the
    #: state from a member while the others train (:mod:`exogym.membership.attendance`);
    #: False: it waits for the next round.
    admits_mid_round: bool
    #: Whether :attr:`admits_mid_round` may be set (runs across hosts).
    can_admit_mid_round: bool
    #: Decided in the run's store (runs across hosts): each step event then says how many
    #: round trips to it the step made (``store_trips``).
    decided_in_store: bool

    def is_present(self, rank: int, step: int) -> bool:
        """True when ``rank`` trains step ``step``."""

    def present(self, step: int) -> frozenset[int]:
        """The ranks that train step ``step``."""

    def epoch(self, step: int) -> int:
        """The step at which the membership of ``step`` began (where ranks last changed)."""

    def joiners(self, step: int) -> list[int]:
        """Ranks that rejoin at ``step``."""

    def source(self, step: int) -> int:
        """The member that hands the state to the ranks rejoining at ``step``."""

    def shard(self, rank: int, step: int) -> tuple[int, int]:
        """``rank``'s place among the members of ``step`` and their number."""

    def next_join(self, rank: int, step: int) -> int | None:
        """The step at which ``rank``, away at ``step``, trains again (None: never)."""

    def changes(self, max_steps: int) -> list[dict[str, Any]]:
        """Every change of membership up to ``max_steps``."""

    def drop(self, reason: str) -> None:
        """This rank could not rejoin (its hand-over failed): it tries a later round."""

    def stop(self, reason: str) -> None:
        """Stop the run for every rank."""

    def finish(self, ranks: Sequence[int] | None = None) -> tuple[list[int], int] | None:
        """The run has ended for this rank; ``ranks``: those that ended it with the final
        model (None: this rank did not). Returns the ranks that ended it and the one that
        writes the outputs, where known."""


def parse_rank_failures(value: Any, num_nodes: int) -> list[Failure]:
    """``rank_failures`` checked in itself: a list of ``(rank, at_step, back_at_step or None)``.

    Raises:
        ValueError: naming the entry that is wrong and what it should be.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"rank_failures must be a list of (rank, at_step, back_at_step or "
                         f"None) tuples, got {value!r}")
    out: list[Failure] = []
    for i, entry in enumerate(value):
        if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 3:
            raise ValueError(f"rank_failures[{i}] must be (rank, at_step, back_at_step or None), "
                             f"got {entry!r}")
        rank, at, back = entry
        if not _is_int(rank) or not 0 <= rank < num_nodes:
            raise ValueError(f"rank_failures[{i}]: rank must be an integer in 0..{num_nodes - 1}, "
                             f"got {rank!r}")
        if not _is_int(at) or at < 1:
            raise ValueError(f"rank_failures[{i}]: at_step must be an integer >= 1 (steps count "
                             f"from 1), got {at!r}")
        if back is not None and (not _is_int(back) or back <= at):
            raise ValueError(f"rank_failures[{i}]: back_at_step must be None (gone for good) or "
                             f"an integer > at_step={at}, got {back!r}")
        out.append((int(rank), int(at), None if back is None else int(back)))
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Membership:
    """The ranks present at every step of a run with ``rank_failures``.

    Args:
        failures: ``(rank, at_step, back_at_step or None)`` entries (see the module).
        num_nodes: ranks in the run.
        round_steps: steps per round of the strategy; a returning rank joins at
            the first step >= its ``back_at_step`` that begins a round.

    Raises:
        ValueError: a rank leaves again before it has rejoined, every rank is away
            at some step, or a rank rejoins where no rank stayed to hand it the state.
    """

    #: Present ranks read the data shard of their place among them (exogym.data.loading).
    reshards = True
    admits_mid_round = can_admit_mid_round = False  # a rank comes back where rank_failures says
    decided_in_store = False
    #: Every rank of a simulation starts with the run.
    joining = False

    def __init__(self, failures: Sequence[Failure], num_nodes: int, round_steps: int = 1):
        self.num_nodes = num_nodes
        self.round_steps = max(1, int(round_steps))
        self.away: dict[int, list[tuple[int, int | None]]] = {}
        for rank, at, back in sorted(parse_rank_failures(failures, num_nodes)):
            join = None if back is None else self._round_start(back)
            spans = self.away.setdefault(rank, [])
            if spans and (spans[-1][1] is None or at < spans[-1][1]):
                before = spans[-1][1]
                raise ValueError(
                    f"rank_failures: rank {rank} leaves at step {at} before it is back from its "
                    f"previous absence (it rejoins at step {before}, the start of a round of "
                    f"{plural(self.round_steps, 'step')})" if before is not None else
                    f"rank_failures: rank {rank} leaves at step {at}, but it left for good before")
            spans.append((at, join))
        self._changes = self._change_steps()
        self._present: dict[int, frozenset[int]] = {}
        self._check()

    def _round_start(self, step: int) -> int:
        """The first step >= ``step`` that begins a round."""
        h = self.round_steps
        return -(-(step - 1) // h) * h + 1

    def _change_steps(self) -> list[int]:
        steps = {1}
        for spans in self.away.values():
            for at, join in spans:
                steps.add(at)
                if join is not None:
                    steps.add(join)
        return sorted(steps)

    def _check(self) -> None:
        for step in self._changes:
            present = self.present(step)
            if not present:
                raise ValueError(f"rank_failures: every rank is away at step {step}; at least one "
                                 "must stay")
            joining = self.joiners(step)
            if joining and not (present - set(joining)):
                raise ValueError(
                    f"rank_failures: at step {step} {plural_noun(len(joining), 'rank')} "
                    f"{', '.join(map(str, joining))} {'rejoins' if len(joining) == 1 else 'rejoin'}, "
                    "but no rank that stayed is there to hand them the current state")

    def is_present(self, rank: int, step: int) -> bool:
        """True when ``rank`` runs step ``step``."""
        for at, join in self.away.get(rank, ()):
            if at <= step and (join is None or step < join):
                return False
        return True

    def present(self, step: int) -> frozenset[int]:
        """The ranks that run step ``step``."""
        # Membership only changes at a few steps: the set of the latest change holds.
        at = max((s for s in self._changes if s <= step), default=1)
        found = self._present.get(at)
        if found is None:
            found = self._present[at] = frozenset(
                r for r in range(self.num_nodes) if self.is_present(r, at))
        return found

    def epoch(self, step: int) -> int:
        """The step at which the membership of ``step`` began (where ranks last changed)."""
        return max((s for s in self._changes if s <= step), default=1)

    def joiners(self, step: int) -> list[int]:
        """Ranks that are back at ``step`` after being away at ``step - 1``."""
        if step <= 1:
            return []
        return sorted(r for r, spans in self.away.items()
                      if any(join == step for _, join in spans))

    def next_join(self, rank: int, step: int) -> int | None:
        """The step at which ``rank``, away at ``step``, runs again (None: never)."""
        for at, join in self.away.get(rank, ()):
            if at <= step and (join is None or step < join):
                return join
        return step

    def shard(self, rank: int, step: int) -> tuple[int, int]:
        """``rank``'s place among the ranks present at ``step`` and their number."""
        present = sorted(self.present(step))
        return present.index(rank), len(present)

    def source(self, step: int) -> int:
        """The rank that hands the state to the ranks joining at ``step``."""
        return min(self.present(step) - set(self.joiners(step)))

    def changes(self, max_steps: int) -> list[dict[str, Any]]:
        """Every change of membership up to ``max_steps``: ``{"step", "ranks", "reason"}``."""
        out = [{"step": 1, "ranks": sorted(self.present(1)), "reason": "start"}]
        if len(out[0]["ranks"]) < self.num_nodes:
            gone = sorted(set(range(self.num_nodes)) - set(out[0]["ranks"]))
            out[0]["reason"] = "start; " + _ranks_phrase(gone, "away")
        previous = self.present(1)
        for step in self._changes:
            if step <= 1 or step > max_steps:
                continue
            now = self.present(step)
            if now == previous:
                continue
            parts = []
            if previous - now:
                parts.append(_ranks_phrase(sorted(previous - now), "left"))
            if now - previous:
                parts.append(_ranks_phrase(sorted(now - previous), "rejoined"))
            out.append({"step": step, "ranks": sorted(now), "reason": "; ".join(parts)})
            previous = now
        return out


    def drop(self, reason: str) -> None:
        """A simulated hand-over cannot lose its source: reaching here is a bug."""
        raise RuntimeError(f"a simulated rank cannot be dropped: {reason}")

    def stop(self, reason: str) -> None:
        """Nothing to tell: a simulated run stops with the error that stopped it."""

    def finish(self, ranks: Sequence[int] | None = None) -> tuple[list[int], int] | None:
        """Nothing to tell: every rank of a simulation ends with the run, and its
        ``rank_failures`` say who is present at the end."""
        return None


def _ranks_phrase(ranks: list[int], verb: str) -> str:
    noun = "rank" if len(ranks) == 1 else "ranks"
    return f"{noun} {', '.join(map(str, ranks))} {verb}"
