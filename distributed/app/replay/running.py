"""Run the replays: each variant simulated here, one after another, on the recorded
cluster, and its figures set beside the recorded run's.

Evaluation and the hand-over of the state to a readmitted rank cost a real run time
that the simulated clock does not charge: the seconds one evaluation added to the
recorded run (:func:`~.timelines.eval_seconds`, apart for an evaluation that ends a round
and one inside a round, which must first gather the ranks' models) are added to each
replay's timeline at each evaluation, by where it falls in the replayed strategy's
rounds, and each recorded hand-over's seconds at the replay's readmission of the same
order (:func:`~.timelines.hand_over_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from exogym.report.trace import read_trace

from .load import round_steps_of
from .recording import Recording
from .report import ReplayResult
from .timelines import Timeline, hand_over_seconds, rounded, timeline
from .variants import Variant, replay_profile

__all__ = ["replay", "simulate"]


def simulate(variant: Variant, progress: Any = False) -> Any:
    """Run one variant as a local simulation into its profile's ``output_dir`` (its trace
    and ``summary.json`` there); returns the trainer."""
    from exogym.base.io import atomic_write_json
    from exogym.run.trainer import LocalTrainer

    profile = variant.profile
    resolved = profile.resolved
    out = resolved.output_dir
    model, train_dataset, val_dataset = resolved.task_fn(**resolved.task_kwargs)
    strategy = resolved.strategy_cls(**resolved.strategy_kwargs)
    trainer = LocalTrainer(model, train_dataset, val_dataset)
    trainer.fit(**resolved.run_kwargs, strategy=strategy, run_name=profile.name,
                save_dir=str(out / "checkpoints"), log_dir=str(out / "logs"),
                progress=progress, trace=str(out),
                rank_failures=[tuple(f) for f in variant.rank_failures]
                if variant.rank_failures else None,
                compute_schedule=variant.compute_schedule)
    atomic_write_json(out / "summary.json", {"profile": profile.name, "replay": variant.label,
                                             **trainer.summary})
    return trainer


def replay(recording: Recording, variants: Sequence[Variant],
           progress: Callable[[Variant], Any] | None = None,
           on_result: Callable[[Variant, Timeline], None] | None = None) -> ReplayResult:
    """Simulate every variant on the recorded cluster, one after another.

    Args:
        recording: from :func:`load_recording`.
        variants: from :func:`plan_variants` (the run as recorded first).
        progress: for each variant, what shows its run (a ``ProgressSink`` or a bool).
        on_result: called after each replay.

    Raises:
        RunFailedError: a replay's rank failed.
    """
    # Here: they bring torch, which checking the input must not wait for.
    from exogym.run.run_rank import LostRankError
    from exogym.run.trainer import RankFailedError

    from ..run import RunFailedError, brief_failure

    real = timeline(recording.lines, recording.round_steps, recording.num_nodes,
                    measured_eval=True)
    eval_s = real.eval_s if real.clock == "wall" else {"round_end": 0.0, "mid_round": 0.0}
    hand_overs = hand_over_seconds(recording.lines, real.rank) if real.clock == "wall" else []
    _, cluster = replay_profile(recording, Path(variants[0].profile.resolved.output_dir).parent)
    schedule = cluster.pop("compute_schedule")
    cluster["compute_schedule"] = (f"each rank's {len(schedule[0])} steps as recorded "
                                   "(full-speed seconds, divided by rank_speeds)")
    cluster["eval_s"] = eval_s
    cluster["hand_over_s"] = [rounded(h) for h in hand_overs]
    results = []
    for variant in variants:
        sink = progress(variant) if progress is not None else False
        try:
            trainer = simulate(variant, sink)
        except (RankFailedError, LostRankError) as exc:
            raise RunFailedError(f"replaying {variant.label}: {brief_failure(exc)}") from exc
        lines = read_trace(trainer.trace_path)
        figures = timeline(lines, round_steps_of(variant.profile), recording.num_nodes,
                           rank=real.rank if variant.recorded else None, add_eval_s=eval_s,
                           add_hand_overs=hand_overs)
        results.append((variant, figures))
        if on_result is not None:
            on_result(variant, figures)
    return ReplayResult(recording, real, results, cluster, real.final_val_loss)
