"""Parsers of single values that other parts of exogym need, apart from ``fit``'s schema.

A device name (:func:`parse_device`), a partition (:func:`parse_partition`) and
the divisors of a batch size (:func:`divisors`) are read by the argument checks
in :mod:`exogym.config.fit_args` and also by the modules that act on them
(devices, data partitions, memory), which therefore need not import the schema.
No torch here.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["DEVICE_KINDS", "PARTITION_KINDS", "divisors", "parse_device", "parse_partition"]

DEVICE_KINDS = ("cpu", "cuda", "mps")


def parse_device(device: Any) -> tuple[str, str]:
    """``device`` as (kind, index): ``('best', '')`` for None/'auto', ``('cuda', '1')`` for 'cuda:1'.

    Checks the spelling only; whether the device exists here is for
    :func:`exogym.run.devices.resolve_devices` on the machine that trains.
    """
    if device is not None and not isinstance(device, str) \
            and type(device).__module__.startswith("torch"):
        device = str(device)  # a torch.device
    if device in (None, "", "auto"):
        return "best", ""
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cpu', 'cuda' or 'mps', got {device!r}")
    kind, _, index = device.partition(":")
    if kind not in DEVICE_KINDS or (index and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}")
    return kind, index


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


PARTITION_KINDS = ("iid", "dirichlet:ALPHA", "shards:N")


def parse_partition(value: Any) -> tuple[str, float]:
    """``partition=`` as (kind, parameter): ``('iid', 0)``, ``('dirichlet', 0.3)``, ``('shards', 2)``.

    Raises:
        ValueError: not one of ``'iid'``, ``'dirichlet:ALPHA'`` (ALPHA > 0) or
            ``'shards:N'`` (N an integer >= 1).
    """
    if not isinstance(value, str):
        raise ValueError(f"partition must be one of {', '.join(PARTITION_KINDS)}, got {value!r}")
    kind, sep, param = value.strip().partition(":")
    if kind == "iid" and not sep:
        return "iid", 0.0
    if kind == "dirichlet" and sep:
        try:
            alpha = float(param)
        except ValueError:
            alpha = math.nan
        if alpha > 0 and math.isfinite(alpha):
            return "dirichlet", alpha
        raise ValueError(f"partition {value!r}: ALPHA in 'dirichlet:ALPHA' must be a number > 0 "
                         "(0.1: each rank sees mostly a few labels; 100: close to iid)")
    if kind == "shards" and sep:
        if param.isdigit() and int(param) >= 1:
            return "shards", float(int(param))
        raise ValueError(f"partition {value!r}: N in 'shards:N' must be an integer >= 1 "
                         "(label-sorted shards per rank)")
    raise ValueError(f"partition must be one of {', '.join(PARTITION_KINDS)}, got {value!r}")
