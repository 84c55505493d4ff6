"""A rank's attendance, step by step, in a run whose ranks come and go.

Before each step a rank asks :class:`Attendance` whether it takes part. It
meets the step's members (``comm.enter_step``), or, away, skips to the step
it comes back at; at a step where ranks rejoin, the member chosen as the
source hands them the state (:mod:`exogym.membership.handover`) while the
others go on. The rank keeps its own state: it gives it through
:meth:`Member.handed_state` and takes a received one through
:meth:`Member.adopt_state`.

Across hosts, under a strategy that :attr:`~exogym.strategy.strategy.Strategy.joins_mid_round`,
a returning rank need not wait for a round to begin. It asks the lowest live
member for the state; that member copies :meth:`Member.join_state` at its next
step boundary and a thread of its own streams the copy on a link of the two
(:class:`exogym.comm.elastic_groups.PairLink`) while it trains on. Every other
live member sends a share of it at the same time, on a link of its own
(:mod:`exogym.membership.handover`). The joiner
then skips to the step after the member's latest, enters itself in the round's
record of joins (:mod:`exogym.membership.hosts`) and trains; it meets the
members in the round's closing collective. If the round closes first, it waits
for the next round as before. A strategy whose members also meet within a round
(:attr:`~exogym.strategy.strategy.Strategy.catches_up_at_entry`) has its joiner
train alone until then; where the members and the joiners have formed one group
at the round's last step, the lowest member in it gives them what every rank
holds alike, so a joiner needs the member it took the state from only while
that transfer lasts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from exogym import comm
from exogym.comm.protocol import PeerLost, PeerTimeoutError, RankDropped
from exogym.membership.handover import (
    Outgoing,
    StripedIntake,
    exchange_ints,
    hand_over,
    helper_share,
    send_description,
    send_share,
    send_tensors,
    send_update,
    share_tag,
    stripes,
)
from exogym.membership.simulated import RunMembership

__all__ = ["Attendance", "Member"]

#: How long a rank that is done waits for its hand-over threads to stop.
CLOSE_WAIT_S = 10.0


class Member(Protocol):
    """What a rank gives to and takes from a hand-over."""

    def handed_state(self) -> dict[str, Any]:
        """The state a rank that rejoins takes from a member that stayed (live tensors)."""

    def join_state(self, copy: bool = True) -> dict[str, Any]:
        """The state a rank that joins a round under way takes: the model as the round
        began, the rest as now; a copy, which may travel while this rank trains on
        (``copy=False``: the live tensors)."""

    def adopt_state(self, state: dict[str, Any], reshard: bool,
                    at_step: int | None = None) -> None:
        """Continue from a handed-over state (``reshard``: the data position travels too;
        ``at_step``: train from that step on, skipping those between)."""

    def steps_done(self) -> int:
        """Steps this rank has trained (its step counter)."""

    def keep_round_updates(self, keep: bool) -> None:
        """Keep (or stop keeping) the update every rank applies at a round's end."""

    def round_updates(self, through_step: int) -> list[dict[str, Any]]:
        """The updates kept of the rounds that ended at ``through_step`` or before."""

    def catch_up(self, updates: list[dict[str, Any]], start: bool = True) -> None:
        """Apply updates of rounds that ended after this rank's state was copied
        (``start``: then start training from it, joined under way)."""

    def entry_state(self) -> dict[str, Any]:
        """What every rank of the round holds alike, for a rank that trained alone since
        it joined under way and meets the members now."""

    def take_entry_state(self, state: dict[str, Any]) -> None:
        """Take a member's :meth:`entry_state`."""

    def late_join_note(self, state: dict[str, Any],
                       updates: list[dict[str, Any]]) -> dict[str, Any]:
        """What the members learn of this rank, joining under way, when it meets them."""

    def admit_late(self, joins: dict[int, dict[str, Any]], step: int) -> None:
        """At the last step of a round that ``joins`` joined under way: take them in."""

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
        #: A returning rank may join a round under way (:meth:`allow_mid_round`).
        self.mid_round = False
        #: ... and takes the steps it missed when it meets the members.
        self.catches_up_at_entry = False
        # The step a joiner that trains alone meets the members at, and at that step, the
        # ranks that joined the round under way, still to be given the members' state.
        self._meets_at: int | None = None
        self._entering: dict[int, dict[str, Any]] | None = None
        self._requests_seen = 0
        self._requests: list[dict[str, Any]] = []
        self._next_poll = 0.0
        # The thread handing a joiner the state, and the one sending a joiner a share, with
        # their links; a joiner's intake of its last state taken under way.
        self._senders: dict[str, tuple[threading.Thread, Any]] = {}
        self._intake: StripedIntake | None = None
        self._closing = threading.Event()  # the rank is done: its threads stop
        self._keeping = 0  # threads that need the rounds' updates kept
        self._keep_lock = threading.Lock()
        # The member this rank is, while it may serve requests during a collective's wait
        # (None: not now), and the thread that trains.
        self._serving: Member | None = None
        self._trainer = threading.get_ident()

    def allow_mid_round(self, catches_up_at_entry: bool = False) -> None:
        """The strategy's state can be handed over while training goes on: across hosts, a
        returning rank joins the round under way instead of waiting for the next one
        (``catches_up_at_entry``: it trains alone until the round's last step, and takes
        the state every rank holds alike from a member there)."""
        membership = self.membership
        if membership is not None and membership.can_admit_mid_round:
            membership.admits_mid_round = True
            self.mid_round = True
            self.catches_up_at_entry = catches_up_at_entry
            if not catches_up_at_entry and hasattr(membership.world, "while_waiting"):
                # The members' state changes only in their steps, not while they wait for
                # a round's collective (seconds, on a slow link): a request that comes
                # then is served then, not at the next step boundary.
                self._trainer = threading.get_ident()
                membership.world.while_waiting = self._serve_while_waiting

    def in_group(self, step: int) -> bool:
        """False while this rank, joined under way, trains before its round's last step:
        it takes part in no collective of the members' until then (an evaluation of the
        average model is theirs)."""
        return not self.mid_round or self.membership.in_members_group(step)

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
        self._serving = None
        if self.mid_round:
            membership.max_steps = max_steps
        if not membership.is_present(self.rank, step):
            self._meets_at = self._entering = None  # whatever it was joining, it is away
            if self.mid_round:
                back = membership.next_join(self.rank, step,
                                            lambda generation: self._join_late(generation, member))
            else:
                back = membership.next_join(self.rank, step)
            if back is None or back > max_steps:
                return None
            step = back
        if self.mid_round:
            if step == membership.round_end(step):
                membership.close_round(step)
                self._admit(step, member)
            if not membership.in_members_group(step):  # joined under way: trains alone
                member.reshard(*membership.shard(self.rank, step))
                return step
            self._serving = member
            self._serve(member)
        comm.enter_step(step, membership.present(step), membership.epoch(step))
        entering, self._entering = self._entering, None
        if entering:
            self._enter(step, entering, member)
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

    # -- a round under way ----------------------------------------------------------------

    def _serve(self, member: Member) -> None:
        """A member: at most every :data:`SERVE_POLL_S` seconds, look for ranks that asked it
        for the state (or for a share of it, :mod:`exogym.membership.handover`), and start
        handing the first of each kind a copy in a thread."""
        now = time.monotonic()
        if now < self._next_poll or self._closing.is_set():
            return
        self._next_poll = now + SERVE_POLL_S
        membership = self.membership
        found, self._requests_seen = membership.state_requests(self._requests_seen)
        for request in found:  # how long it waited to be read (wall clocks), and since then
            request["waited_s"] = max(0.0, time.time() - float(request.get("asked_at", 0) or
                                                                time.time()))
            request["seen"] = now
        self._requests.extend(found)
        for request in list(self._requests):
            kind = "share" if "share" in request else "state"
            busy = self._senders.get(kind)
            if busy is not None and busy[0].is_alive():
                continue
            self._requests.remove(request)
            members = [int(r) for r in request.get("share") or [self.rank]]
            link = self._link_to(request)
            if self.rank not in members or link.given_up():  # the joiner went on without it
                continue
            # Copied at this step boundary, before training goes on; the thread sends each
            # tensor as soon as its copy is made.
            copying = time.monotonic()
            wait_s = self.membership.world.timeout_s
            live = member.join_state(copy=False)
            if kind == "share":
                what = helper_share(live, members.index(self.rank), len(members), wait_s)
                target, copies = self._send_share, what["tensors"]
            else:
                out = Outgoing(live)
                parts = stripes(out.sizes, 1 + len(request.get("helpers") or []))
                # Its own part first; then a helper's, in case it cannot send its own,
                # unless the joiner has taken that helper's share by then.
                copies = out.copy_ahead([i for part in parts for i in part], wait_s,
                                        _left_to_helpers(parts, link))
                target, what = self._send, (out, parts, int(live["step"]))
            del live
            request["served_after_s"] = copying - request["seen"]
            self._keep_updates(member, True)  # what rounds that end during the transfer change
            thread = threading.Thread(target=target, args=(link, request, what, member),
                                      name=f"{kind} to rank {request['rank']}", daemon=True)
            self._senders[kind] = (thread, link)
            thread.start()
            copies.make()
            request["copy_s"] = time.monotonic() - copying
            request["copied_bytes"] = copies.copied_bytes

    def _serve_while_waiting(self) -> None:
        """Between the slices of a wait for the members' collective, on the thread that
        trains: serve requests as at a step boundary. The state stands still there; a copy
        taken in the collective of a round's last step is the state after the step before,
        with the inner optimizer's moments of this one (each member's own), and the update
        of the round ending now follows it like any other."""
        member = self._serving
        if member is not None and threading.get_ident() == self._trainer:
            self._serve(member)

    def _keep_updates(self, member: Member, keep: bool) -> None:
        """One more (or one fewer) thread that needs the rounds' updates kept."""
        with self._keep_lock:
            self._keeping += 1 if keep else -1
            if self._keeping == (1 if keep else 0):
                member.keep_round_updates(keep)

    def _link_to(self, request: dict[str, Any]) -> Any:
        """The link a request names, of this member and the joiner (not formed yet)."""
        world = self.membership.world
        joiner = int(request["rank"])
        return world.pair_link(request["link"], self.rank, joiner,
                               {self.rank: world.generations[self.rank],
                                joiner: int(request["gen"])})

    def _send(self, link: Any, request: dict[str, Any],
              what: tuple[Outgoing, list[list[int]], int], member: Member) -> None:
        """The member's thread: the state copied at the step boundary (``what``: the
        state taken apart, whose copies the trainer makes as this thread sends them; its
        parts; its step) on a link of the two (the tensors of the shares the joiner took
        from helpers left out), then, until the joiner has entered a round, the step the
        member has reached and the updates of the rounds that ended since the copy that
        the joiner asks of it (a round the joiner finds closed, a member being ahead, is
        waited out: the next one's update follows)."""
        membership = self.membership
        joiner = int(request["rank"])
        ranks = [self.rank, joiner]
        started = time.perf_counter()
        caught_up = 0
        out, parts, sent = what
        copies = out.tensors
        try:
            send_description(link.broadcast, self.rank, ranks, self.rank, out.description)
            described = time.perf_counter() - started
            send_tensors(link.broadcast, self.rank, ranks, self.rank, out.shapes, parts[0],
                         out.tensors)
            own_part = time.perf_counter() - started
            nbytes = out.description.numel() + out.nbytes(parts[0])
            for position in exchange_ints(link, None, joiner, ranks):  # the helpers' left
                if not 0 < position < len(parts):
                    raise RuntimeError(f"rank {joiner} asked for share {position} of "
                                       f"{len(parts)}")
                send_tensors(link.broadcast, self.rank, ranks, self.rank, out.shapes,
                             parts[position], out.tensors)
                nbytes += out.nbytes(parts[position])
            copies.stop()  # the copies of the helpers' parts go
            del out, what
            for _ in range(MAX_TRIES):
                at = member.steps_done()
                updates = {u["step"]: u for u in member.round_updates(at) if u["step"] > sent}
                exchange_ints(link, [at, *updates], self.rank, ranks)
                count, *steps = exchange_ints(link, None, joiner, ranks)  # in how many parts
                for step in steps:
                    nbytes += send_update(link, self.rank, joiner, updates[step], count)
                caught_up += len(updates)
                sent = at
                verdict = torch.zeros(1, dtype=torch.int64)
                link.broadcast(verdict, joiner, ranks)
                if int(verdict) != 0 or at >= (membership.max_steps or at + 1):
                    break
                self._wait_for_step(member, membership.round_end(at + 1))
            joined = int(verdict)
            if joined:
                self.emit({"event": "hand_over", "rank": self.rank, "step": joined,
                           "source": self.rank, "joiners": [joiner], "bytes": nbytes,
                           "seconds": time.perf_counter() - started, "during_round": True,
                           "rounds_caught_up": caught_up, "timing": {
                               "request_waited_s": request.get("waited_s"),
                               "served_after_s": request.get("served_after_s"),
                               "copy_s": request.get("copy_s"),
                               "copied_bytes": request.get("copied_bytes"),
                               "described_s": described,
                               "own_part_s": own_part}})
        except (PeerLost, PeerTimeoutError, RuntimeError, KeyError) as exc:
            if not self._closing.is_set():
                print(f"rank {self.rank}: handing the state to rank {joiner} during the round "
                      f"failed ({exc}); it asks again", flush=True)
            return
        finally:
            copies.stop()  # no more copies are made, and those made go
            self._keep_updates(member, False)
            link.close()

    def _send_share(self, link: Any, request: dict[str, Any], share: dict[str, Any],
                    member: Member) -> None:
        """A helper's thread: its share of the state, if the joiner takes it, then the
        rounds' updates the joiner asks of it (:func:`exogym.membership.handover.send_share`)."""
        joiner = int(request["rank"])

        def update_of(step: int) -> dict[str, Any]:
            self._wait_for_step(member, step)
            for update in member.round_updates(step):
                if update["step"] == step:
                    return update
            raise RuntimeError(f"rank {self.rank} kept no update of the round that ended at "
                               f"step {step}")

        try:
            send_share(link, self.rank, joiner, share, update_of)
        except (PeerLost, PeerTimeoutError, RuntimeError) as exc:
            refused = link.given_up()
            link.abandon()  # the joiner stops waiting for it at once
            if refused and not self._closing.is_set():
                print(f"rank {self.rank}: rank {joiner} went on without its share of the "
                      f"state ({exc})", flush=True)
            elif not refused:
                print(f"rank {self.rank}: sending rank {joiner} its share of the state "
                      f"failed ({exc})", flush=True)
        finally:
            self._keep_updates(member, False)
            link.close()

    def _admit(self, step: int, member: Member) -> None:
        """At the last step of a round: the ranks that joined it under way meet the members.
        Where they trained alone (:attr:`catches_up_at_entry`), a joiner is admitted only
        once it has the members' state (:meth:`_enter`, after the group forms)."""
        membership = self.membership
        joins = membership.late_joins(step)
        meets_at, self._meets_at = self._meets_at, None
        if meets_at is not None and (meets_at != step or self.rank not in joins):
            why = (f"rank {self.rank} was to meet the members at step {meets_at}, not at "
                   f"{step}")
            membership.drop(why)
            raise RankDropped(why)
        if not joins:
            return
        if self.catches_up_at_entry:
            self._entering = joins
            if self.rank in joins:
                return
        member.admit_late(joins, step)

    def _enter(self, step: int, joins: dict[int, dict[str, Any]], member: Member) -> None:
        """At the last step of a round, the members and the ranks that joined it under way
        formed one group: the lowest member in it sends the joiners what every rank holds
        alike (:meth:`Member.entry_state`), whichever member handed them the state before.
        A joiner then is admitted; one whose transfer fails tries a later round."""
        present = set(comm.present_ranks())
        joiners = sorted(r for r in joins if r in present)
        members = sorted(present - set(joins))
        if not joiners or (self.rank not in joiners and self.rank != min(members, default=-1)):
            return
        if not members:
            why = f"no member was left to give rank {self.rank} the state at step {step}"
            self.membership.drop(why)
            raise RankDropped(why)
        source = members[0]
        try:
            state, _ = hand_over(member.entry_state() if self.rank == source else None,
                                 source, [source, *joiners], self.rank)
        except PeerLost as exc:
            if self.rank == source:
                return  # the joiners that are left try a later round
            self.membership.drop(f"rank {self.rank} could not take the members' state from "
                                 f"rank {source} at step {step} ({exc})")
            raise RankDropped(str(exc)) from exc
        if self.rank != source:
            member.take_entry_state(state)
            member.admit_late(joins, step)
            print(f"step {step}: rank {self.rank} met the members and took their state from "
                  f"rank {source}", flush=True)

    def _wait_for_step(self, member: Member, step: int) -> None:
        """Until this member has trained ``step``: as long as it takes while the member
        trains on, bounded by the world's timeout without a step trained."""
        timeout = self.membership.world.timeout_s
        seen = member.steps_done()
        deadline = time.monotonic() + timeout
        while seen < step:
            if self._closing.wait(0.02):
                raise PeerLost(f"rank {self.rank} stopped at step {seen}, before step {step}")
            now = member.steps_done()
            if now != seen:
                seen, deadline = now, time.monotonic() + timeout
            elif time.monotonic() > deadline:
                raise PeerTimeoutError(f"rank {self.rank} trained no step after step {seen} "
                                       f"within {timeout:.0f} s (waiting to reach step {step})")

    def _join_late(self, generation: int, member: Member) -> int | None:
        """A returning rank: take the state from the live members while training goes on
        (the lowest gives it, each other one a share, :mod:`exogym.membership.handover`),
        bring it up to date with the rounds that ended meanwhile, and enter the round under
        way at the step after the lowest member's latest; None when it cannot now (no live
        member, or the transfer failed)."""
        membership = self.membership
        found = membership.current_round()
        if found is None:
            return None
        _, decided = found
        live = membership.live_members(decided)
        if not live:
            return None
        source, helpers = live[0], live[1:]
        world = membership.world
        started = time.perf_counter()
        gens = {int(r): int(g) for r, g in decided["gens"].items()}
        links = {source: world.pair_link(
            membership.ask_state(source, generation, {"helpers": helpers}), source, self.rank,
            {source: gens[source], self.rank: generation})}
        for helper in helpers:
            name = membership.ask_state(helper, generation, {"share": live})
            links[helper] = world.pair_link(name, helper, self.rank,
                                            {helper: gens[helper], self.rank: generation})
        intake = StripedIntake(self.rank, source, links, helpers, self._alike, world.timeout_s)
        self._intake = intake
        ranks = [source, self.rank]
        link = links[source]
        step = None
        updates: list[dict[str, Any]] = []
        try:
            state, nbytes = intake.take_state(member.handed_state())
            state_s = time.perf_counter() - started
            rounds: list[dict[str, Any]] = []  # each exchange of the step and updates
            for attempt in range(MAX_TRIES):
                at, *ended = exchange_ints(link, None, source, ranks)
                asked_at = time.perf_counter() - started
                enters = None
                if not self.catches_up_at_entry and at + 1 <= state["max_steps"]:
                    # The joiner enters the round under way before the updates arrive, so
                    # that the round cannot close while they travel (a member reaching its
                    # last step) and leave it to chase the next one; the members' closing
                    # collective waits for it at most that long. After a round closed while
                    # its update travelled (rounds shorter than an update's transfer), it
                    # enters at the round's last step.
                    enters = at + 1 if attempt == 0 else membership.round_end(at + 1)
                    if not membership.join_late(enters, generation,
                                                member.late_join_note(state, [])):
                        enters = None
                got, size = intake.take_updates(ended)
                rounds.append({"at": at, "updates": len(ended), "asked_s": asked_at,
                               "taken_s": time.perf_counter() - started,
                               "entered": enters is not None})
                updates.extend(got)
                nbytes += size
                if enters is None and at + 1 <= state["max_steps"] and membership.join_late(
                        at + 1, generation, member.late_join_note(state, updates)):
                    enters = at + 1
                link.broadcast(torch.tensor([enters or 0], dtype=torch.int64),
                               self.rank, ranks)
                if enters is not None:
                    step = enters
                    break
                if at + 1 > state["max_steps"]:
                    return None  # the run has ended meanwhile
        except (PeerLost, PeerTimeoutError) as exc:
            print(f"rank {self.rank}: taking the state during the round failed ({exc}); "
                  "trying again", flush=True)
            return None
        finally:
            if step is None:  # the members' threads stop at once, not at a timeout
                link.abandon()
                intake.abandon()
            else:
                intake.finish()
            link.close()
        if step is None:
            return None
        if self.catches_up_at_entry:
            self._meets_at = membership.round_end(step)
        member.adopt_state(state, membership.reshards, at_step=step)
        member.catch_up(updates)
        self.emit({"event": "hand_over", "rank": self.rank, "step": step, "source": source,
                   "joiners": [self.rank], "bytes": nbytes,
                   "seconds": time.perf_counter() - started, "during_round": True,
                   "rounds_caught_up": len(updates),
                   "from": {str(r): b for r, b in intake.bytes_from.items()},
                   "timing": {"described_s": intake.described_at - started,
                              "state_s": state_s, "rounds": rounds}})
        return step

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """The rank is done: the transfers its threads still make (a state or a share it
        sends, a share it takes) are given up on both sides, and the threads end within
        ``wait_s`` seconds. A thread left blocked in a collective when the process exits
        would end it with an abort."""
        self._closing.set()
        threads = []
        for thread, link in self._senders.values():
            if thread.is_alive():
                link.abandon()
                threads.append(thread)
        intake, self._intake = self._intake, None
        if intake is not None and any(h.is_alive() for h in intake.helpers):
            intake.abandon()
            threads.extend(h for h in intake.helpers if h.is_alive())
        deadline = time.monotonic() + wait_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in threads if t.is_alive()]
        if left:
            print(f"rank {self.rank}: {', '.join(left)} did not stop within {wait_s:.0f} s "
                  "of the end", flush=True)

    def _alike(self, a: int, b: int) -> bool:
        """Whether copies of the state taken after ``a`` and after ``b`` steps hold the same
        state every member holds alike: no round ended between them (the members of a
        strategy that :attr:`catches_up_at_entry` meet at any step: the same step)."""
        if self.catches_up_at_entry:
            return a == b
        return self.membership.round_end(a + 1) == self.membership.round_end(b + 1)


def _left_to_helpers(parts: list[list[int]], link: Any) -> Callable[[int], bool]:
    """Whether the source still copies tensor ``i`` for itself: its own part's always, a
    helper's unless the joiner has taken that helper's share (asked of the link once per
    part, as the copying reaches it)."""
    position = {i: k for k, part in enumerate(parts) for i in part}
    taken: dict[int, bool] = {}

    def needed(i: int) -> bool:
        k = position[i]
        if k == 0:
            return True
        if k not in taken:
            try:
                taken[k] = link.marked(share_tag(k))
            except Exception:  # noqa: BLE001 - not known to be taken: copied, as before
                taken[k] = False
        return not taken[k]

    return needed


#: How often a member looks for ranks that asked it for the state during a round.
SERVE_POLL_S = 0.5
#: Rounds a joiner may find closed (a member ahead) before it asks for the state afresh.
MAX_TRIES = 5
