"""The time of one real training step of one rank, measured on this machine.

:func:`measure_step_seconds` runs rank 0 of a run spec the way every rank runs
it — :meth:`exogym.run.train_node.TrainNode.train_step`: forward and backward
(with gradient accumulation), the optimizer, and the strategy's own local work
(SPARTA's selection, DeMo's compression and decoding, packing) — in a
one-process group on loopback whose collectives are mirrored
(``EXOGYM_COLLECTIVES=mirror``, :mod:`exogym.comm`): every collective returns
what it would if ``spec.num_nodes`` ranks held this rank's tensors, and
nothing is sent or waited for. What the time leaves out is what a cost model
adds to it: bytes on the wire and waiting for the slowest peer.
"""

from __future__ import annotations

import os
import time

import torch

from exogym import comm
from exogym.run.devices import loopback_interface, rank_device
from exogym.run.spec import Placement, RunSpec
from exogym.run.train_node import TrainNode

IFNAME_VARIABLE = "GLOO_SOCKET_IFNAME"


def _join_alone(timeout_s: float):
    """Join a process group of this process alone, on loopback; returns its store."""
    store = comm.open_store("127.0.0.1", 0, is_master=True, world_size=1, timeout_s=timeout_s)
    iface = loopback_interface()
    set_here = iface is not None and IFNAME_VARIABLE not in os.environ
    if set_here:
        os.environ[IFNAME_VARIABLE] = iface
    try:
        comm.init_process_group(store, 0, 1, "gloo", timeout_s)
    finally:
        if set_here:
            del os.environ[IFNAME_VARIABLE]
    return store


def measure_step_seconds(spec: RunSpec, steps: int = 10, warmup: int = 3) -> list[float]:
    """Seconds of each of ``steps`` training steps of rank 0 of ``spec``, after ``warmup`` ones.

    Runs in this process (which must not be in a process group), on rank 0's
    device, with ``spec.num_threads`` threads (default: all cores); leaves the
    process as it found it: no process group, collectives not mirrored, the
    thread count restored.

    Args:
        spec: the run; ``minibatch_size`` resolved, ``max_steps`` covering
            ``warmup + steps`` (the learning-rate schedule spans it).
        steps: steps timed.
        warmup: steps run before timing (allocations, first-call work).

    Returns:
        The times in increasing order.
    """
    if comm.is_initialized():
        raise RuntimeError("measure_step_seconds runs a rank of its own; call it outside a "
                           "process group")
    placement = Placement(ranks_per_machine=1, devices=spec.devices)
    device = rank_device(spec.device_type, spec.devices, 0)
    previous_threads = torch.get_num_threads()
    store = _join_alone(spec.timeout_s)
    comm.use_mirror_collectives(True, world_size=spec.num_nodes)
    torch.set_num_threads(placement.threads_per_rank(spec))
    times = []
    try:
        node = TrainNode(spec, 0, device, lambda event: None, placement)
        node.start()
        for i in range(warmup + steps):
            started = time.perf_counter()
            node.train_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - started)
        node.close()
    finally:
        torch.set_num_threads(previous_threads)
        comm.use_mirror_collectives(False)
        comm.destroy_process_group()
        comm.reset_counters()
        del store
    return sorted(times)
