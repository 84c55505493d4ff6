"""Collectives among hosts that come and go: a gloo group for each membership, and a vote.

A run across hosts with ``min_nodes`` cannot use one ``torch.distributed``
process group for its whole life: such a group dies with any member. Here a
rank's collectives travel on a gloo group (``ProcessGroupGloo``: ring and
tree algorithms, so the master's link carries no more than any other
member's) formed for the members of the moment, under a store prefix of its
own, and formed anew when the members change; the launcher's store carries
only control messages (:mod:`exogym.comm.store`). The protocol:

- **Forming.** Every member of a new membership builds the group at the same
  round boundary (:meth:`ElasticGroups.enter_step`), within ``form_timeout_s``
  (``lost_after`` plus 30 s on real hosts); a group that does not form is voted
  on as a failed call is, and so, without waiting, is one with a member the
  launcher has declared lost already.
- **Every collective is voted.** A member runs the collective on a private
  copy of its tensors, then votes ``ok`` or ``fail`` in the store. It waits
  for every other member's vote; a member the launcher declares lost before
  voting has its vote sealed as lost (an atomic compare-and-set), so every
  survivor reads the same final votes. All ``ok``: every member takes the
  result. Otherwise the members that voted form the next group (named after
  the failed collective, so they all name it alike) and run the collective
  again from their untouched inputs. A round therefore completes among the
  live ranks, every survivor applies the same outer step, and a per-step
  strategy continues from the last step every survivor completed. An average
  asked of the group's members is over those that completed it.
- **Waiting is bounded by the launcher's verdict.** A collective waits for a
  slow member as long as it lives (a slow host at a round's end is not a
  failure); once the launcher declares a member lost (its process exited, its
  connection dropped, or ``lost_after`` seconds without a heartbeat), the
  survivors give the collective up at once. gloo's own timeout is only the
  backstop for a member that neither answers nor is declared lost.
- **A rank declared lost itself** (frozen, cut off) finds its vote refused
  and raises :class:`~exogym.comm.protocol.RankDropped`: it rejoins at a later
  round.

In a gather that loses a member, the member's part reads as all bits set (NaN
in a floating tensor). A broadcast from a member that is lost cannot complete:
it raises :class:`~exogym.comm.protocol.PeerLost`. A broadcast among some ranks
(the state handed to a rank that rejoins) travels on a group of the source and
the joining ranks only, in chunks of :data:`CHUNK_BYTES`.

A call given up may stay blocked in gloo's own threads until gloo's timeout,
and destroying its group would wait for it: such a group is kept until the
process ends (:func:`_keep_forever`), and no thread of ours ever waits on gloo.
That holds for the call a rank was in when it found itself dropped (thawed
after its loss) too: its process then ends at once, not at gloo's timeout.

Tensors on a GPU are staged through the CPU (gloo).
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from exogym.comm.protocol import (
    Collectives,
    PeerLost,
    PeerTimeoutError,
    RankDropped,
    ReduceOp,
    combine,
    copy_back,
    divided,
    done,
    split_into,
    to_cpu,
)
from exogym.comm.store import ControlStore

NAMESPACE = "exogym/elastic"
#: What a lost member's vote reads once a survivor has sealed it.
TOMBSTONE = b"\x00lost"
_OK, _FAIL = b"ok", b"fail"
#: A broadcast among some ranks (a hand-over) sends at most this much per message.
CHUNK_BYTES = 16 << 20
#: Chunks of such a broadcast posted before the first of them is waited on.
IN_FLIGHT = 4
#: How often a waiting rank looks in the store for lost members.
LOSS_CHECK_S = 0.2
#: Collectives a group runs again, each time among fewer or other members, before
#: the run gives up on it.
MAX_ATTEMPTS = 20
#: What torch says when a wait with a timeout ends before its collective did.
_SLICE_ENDED = "Operation timed out!"
#: Votes of its own a rank keeps track of to delete once read (others are left in the store).
VOTES_KEPT = 64
#: How long a rank polls the store quickly (every 2 ms at most) for its peers' votes
#: before it slows down (to every 20 ms).
QUICK_POLL_S = 1.0


def key(*parts: object) -> str:
    """A key of the elastic protocol in the store."""
    return "/".join([NAMESPACE, *map(str, parts)])


def loss_generation(store: ControlStore, rank: int) -> int:
    """How many times ``rank`` has been declared lost (0: never)."""
    return store.add(key("lost", rank), 0)


class _Group:
    """A formed gloo group of some members (or a member alone, with no group at all)."""

    def __init__(self, name: str, members: tuple[int, ...], rank: int, pg: Any):
        self.name = name
        self.members = members
        self.index = members.index(rank)
        self.pg = pg
        self.calls = 0
        self.transfers = 0  # hand-over groups formed: only their members count them
        self.transfer_groups: dict[tuple[int, ...], Any] = {}  # by members

    def next_call(self) -> int:
        self.calls += 1
        return self.calls


class ElasticSubgroup:
    """A group of ranks that ``new_group`` returns: formed among its present members on use."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = tuple(sorted(set(ranks)))
        self.formed: _Group | None = None


def _digest(members: Sequence[int]) -> str:
    return hashlib.blake2b(",".join(map(str, members)).encode(), digest_size=6).hexdigest()


class ElasticGroups(Collectives):
    """One rank of a run across hosts whose ranks come and go (see the module).

    Args:
        world_size: ranks in the run.
        rank: this process's rank.
        open_store: opens a client of the launcher's store (one for the rank, one
            for each group it forms).
        timeout_s: how long a rank waits for a member that neither arrives nor is
            declared lost; also gloo's own timeout for a call.
        form_timeout_s: how long forming a group may take (a member that does not come
            within it fails the group, which is then voted on).
        hosts: each rank's host, for errors (optional).
    """

    name = "elastic gloo groups"

    def __init__(self, world_size: int, rank: int, open_store: Callable[[float], ControlStore],
                 timeout_s: float = 1800.0, form_timeout_s: float = 60.0,
                 hosts: dict[int, str] | None = None):
        self._world_size = world_size
        self._rank = rank
        self._open_store = open_store
        self.timeout_s = float(timeout_s)
        self.form_timeout_s = float(min(form_timeout_s, timeout_s))
        self.store = open_store(self.timeout_s)
        self.hosts = dict(hosts or {})
        #: Each member's loss generation when the current round admitted it.
        self.generations: dict[int, int] = {r: 0 for r in range(world_size)}
        self._wanted: tuple[int, ...] = tuple(range(world_size))
        self._epoch: int | None = 1  # the step the current membership began at (None: dropped)
        self._wanted_name = f"e1-{_digest(self._wanted)}"
        self._group: _Group | None = None
        self._given_up: list[tuple[Any, Any]] = []  # (group, its call that may still hang)
        self._group_stores: list[ControlStore] = []  # the stores the formed groups met through
        # This rank's votes not deleted yet, with their calls' members (for tidying up).
        self._own_votes: list[tuple[str, frozenset[int]]] = []
        #: What the rank waits for now, for a watchdog's message (None: nothing).
        self.waiting_for: str | None = None
        #: Called between the slices of a wait for the members' collective (None: nothing):
        #: the rank's state stands still meanwhile, so a joiner's request can be served.
        self.while_waiting: Callable[[], None] | None = None

    # -- who, where -----------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return True

    def rank(self) -> int:
        return self._rank

    def world_size(self) -> int:
        return self._world_size

    def _host(self, rank: int) -> str:
        host = self.hosts.get(rank)
        if host is None:
            raw = self.store.get_if_set(key("host", rank))
            host = raw.decode() if raw else "?"
            self.hosts[rank] = host
        return f"rank {rank} ({host})"

    def lost_since_admitted(self, rank: int) -> bool:
        """True when ``rank`` has been declared lost since the current round admitted it."""
        return loss_generation(self.store, rank) > self.generations.get(rank, 0)

    def check_self(self) -> None:
        """Raise :class:`RankDropped` once this rank has been declared lost."""
        if self.lost_since_admitted(self._rank):
            self._dropped("was declared lost by the launcher (it stopped answering)")

    def _dropped(self, why: str) -> None:
        """This rank is out of the run's groups until a round admits it again."""
        self._abandon()
        self._epoch = None
        raise RankDropped(f"rank {self._rank} {why}: it rejoins once the members admit it")

    # -- membership ----------------------------------------------------------------------

    def enter_step(self, step: int, members: Sequence[int] | None,
                   epoch: int | None = None) -> None:
        """At ``step``: a membership that began at step ``epoch`` gets a group of its own,
        formed by every member now, at the round boundary; within a membership the group
        is whatever its losses left of it."""
        wanted = tuple(range(self._world_size)) if members is None else tuple(sorted(members))
        if self._rank not in wanted:
            raise RuntimeError(f"rank {self._rank} entered step {step}, where it is no member "
                               f"(members {list(wanted)})")
        epoch = 1 if epoch is None else int(epoch)
        if epoch == self._epoch and self._group is not None:
            return
        if epoch != self._epoch:
            self._abandon()
            self._epoch = epoch
            self._wanted_name = f"e{epoch}-{_digest(wanted)}"
        self._wanted = wanted
        self._main()

    def group_ranks(self, group: Any = None) -> list[int]:
        if isinstance(group, ElasticSubgroup):
            members = self._group.members if self._group is not None else self._wanted
            return [r for r in group.ranks if r in members]
        return list(self._group.members if self._group is not None else self._wanted)

    def new_group(self, ranks: Sequence[int]) -> ElasticSubgroup:
        return ElasticSubgroup(ranks)

    # -- forming groups ------------------------------------------------------------------

    def _abandon(self, group: _Group | None = None, pending: Any = None) -> None:
        """Give up ``group`` (default: the current one), whose call ``pending`` may still be
        blocked in gloo (None: none is)."""
        group = group or self._group
        if group is None:
            return
        if group is self._group:
            self._group = None
        if group.pg is not None:
            self._given_up.append((group.pg, pending))
        self._given_up.extend((pg, None) for pg in group.transfer_groups.values())
        group.transfer_groups = {}

    def _keep_with(self, pg: Any, calls: Sequence[Any]) -> None:
        """``pg`` is given up while ``calls`` of it may still be blocked in gloo's threads
        (this rank was dropped in the middle of them): :meth:`close` keeps it for good
        instead of destroying it, whose destructor would wait for them until gloo's
        timeout."""
        if pg is not None:
            self._given_up.extend((pg, call) for call in calls if call is not None)

    def _main(self) -> _Group:
        if self._group is None:
            self._group = self._form(self._wanted_name, self._wanted)
        return self._group

    def _resolve(self, group: Any) -> _Group:
        main = self._main()
        if not isinstance(group, ElasticSubgroup):
            return main
        members = tuple(r for r in group.ranks if r in main.members)
        formed = group.formed
        if formed is None or formed.members != members or not formed.name.startswith(main.name):
            if formed is not None:
                self._abandon(formed)
            group.formed = self._form(f"{main.name}/sub-{_digest(members)}", members)
        return group.formed

    def _form(self, name: str, members: tuple[int, ...]) -> _Group:
        """The group ``name`` of ``members``, formed with every member (voted; on a loss,
        formed again among those left).

        Raises:
            RuntimeError: twice in a row every member was there and alive, yet the group
                did not form (the hosts cannot reach each other's gloo ports).
        """
        alike = 0
        for _ in range(MAX_ATTEMPTS):
            # A member declared lost already never comes: rather than wait the form timeout
            # for it, vote at once (the vote seals it lost; the others form without it).
            gone = any(self.lost_since_admitted(m) for m in members if m != self._rank)
            pg, ok = (None, False) if gone else self._build(name, members)
            if pg is None and ok:
                return _Group(name, members, self._rank, None)  # a member alone
            committed, survivors = self._vote(name, "form", members, ok)
            if committed:
                return _Group(name, members, self._rank, pg)
            if pg is not None:
                self._given_up.append((pg, None))
            alike = alike + 1 if survivors == members else 0
            if alike == 2:
                raise RuntimeError(
                    f"rank {self._rank}: the group of {', '.join(map(self._host, members))} did "
                    f"not form twice in {self.form_timeout_s:.0f} s although every member is "
                    "alive: the hosts cannot reach each other's gloo connections (check "
                    "that each host reaches the others' addresses on any port, and "
                    "GLOO_SOCKET_IFNAME)")
            name, members = f"{name}/f", survivors
        raise RuntimeError(f"rank {self._rank}: could not form a group after {MAX_ATTEMPTS} "
                           f"attempts (last: ranks {list(members)})")

    def _build(self, name: str, members: tuple[int, ...],
               is_lost: Callable[[int], bool] | None = None) -> tuple[Any, bool]:
        """A gloo group of ``members`` under the store prefix ``name`` (None alone), and
        whether it formed within ``form_timeout_s``: False at once when a member is
        declared lost (``is_lost``; default: since the round admitted it) before every
        member arrived."""
        if len(members) == 1:
            return None, True
        if not self._arrive(name, members, is_lost or self.lost_since_admitted):
            return None, False
        self.waiting_for = f"forming group {name} of {', '.join(map(self._host, members))}"
        client = self._open_store(self.form_timeout_s)
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(key("pg", name) + "/", client.raw),
                                       members.index(self._rank), len(members),
                                       timedelta(seconds=self.form_timeout_s))
        except Exception:  # noqa: BLE001 - a member did not come in time: voted on
            return None, False
        finally:
            self.waiting_for = None
        pg.set_timeout(timedelta(seconds=self.timeout_s))
        # The group holds the store's C++ side only; a signed store's Python side must
        # outlive it.
        self._group_stores.append(client)
        return pg, True

    def _arrive(self, name: str, members: tuple[int, ...],
                is_lost: Callable[[int], bool]) -> bool:
        """Wait until every member of group ``name`` has come to form it: True, or False
        once one is declared lost (its arrival sealed, so every member reads the same),
        after ``form_timeout_s``, or when this rank's own arrival was sealed.

        gloo's rendezvous cannot be interrupted: a member killed while the others wait
        in it would hold them the whole form timeout. Here they wait in the store,
        looking for losses every :data:`LOSS_CHECK_S`, and enter gloo only together.
        """
        store = self.store
        base = key("arrive", name)
        if store.compare_set(f"{base}/{self._rank}", "", _OK) != _OK:
            return False  # declared lost while it came: the vote drops it
        slots = {m: f"{base}/{m}" for m in members if m != self._rank}
        start = time.monotonic()
        deadline = start + self.form_timeout_s
        next_check = start + LOSS_CHECK_S
        delay = 0.0002
        self.waiting_for = f"the members of group {name} ({', '.join(map(self._host, members))})"
        try:
            while (found := store.values_if_set(list(slots.values()))) is None:
                now = time.monotonic()
                if now >= next_check:
                    for peer, slot in slots.items():
                        if not store.check([slot]) and is_lost(peer):
                            store.compare_set(slot, "", TOMBSTONE)
                    next_check = now + LOSS_CHECK_S
                if now > deadline:
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 0.002 if now - start < QUICK_POLL_S else 0.02)
        finally:
            self.waiting_for = None
        return all(v == _OK for v in found)

    # -- waiting and voting --------------------------------------------------------------

    def _completes(self, work: Any, members: Sequence[int], what: str) -> bool:
        """Wait for ``work`` (a gloo collective) to complete; False if it failed, or once a
        member is declared lost (the call is then given up where it stands).

        It waits in slices of :data:`LOSS_CHECK_S` (a collective's wait may time out and be
        waited on again; gloo's own waits of a send or receive may not, which is why the
        hand-over is a broadcast too), looking for lost members between them.
        """
        deadline = time.monotonic() + self.timeout_s
        self.waiting_for = what
        try:
            while True:
                try:
                    work.wait(timedelta(seconds=LOSS_CHECK_S))
                    return True
                except Exception as exc:  # noqa: BLE001 - a peer's connection failed: voted on
                    if _SLICE_ENDED not in str(exc):
                        return False
                self.check_self()
                if any(self.lost_since_admitted(m) for m in members if m != self._rank):
                    return False
                if self.while_waiting is not None:
                    self.while_waiting()
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(
                        f"rank {self._rank}: {what} did not finish within "
                        f"{self.timeout_s:.0f} s, and no member was declared lost")
        finally:
            self.waiting_for = None

    def _final_votes(self, base: str, members: tuple[int, ...], what: str) -> dict[int, bytes]:
        """Every other member's vote under ``base``, or the tombstone for one declared lost
        before it voted (sealed here, so a vote that comes later is refused and every
        survivor reads the same)."""
        store = self.store
        slots = {m: f"{base}/{m}" for m in members if m != self._rank}
        if not slots:
            return {}
        start = time.monotonic()
        deadline = start + self.timeout_s
        next_check = start + LOSS_CHECK_S
        delay = 0.0002
        # One round trip a look, and one more to read the votes once all are there.
        while (found := store.values_if_set(list(slots.values()))) is None:
            now = time.monotonic()
            if now >= next_check:
                self.check_self()
                for peer, slot in slots.items():
                    if not store.check([slot]) and self.lost_since_admitted(peer):
                        store.compare_set(slot, "", TOMBSTONE)
                next_check = now + LOSS_CHECK_S
            if now > deadline:
                missing = [p for p, slot in slots.items() if not store.check([slot])]
                raise PeerTimeoutError(
                    f"rank {self._rank}: {', '.join(map(self._host, missing))} neither finished "
                    f"{what} nor was declared lost within {self.timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.002 if now - start < QUICK_POLL_S else 0.02)
        return dict(zip(slots, found))

    def _vote(self, name: str, call: str, members: tuple[int, ...],
              ok: bool) -> tuple[bool, tuple[int, ...]]:
        """Vote on call ``call`` of group ``name``; (every member ok, the members that voted)."""
        store = self.store
        base = key("v", name, call)
        mine = _OK if ok else _FAIL
        if store.compare_set(f"{base}/{self._rank}", "", mine) != mine:
            self._dropped("was declared lost and its vote refused")
        what = f"call {call} of group {name}"
        self.waiting_for = f"votes on {what}"
        try:
            finals = {self._rank: mine, **self._final_votes(base, members, what)}
        finally:
            self.waiting_for = None
        survivors = tuple(m for m in members if finals[m] != TOMBSTONE)
        # Tidying up: each member deletes its own votes of earlier calls once every member
        # of such a call has voted on this one (and so has read that call's votes); a vote
        # whose call had a member lost since is left (at most VOTES_KEPT of them).
        voted = set(survivors)
        kept = []
        for slot, its_members in self._own_votes:
            if its_members <= voted:
                store.delete_key(slot)
            else:
                kept.append((slot, its_members))
        self._own_votes = [*kept[-VOTES_KEPT:], (f"{base}/{self._rank}", frozenset(members))]
        return all(v == _OK for v in finals.values()), survivors

    def _reliably(self, group: Any, what: str,
                  launch: Callable[[_Group], Any]) -> tuple[_Group, tuple[int, ...]]:
        """Run ``launch(group)`` until every member of some group completes it.

        Returns the group that completed it and the members of the group it was
        first asked of (by position, for a gather)."""
        first = self._resolve(group)
        asked = first.members
        for _ in range(MAX_ATTEMPTS):
            formed = self._resolve(group)
            call = formed.next_call()
            ok = True
            if formed.pg is None:
                launch(formed)
                return formed, asked
            work = None
            try:
                work = launch(formed)
            except (RankDropped, PeerLost):
                raise
            except Exception:  # noqa: BLE001 - a peer's connection failed: voted on
                ok = False
            else:
                try:
                    ok = self._completes(work, formed.members,
                                         f"{what} (call {call} of group {formed.name})")
                except RankDropped:
                    self._keep_with(formed.pg, [work])
                    raise
            try:
                committed, survivors = self._vote(formed.name, str(call), formed.members, ok)
            except RankDropped:
                self._keep_with(formed.pg, [work] if not ok else [])
                raise
            if committed:
                return formed, asked
            self._regroup(group, formed, survivors, call, None if ok else work)
        raise RuntimeError(f"rank {self._rank}: {what} failed {MAX_ATTEMPTS} times")

    def _regroup(self, group: Any, failed: _Group, survivors: tuple[int, ...], call: int,
                 pending: Any) -> None:
        """After a failed call (``pending``: its work, if it may still hang): the survivors
        form the next group."""
        self._abandon(failed, pending)
        if isinstance(group, ElasticSubgroup):
            group.formed = self._form(f"{failed.name}/c{call}", survivors)
            return
        self._wanted = survivors
        self._wanted_name = f"{failed.name}/c{call}"
        self._group = self._form(self._wanted_name, survivors)

    # -- the collectives -----------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None,
                   async_op: bool = False) -> Any:
        self.all_reduce_many([tensor], op, group, None, None)
        return done(async_op)

    def all_reduce_many(self, tensors: Sequence[torch.Tensor], op: Any = None,
                        group: Any = None, divide_by: float | None = None,
                        wire_dtype: torch.dtype | None = None, async_op: bool = False) -> Any:
        members = list(tensors)
        op = ReduceOp.SUM if op is None else op
        asked = len(self.group_ranks(group))
        flat: list[torch.Tensor] = []

        def launch(formed: _Group) -> Any:
            # A fresh private copy each time: a call given up may still write into its own.
            flat[:] = [torch.cat([t.detach().reshape(-1).to("cpu") for t in members])]
            if wire_dtype is not None and flat[0].dtype != wire_dtype:
                flat[0] = flat[0].to(wire_dtype)
            if formed.pg is None:
                return None
            options = dist.AllreduceOptions()
            options.reduceOp = ReduceOp.SUM if op == ReduceOp.AVG else op
            return formed.pg.allreduce([flat[0]], options)

        formed, _ = self._reliably(group, "an all-reduce", launch)
        result = flat[0]
        if op == ReduceOp.AVG:
            result = divided(result, len(formed.members))
        if divide_by is not None:
            if result.dtype != members[0].dtype:
                result = result.to(members[0].dtype)
            # An average asked of the members is over those that completed it.
            result = divided(result, len(formed.members) if divide_by == asked else divide_by)
        split_into(result, members)
        return done(async_op)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                   group: Any = None, async_op: bool = False) -> Any:
        asked = self.group_ranks(group)
        if len(tensor_list) != len(asked):
            raise ValueError(f"all_gather needs one output tensor per present rank of the group "
                             f"({len(asked)}), got {len(tensor_list)}")
        outs: list[torch.Tensor] = []
        source = to_cpu(tensor).contiguous()

        def launch(formed: _Group) -> Any:
            outs[:] = [torch.empty_like(source) for _ in formed.members]
            if formed.pg is None:
                outs[0].copy_(source)
                return None
            return formed.pg.allgather([outs], [source.clone()])

        formed, _ = self._reliably(group, "an all-gather", launch)
        by_rank = dict(zip(formed.members, outs))
        for target, rank in zip(tensor_list, asked):
            part = by_rank.get(rank)
            if part is None:  # lost meanwhile: all bits set (NaN), which a strategy skips
                raw = torch.full((source.numel() * source.element_size(),), 255, dtype=torch.uint8)
                part = raw.view(source.dtype).view(source.shape)
            copy_back(target, part.to(target.device))
        return done(async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None,
                  async_op: bool = False) -> Any:
        staged: list[torch.Tensor] = []

        def launch(formed: _Group) -> Any:
            if src not in formed.members:
                raise PeerLost(f"{self._host(src)} was lost during a broadcast from it")
            staged[:] = [to_cpu(tensor).clone().contiguous()]
            if formed.pg is None:
                return None
            options = dist.BroadcastOptions()
            options.rootRank = formed.members.index(src)
            options.rootTensor = 0
            return formed.pg.broadcast([staged[0]], options)

        if src not in self.group_ranks(group):
            raise PeerLost(f"{self._host(src)} is not a present member for a broadcast from it")
        self._reliably(group, "a broadcast", launch)
        if self._rank != src:
            copy_back(tensor, staged[0].to(tensor.device))
        return done(async_op)

    def latest(self, value: float, group: Any = None) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        self.all_reduce_many([t], ReduceOp.MAX, group)
        return float(t.item())

    # -- the side channel: the same groups, uncounted -------------------------------------

    def side_size(self) -> int:
        return len(self.group_ranks())

    def side_all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        staged = to_cpu(tensor)
        self.all_reduce_many([staged], op)
        copy_back(tensor, staged)

    def side_broadcast(self, tensor: torch.Tensor, src: int,
                       ranks: Sequence[int] | None = None) -> None:
        if ranks is None:
            self.broadcast(tensor, src)
            return
        if self._rank != src and self._rank not in ranks:
            return
        self._point_to_point(tensor, src, [r for r in ranks if r != src])

    def _point_to_point(self, tensor: torch.Tensor, src: int, receivers: list[int]) -> None:
        """``src`` sends ``tensor`` to ``receivers`` on a group of their own, in chunks; the
        others take part in nothing. If a member of that group is lost meanwhile, the
        sender gives the transfer up and goes on, and a receiver raises :class:`PeerLost`
        (it tries again at a later round)."""
        main = self._main()
        ranks = tuple(sorted({src, *receivers} & set(main.members)))
        if src not in ranks:
            raise PeerLost(f"{self._host(src)} was lost before it could hand over the state")
        if self._rank not in ranks or len(ranks) == 1:
            return
        pg = main.transfer_groups.get(ranks)
        ok = True
        if pg is None:  # formed once, for every tensor the hand-over sends
            main.transfers += 1
            pg, ok = self._build(f"{main.name}/h{main.transfers}", ranks)
            if ok:
                main.transfer_groups[ranks] = pg
        what = (f"handing over the state to {', '.join(self._host(r) for r in receivers)}"
                if self._rank == src else f"taking the state from {self._host(src)}")
        if ok:
            ok = self._stream(pg, tensor, ranks, src,
                              lambda work: self._completes(work, ranks, what))
            if not ok:
                main.transfer_groups.pop(ranks, None)
        if not ok and self._rank != src:
            raise PeerLost(f"the hand-over from {self._host(src)} failed: a rank of it was "
                           "lost or did not come")
        # A failed send: the joiners that are left try again at a later round.

    def _stream(self, pg: Any, tensor: torch.Tensor, ranks: tuple[int, ...], src: int,
                completes: Callable[[Any], bool]) -> bool:
        """Broadcast ``tensor`` from ``src`` over ``pg`` (of ``ranks``) in chunks of
        :data:`CHUNK_BYTES`; False once ``completes`` says a chunk failed (its calls are
        then given up where they stand)."""
        flat = to_cpu(tensor).contiguous().view(-1)
        raw = flat.view(torch.uint8) if flat.numel() else flat
        # Up to IN_FLIGHT chunks are posted at once, so the link never waits for a chunk's
        # completion to be seen before the next one starts. A receiver takes each chunk
        # into a buffer of its own and copies it in once it is whole.
        pending: collections.deque[tuple[int, torch.Tensor, Any]] = collections.deque()
        starts = iter(range(0, raw.numel(), CHUNK_BYTES))
        while True:
            for lo in starts:
                piece = (raw[lo:lo + CHUNK_BYTES] if self._rank == src
                         else torch.empty_like(raw[lo:lo + CHUNK_BYTES]))
                options = dist.BroadcastOptions()
                options.rootRank = ranks.index(src)
                options.rootTensor = 0
                pending.append((lo, piece, pg.broadcast([piece], options)))
                if len(pending) >= IN_FLIGHT:
                    break
            if not pending:
                break
            lo, piece, work = pending.popleft()
            try:
                finished = completes(work)
            except RankDropped:
                self._keep_with(pg, [work, *(w for _, _, w in pending)])
                raise
            if not finished:
                self._given_up.extend((pg, w) for _, _, w in [(lo, piece, work), *pending])
                return False
            if self._rank != src:
                raw[lo:lo + CHUNK_BYTES].copy_(piece)
        if self._rank != src:
            copy_back(tensor, flat.view_as(tensor).to(tensor.device))
        return True

    def pair_link(self, name: str, source: int, joiner: int,
                  generations: dict[int, int]) -> PairLink:
        """A link of ``source`` and ``joiner`` of their own, apart from the members' groups:
        the state a rank takes when it joins a round under way streams on it (from a
        thread of the source's while its training goes on). ``generations``: both ranks'
        loss generations now; the link fails once either is declared lost again."""
        return PairLink(self, name, (source, joiner), generations)

    def side_all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.all_gather(tensor_list, tensor)

    def side_barrier(self) -> None:
        self.all_reduce_many([torch.zeros(1)])

    def close(self) -> None:
        self._abandon()
        for pg, pending in self._given_up:
            if pending is not None and not pending.is_completed():
                _keep_forever((pg, pending))
        self._given_up = []


class PairLink:
    """Two ranks' own gloo group, for a state handed over while the others train.

    A rank that comes back in the middle of a round takes the state from a member
    (:mod:`exogym.membership.attendance`): the member's thread streams it here while its
    training goes on, and the joiner receives it before it joins the members' group at
    the round's end. Both sides build it under the same ``name``; :meth:`broadcast` has
    the signature of :func:`exogym.comm.side_broadcast`, so a hand-over runs on it
    unchanged.

    Args:
        groups: the rank's elastic collectives (store, timeouts).
        name: the link's name, alike on both sides and used once.
        ranks: the source and the joiner.
        generations: both ranks' loss generations when the link was asked for.
    """

    def __init__(self, groups: ElasticGroups, name: str, ranks: tuple[int, int],
                 generations: dict[int, int]):
        self.groups = groups
        self.name = name
        self.ranks = tuple(sorted(ranks))
        self.generations = {r: int(generations[r]) for r in self.ranks}
        self.pg: Any = None
        self.failed = False
        self.why = ""  # what broke the transfer, when no rank was lost
        self._failed_key = key("pair", name, "failed")

    def _lost(self) -> list[int]:
        store = self.groups.store
        return [r for r in self.ranks if loss_generation(store, r) != self.generations[r]]

    def _completes(self, work: Any) -> bool:
        groups = self.groups
        deadline = time.monotonic() + groups.timeout_s
        while True:
            try:
                work.wait(timedelta(seconds=LOSS_CHECK_S))
                return True
            except Exception as exc:  # noqa: BLE001 - the peer's connection failed
                if _SLICE_ENDED not in str(exc):
                    self.why = str(exc).strip().splitlines()[0] if str(exc).strip() else \
                        type(exc).__name__
                    return False
            if self._lost():
                return False
            if groups.store.check([self._failed_key]):
                self.why = "the other side gave the transfer up"
                return False
            if time.monotonic() > deadline:
                raise PeerTimeoutError(f"rank {groups.rank()}: the hand-over on {self.name} "
                                       f"did not finish within {groups.timeout_s:.0f} s")

    def broadcast(self, tensor: torch.Tensor, src: int,
                  ranks: Sequence[int] | None = None) -> None:
        """Send ``tensor`` from ``src`` to the other rank of the link (``ranks`` must be
        the link's); raises :class:`PeerLost` on either side once the transfer fails."""
        if ranks is not None and tuple(sorted(ranks)) != self.ranks:
            raise ValueError(f"link {self.name} joins ranks {list(self.ranks)}, "
                             f"not {sorted(ranks)}")
        if self.failed:
            raise PeerLost(f"the hand-over on {self.name} failed earlier")
        groups = self.groups
        if self.pg is None:
            lost = self._lost()
            if lost:
                self.failed = True
                raise PeerLost(f"rank {lost[0]} was lost before the hand-over on {self.name}")
            if self.given_up():
                self.failed = True
                raise PeerLost(f"the other side gave the hand-over on {self.name} up before "
                               "it began")
            # A side that gives the link up while the other waits for it to form ends that
            # wait too (within a loss check), not at the form timeout.
            self.pg, ok = groups._build(key("pair", self.name), self.ranks,
                                        is_lost=lambda r: r in self._lost() or self.given_up())
            if not ok:
                self.failed = True
                raise PeerLost(f"the link {self.name} of ranks {list(self.ranks)} " + (
                    "was given up before it formed" if self.given_up() else
                    f"did not form within {groups.form_timeout_s:.0f} s"))
        if not groups._stream(self.pg, tensor, self.ranks, src, self._completes):
            self.failed = True
            groups.store.set(self._failed_key, "1")  # the other side stops waiting at once
            lost = self._lost()
            raise PeerLost(f"the hand-over on {self.name} failed: " + (
                f"rank {', '.join(map(str, lost))} was lost" if lost else
                f"{self.why or 'a rank stopped answering'} (ranks "
                f"{', '.join(map(str, self.ranks))} still live)"))

    def mark(self, tag: str) -> None:
        """Tell the other side ``tag`` (a plain word), apart from the transfer."""
        self.groups.store.set(key("pair", self.name, "mark", tag), "1")

    def marked(self, tag: str) -> bool:
        """Whether either side set the mark ``tag`` (:meth:`mark`)."""
        return bool(self.groups.store.check([key("pair", self.name, "mark", tag)]))

    def given_up(self) -> bool:
        """Whether either side gave the transfer up (:meth:`abandon`)."""
        return bool(self.groups.store.check([self._failed_key]))

    def abandon(self) -> None:
        """Give the transfer up on both sides: the other side's wait ends at once."""
        self.failed = True
        self.groups.store.set(self._failed_key, "1")

    def close(self) -> None:
        """Give the group up (kept until the process ends if a call may still hang)."""
        if self.pg is not None:
            groups = self.groups
            if self.failed:
                groups._given_up.append((self.pg, None))
            self.pg = None


def _keep_forever(obj: Any) -> None:
    """Never destroy ``obj``: a gloo group with a call still blocked in its threads would
    wait for that call in its destructor (until gloo's timeout) when the process ends."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


__all__ = ["CHUNK_BYTES", "ElasticGroups", "ElasticSubgroup", "NAMESPACE", "PairLink",
           "TOMBSTONE",
           "combine", "key", "loss_generation"]
