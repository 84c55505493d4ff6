"""Average the ranks' final model states into one, every tensor in its own dtype."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def average_state_dicts(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of several state dicts with the same keys.

    Floating tensors are averaged in float64 and cast back to their dtype;
    integer tensors (e.g. BatchNorm's ``num_batches_tracked``) are averaged and
    rounded to their own integer dtype; boolean tensors keep the first state's value.
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
        total = torch.zeros_like(first, dtype=torch.float64)
        for state in states:
            total += state[key].to(torch.float64)
        mean = total / len(states)
        if first.is_floating_point() or first.is_complex():
            out[key] = mean.to(first.dtype)
        else:
            out[key] = mean.round().to(first.dtype)
    return out
