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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from exogym import comm
from exogym.base import plain_state

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
                 tensors: Sequence[torch.Tensor] | None = None,
                 targets: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """The tensors numbered ``indices`` (of a description's ``shapes``) from ``source``:
    small ones coalesced into buffers of up to :data:`BUCKET_BYTES`, large ones alone.

    ``tensors``: on the source, the state's flattened tensors (all of them, by number).
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


class Outgoing:
    """A state taken apart to be sent, whole or in parts (:func:`stripes`).

    Args:
        state: the nested state (dicts, lists, tuples and tensors of plain data).
    """

    def __init__(self, state: Any):
        self.tensors, skeleton = flatten_tensors(state)
        self.shapes = skeleton["tensors"]
        self.sizes = [_nbytes(shape, dtype) for shape, dtype in self.shapes]
        self.description = torch.frombuffer(bytearray(describe(skeleton)), dtype=torch.uint8)

    def nbytes(self, indices: Sequence[int]) -> int:
        """The bytes of the tensors numbered ``indices``."""
        return sum(self.sizes[i] for i in indices)


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


def receiver_targets(skeleton: dict[str, Any], into: Any) -> dict[int, torch.Tensor]:
    """For each tensor of a received description, the receiver's own tensor (in ``into``,
    its state of the same structure) that takes it in place."""
    return _targets(skeleton, into)
