"""The comm module under its historical name: ``exogym.strategy.communicate``.

Strategies written for exo-explore/gym import their collectives from here; they
are the same counted functions as :mod:`exogym.comm`.
"""

from exogym.comm import (  # noqa: F401
    all_gather,
    all_reduce,
    all_reduce_tensors,
    broadcast,
    comm_bytes,
    reset_counters,
)

__all__ = ["all_reduce", "broadcast", "all_gather", "all_reduce_tensors"]
