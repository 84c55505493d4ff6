"""A state that several members send a joiner at once, a share each.

A rank that joins a round under way (:mod:`exogym.membership.attendance`) takes
the state from the lowest live member, the *source*, and, where other members
are live, a share of it from each of them, on links of their own, so that the
state is not held to what the source's uplink has left beside the members'
collectives. :func:`~exogym.membership.handover.stripes` says which tensors
each member sends: the source sends the description, every small tensor and its
run of the large ones; each other member (a *helper*) a run of the large ones.

A helper's share is copied from its own state, at its own step boundary. The
state every member holds alike (the model as the round began, the outer
optimizer's state) must then be the same as the source's: the joiner takes a
helper's share only if no round ended between the two copies (for a strategy
whose members meet at any step, only if both were taken after the same step);
else the source sends that share too. The rest (the inner optimizer's moments)
is each member's own, and any member's serves a joiner as well as the source's.

The updates of the rounds that end while the state travels are the same on every
member: the joiner takes each in parts, like the state, from the source and the
helpers whose share it took.

Every message here is tensors of numbers and the JSON description of
:mod:`exogym.membership.handover`; nothing is unpickled.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from exogym.comm.protocol import PeerLost, PeerTimeoutError
from exogym.membership.handover import (
    Outgoing,
    _nbytes,
    hand_over,
    receiver_targets,
    send_description,
    send_tensors,
    stripes,
    unflatten_tensors,
)

__all__ = ["StripedIntake", "exchange_ints", "helper_share", "send_share", "send_update",
           "update_part"]

#: The most numbers one message of :func:`exchange_ints` carries.
MAX_INTS = 1 << 20


def exchange_ints(link: Any, values: Sequence[int] | None, src: int,
                  ranks: Sequence[int]) -> list[int]:
    """Send a list of integers from ``src`` on ``link`` (``values`` there; None on the
    other side), its length first; the list, on both sides.

    Raises:
        ValueError: the length announced is not one this protocol sends.
    """
    sending = values is not None
    size = torch.tensor([len(values) if sending else 0], dtype=torch.int64)
    link.broadcast(size, src, ranks)
    n = int(size.item())
    if not 0 <= n <= MAX_INTS:
        raise ValueError(f"rank {src} announced {n} numbers on {getattr(link, 'name', link)}")
    if n == 0:
        return []
    data = (torch.tensor(list(values), dtype=torch.int64) if sending
            else torch.zeros(n, dtype=torch.int64))
    link.broadcast(data, src, ranks)
    return [int(v) for v in data]


def helper_share(state: dict[str, Any], position: int, count: int) -> dict[str, Any]:
    """A helper's share of its live ``state`` (a member's ``join_state(copy=False)``, copied
    now, at a step boundary): part ``position`` of ``count`` (:func:`stripes`), and the
    step the state is of."""
    out = Outgoing(state)
    indices = stripes(out.sizes, count)[position]
    return {"step": int(state["step"]), "count": len(out.shapes), "indices": indices,
            "sizes": [out.sizes[i] for i in indices],
            "shapes": {i: out.shapes[i] for i in indices},
            "tensors": {i: out.tensors[i].detach().clone() for i in indices}}


def send_share(link: Any, rank: int, joiner: int, share: dict[str, Any],
               update_of: Callable[[int], dict[str, Any]]) -> int:
    """A helper's thread: offer ``share`` to ``joiner`` (its step, its tensors' numbers and
    sizes), send the tensors if the joiner takes it, then the updates it asks for
    (``update_of(step)``: the update of the round that ended at ``step``, once this rank
    has it) until it asks for none. The bytes sent."""
    ranks = [rank, joiner]
    exchange_ints(link, [share["step"], share["count"], *share["indices"], *share["sizes"]],
                  rank, ranks)
    taken = exchange_ints(link, None, joiner, ranks)
    if taken != [1]:
        return 0
    send_tensors(link.broadcast, rank, ranks, rank, share["shapes"], share["indices"],
                 share["tensors"])
    nbytes = sum(share["sizes"])
    share["tensors"] = {}  # sent: the copy goes now
    while True:
        ask = exchange_ints(link, None, joiner, ranks)
        if not ask:
            return nbytes
        count, position, steps = ask[0], ask[1], ask[2:]
        if not 0 < position < count:
            raise RuntimeError(f"rank {joiner} asked rank {rank} for part {position} of "
                               f"{count} of an update")
        for step in steps:
            nbytes += hand_over(update_part(update_of(step), position, count), rank, ranks,
                                rank, send=link.broadcast)[1]


def update_part(update: dict[str, Any], position: int, count: int) -> dict[str, Any]:
    """Part ``position`` of ``count`` of a round's update (:func:`stripes` of its tensors):
    the tensors' numbers and the tensors."""
    out = Outgoing(update)
    indices = stripes(out.sizes, count)[position]
    return {"indices": indices, "tensors": [out.tensors[i] for i in indices]}


def send_update(link: Any, rank: int, joiner: int, update: dict[str, Any], count: int) -> int:
    """The source's part of a round's update, of ``count``: the description and part 0. The
    bytes sent."""
    ranks = [rank, joiner]
    out = Outgoing(update)
    part = stripes(out.sizes, count)[0]
    send_description(link.broadcast, rank, ranks, rank, out.description)
    send_tensors(link.broadcast, rank, ranks, rank, out.shapes, part, out.tensors)
    return out.description.numel() + out.nbytes(part)


def _is_part(piece: Any, indices: list[int],
             shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> bool:
    """Whether a helper's ``piece`` of an update (:func:`update_part`) holds the tensors
    numbered ``indices``, of the shapes and dtypes the source described."""
    if not isinstance(piece, dict) or piece.get("indices") != indices:
        return False
    tensors = piece.get("tensors")
    return (isinstance(tensors, list) and len(tensors) == len(indices)
            and all(isinstance(t, torch.Tensor) and (tuple(t.shape), t.dtype) == tuple(shapes[i])
                    for i, t in zip(indices, tensors)))


class _Helper(threading.Thread):
    """The joiner's side of one helper's link, in a thread of its own: its share of the
    state, then the updates the joiner hands it (:meth:`ask`)."""

    def __init__(self, intake: StripedIntake, position: int, member: int, link: Any):
        super().__init__(name=f"share of rank {member}", daemon=True)
        self.intake = intake
        self.position = position
        self.member = member
        self.link = link
        self.ranks = [member, intake.rank]
        self.decided = threading.Event()
        self.taken: bool | None = None  # None until decided; False: the source sends it
        self.received: dict[int, torch.Tensor] = {}
        self.nbytes = 0
        self.error: BaseException | None = None
        self.done = threading.Event()  # its share is in (or refused, or failed)
        self._asks: queue.Queue = queue.Queue()
        self._answers: queue.Queue = queue.Queue()

    def run(self) -> None:
        try:
            if self._take_share():
                while True:
                    ask = self._asks.get()
                    exchange_ints(self.link, ask, self.intake.rank, self.ranks)
                    if not ask:
                        break
                    got = {}
                    for step in ask[2:]:
                        piece, size = hand_over(None, self.member, self.ranks, self.intake.rank,
                                                send=self.link.broadcast)
                        got[step] = piece
                        self.nbytes += size
                    self._answers.put(got)
        except BaseException as exc:  # noqa: BLE001 - reported to the joiner's main thread
            self.error = exc
            self._answers.put(exc)
        finally:
            self.decided.set()
            self.done.set()
            self.link.close()

    def _take_share(self) -> bool:
        intake = self.intake
        head = exchange_ints(self.link, None, self.member, self.ranks)
        if not intake.ready.wait(intake.wait_s):
            raise PeerTimeoutError(f"rank {intake.rank}: the description from rank "
                                   f"{intake.source} did not come within {intake.wait_s:.0f} s")
        with intake.lock:
            if self.taken is None:
                self.taken = intake.fits(self.position, head)
            taken = self.taken
            self.decided.set()
        exchange_ints(self.link, [1 if taken else 0], intake.rank, self.ranks)
        if not taken:
            return False
        indices = intake.parts[self.position]
        self.received = send_tensors(self.link.broadcast, self.member, self.ranks, intake.rank,
                                     intake.shapes, indices, targets=intake.targets)
        self.nbytes += sum(intake.sizes[i] for i in indices)
        self.done.set()
        return True

    def ask(self, steps: list[int], count: int = 1, position: int = 1) -> None:
        """Take part ``position`` of ``count`` of each update of the rounds that ended at
        ``steps`` from this helper (none: it sends no more)."""
        self._asks.put([count, position, *steps] if steps else [])

    def answer(self, wait_s: float) -> dict[int, Any]:
        """Its parts of the updates asked for last, by step."""
        try:
            got = self._answers.get(timeout=wait_s)
        except queue.Empty:
            raise PeerTimeoutError(f"rank {self.intake.rank}: rank {self.member}'s updates did "
                                   f"not come within {wait_s:.0f} s") from None
        if isinstance(got, BaseException):
            raise PeerLost(f"taking updates from rank {self.member} failed ({got})") from got
        return got


class StripedIntake:
    """A joiner's side of a state that the source and helpers send at once.

    Args:
        rank: the joiner.
        source: the member that gives the description, the small tensors and the rest.
        links: a link of the joiner's with the source and with each helper
            (:meth:`~exogym.comm.elastic_groups.ElasticGroups.pair_link`), by rank.
        helpers: the other members asked for a share, in the order of their parts.
        alike: whether two copies taken after ``a`` and ``b`` steps hold the same state
            every member holds alike.
        wait_s: the longest wait for a helper's answer.
    """

    def __init__(self, rank: int, source: int, links: dict[int, Any], helpers: Sequence[int],
                 alike: Callable[[int, int], bool], wait_s: float):
        self.rank = rank
        self.source = source
        self.links = links
        self.alike = alike
        self.wait_s = wait_s
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.helpers = [_Helper(self, k, h, links[h]) for k, h in enumerate(helpers, 1)]
        self.taking: list[_Helper] = []  # the helpers whose share it took
        self.parts: list[list[int]] = []
        self.shapes: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.sizes: list[int] = []
        self.targets: dict[int, torch.Tensor] = {}
        self.step = 0
        self.bytes_from: dict[int, int] = {source: 0}

    def fits(self, position: int, head: list[int]) -> bool:
        """Whether a helper's offer is part ``position`` of the source's state, copied
        where the state every member holds alike was the source's."""
        if len(head) < 2:
            return False
        step, count, rest = head[0], head[1], head[2:]
        indices = self.parts[position]
        return (count == len(self.shapes) and rest == indices + [self.sizes[i] for i in indices]
                and self.alike(self.step, step))

    def take_state(self, into: Any) -> tuple[Any, int]:
        """The state, the source's share and the helpers' at once (the helpers' that could
        not send theirs in time from the source after its own); received into ``into``
        where it fits. Returns it and the bytes received."""
        source, ranks = self.source, [self.source, self.rank]
        link = self.links[source]
        for helper in self.helpers:
            helper.start()
        skeleton = send_description(link.broadcast, source, ranks, self.rank, None)
        self.shapes = skeleton["tensors"]
        self.sizes = [torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                      for s, d in self.shapes]
        self.parts = stripes(self.sizes, 1 + len(self.helpers))
        self.targets = receiver_targets(skeleton, into)
        state = skeleton["state"]
        self.step = int(state["step"]) if isinstance(state, dict) else 0
        self.ready.set()
        got = send_tensors(link.broadcast, source, ranks, self.rank, self.shapes, self.parts[0],
                           targets=self.targets)
        nbytes = skeleton["description_bytes"] + sum(self.sizes[i] for i in self.parts[0])
        missing = []
        for helper in self.helpers:
            with self.lock:
                if helper.taken is None:  # not offered yet: the source sends it instead
                    helper.taken = False
                    helper.link.abandon()  # the helper, reading the request later, skips it
            if helper.taken and not helper.done.wait(self.wait_s):
                raise PeerTimeoutError(f"rank {self.rank}: rank {helper.member}'s share did "
                                       f"not come within {self.wait_s:.0f} s")
            if helper.taken and helper.error is None:
                got.update(helper.received)
                self.taking.append(helper)
                self.bytes_from[helper.member] = helper.nbytes
            else:
                missing.append(helper.position)
        exchange_ints(link, missing, self.rank, ranks)
        for position in missing:
            indices = self.parts[position]
            got.update(send_tensors(link.broadcast, source, ranks, self.rank, self.shapes,
                                    indices, targets=self.targets))
            nbytes += sum(self.sizes[i] for i in indices)
        self.bytes_from[source] = nbytes
        rebuilt = unflatten_tensors(skeleton, [got[i] for i in range(len(self.shapes))], into)
        return rebuilt, nbytes + sum(h.nbytes for h in self.taking)

    def take_updates(self, steps: list[int]) -> tuple[list[dict[str, Any]], int]:
        """The updates of the rounds that ended at ``steps``, each in parts: the source's
        (its description and part 0) and one from each helper whose share it took. Returns
        them in order and their bytes."""
        source, ranks = self.source, [self.source, self.rank]
        link = self.links[source]
        count = 1 + len(self.taking)
        exchange_ints(link, [count, *steps], self.rank, ranks)
        if not steps:
            return [], 0
        before = {h.member: h.nbytes for h in self.taking}
        for position, helper in enumerate(self.taking, 1):
            helper.ask(steps, count, position)
        nbytes = 0
        partial = {}
        for step in steps:
            skeleton = send_description(link.broadcast, source, ranks, self.rank, None)
            shapes = skeleton["tensors"]
            sizes = [_nbytes(*shape) for shape in shapes]
            parts = stripes(sizes, count)
            got = send_tensors(link.broadcast, source, ranks, self.rank, shapes, parts[0])
            nbytes += skeleton["description_bytes"] + sum(sizes[i] for i in parts[0])
            partial[step] = (skeleton, parts, got)
        self.bytes_from[source] += nbytes
        for position, helper in enumerate(self.taking, 1):
            pieces = helper.answer(self.wait_s)
            for step, piece in pieces.items():
                skeleton, parts, got = partial[step]
                if not _is_part(piece, parts[position], skeleton["tensors"]):
                    raise PeerLost(f"rank {helper.member}'s part of the update of step {step} "
                                   "is not the one the source left to it")
                got.update(zip(piece["indices"], piece["tensors"]))
            size = helper.nbytes - before[helper.member]
            self.bytes_from[helper.member] += size
            nbytes += size
        return [unflatten_tensors(skeleton, [got[i] for i in range(len(skeleton["tensors"]))])
                for skeleton, _, got in (partial[step] for step in steps)], nbytes

    def finish(self) -> None:
        """The helpers whose share it took send nothing more."""
        for helper in self.taking:
            helper.ask([])

    def abandon(self) -> None:
        """The transfer failed: every helper's link gives up at once, on both sides."""
        for helper in self.helpers:
            abandon = getattr(helper.link, "abandon", None)
            if abandon is not None:
                abandon()
            helper.ask([])
