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
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch

from exogym import comm

#: Small tensors travel together in buffers of up to this many bytes.
BUCKET_BYTES = 16 << 20
#: Where a tensor may start in such a buffer (a multiple of every element's size).
ALIGN = 16


class _Slot:
    """Where a tensor stood in a flattened state."""

    def __init__(self, index: int):
        self.index = index


def flatten_tensors(value: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The distinct tensors inside a nested state (dicts, lists, tuples), in order, and
    the state with each replaced by a placeholder: ``{"state": ..., "tensors": [(shape,
    dtype)]}``. A tensor equal to an earlier one of its shape and dtype takes its place."""
    tensors: list[torch.Tensor] = []
    alike: dict[tuple[Any, ...], list[int]] = {}

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            # Only tensors of one shape, dtype and first and last values are compared whole.
            flat = t.reshape(-1)
            kind = (tuple(t.shape), t.dtype, flat[:8].numpy().tobytes() if t.numel() > 1
                    else None, flat[-8:].numpy().tobytes() if t.numel() > 1 else None)
            for index in alike.get(kind, ()) if t.numel() > 1 else ():
                if torch.equal(tensors[index], t):
                    return _Slot(index)
            alike.setdefault(kind, []).append(len(tensors))
            tensors.append(t)
            return _Slot(len(tensors) - 1)
        if isinstance(v, dict):
            return type(v)((k, walk(x)) for k, x in v.items())
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            return type(v)(walk(x) for x in v)
        return v

    state = walk(value)
    return tensors, {"state": state, "tensors": [(tuple(t.shape), t.dtype) for t in tensors]}


def unflatten_tensors(skeleton: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    """The state :func:`flatten_tensors` took apart, with ``tensors`` back in their places
    (a tensor that stood in several places is copied for each after the first)."""
    used: set[int] = set()

    def walk(v: Any) -> Any:
        if isinstance(v, _Slot):
            t = tensors[v.index]
            if v.index in used:
                return t.clone()
            used.add(v.index)
            return t
        if isinstance(v, dict):
            return type(v)((k, walk(x)) for k, x in v.items())
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            return type(v)(walk(x) for x in v)
        return v

    return walk(skeleton["state"])


def _buckets(sizes: Sequence[int]) -> list[list[int]]:
    """Indices of consecutive tensors in groups of at most :data:`BUCKET_BYTES` (a larger
    tensor alone)."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if current and total + size > BUCKET_BYTES:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        groups.append(current)
    return groups


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def hand_over(state: Any, source: int, ranks: Sequence[int], rank: int) -> tuple[Any, int]:
    """Send ``state`` from ``source`` to the other ``ranks``; every one of them calls this.

    Args:
        state: the state on ``source`` (ignored elsewhere).
        source: the rank that sends.
        ranks: the source and the ranks that receive.
        rank: the calling rank.

    Returns:
        The state (``state`` itself on the source, rebuilt elsewhere) and the bytes sent.
    """
    if rank == source:
        tensors, skeleton = flatten_tensors(state)
        buffer = io.BytesIO()
        torch.save(skeleton, buffer)
        description = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([description.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    comm.side_broadcast(size, source, ranks)
    if rank != source:
        description = torch.empty(int(size.item()), dtype=torch.uint8)
    comm.side_broadcast(description, source, ranks)
    if rank != source:
        skeleton = torch.load(io.BytesIO(description.numpy().tobytes()), weights_only=False)
    shapes = skeleton["tensors"]
    sizes = [_nbytes(shape, dtype) for shape, dtype in shapes]
    received: list[torch.Tensor] = []
    for group in _buckets(sizes):
        if len(group) == 1:
            shape, dtype = shapes[group[0]]
            one = tensors[group[0]] if rank == source else torch.empty(shape, dtype=dtype)
            comm.side_broadcast(one, source, ranks)
            received.append(one)
            continue
        # Each tensor starts at a multiple of ALIGN in the buffer, so that it can be a view.
        starts = []
        end = 0
        for i in group:
            starts.append(end)
            end += -(-sizes[i] // ALIGN) * ALIGN
        flat = torch.zeros(end, dtype=torch.uint8)
        if rank == source:
            for i, at in zip(group, starts):
                flat[at:at + sizes[i]].copy_(tensors[i].reshape(-1).view(torch.uint8))
        comm.side_broadcast(flat, source, ranks)
        for i, at in zip(group, starts):
            shape, dtype = shapes[i]
            received.append(flat[at:at + sizes[i]].view(dtype).view(shape))
    nbytes = sum(sizes) + description.numel()
    if rank == source:
        return state, nbytes
    return unflatten_tensors(skeleton, received), nbytes
