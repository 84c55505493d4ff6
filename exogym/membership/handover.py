"""The state a rank that rejoins takes from a rank that stayed, streamed over the side channel.

:func:`hand_over` sends a nested state (the model's, the strategy's, the data's
position: dicts, lists and tensors) from ``source`` to the joining ranks, and
returns it rebuilt on them. It never serialises the state whole: a short
description of its structure goes first (tensor shapes and dtypes in place of
the tensors), then the tensors, small ones coalesced into buffers of up to
:data:`BUCKET_BYTES`, large ones alone (a backend sends those in chunks;
across hosts, point to point). A tensor equal to one sent already (DiLoCo's
outer parameters equal the model's right after a round) is sent once and
copied on arrival.

The description is JSON (:mod:`exogym.base.plain_state`), never a pickle: a rank
that receives a hand-over builds only dicts, lists, numbers, strings and the
tensors described, whoever sent it.

**A state that several members send at once, a share each.** A rank that joins a
round under way (:mod:`exogym.membership.attendance`) takes the state from the
lowest live member, the *source*, and, where other members are live, a share of it
from each of them, on links of their own, so that the state is not held to what the
source's uplink has left beside the members' collectives. :func:`stripes` says which
tensors each member sends: the source sends the description, every small tensor and
its run of the large ones; each other member (a *helper*) a run of the large ones.

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

Every message of theirs is tensors of numbers and the JSON description above;
nothing is unpickled.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from exogym import comm
from exogym.base import plain_state
from exogym.comm.protocol import PeerLost, PeerTimeoutError

#: Small tensors travel together in buffers of up to this many bytes.
BUCKET_BYTES = 16 << 20
#: Where a tensor may start in such a buffer (a multiple of every element's size).
ALIGN = 16
#: The longest description of a state's structure a joiner accepts.
MAX_DESCRIPTION_BYTES = 64 << 20
#: A tensor smaller than this comes from the member that gives the rest of a state sent
#: by several (:func:`stripes`).
STRIPE_MIN_BYTES = 1 << 20


class _Slot:
    """Where a tensor stood in a flattened state (``numpy``: it was a NumPy array)."""

    def __init__(self, index: int, numpy: bool = False):
        self.index = index
        self.numpy = numpy


def flatten_tensors(value: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The distinct tensors inside a nested state (dicts, lists, tuples), in order, and
    the state with each replaced by a placeholder: ``{"state": ..., "tensors": [(shape,
    dtype)]}``. A tensor equal to an earlier one of its shape and dtype takes its place.

    Raises:
        plain_state.PlainStateError: the state holds a value that is not plain data.
    """
    tensors: list[torch.Tensor] = []
    alike: dict[tuple[Any, ...], list[int]] = {}

    def index_of(v: torch.Tensor) -> int:
        t = v.detach().to("cpu").contiguous()
        # Only tensors of one shape, dtype and first and last values are compared whole.
        flat = t.reshape(-1)
        kind = (tuple(t.shape), t.dtype, flat[:8].numpy().tobytes() if t.numel() > 1
                else None, flat[-8:].numpy().tobytes() if t.numel() > 1 else None)
        for index in alike.get(kind, ()) if t.numel() > 1 else ():
            if torch.equal(tensors[index], t):
                return index
        alike.setdefault(kind, []).append(len(tensors))
        tensors.append(t)
        return len(tensors) - 1

    plain = plain_state.to_plain(value, index_of)
    return tensors, _skeleton(plain, [(tuple(t.shape), t.dtype) for t in tensors])


def _skeleton(plain: Any, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
    def slot(i: int) -> _Slot:
        if type(i) is not int or not 0 <= i < len(shapes):
            raise plain_state.PlainStateError(f"the state description names tensor {i} of "
                                              f"{len(shapes)}")
        return _Slot(i)

    state = plain_state.from_plain(plain, slot, numpy_of=lambda s: _Slot(s.index, True))
    return {"state": state, "plain": plain, "tensors": shapes}


def describe(skeleton: dict[str, Any]) -> bytes:
    """A skeleton of :func:`flatten_tensors` as the JSON bytes a joiner reads."""
    return plain_state.dumps({"state": skeleton["plain"], "tensors": [
        [list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in skeleton["tensors"]]})


def read_description(raw: bytes) -> dict[str, Any]:
    """The skeleton :func:`describe` wrote.

    Raises:
        plain_state.PlainStateError: the bytes are not such a description.
    """
    data = plain_state.loads(raw)
    shapes = data.get("tensors") if isinstance(data, dict) else None
    if not isinstance(shapes, list) or "state" not in data:
        raise plain_state.PlainStateError("not a hand-over's description")
    parsed = []
    for entry in shapes:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                and all(type(n) is int and n >= 0 for n in entry[0])):
            raise plain_state.PlainStateError(f"not a tensor's shape and dtype: {entry!r:.80}")
        parsed.append((tuple(entry[0]), plain_state.dtype_named(entry[1])))
    return _skeleton(data["state"], parsed)


def unflatten_tensors(skeleton: dict[str, Any], tensors: list[torch.Tensor],
                      into: Any = None) -> Any:
    """The state :func:`flatten_tensors` took apart, with ``tensors`` back in their places
    (a tensor that stood in several places is copied for each after the first).

    ``into``: the receiver's own state of the same structure (or None); where it holds a
    CPU tensor of the same shape and dtype at a place, the value is copied into that
    tensor (if it is not already there) and the state holds it, not a new copy.
    """
    used: set[int] = set()

    def walk(v: Any, mine: Any) -> Any:
        if isinstance(v, _Slot):
            t = tensors[v.index]
            if not v.numpy and _fits(mine, t.shape, t.dtype):
                if mine.data_ptr() != t.data_ptr():
                    mine.copy_(t)
                used.add(v.index)
                return mine
            if v.index in used:
                t = t.clone()
            used.add(v.index)
            return t.numpy() if v.numpy else t
        return _descend(v, mine, walk)

    return walk(skeleton["state"], into)


def _descend(v: Any, mine: Any, walk: Callable[[Any, Any], Any]) -> Any:
    """``walk`` applied to the members of a dict, list or tuple ``v`` alongside the same
    members of ``mine`` (None where it has none); any other ``v`` as it is."""
    if isinstance(v, dict):
        out = type(v)((k, walk(x, mine.get(k) if isinstance(mine, dict) else None))
                      for k, x in v.items())
        if hasattr(v, "_metadata"):  # a module's state_dict: its versions go with it
            out._metadata = v._metadata
        return out
    if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
        same = isinstance(mine, (list, tuple)) and len(mine) == len(v)
        return type(v)(walk(x, mine[i] if same else None) for i, x in enumerate(v))
    return v


def _fits(mine: Any, shape: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether ``mine`` is a CPU tensor that can hold a tensor of ``shape`` and ``dtype``
    in place."""
    return (isinstance(mine, torch.Tensor) and mine.device.type == "cpu"
            and mine.is_contiguous() and tuple(mine.shape) == tuple(shape)
            and mine.dtype == dtype)


def _targets(skeleton: dict[str, Any], into: Any) -> dict[int, torch.Tensor]:
    """For each tensor of the description, the receiver's own tensor at its first place
    that can take it in place, if any."""
    found: dict[int, torch.Tensor] = {}
    shapes = skeleton["tensors"]

    def walk(v: Any, mine: Any) -> Any:
        if isinstance(v, _Slot):
            shape, dtype = shapes[v.index]
            if v.index not in found and not v.numpy and _fits(mine, shape, dtype):
                found[v.index] = mine.detach()
            return v
        return _descend(v, mine, walk)

    if into is not None:
        walk(skeleton["state"], into)
    return found


def _buckets(sizes: Sequence[int]) -> list[list[int]]:
    """Indices of consecutive tensors in groups of at most :data:`BUCKET_BYTES` (a larger
    tensor alone)."""
    return comm.runs_within(sizes, BUCKET_BYTES)


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def stripes(sizes: Sequence[int], count: int,
            least: int = STRIPE_MIN_BYTES) -> list[list[int]]:
    """Which of a state's tensors (their ``sizes`` in bytes, in order) each of ``count``
    senders sends when the state comes from several members at once.

    Part 0 is the member that gives the rest: it sends the description and every tensor
    under ``least`` bytes (the bookkeeping, the data position). The larger tensors are
    cut, in their order, into runs of about an equal share of the whole for parts 1 to
    ``count - 1``, and what is left goes to part 0 as well; so a parameter's optimizer
    moments, next to each other, mostly come from one member. The same sizes give the
    same parts on every rank.
    """
    if count < 1:
        raise ValueError(f"a state is sent by at least one member, not {count}")
    if count == 1:
        return [list(range(len(sizes)))]
    share = sum(sizes) / count
    parts: list[list[int]] = [[] for _ in range(count)]
    part, load = 1, 0
    for i, size in enumerate(sizes):
        if size < least or part == count:
            parts[0].append(i)
            continue
        # Close a run once this tensor would take it further past the share than short of it.
        if load and load + size - share > share - load:
            part, load = part + 1, 0
            if part == count:
                parts[0].append(i)
                continue
        parts[part].append(i)
        load += size
    return [sorted(p) for p in parts]


def send_description(send: Callable[..., None], source: int, ranks: Sequence[int], rank: int,
                     description: torch.Tensor | None) -> dict[str, Any] | None:
    """The first part of a hand-over: the state's description (``description``, on the
    source, from :func:`describe`), and on a receiver the skeleton it reads from it (with
    the description's length as ``description_bytes``)."""
    if rank == source:
        size = torch.tensor([description.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    send(size, source, ranks)
    if rank == source:
        send(description, source, ranks)
        return None
    if not 0 < int(size.item()) <= MAX_DESCRIPTION_BYTES:
        raise ValueError(f"rank {rank}: rank {source} announced a hand-over description "
                         f"of {int(size.item())} bytes (at most {MAX_DESCRIPTION_BYTES}): "
                         "not a hand-over of this run")
    description = torch.empty(int(size.item()), dtype=torch.uint8)
    send(description, source, ranks)
    skeleton = read_description(description.numpy().tobytes())
    skeleton["description_bytes"] = description.numel()
    return skeleton


def send_tensors(send: Callable[..., None], source: int, ranks: Sequence[int], rank: int,
                 shapes: Sequence[tuple[tuple[int, ...], torch.dtype]], indices: Sequence[int],
                 tensors: Sequence[torch.Tensor] | CopyAhead | None = None,
                 targets: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """The tensors numbered ``indices`` (of a description's ``shapes``) from ``source``:
    small ones coalesced into buffers of up to :data:`BUCKET_BYTES`, large ones alone.

    ``tensors``: on the source, the state's flattened tensors (all of them, by number), or
    their copies as they are made (:class:`CopyAhead`).
    ``targets``: on a receiver, its own tensors that take a received one in place.
    Returns on a receiver each received tensor by its number (nothing on the source).
    """
    targets = targets or {}
    received: dict[int, torch.Tensor] = {}
    sizes = [_nbytes(*shapes[i]) for i in indices]
    for group in _buckets(sizes):
        numbers = [indices[j] for j in group]
        if len(numbers) == 1:
            shape, dtype = shapes[numbers[0]]
            one = tensors[numbers[0]] if rank == source else targets.get(numbers[0])
            if one is None:
                one = torch.empty(shape, dtype=dtype)
            send(one, source, ranks)
            if rank != source:
                received[numbers[0]] = one
            continue
        # Each tensor starts at a multiple of ALIGN in the buffer, so that it can be a view.
        starts = []
        end = 0
        for j in group:
            starts.append(end)
            end += -(-sizes[j] // ALIGN) * ALIGN
        flat = torch.zeros(end, dtype=torch.uint8)
        if rank == source:
            for i, j, at in zip(numbers, group, starts):
                flat[at:at + sizes[j]].copy_(tensors[i].reshape(-1).view(torch.uint8))
        send(flat, source, ranks)
        if rank == source:
            continue  # the buffer goes now: the source holds no more than its own state
        for i, j, at in zip(numbers, group, starts):
            shape, dtype = shapes[i]
            piece = flat[at:at + sizes[j]].view(dtype).view(shape)
            if i in targets:  # into the receiver's own tensor now: the buffer goes sooner
                piece = targets[i].copy_(piece)
            received[i] = piece
    return received


class CopyAhead:
    """Copies of some of a state's tensors, made one after another by the thread that
    trains (:meth:`make`, before the state changes again) while a thread that sends them
    takes each as soon as it is made: the transfer starts with the first copy, not after
    the last, and each copy goes once it is sent.

    Args:
        tensors: the state's live tensors, by number.
        order: the numbers of those to copy, in the order they are sent.
        wait_s: the longest wait for one copy.
        needed: asked of each tensor as its turn comes (None: every one is): False leaves
            it uncopied (another member sends it), and asking for it is then an error.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], order: Sequence[int], wait_s: float,
                 needed: Callable[[int], bool] | None = None):
        self._live = list(tensors)
        self.order = list(order)
        self.wait_s = wait_s
        self.needed = needed
        self._made: dict[int, torch.Tensor] = {}
        self._taken: set[int] = set()
        self.skipped: set[int] = set()  # left to another member
        self.copied_bytes = 0
        self._cond = threading.Condition()
        self._finished = False
        self._stopped = False

    def make(self) -> None:
        """On the thread that trains: copy the tensors in order (until :meth:`stop`)."""
        try:
            for i in self.order:
                if self._stopped:
                    break
                if self.needed is not None and not self.needed(i):
                    self.skipped.add(i)
                    continue
                copy = self._live[i].detach().clone()
                self.copied_bytes += copy.numel() * copy.element_size()
                with self._cond:
                    if not self._stopped:  # a copy made as the sending stopped goes at once
                        self._made[i] = copy
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._live = []  # the live tensors change from now on: no reference is kept
                self._finished = True
                self._cond.notify_all()

    def __getitem__(self, i: int) -> torch.Tensor:
        """Tensor ``i``'s copy, once made; it is handed out once.

        Raises:
            PeerTimeoutError: it was not made within :attr:`wait_s`.
            RuntimeError: it was not copied (not in the order, left to another member,
                handed out before, or the sending stopped).
        """
        with self._cond:
            if not self._cond.wait_for(
                    lambda: i in self._made or self._finished or self._stopped, self.wait_s):
                raise PeerTimeoutError(f"the copy of tensor {i} of the state was not made "
                                       f"within {self.wait_s:.0f} s")
            if i not in self._made:
                why = (" (handed out already)" if i in self._taken else
                       " (another member was sending it)" if i in self.skipped else
                       " (the sending stopped)" if self._stopped else "")
                raise RuntimeError(f"tensor {i} of the state was not copied for sending{why}")
            self._taken.add(i)
            return self._made.pop(i)

    def stop(self) -> None:
        """Nothing more is sent: the copies go, and :meth:`make` stops copying."""
        with self._cond:
            self._stopped = True
            self._made.clear()
            self._cond.notify_all()


class Outgoing:
    """A state taken apart to be sent, whole or in parts (:func:`stripes`).

    Args:
        state: the nested state (dicts, lists, tuples and tensors of plain data).
    """

    def __init__(self, state: Any):
        self.tensors, self._skeleton = flatten_tensors(state)
        self.shapes = self._skeleton["tensors"]
        self.sizes = [_nbytes(shape, dtype) for shape, dtype in self.shapes]

    @functools.cached_property
    def description(self) -> torch.Tensor:
        """The description a receiver reads first (a helper, sending a part, sends none)."""
        return torch.frombuffer(bytearray(describe(self._skeleton)), dtype=torch.uint8)

    def nbytes(self, indices: Sequence[int]) -> int:
        """The bytes of the tensors numbered ``indices``."""
        return sum(self.sizes[i] for i in indices)

    def copy_ahead(self, order: Sequence[int], wait_s: float,
                   needed: Callable[[int], bool] | None = None) -> CopyAhead:
        """Send copies of the tensors numbered ``order`` (made in that order by
        :meth:`CopyAhead.make`, those ``needed``) instead of the live tensors it was built
        of; the description is made now, of the state as it stands."""
        self.description  # noqa: B018 - made before the state changes
        self.tensors = CopyAhead(self.tensors, order, wait_s, needed)
        return self.tensors


def hand_over(state: Any, source: int, ranks: Sequence[int], rank: int,
              into: Any = None, send: Callable[..., None] | None = None) -> tuple[Any, int]:
    """Send ``state`` from ``source`` to the other ``ranks``; every one of them calls this.

    Args:
        state: the state on ``source`` (ignored elsewhere).
        source: the rank that sends.
        ranks: the source and the ranks that receive.
        rank: the calling rank.
        into: on a receiver, its own state of the same structure (its model's and
            strategy's live tensors): a large tensor is received straight into the
            matching one, so the state is not held twice. If the transfer fails, those
            tensors hold part of the new state (the caller takes the state again later).
        send: the broadcast it travels on, called as ``send(tensor, source, ranks)``
            (default: :func:`exogym.comm.side_broadcast`, the members' side channel; a
            rank that joins a round under way takes it on a link of its own).

    Returns:
        The state (``state`` itself on the source, rebuilt elsewhere) and the bytes sent.
    """
    send = comm.side_broadcast if send is None else send
    if rank == source:
        out = Outgoing(state)
        send_description(send, source, ranks, rank, out.description)
        send_tensors(send, source, ranks, rank, out.shapes, range(len(out.shapes)), out.tensors)
        return state, out.nbytes(range(len(out.shapes))) + out.description.numel()
    skeleton = send_description(send, source, ranks, rank, None)
    shapes = skeleton["tensors"]
    got = send_tensors(send, source, ranks, rank, shapes, range(len(shapes)),
                       targets=_targets(skeleton, into))
    nbytes = sum(_nbytes(*shape) for shape in shapes) + skeleton["description_bytes"]
    return unflatten_tensors(skeleton, [got[i] for i in range(len(shapes))], into), nbytes


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


def share_tag(position: int) -> str:
    """The mark (:meth:`~exogym.comm.elastic_groups.PairLink.mark`) a joiner sets on its
    link with the source once it takes part ``position`` from a helper."""
    return f"share{position}"


def helper_share(state: dict[str, Any], position: int, count: int,
                 wait_s: float) -> dict[str, Any]:
    """A helper's share of its live ``state`` (a member's ``join_state(copy=False)``, at a
    step boundary): part ``position`` of ``count`` (:func:`stripes`), the step the state is
    of, and the share's tensors as a :class:`CopyAhead` whose :meth:`~CopyAhead.make` the
    caller runs before the state changes."""
    out = Outgoing(state)
    indices = stripes(out.sizes, count)[position]
    return {"step": int(state["step"]), "count": len(out.shapes), "indices": indices,
            "sizes": [out.sizes[i] for i in indices],
            "shapes": {i: out.shapes[i] for i in indices},
            "tensors": CopyAhead(out.tensors, indices, wait_s)}


def send_share(link: Any, rank: int, joiner: int, share: dict[str, Any],
               update_of: Callable[[int], dict[str, Any]]) -> int:
    """A helper's thread: offer ``share`` to ``joiner`` (its step, its tensors' numbers and
    sizes), send the tensors if the joiner takes it, then the updates it asks for
    (``update_of(step)``: the update of the round that ended at ``step``, once this rank
    has it) until it asks for none. The bytes sent."""
    ranks = [rank, joiner]
    copies = share["tensors"]
    try:
        exchange_ints(link, [share["step"], share["count"], *share["indices"],
                             *share["sizes"]], rank, ranks)
        taken = exchange_ints(link, None, joiner, ranks)
        if taken != [1]:
            return 0
        send_tensors(link.broadcast, rank, ranks, rank, share["shapes"], share["indices"],
                     copies)
    finally:
        copies.stop()  # sent, refused or failed: the copies go (and no more are made)
    nbytes = sum(share["sizes"])
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
            self.done.set()
            self.link.close()

    def _take_share(self) -> bool:
        intake = self.intake
        head = exchange_ints(self.link, None, self.member, self.ranks)
        if not intake.ready.wait(intake.wait_s):
            raise PeerTimeoutError(f"rank {intake.rank}: the description from rank "
                                   f"{intake.source} did not come within {intake.wait_s:.0f} s")
        if intake.abandoned:
            raise PeerLost(f"rank {intake.rank} gave the transfer up")
        with intake.lock:
            if self.taken is None:
                self.taken = intake.fits(self.position, head)
            taken = self.taken
        if taken:  # the source need not copy this part for itself
            intake.links[intake.source].mark(share_tag(self.position))
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
        self.abandoned = False
        self.described_at = 0.0  # perf_counter() when the description came

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
        self.targets = _targets(skeleton, into)
        state = skeleton["state"]
        self.step = int(state["step"]) if isinstance(state, dict) else 0
        self.described_at = time.perf_counter()
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
        self.targets = {}  # in the state now: the intake keeps no tensor of it
        for helper in self.taking:
            helper.received = {}
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
        self.abandoned = True
        self.ready.set()  # a helper waiting for the description goes on to fail
        for helper in self.helpers:
            helper.link.abandon()
            helper.ask([])
