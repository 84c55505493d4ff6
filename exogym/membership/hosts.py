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
  (:mod:`exogym.comm.elastic_groups` says how they agree).
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
import time
from collections.abc import Sequence
from typing import Any

from exogym.comm.elastic_groups import NAMESPACE, ElasticGroups, key, loss_generation
from exogym.comm.protocol import PeerLost, PeerTimeoutError, RankDropped
from exogym.comm.store import ControlStore
from exogym.membership.simulated import MembershipStop

__all__ = ["ElasticMembership", "MembershipStop", "NAMESPACE", "PeerLost", "RankDropped",
           "declare_lost", "key", "loss_generation", "membership_log", "ready_generation"]


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


def membership_log(store: ControlStore, after: int = 0) -> list[dict[str, Any]]:
    """The decided changes of membership logged after the first ``after``, in order."""
    count = store.add(key("log", "n"), 0)
    out = []
    for number in range(after + 1, count + 1):
        raw = store.get_if_set(key("log", number))
        if raw is None:  # numbered but not written yet: read it next time
            break
        out.append(json.loads(raw))
    return out


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

    # -- decisions --------------------------------------------------------------------

    def _round_start(self, step: int) -> int:
        h = self.round_steps
        return (max(1, step) - 1) // h * h + 1

    def _hosts(self) -> dict[int, str]:
        names = {}
        for r in range(self.num_nodes):
            k = key("host", r)
            if self.store.check([k]):
                names[r] = self.store.get(k).decode()
        return names

    def _propose(self, start: int) -> dict[str, Any]:
        lost = {r: loss_generation(self.store, r) for r in range(self.num_nodes)}
        earlier = [s for s in self.decisions if s < start]
        hosts = self._hosts()
        if not earlier:
            members = list(range(self.num_nodes))
            return {"step": start, "epoch": start, "ranks": members, "gens": lost, "joined": [],
                    "left": [],
                    "reason": "start", "hosts": [hosts.get(r, f"rank {r}") for r in members],
                    "stop": None}
        previous = self.decisions[max(earlier)]
        gens = {int(r): g for r, g in previous["gens"].items()}
        stay = [r for r in previous["ranks"] if lost[r] == gens[r]]
        ready = {r: ready_generation(self.store, r) for r in range(self.num_nodes)}
        joined = [r for r in range(self.num_nodes)
                  if r not in stay and lost[r] > 0 and ready[r] == lost[r]]
        left = sorted(set(previous["ranks"]) - set(stay) - set(joined))
        members = sorted(stay + joined)
        parts = []
        if left:
            whys = []
            for r in left:
                k = key("why", r, lost[r])
                whys.append(self.store.get(k).decode() if self.store.check([k]) else "lost")
            parts.append(_phrase(left, hosts, "lost") + f" ({'; '.join(whys)})")
        if joined:
            parts.append(_phrase(joined, hosts, "rejoined"))
        stop = None
        if len(members) < self.min_nodes:
            stop = (f"{'; '.join(parts) or 'ranks lost'}: {len(members)} of {self.num_nodes} "
                    f"ranks remain, fewer than min_nodes={self.min_nodes}")
        # A new membership begins (its ranks form a group of their own) where ranks change.
        epoch = start if joined or left else previous.get("epoch", start)
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
            if self.store.check([k]):
                raw = self.store.get(k)
            else:
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
        if rank == self.rank and self.world.lost_since_admitted(rank):
            return False
        return rank in self.decision(step)["ranks"]

    def present(self, step: int) -> frozenset[int]:
        """The ranks that train step ``step``."""
        return frozenset(self.decision(step)["ranks"])

    def epoch(self, step: int) -> int:
        """The step at which the membership of ``step`` began."""
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
        members = self.decision(step)["ranks"]
        return members.index(rank), len(members)

    def next_join(self, rank: int, step: int) -> int | None:
        """Wait until this rank is admitted again; the step it rejoins at.

        Acknowledges its loss generation (ready to rejoin), then follows the
        round decisions until one admits it. Raises :class:`MembershipStop` if
        the run stops meanwhile, ``PeerTimeoutError`` after the world's timeout.
        """
        if rank != self.rank:
            raise ValueError("only a rank's own return can be waited for")
        store = self.store
        deadline = time.monotonic() + self.world.timeout_s
        generation = loss_generation(store, rank)
        store.set(key("ready", rank), str(generation))
        latest = key("latest")
        start = self._round_start(step)
        if store.check([latest]):
            start = max(start, int(store.get(latest)))
        while True:
            if store.check([key("finished")]):
                return None  # the run ended while this rank was away
            now = loss_generation(store, rank)
            if now != generation:  # lost again while waiting: acknowledge that one
                generation = now
                store.set(key("ready", rank), str(generation))
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

    def drop(self, reason: str) -> None:
        """Declare this rank lost itself (its hand-over failed): it rejoins at a later round."""
        declare_lost(self.store, self.rank, reason)

    def stop(self, reason: str) -> None:
        """Stop the run for every rank (the launcher watches for it)."""
        self.store.compare_set(key("stop"), "", reason)

    def finish(self) -> None:
        """Say the run has ended (a rank still waiting to rejoin then stops waiting)."""
        self.store.set(key("finished"), "1")

    def changes(self, max_steps: int | None = None) -> list[dict[str, Any]]:
        """Every decided change of membership: ``{"step", "ranks", "hosts", "reason"}``."""
        out = [{k: entry[k] for k in ("step", "ranks", "hosts", "reason")}
               for entry in membership_log(self.store)
               if max_steps is None or entry["step"] <= max_steps]
        return sorted(out, key=lambda e: e["step"])
