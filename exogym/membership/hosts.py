"""Which ranks train each round of a run across hosts that come and go (``min_nodes``).

A run across hosts with ``min_nodes`` set keeps training while at least that
many hosts remain. Its ranks meet through the rendezvous store the launcher
hosts in its own process (so that no rank's death takes it away), for control
only; their tensors travel on gloo groups formed for each membership
(:mod:`exogym.comm.elastic_groups`). This module is the membership those groups follow:

- **Losses.** The launcher declares a rank lost (its process exited, its host
  dropped the connection, or its heartbeat stopped for the deadline: frozen,
  asleep, cut off) by bumping the rank's *loss generation* in the store. The
  survivors of a collective that loses it complete the collective without it
  (:mod:`exogym.comm.elastic_groups` says how they agree). A rank whose host
  did not answer pre-flight is declared lost before any rank starts
  (:func:`declare_absent`): the start's members leave it out, and it joins as a
  lost rank rejoins (told as ``joined``, not ``rejoined``).
- **Membership.** At every round boundary (each step of a per-step strategy),
  the first rank to arrive decides the members of the round with a
  compare-and-set: the members of the last round that were not lost since,
  plus the ranks that are back and ready. Every rank reads that one
  decision. Members are numbered among themselves for the data: each takes
  the shard of its place among the members (:meth:`exogym.data.loading.MinibatchStream.reshard`).
- **Rejoining.** A rank that finds itself declared lost (a process that was
  frozen and thawed, or cut off and reconnected), or a process the launcher
  started again on a host that came back, acknowledges its loss generation
  and waits. The next round's decision admits it; at that boundary the
  members form a new group, and the lowest-numbered member that stayed hands
  it the model, the strategy's state and the step counter, point to point
  (:class:`exogym.membership.attendance.Attendance`).
- **Joining mid-round.** Under a strategy whose state can be handed over while
  training goes on (``Strategy.joins_mid_round``: DiLoCo, whose ranks meet only at a
  round's end), a returning rank does not wait for the next round: it asks the
  lowest live member for the state, which a thread of that member streams to it
  on a link of their own while every member trains on; it then joins at the next
  step boundary, and the members take it into the round's closing collective.
  Each round keeps one record of such joins in the store; the first member to
  reach the round's last step closes it by compare-and-set, so every member
  reads the same joiners there, and a joiner that finds it closed waits for the
  next round.
- **Off the step.** Within a round a rank asks the store nothing: a thread of
  its own (:class:`Lookout`) reads whether it was declared lost and whether a
  returning rank asked it for the state, and the step takes that look while
  it is fresh. The store is asked on the step's path at a round's edges only
  (its decision, its record of joins closed, its voted collective).
- **Too few hosts.** A decision that leaves fewer than ``min_nodes`` members
  says so; every rank then writes a checkpoint and stops, naming the lost hosts.
- **The master.** The store lives in the launcher. If the launcher's host
  dies, the ranks lose the store: they stop, naming it, and a run with a
  ``checkpoint_interval`` continues with ``--resume`` from the newest
  checkpoint every rank has.

Every value in the store is a small control message (:mod:`exogym.comm.store`);
the log of membership changes is one key per change.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from exogym.comm.elastic_groups import NAMESPACE, ElasticGroups, key, loss_generation
from exogym.comm.protocol import PeerLost, PeerTimeoutError, RankDropped
from exogym.comm.store import ControlStore
from exogym.membership.simulated import MembershipStop

__all__ = ["ElasticMembership", "MembershipStop", "NAMESPACE", "PeerLost", "RankDropped",
           "ToldChanges", "declare_absent", "declare_lost", "key", "loss_generation",
           "membership_log", "ready_generation"]


#: How often a returning rank tries to join a round under way while it waits.
LATE_TRY_S = 0.5
#: Seconds between a rank's looks at the store off its training step (:class:`Lookout`).
LOOK_S = 0.2
#: A look older than this is not trusted: the step asks the store itself (the process was
#: frozen and thawed, or the look's thread starved on a busy machine, or the store is out
#: of reach).
LOOK_FRESH_S = 1.0


def declare_lost(store: ControlStore, rank: int, why: str) -> int:
    """Declare ``rank`` lost (the launcher does); returns its new loss generation."""
    generation = store.add(key("lost", rank), 1)
    store.set(key("why", rank, generation), why[:2000])
    return generation


def ready_generation(store: ControlStore, rank: int) -> int:
    """The loss generation ``rank`` last acknowledged, ready to rejoin (0: none)."""
    return store.add(key("ready", rank), 0)


def log_change(store: ControlStore, decision: bytes) -> None:
    """Add a decided change of membership to the run's log (one key per entry)."""
    number = store.add(key("log", "n"), 1)
    store.set(key("log", number), decision)


def membership_log(store: ControlStore, after: int = 0, whole: bool = False
                   ) -> list[dict[str, Any]]:
    """The decided changes of membership logged after the first ``after``, in order.

    Read as the run goes (``whole`` false), the log stops at an entry that cannot be read
    yet: numbered but not written, it is read next time. Read ``whole`` once the run has
    ended, when every numbered entry has been written, an entry that cannot be read (its
    value replaced by one this run did not sign) is left out and the others are kept.
    """
    count = store.add(key("log", "n"), 0)
    out = []
    for number in range(after + 1, count + 1):
        raw = store.get_if_set(key("log", number))
        if raw is None:
            if whole:
                continue
            break
        out.append(json.loads(raw))
    return out


class ToldChanges:
    """Which entries of the membership log are told: each change of membership once, at
    the step of its first entry.

    An entry that changes nothing against those told before it (the same members, and
    none of its joiners back at a loss generation not told yet) repeats a change already
    told, as when one loss is logged at two steps, or one join twice: it is left out. The
    launcher (its lines and events, and through them the dashboards, ``summary.json``,
    the trace, ``replay`` and goodput) and :meth:`ElasticMembership.changes` (a rank's
    own record) read the log through it, so each gives every change one line, one step.
    """

    def __init__(self) -> None:
        self._ranks: frozenset[int] | None = None
        self._gens: dict[int, int] = {}

    def is_new(self, entry: dict[str, Any]) -> bool:
        """Whether ``entry`` (read in the log's order) tells a change; noted if it does."""
        ranks = frozenset(int(r) for r in entry.get("ranks", ()))
        gens = {int(r): int(g) for r, g in (entry.get("gens") or {}).items()}
        back = [int(r) for r in entry.get("joined", ())
                if int(r) not in gens or gens[int(r)] != self._gens.get(int(r))]
        if ranks == self._ranks and not back:
            return False
        self._ranks = ranks
        self._gens.update({r: g for r, g in gens.items() if r in ranks})
        return True


@dataclass(frozen=True)
class Look:
    """What a :class:`Lookout` read in the store, and when it began to read it."""

    #: This rank's loss generation.
    generation: int
    #: How many times ranks have asked this rank for the state (the ``asked`` counter).
    asked: int
    #: ``time.monotonic()`` before the reads: the values are at least this recent.
    at: float


class Lookout:
    """What a rank would otherwise ask the store before every training step, read by a
    thread of its own: its loss generation (declared lost since the round admitted it?)
    and the requests for its state (a rank joining a round under way).

    The step takes a :meth:`look` no older than :data:`LOOK_FRESH_S` instead of asking
    the store; an older one (a process frozen and thawed, a thread starved, a store out of
    reach) makes the step ask the store itself, as it did before every step. Both values
    only grow, so a look can be late but never wrong the other way: a loss is noticed at
    most :data:`LOOK_FRESH_S` later on the step's path, and at once by any collective's
    vote or round decision, which read the store.

    Args:
        open_store: opens a client of the run's store (the thread's own).
        rank: this rank.
        interval_s: seconds between looks.
    """

    def __init__(self, open_store: Callable[[float], ControlStore], rank: int,
                 interval_s: float = LOOK_S):
        self.rank = rank
        self.interval_s = interval_s
        self._latest: Look | None = None
        self._stop = threading.Event()
        # The thread holds the lookout weakly: a lookout dropped without stop() ends it too.
        self._thread = threading.Thread(target=_keep_looking,
                                        args=(weakref.ref(self), open_store, self._stop),
                                        name=f"exogym-lookout-{rank}", daemon=True)
        self._thread.start()

    def read(self, store: ControlStore) -> None:
        """Take one look through ``store`` (the thread's)."""
        at = time.monotonic()
        generation = loss_generation(store, self.rank)
        asked = store.add(key("asked", self.rank), 0)
        self._latest = Look(generation, asked, at)

    def look(self) -> Look | None:
        """The latest look, if no older than :data:`LOOK_FRESH_S` (None: ask the store)."""
        latest = self._latest
        if latest is None or time.monotonic() - latest.at > LOOK_FRESH_S:
            return None
        return latest

    def stop(self) -> None:
        """End the thread: at once between looks; one blocked on a store out of reach ends
        with the process (a daemon), not waited for beyond :data:`LOOK_FRESH_S`."""
        self._stop.set()
        self._thread.join(timeout=LOOK_FRESH_S)


def _keep_looking(ref: weakref.ref[Lookout], open_store: Callable[[float], ControlStore],
                  stop: threading.Event) -> None:
    store = None
    interval = LOOK_S
    while True:
        lookout = ref()
        if lookout is None:
            return
        interval = lookout.interval_s
        try:
            if store is None:
                store = open_store(10.0)
            lookout.read(store)
        except Exception:  # noqa: BLE001 - out of reach: the look goes stale, the step asks
            store = None
        del lookout
        if stop.wait(interval):
            return


def declare_absent(store: ControlStore, rank: int, why: str) -> None:
    """Declare ``rank`` lost before the run starts (its host did not answer pre-flight; the
    launcher does, before any rank starts): the start's members leave it out, and it
    joins, as a lost rank rejoins, once its host answers."""
    generation = declare_lost(store, rank, why)
    store.set(key("absent", rank), str(generation))


def _return_verb(store: ControlStore, rank: int, generation: int) -> str:
    """``joined`` for a rank that comes in for the first time (absent at the start, not
    lost since), ``rejoined`` for one that was a member before."""
    raw = store.get_if_set(key("absent", rank))
    return "joined" if raw is not None and int(raw) == generation else "rejoined"


def _phrase(ranks: Sequence[int], hosts: dict[int, str], verb: str) -> str:
    named = ", ".join(f"{hosts[r]} (rank {r})" if r in hosts else f"rank {r}" for r in ranks)
    return f"{named} {verb}"


class ElasticMembership:
    """Which ranks train each round of a run across hosts, decided as the run goes
    (a :class:`exogym.membership.simulated.RunMembership`).

    The same questions as :class:`exogym.membership.simulated.Membership` (which a
    simulation's ``rank_failures`` fixes in advance), answered from the
    decisions in the store (see the module).

    Args:
        world: this rank's collectives (:class:`exogym.comm.elastic_groups.ElasticGroups`).
        rank: this rank.
        num_nodes: ranks in the run.
        round_steps: steps per round of the strategy (``Strategy.round_steps``).
        min_nodes: the run stops when fewer ranks than this remain.
    """

    #: Members take the data shard of their place among the members (exogym.data.loading).
    reshards = True
    #: A returning rank may join a round under way (see the module).
    can_admit_mid_round = True
    #: Decided through the launcher's store.
    decided_in_store = True

    def __init__(self, world: ElasticGroups, rank: int, num_nodes: int, round_steps: int,
                 min_nodes: int):
        self.world = world
        self.store = world.store
        self.rank = rank
        self.num_nodes = num_nodes
        self.round_steps = max(1, int(round_steps))
        self.min_nodes = min_nodes
        self.decisions: dict[int, dict[str, Any]] = {}
        #: True for a process that starts after this rank was lost: it joins a running round.
        self.joining = loss_generation(self.store, rank) > 0
        #: Whether a returning rank may join a round under way (set by the training loop).
        self.admits_mid_round = False
        #: The run's length, where a round is cut short by it (set by the training loop).
        self.max_steps: int | None = None
        #: Each round's closed record of the ranks that joined it under way, by its start.
        self.late: dict[int, dict[str, Any]] = {}
        #: (round start, step) at which this rank joined a round under way, until it ends.
        self.joined_late: tuple[int, int] | None = None
        #: Reads off the training step what it would ask the store (:meth:`watch`).
        self.lookout: Lookout | None = None
        self._host_names: dict[int, str] = {}

    def watch(self, open_store: Callable[[float], ControlStore]) -> None:
        """Read this rank's loss generation and the requests for its state in a thread of
        its own (:class:`Lookout`, through a client ``open_store`` opens), so that a step
        inside a round asks the store nothing while the membership holds."""
        if self.lookout is None:
            self.lookout = Lookout(open_store, self.rank)

    def close(self) -> None:
        """Stop the thread of :meth:`watch`."""
        if self.lookout is not None:
            self.lookout.stop()
            self.lookout = None

    def _look(self) -> Look | None:
        return self.lookout.look() if self.lookout is not None else None

    def _lost_here(self) -> bool:
        """True once this rank has been declared lost since the round admitted it (as a
        fresh look says, else as the store does)."""
        look = self._look()
        generation = look.generation if look is not None else loss_generation(self.store,
                                                                               self.rank)
        return generation > self.world.generations.get(self.rank, 0)

    # -- decisions --------------------------------------------------------------------

    def _round_start(self, step: int) -> int:
        h = self.round_steps
        return (max(1, step) - 1) // h * h + 1

    def _hosts(self) -> dict[int, str]:
        """Each rank's host, as the launcher named it (kept: a rank's host has one name)."""
        for r in range(self.num_nodes):
            if r not in self._host_names:
                raw = self.store.get_if_set(key("host", r))
                if raw is not None:
                    self._host_names[r] = raw.decode()
        return dict(self._host_names)

    def _propose(self, start: int) -> dict[str, Any]:
        lost = {r: loss_generation(self.store, r) for r in range(self.num_nodes)}
        earlier = [s for s in self.decisions if s < start]
        hosts = self._hosts()
        if not earlier:
            # A rank declared lost before the start (its host did not answer pre-flight) is
            # no member: it joins, as a lost rank rejoins, once its host answers.
            members = [r for r in range(self.num_nodes) if lost[r] == 0]
            return {"step": start, "epoch": start, "ranks": members, "gens": lost, "joined": [],
                    "left": [],
                    "reason": "start", "hosts": [hosts.get(r, f"rank {r}") for r in members],
                    "stop": None}
        previous = self.decisions[max(earlier)]
        gens = {int(r): g for r, g in previous["gens"].items()}
        ranks = set(previous["ranks"])
        for r, joined_at in self._late_joins(max(earlier)).items():
            ranks.add(r)  # joined that round under way, with the generation it joined at
            gens[r] = joined_at["gen"]
        stay = [r for r in sorted(ranks) if lost[r] == gens[r]]
        # Where ranks join rounds under way, a returning rank asks for the state itself.
        joined = [] if self.admits_mid_round else [
            r for r in range(self.num_nodes)
            if r not in stay and lost[r] > 0 and ready_generation(self.store, r) == lost[r]]
        left = sorted(ranks - set(stay) - set(joined))
        members = sorted(stay + joined)
        parts = []
        if left:
            whys = []
            for r in left:
                k = key("why", r, lost[r])
                whys.append(self.store.get(k).decode() if self.store.check([k]) else "lost")
            parts.append(_phrase(left, hosts, "lost") + f" ({'; '.join(whys)})")
        for verb in ("joined", "rejoined"):
            these = [r for r in joined if _return_verb(self.store, r, lost[r]) == verb]
            if these:
                parts.append(_phrase(these, hosts, verb))
        stop = None
        if len(members) < self.min_nodes:
            stop = (f"{'; '.join(parts) or 'ranks lost'}: {len(members)} of {self.num_nodes} "
                    f"ranks remain, fewer than min_nodes={self.min_nodes}")
        # A new membership begins (its ranks form a group of their own) where ranks change.
        late = self.late.get(max(earlier))
        if joined or left:
            epoch = start
        elif late is not None and late["ranks"]:  # the group formed at that round's end
            epoch = late["closed_at"]
        else:
            epoch = previous.get("epoch", start)
        return {"step": start, "epoch": epoch, "ranks": members,
                "gens": {r: lost[r] for r in members}, "joined": joined, "left": left,
                "reason": "; ".join(parts) or "no change",
                "hosts": [hosts.get(r, f"rank {r}") for r in members], "stop": stop}

    def decision(self, step: int) -> dict[str, Any]:
        """The members of the round that contains ``step`` (deciding them if this rank is first)."""
        start = self._round_start(step)
        found = self.decisions.get(start)
        if found is None:
            k = key("members", start)
            raw = self.store.get_if_set(k)
            if raw is None:
                # "by" makes each rank's proposal its own: only the winner logs the decision.
                proposal = json.dumps({**self._propose(start), "by": self.rank}).encode()
                raw = self.store.compare_set(k, "", proposal)
                if raw == proposal:
                    self.store.set(key("latest"), str(start))
                    stop = json.loads(raw)["stop"]
                    if stop:  # the launcher watches for it: the job is over, nothing rejoins
                        self.store.set(key("stop"), stop)
                    if json.loads(raw)["reason"] not in ("no change",):
                        log_change(self.store, raw)
            found = self.decisions[start] = json.loads(raw)
            gens = {int(r): int(g) for r, g in found["gens"].items()}
            found["gens"] = gens
            self.world.generations.update(gens)
        if found.get("stop"):
            raise MembershipStop(found["stop"], found["left"])
        return found

    # -- what TrainNode asks (the same as Membership) -----------------------------------

    def is_present(self, rank: int, step: int) -> bool:
        """True when ``rank`` trains step ``step``; for this rank, False once it was declared lost."""
        if rank == self.rank and self._lost_here():
            return False
        if rank in self.decision(step)["ranks"]:
            return True
        return self._joined_by(rank, step)

    def present(self, step: int) -> frozenset[int]:
        """The ranks that train step ``step`` (with those that joined its round under way,
        from the round's last step on; a joiner counts itself from its first step)."""
        ranks = set(self.decision(step)["ranks"])
        start = self._round_start(step)
        record = self.late.get(start)
        if record is not None and step >= record["closed_at"]:
            ranks.update(int(r) for r in record["ranks"])
        if self._joined_by(self.rank, step):
            ranks.add(self.rank)
        return frozenset(ranks)

    def epoch(self, step: int) -> int:
        """The step at which the membership of ``step`` began (a round that ranks joined
        under way: its last step, where the members and the joiners form one group)."""
        start = self._round_start(step)
        record = self.late.get(start)
        if record is not None and record["ranks"] and step >= record["closed_at"]:
            return int(record["closed_at"])
        return int(self.decision(step)["epoch"])

    def joiners(self, step: int) -> list[int]:
        """Ranks that rejoin at ``step`` (a round boundary)."""
        if step != self._round_start(step):
            return []
        return list(self.decision(step)["joined"])

    def source(self, step: int) -> int:
        """The member that hands the state to the ranks rejoining at ``step``."""
        decided = self.decision(step)
        return min(set(decided["ranks"]) - set(decided["joined"]))

    def shard(self, rank: int, step: int) -> tuple[int, int]:
        """``rank``'s place among the members of ``step`` and their number: its data shard."""
        members = set(self.decision(step)["ranks"])
        if rank == self.rank and self.joined_late is not None:
            members.add(rank)  # a joiner reads the shard it will hold next round
        members = sorted(members)
        return members.index(rank), len(members)

    def next_join(self, rank: int, step: int,
                  join_late: Callable[[int], int | None] | None = None) -> int | None:
        """Wait until this rank is admitted again; the step it rejoins at.

        Acknowledges its loss generation (ready to rejoin), then follows the
        round decisions until one admits it. With ``join_late`` (given the loss
        generation: the step at which it joined a round under way, or None), it
        tries that too, every :data:`LATE_TRY_S` seconds. Raises
        :class:`MembershipStop` if the run stops meanwhile, ``PeerTimeoutError``
        after the world's timeout.
        """
        if rank != self.rank:
            raise ValueError("only a rank's own return can be waited for")
        store = self.store
        deadline = time.monotonic() + self.world.timeout_s
        generation = self.acknowledge()
        next_try = time.monotonic()
        latest = key("latest")
        start = self._round_start(step)
        if store.check([latest]):
            start = max(start, int(store.get(latest)))
        while True:
            if store.check([key("finished")]):
                return None  # the run ended while this rank was away
            now = loss_generation(store, rank)
            if now != generation:  # lost again while waiting: acknowledge that one
                generation = self.acknowledge()
            if join_late is not None and time.monotonic() >= next_try:
                joined = join_late(generation)
                if joined is not None:
                    return joined
                next_try = time.monotonic() + LATE_TRY_S
            k = key("members", start)
            if store.check([k]):
                decided = json.loads(store.get(k))
                if decided.get("stop"):
                    raise MembershipStop(decided["stop"], decided["left"])
                gens = {int(r): int(g) for r, g in decided["gens"].items()}
                if rank in decided["joined"] and gens.get(rank) == generation:
                    decided["gens"] = gens
                    self.decisions = {start: decided}
                    self.world.generations.update(gens)
                    self.joining = False
                    return start
                start += self.round_steps
                continue
            if time.monotonic() > deadline:
                raise PeerTimeoutError(f"rank {rank} waited {self.world.timeout_s:.0f} s to rejoin")
            time.sleep(0.05)

    # -- joining a round under way ------------------------------------------------------

    def round_end(self, step: int) -> int:
        """The last step of the round that contains ``step`` (the run's last, if sooner)."""
        end = self._round_start(step) + self.round_steps - 1
        return min(end, self.max_steps) if self.max_steps else end

    def _joined_by(self, rank: int, step: int) -> bool:
        """True when ``rank`` joined the round of ``step`` under way, at ``step`` or before
        (as this rank knows: its own join, or the round's closed record)."""
        start = self._round_start(step)
        if rank == self.rank and self.joined_late is not None:
            return self.joined_late[0] == start and self.joined_late[1] <= step
        record = self.late.get(start)
        return record is not None and step >= record["closed_at"] and str(rank) in record["ranks"]

    def in_members_group(self, step: int) -> bool:
        """False while this rank, joined under way, trains steps before its round's last:
        the members' group takes it only there (nothing of theirs may wait for it)."""
        if self.joined_late is None:
            return True
        start, _ = self.joined_late
        if self._round_start(step) != start:
            self.joined_late = None  # that round is over: a member like any other
            return True
        return step >= self.round_end(step)

    def _late_joins(self, start: int) -> dict[int, dict[str, Any]]:
        """The ranks that joined the round of ``start`` under way (its closed record)."""
        record = self.late.get(start)
        if record is None:
            return {}
        return {int(r): v for r, v in record["ranks"].items()}

    def late_joins(self, step: int) -> dict[int, dict[str, Any]]:
        """The ranks that joined the round of ``step`` under way, once it is closed
        (:meth:`close_round`): each one's first step (``at``) and strategy's ``note``."""
        return {r: {"at": int(v["at"]), "note": v.get("note") or {}}
                for r, v in self._late_joins(self._round_start(step)).items()}

    def close_round(self, step: int) -> None:
        """At the last step of its round: close the round's record of joins under way (the
        first member there closes it, by compare-and-set) and read who joined, whom the
        closing collective's group then takes in."""
        start = self._round_start(step)
        if start in self.late or not self.admits_mid_round:
            return
        k = key("late", start)
        raw = None  # most rounds have no record: closing an empty one is one round trip
        while True:
            record = json.loads(raw) if raw else {"closed": False, "ranks": {}}
            if record["closed"]:
                break
            closed = json.dumps({**record, "closed": True}).encode()
            got = self.store.compare_set(k, raw or "", closed)
            if got == closed:
                record["closed"] = True
                break
            raw = got
        record["closed_at"] = step
        self.late[start] = record
        for r, joined_at in record["ranks"].items():
            self.world.generations[int(r)] = int(joined_at["gen"])

    def current_round(self) -> tuple[int, dict[str, Any]] | None:
        """The round being trained now and its decision, as the store holds them (None
        before the first decision)."""
        raw = self.store.get_if_set(key("latest"))
        if raw is None:
            return None
        start = int(raw)
        decided = self.store.get_if_set(key("members", start))
        if decided is None:
            return None
        return start, json.loads(decided)

    def live_source(self, decided: dict[str, Any]) -> int | None:
        """The lowest member of a round's decision not lost since it (None: none is left)."""
        live = self.live_members(decided)
        return live[0] if live else None

    def live_members(self, decided: dict[str, Any]) -> list[int]:
        """The members of a round's decision not lost since it, this rank aside, lowest
        first."""
        gens = {int(r): int(g) for r, g in decided["gens"].items()}
        return [r for r in sorted(decided["ranks"])
                if r != self.rank and loss_generation(self.store, r) == gens[r]]

    def ask_state(self, source: int, generation: int,
                  what: dict[str, Any] | None = None) -> str:
        """Ask ``source`` for the state (this rank, at its loss ``generation``; ``what``:
        the helpers that send shares of it, or the share asked of a helper); the name of
        the link it will come on."""
        number = self.store.add(key("asked", source), 1)
        name = f"r{self.rank}g{generation}n{number}-{source}"
        self.store.set(key("asked", source, number),
                       json.dumps({**(what or {}), "rank": self.rank, "gen": generation,
                                   "link": name, "asked_at": time.time()}))
        return name

    def state_requests(self, seen: int) -> tuple[list[dict[str, Any]], int]:
        """Requests for the state made of this rank after the first ``seen`` (every one
        still valid: its rank not lost again since), and how many it has read now.

        Each request is taken once, by whichever process of this rank reads it first: a
        rank started again after it served some does not serve them a second time (their
        joiners, still live, took the state long ago and never come to those links)."""
        look = self._look()
        if look is not None and look.asked <= seen:
            return [], seen  # none since: nothing to ask the store
        count = self.store.add(key("asked", self.rank), 0)
        out = []
        while seen < count:
            raw = self.store.get_if_set(key("asked", self.rank, seen + 1))
            if raw is None:  # numbered but not written yet: read it next time
                break
            seen += 1
            request = json.loads(raw)
            if (loss_generation(self.store, int(request["rank"])) == int(request["gen"])
                    and self.store.add(key("asked", self.rank, seen, "taken"), 1) == 1):
                out.append(request)
        return out, seen

    def join_late(self, step: int, generation: int,
                  note: dict[str, Any] | None = None) -> bool:
        """Enter this rank in the joins of the round that contains ``step``, training from
        ``step`` (at its loss ``generation``, with the strategy's ``note`` for the members,
        :meth:`late_joins`); False when the round's record is closed."""
        start = self._round_start(step)
        k = key("late", start)
        raw = self.store.get_if_set(k)
        while True:
            record = json.loads(raw) if raw else {"closed": False, "ranks": {}}
            if record["closed"]:
                return False
            record["ranks"][str(self.rank)] = {"at": step, "gen": generation,
                                               "note": note or {}}
            desired = json.dumps(record).encode()
            got = self.store.compare_set(k, raw or "", desired)
            if got == desired:
                break
            raw = got
        # The round's members decide it (the first of them at its start): a joiner only
        # reads that, waiting for it if it joins the round before they have begun it.
        decided_key = key("members", start)
        if not self.store.wait([decided_key], self.world.timeout_s):
            raise PeerTimeoutError(f"rank {self.rank} joined the round of step {start}, but "
                                   f"no member began it within {self.world.timeout_s:.0f} s")
        found = json.loads(self.store.get(decided_key))
        found["gens"] = {int(r): int(g) for r, g in found["gens"].items()}
        self.world.generations.update(found["gens"])
        self.decisions = {start: found}
        self.world.generations[self.rank] = generation
        self.joined_late = (start, step)
        self.joining = False
        hosts = self._hosts()
        # the round's members, with every rank that joined it under way so far
        members = sorted({*found["ranks"], *map(int, record["ranks"]), self.rank})
        log_change(self.store, json.dumps({
            "step": step, "epoch": start, "ranks": members, "joined": [self.rank], "left": [],
            "gens": {self.rank: generation}, "reason": _phrase([self.rank], hosts,
                                          f"{_return_verb(self.store, self.rank, generation)} "
                                          "during a round"),
            "hosts": [hosts.get(r, f"rank {r}") for r in members], "stop": None}).encode())
        return True

    def acknowledge(self) -> int:
        """Say this rank is ready to come back (at its loss generation, returned)."""
        generation = loss_generation(self.store, self.rank)
        self.store.set(key("ready", self.rank), str(generation))
        return generation

    def drop(self, reason: str) -> None:
        """Declare this rank lost itself (its hand-over failed): it rejoins at a later round."""
        declare_lost(self.store, self.rank, reason)

    def stop(self, reason: str) -> None:
        """Stop the run for every rank (the launcher watches for it)."""
        self.store.compare_set(key("stop"), "", reason)

    def finish(self, ranks: Sequence[int] | None = None) -> tuple[list[int], int] | None:
        """Say the run has ended (a rank still waiting to rejoin then stops waiting).

        Args:
            ranks: the ranks that met this rank at the run's last collective, and so
                hold the final model (None: this rank was away at the end).

        Returns:
            The ranks that ended the run with the final model and the one of them that
            writes the outputs, as the first of them to finish recorded it (None where
            none has). The writer is the lowest of those never lost, else of those lost
            the fewest times: a rank started again holds the history of its own steps
            only, and the summary it writes would lack the merges before.
        """
        finished = key("finished")
        if ranks is not None:
            # Every rank that ended the run met the same last collective: one record.
            ranks = sorted(int(r) for r in ranks)
            writer = min(ranks, key=lambda r: (loss_generation(self.store, r), r))
            self.store.compare_set(finished, "",
                                   json.dumps({"ranks": ranks, "writer": writer}))
        raw = self.store.get_if_set(finished)
        try:
            found = json.loads(raw) if raw else None
        except ValueError:
            return None
        if not isinstance(found, dict):
            return None
        return sorted(int(r) for r in found["ranks"]), int(found["writer"])

    def changes(self, max_steps: int | None = None) -> list[dict[str, Any]]:
        """Every decided change of membership, each once (:class:`ToldChanges`):
        ``{"step", "ranks", "hosts", "reason"}``."""
        told = ToldChanges()
        out = [{k: entry[k] for k in ("step", "ranks", "hosts", "reason")}
               for entry in membership_log(self.store, whole=True)
               if told.is_new(entry) and (max_steps is None or entry["step"] <= max_steps)]
        return sorted(out, key=lambda e: e["step"])
