"""What the cost model needs from a profile: its model's size and the time of one step here.

:func:`measure_model` builds the profile's task and strategy the way a rank
does and times real training steps of one rank on this machine
(:func:`exogym.run.step_time.measure_step_seconds`): forward, backward, the
optimizer and the strategy's own local work (selection, compression,
decoding), with collectives that return what they would among the planned
number of hosts but send nothing. That time stands in for every host when the
wizard predicts the speedup of each strategy (``distributed.planning.projection``,
the model ``python -m bench.project_speedup`` validates against measured runs), which
adds the time on the wire.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from exogym.config.fit_args import RunArgs
from exogym.run.memory import with_measured_minibatch
from exogym.run.spec import Placement, make_run_spec
from exogym.run.step_time import measure_step_seconds

from ..profiles.profile import Profile, quietly
from ..tasks.builtin import count_parameters


@dataclass(frozen=True)
class ModelFacts:
    """A profile's model, measured.

    Args:
        num_params: trainable parameters.
        compute_s_per_step: seconds of one training step of one rank here: forward,
            backward, optimizer and the strategy's local work, without the network.
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
                  warmup: int = 3, num_nodes: int | None = None,
                  task: tuple[Any, Any, Any] | None = None) -> ModelFacts:
    """Build ``profile``'s task and strategy and time ``steps`` training steps after ``warmup`` ones.

    Args:
        profile: the profile whose model, strategy and batch size are measured.
        ranks_here: ranks that share this machine's cores (a local simulation of K
            nodes: K). The steps use the threads one such rank gets: the profile's
            ``num_threads``, else ``cores // ranks_here``, as the trainer sets them.
        steps, warmup: steps timed, and steps run before timing.
        num_nodes: the ranks the run is planned for (default: the profile's
            ``num_nodes``); a strategy's local work may grow with them (DeMo
            decodes every rank's payload).
        task: the profile's ``(model, train_dataset, val_dataset)`` when already built
            (timing several strategies on one task); the model is copied, never trained.

    Raises:
        Whatever building the task raises (a missing extra, a bad setting).
    """
    resolved = profile.resolved
    model, train, _ = task if task is not None else resolved.task_fn(**resolved.task_kwargs)
    run = resolved.run_kwargs
    threads = int(run.get("num_threads") or max(1, (os.cpu_count() or 1) // max(1, ranks_here)))
    args = RunArgs(**{
        **run,
        "strategy": quietly(resolved.strategy_cls, resolved.strategy_kwargs),  # timed, not run
        "num_nodes": num_nodes or profile.num_nodes,
        "max_steps": warmup + steps,
        "device": "cpu",
        "num_threads": threads,
        "val_size": 0,
        "checkpoint_interval": None,
        "correlation_interval": None,
    })
    spec = with_measured_minibatch(make_run_spec(model, train, None, args),
                                   Placement(ranks_per_machine=ranks_here))
    times = measure_step_seconds(spec, steps, warmup)
    shapes = tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)
    return ModelFacts(count_parameters(model), times[len(times) // 2], spec.batch_size, threads,
                      shapes)
