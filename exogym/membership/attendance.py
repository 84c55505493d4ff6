"""A rank's attendance, step by step, in a run whose ranks come and go.

Before each step a rank asks :class:`Attendance` whether it takes part. It
meets the step's members (``comm.enter_step``), or, away, skips to the step
it comes back at; at a step where ranks rejoin, the member chosen as the
source hands them the state (:mod:`exogym.membership.handover`) while the
others go on. The rank keeps its own state: it gives it through
:meth:`Member.handed_state` and takes a received one through
:meth:`Member.adopt_state`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from exogym import comm
from exogym.comm.protocol import PeerLost, RankDropped
from exogym.membership.handover import hand_over
from exogym.membership.simulated import RunMembership

__all__ = ["Attendance", "Member"]


class Member(Protocol):
    """What a rank gives to and takes from a hand-over."""

    def handed_state(self) -> dict[str, Any]:
        """The state a rank that rejoins takes from a member that stayed (live tensors)."""

    def adopt_state(self, state: dict[str, Any], reshard: bool) -> None:
        """Continue from a handed-over state (``reshard``: the data position travels too)."""

    def reshard(self, index: int, count: int) -> None:
        """Read shard ``index`` of ``count`` from now on."""


class Attendance:
    """One rank's part in the membership of its run.

    Args:
        membership: the run's membership (None: every rank takes every step).
        rank: this rank.
        emit: where the ``hand_over`` event goes.
    """

    def __init__(self, membership: RunMembership | None, rank: int,
                 emit: Callable[[dict[str, Any]], None]):
        self.membership = membership
        self.rank = rank
        self.emit = emit

    def take_part(self, step: int, max_steps: int, member: Member) -> int | None:
        """Before ``step``: the step this rank trains next (``step``, or a later one after an
        absence, the state handed over if it rejoins), or None when it is away for the rest
        of the run.

        Raises:
            RankDropped: its hand-over failed (the source was lost); a later round admits it.
        """
        membership = self.membership
        if membership is None:
            comm.enter_step(step)
            return step
        if not membership.is_present(self.rank, step):
            back = membership.next_join(self.rank, step)
            if back is None or back > max_steps:
                return None
            step = back
        comm.enter_step(step, membership.present(step), membership.epoch(step))
        if membership.joiners(step):
            try:
                self.hand_over(step, member)
            except PeerLost as exc:
                if self.rank not in membership.joiners(step):
                    raise
                # The rank handing over the state was lost meanwhile: try a later round.
                membership.drop(f"rank {membership.source(step)} was lost while handing over "
                                "the state")
                raise RankDropped(str(exc)) from exc
        if membership.reshards:
            member.reshard(*membership.shard(self.rank, step))
        return step

    def hand_over(self, step: int, member: Member) -> None:
        """At ``step``, where ranks rejoin: the source sends the state, a joining rank
        receives it; the others take no part (side channel, uncounted).

        The state streams after a small description of its structure, small tensors
        together and large ones alone (:mod:`exogym.membership.handover`), so it is
        never held whole in a buffer; a joiner receives straight into its own tensors.
        Its bytes and time are reported as a ``hand_over`` event.
        """
        membership = self.membership
        joining = membership.joiners(step)
        source = membership.source(step)
        if self.rank != source and self.rank not in joining:
            return
        started = time.perf_counter()
        mine = member.handed_state()
        state, nbytes = hand_over(mine if self.rank == source else None, source,
                                  [source, *joining], self.rank,
                                  into=None if self.rank == source else mine)
        seconds = time.perf_counter() - started
        self.emit({"event": "hand_over", "rank": self.rank, "step": step, "source": source,
                   "joiners": list(joining), "bytes": nbytes, "seconds": seconds})
        if self.rank != source:  # the event tells it (the run's progress shows it unless quiet)
            member.adopt_state(state, membership.reshards)
