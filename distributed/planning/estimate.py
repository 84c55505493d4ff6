"""What the cost model needs from a profile: its model's size and the time of one step here.

:func:`measure_model` builds the profile's task the way a rank does, counts
the trainable parameters, and times a few forward and backward passes at the
profile's batch size on this machine, which stands in for every host when
the wizard predicts the speedup of each strategy (``distributed.planning.projection``, the
model ``bench/project_speedup.py`` validates against measured runs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from distributed.profiles.profile import Profile


@dataclass(frozen=True)
class ModelFacts:
    """A profile's model, measured.

    Args:
        num_params: trainable parameters.
        compute_s_per_step: seconds of one forward and backward pass over a batch.
        batch_size: the batch the time is for.
        threads: the compute threads it ran with.
        shapes: the shape of every trainable tensor (DeMo's payload depends on them).
    """

    num_params: int
    compute_s_per_step: float
    batch_size: int
    threads: int
    shapes: tuple[tuple[int, ...], ...] = ()


def measure_model(profile: Profile, ranks_here: int = 1, steps: int = 10,
                  warmup: int = 3) -> ModelFacts:
    """Build ``profile``'s task and time ``steps`` training passes after ``warmup`` ones.

    Args:
        profile: the profile whose model and batch size are measured.
        ranks_here: ranks that share this machine's cores (a local simulation of K
            nodes: K). The passes use the threads one such rank gets: the profile's
            ``num_threads``, else ``cores // ranks_here``, as the trainer sets them.
        steps, warmup: passes timed, and passes run before timing.

    Raises:
        Whatever building the task raises (a missing extra, a bad setting).
    """
    import os

    import torch

    from distributed.tasks.builtin import count_parameters

    resolved = profile.resolved
    model, train, _ = resolved.task_fn(**resolved.task_kwargs)
    run = resolved.run_kwargs
    batch_size = int(run.get("batch_size") or 16)
    device = torch.device("cpu")
    model.to(device).train()
    threads = int(run.get("num_threads") or max(1, (os.cpu_count() or 1) // max(1, ranks_here)))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = _time_passes(model, train, batch_size, device, steps, warmup)
    finally:
        torch.set_num_threads(previous)
    shapes = tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)
    return ModelFacts(count_parameters(model), times[len(times) // 2], batch_size, threads,
                      shapes)


def _time_passes(model, train, batch_size: int, device, steps: int, warmup: int) -> list[float]:
    from torch.utils.data import DataLoader

    from exogym.data import to_device

    loader = iter(DataLoader(train, batch_size=batch_size, shuffle=False))
    times = []
    for i in range(warmup + steps):
        try:
            batch = next(loader)
        except StopIteration:
            loader = iter(DataLoader(train, batch_size=batch_size, shuffle=False))
            batch = next(loader)
        batch = to_device(batch, device)
        started = time.perf_counter()
        model(batch).backward()
        model.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return sorted(times)
