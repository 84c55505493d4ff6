"""Model averaging, in one place: of several states here, or of every rank's, across ranks.

One rule for every tensor: floating tensors are averaged in float64 and cast
back to their dtype; integer tensors (e.g. BatchNorm's ``num_batches_tracked``)
are averaged and rounded to their own integer dtype; boolean tensors keep
their value. :func:`average_state_dicts` averages states a process holds
(the ranks' final states in a local simulation); :func:`average_across_ranks`
gives every rank the average of all ranks' tensors, over the comm module's
side channel (uncounted), in a few bucketed calls.
:func:`averaged_tensors` says which tensors of a model an average covers, for
the strategies that average models and for evaluating the average model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence

import torch

from exogym import comm

BUCKET_ELEMENTS = 4 * 1024 * 1024  # float64 values per side-channel call (32 MiB) per process
MIN_BUCKET_ELEMENTS = 16 * 1024  # and never fewer per rank (128 KiB)


def averaged_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a model average covers: trainable parameters, then float buffers."""
    tensors = [p.data for p in model.parameters() if p.requires_grad]
    tensors += [b for b in model.buffers() if b.is_floating_point()]
    return tensors


def _mean_as(mean: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A float64 mean back in ``like``'s dtype: cast when floating, rounded when integer."""
    if like.is_floating_point() or like.is_complex():
        return mean.to(like.dtype)
    return mean.round().to(like.dtype)


def state_sums(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise float64 sums of several state dicts with the same keys, in order.

    Boolean tensors and other values keep the first state's value. With
    :func:`average_of_sums`, an average can be taken in parts (the ranks of
    each process of a packed simulation) and finished in one place.
    """
    if not states:
        raise ValueError("no states to average")
    keys = list(states[0].keys())
    for i, state in enumerate(states[1:], start=1):
        if list(state.keys()) != keys:
            missing = set(keys) ^ set(state.keys())
            raise ValueError(f"state {i} has different keys from state 0: {sorted(missing)}")
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        first = states[0][key]
        if not isinstance(first, torch.Tensor) or first.dtype == torch.bool:
            out[key] = first
            continue
        total = first.to(torch.float64, copy=True)
        for state in states[1:]:
            total += state[key].to(torch.float64)
        out[key] = total
    return out


class RunningSum:
    """Float64 sums of states added one at a time (:func:`state_sums` of all of them, held
    as one sum rather than every state), in the order they are added."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] | None = None
        self.count = 0

    def add(self, state: Mapping[str, torch.Tensor], count: int = 1) -> None:
        """Add ``state`` (a state, or already a float64 sum of ``count`` states)."""
        if self.sums is None:
            self.sums = state_sums([state]) if count == 1 else dict(state)
        else:
            for key, total in self.sums.items():
                if isinstance(total, torch.Tensor) and total.dtype == torch.float64:
                    total += state[key].to(torch.float64)
        self.count += count


def average_of_sums(parts: Sequence[tuple[Mapping[str, torch.Tensor], int]],
                    like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The mean from partial sums (:func:`state_sums`) and how many states each holds,
    each tensor in ``like``'s dtype."""
    count = sum(n for _, n in parts)
    if not parts or count == 0:
        raise ValueError("no states to average")
    out: dict[str, torch.Tensor] = {}
    for key, first in parts[0][0].items():
        if not isinstance(first, torch.Tensor) or first.dtype == torch.bool:
            out[key] = first
            continue
        total = first.clone()
        for sums, _ in parts[1:]:
            total += sums[key]
        out[key] = _mean_as(total / count, like[key])
    return out


def average_state_dicts(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of several state dicts with the same keys, each tensor in its dtype."""
    return average_of_sums([(state_sums(states), len(states))], states[0])


def bucket_elements() -> int:
    """Float64 values a rank sends per side-channel call of :func:`average_across_ranks`.

    :data:`BUCKET_ELEMENTS` for the whole process: the ranks packed in one process
    (:func:`exogym.comm.ranks_here`) each hold their bucket at once, so they share
    it, down to :data:`MIN_BUCKET_ELEMENTS` each.
    """
    return max(MIN_BUCKET_ELEMENTS, BUCKET_ELEMENTS // max(1, comm.ranks_here()))


def _spans(sizes: Sequence[int], limit: int) -> Iterator[list[tuple[int, int, int]]]:
    """Pieces ``(tensor index, start, stop)`` of the tensors' flattened values, in order,
    in buckets of at most ``limit`` values; a tensor larger than that is split."""
    bucket: list[tuple[int, int, int]] = []
    room = limit
    for i, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(size - start, room)
            bucket.append((i, start, start + take))
            start += take
            room -= take
            if room == 0:
                yield bucket
                bucket, room = [], limit
    if bucket:
        yield bucket


def average_across_ranks(tensors: Sequence[torch.Tensor],
                         into: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every rank gets the mean over all ranks of each of ``tensors`` (a collective).

    Travels over the side channel, so it is never counted as training traffic, in
    buckets of :func:`bucket_elements` values. Returns new tensors on the CPU, each in
    its input's dtype; boolean tensors come back unchanged. With ``into`` (tensors of
    the same shapes, contiguous), the means are written there instead, bucket by
    bucket, and ``into`` is returned: a rank then holds one bucket beyond its targets,
    not a second copy of them. Outside a process group, the tensors themselves
    (copied into ``into`` when given).
    """
    if into is not None:
        if len(into) != len(tensors) or any(
                t.shape != target.shape for t, target in zip(tensors, into)):
            raise ValueError("average_across_ranks: 'into' must hold one tensor of the same "
                             "shape for each tensor averaged")
        if not all(target.is_contiguous() for target in into):
            raise ValueError("average_across_ranks: the tensors of 'into' must be contiguous")
    ranks = comm.side_group_size()
    if ranks == 1:
        if into is None:
            return list(tensors)
        for t, target in zip(tensors, into):
            if t is not target:
                target.copy_(t)
        return list(into)
    out: list[torch.Tensor] = list(into) if into is not None else [
        t if t.dtype == torch.bool else torch.empty(t.shape, dtype=t.dtype)
        for t in tensors]
    numeric = [i for i, t in enumerate(tensors) if t.dtype != torch.bool]
    for i, t in enumerate(tensors):
        if t.dtype == torch.bool and out[i] is not t:
            out[i].copy_(t)
    sizes = [tensors[i].numel() for i in numeric]
    flat_of: tuple[int, torch.Tensor] | None = None  # the tensor being read, flattened
    for bucket in _spans(sizes, bucket_elements()):
        flat = torch.empty(sum(stop - start for _, start, stop in bucket), dtype=torch.float64)
        offset = 0
        for j, start, stop in bucket:
            if flat_of is None or flat_of[0] != j:
                flat_of = (j, tensors[numeric[j]].detach().reshape(-1))
            flat[offset:offset + stop - start].copy_(flat_of[1][start:stop])
            offset += stop - start
        comm.side_all_reduce(flat)
        flat /= ranks
        offset = 0
        for j, start, stop in bucket:
            target = out[numeric[j]].view(-1)
            target[start:stop].copy_(_mean_as(flat[offset:offset + stop - start], target))
            offset += stop - start
    return out


def average_state_across_ranks(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank gets the average of all ranks' ``state`` (see :func:`average_across_ranks`)."""
    return dict(zip(state.keys(), average_across_ranks(list(state.values()))))


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """A digest of a state's names, dtypes, shapes and bytes: equal states, equal digests
    (how the ranks of a run show that they ended with the same model)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, value in state.items():
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()
