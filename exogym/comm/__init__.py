"""The collectives strategies call, their transports (backends), and the wire's facts.

``from exogym import comm`` then ``comm.all_reduce(...)``: the collectives live
in :mod:`exogym.comm.collectives` and load on first use, so the torch-free
parts (:mod:`exogym.comm.wire`, :mod:`exogym.comm.store`) import without torch.

- :mod:`~exogym.comm.collectives`: collectives with byte counters, bucketing,
  quantization, the side channel;
- :mod:`~exogym.comm.in_flight`: each rank's collectives in flight, read from another thread;
- :mod:`~exogym.comm.protocol` and its implementations (``torch_group``,
  ``shared_memory``, ``packed`` with ``mailbox``, ``elastic_groups``, ``mirror``);
- :mod:`~exogym.comm.quantize`, :mod:`~exogym.comm.averaging`;
- :mod:`~exogym.comm.wire`: bucket size, bytes per value, quantized payloads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exogym.comm.collectives import (
        MAX_VALUE_BYTES,
        MODE_ENV,
        MODES,
        Collectives,
        ControlStore,
        ControlValueTooLarge,
        PeerLost,
        PeerTimeoutError,
        RankDropped,
        ReduceOp,
        all_gather,
        all_reduce,
        all_reduce_tensors,
        backend,
        beat_news,
        broadcast,
        collective_time,
        collectives_mode,
        comm_bytes,
        comm_calls,
        destroy_process_group,
        enter_step,
        group_size,
        held_once,
        init_process_group,
        is_connection_error,
        is_initialized,
        link_progress,
        nccl_available,
        new_group,
        next_beat,
        open_store,
        pause,
        present_ranks,
        ranks_here,
        read_beat,
        reset_counters,
        resolve_dtype,
        restore_counters,
        runs_within,
        side_all_gather,
        side_all_reduce,
        side_barrier,
        side_broadcast,
        side_group_size,
        store_round_trips,
        timed,
        torch_identity,
        use_backend,
        use_clock,
        use_local_collectives,
        use_mirror_collectives,
        use_packed_world,
        waiting,
    )

__all__ = [
    "MAX_VALUE_BYTES",
    "MODE_ENV",
    "MODES",
    "Collectives",
    "ControlStore",
    "ControlValueTooLarge",
    "PeerLost",
    "PeerTimeoutError",
    "RankDropped",
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "all_reduce_tensors",
    "backend",
    "beat_news",
    "broadcast",
    "collective_time",
    "collectives_mode",
    "comm_bytes",
    "comm_calls",
    "destroy_process_group",
    "enter_step",
    "group_size",
    "held_once",
    "init_process_group",
    "is_connection_error",
    "is_initialized",
    "link_progress",
    "nccl_available",
    "new_group",
    "next_beat",
    "open_store",
    "pause",
    "present_ranks",
    "ranks_here",
    "read_beat",
    "reset_counters",
    "resolve_dtype",
    "restore_counters",
    "runs_within",
    "side_all_gather",
    "side_all_reduce",
    "side_barrier",
    "side_broadcast",
    "side_group_size",
    "store_round_trips",
    "timed",
    "torch_identity",
    "use_backend",
    "use_clock",
    "use_local_collectives",
    "use_mirror_collectives",
    "use_packed_world",
    "waiting",
]


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    import importlib

    collectives = importlib.import_module("exogym.comm.collectives")
    try:
        value = getattr(collectives, name)
    except AttributeError:
        raise AttributeError(f"module 'exogym.comm' has no attribute {name!r}") from None
    globals()[name] = value  # the next lookup is a plain one
    return value
