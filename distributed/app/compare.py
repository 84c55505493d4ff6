"""Compare strategies on one profile's task: the same run simulated once per strategy.

For each strategy the profile is re-resolved with ``strategy`` replaced: keys
that only the profile's own strategy takes (``H`` of DiLoCo, say) are left
out, and the user's overrides apply where the strategy accepts them. Every
strategy is checked before the first run starts, so a typo costs nothing.
The results give the final validation loss, the bytes each node sent and the
wall time, and the validation curve (against steps and against bytes) that
:func:`plot_comparison` draws.
"""

from __future__ import annotations

import difflib
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distributed.profiles.profile import (
    KeyRouting,
    Profile,
    ProfileError,
    load_profile,
    parse_overrides,
    strategy_class,
)
from exogym.io import atomic_write_bytes

__all__ = ["COMPARE_SETTINGS", "StrategyResult", "check_plotting", "parse_overrides", "plan_comparison",
           "plot_comparison", "profile_for_strategy", "run_comparison"]


#: Settings a compared strategy takes when the profile gives none: Streaming DiLoCo
#: in two fragments (the smallest models, digits' two-layer MLP, have two layers),
#: each overlapped by one inner step.
COMPARE_SETTINGS: dict[str, dict[str, Any]] = {
    "streaming_diloco": {"num_fragments": 2, "fragment_delay": 1},
}


@dataclass
class StrategyResult:
    """One strategy's simulated run.

    Args:
        strategy: the strategy's name as given.
        profile: the resolved profile that ran.
        summary: the trainer's final figures (``exogym.report.summarize``).
        curve: ``(step, bytes sent by rank 0 so far, validation loss)`` at every evaluation.
    """

    strategy: str
    profile: Profile
    summary: dict[str, Any]
    curve: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def final_val_loss(self) -> float | None:
        """Validation loss of the ranks' average model at the end (local model's if unknown)."""
        return self.summary.get("final_val_global_loss", self.summary.get("final_val_loss"))

    @property
    def bytes_per_node(self) -> float:
        """Bytes each node sent, on average."""
        return float(self.summary.get("bytes_per_node") or 0)

    @property
    def wall_s(self) -> float:
        """Seconds the run took, start to end."""
        return float(self.summary.get("wall_s") or 0.0)


def profile_for_strategy(profile: Profile, strategy: str,
                         overrides: Mapping[str, Any] | None = None) -> Profile:
    """``profile`` with ``strategy`` in place of its own, validated.

    Keys only the old strategy took are dropped; ``overrides`` apply where the
    new strategy (or the task or the run) accepts them.

    Raises:
        ProfileError: when the strategy is unknown or unavailable, or the result is invalid.
    """
    old = profile.resolved
    new = KeyRouting.of(old.task_fn, strategy_class(strategy))

    def keep(key: str, from_old_profile: bool) -> bool:
        if key in new.named:
            return True
        if new.task_args is None:  # a task taking **kwargs gets what no strategy claims
            return not (from_old_profile and key in old.routing.strategy_args)
        return False

    values = {k: v for k, v in profile.values.items() if keep(k, True)}
    if strategy != profile.strategy:
        for key, value in COMPARE_SETTINGS.get(strategy, {}).items():
            values.setdefault(key, value)
    values.update({k: v for k, v in (overrides or {}).items() if keep(k, False)})
    values["strategy"] = strategy
    values["description"] = f"{profile.name} with strategy {strategy}"
    result = Profile(profile.name, values, profile.source)
    problems = result.problems()
    if problems:
        raise ProfileError(f"profile {profile.name!r} with strategy {strategy!r}:\n  "
                           + "\n  ".join(problems))
    return result


def plan_comparison(name: str, strategies: Sequence[str], config: str | None = None,
                    overrides: Mapping[str, Any] | None = None,
                    output_root: str | Path | None = None) -> list[Profile]:
    """One validated profile per strategy, each writing to its own output folder:
    ``output_root/STRATEGY`` (default: the ``output_dir`` override, else the profile's
    ``output_dir/compare``).

    Raises:
        ProfileError: for a bad profile, strategy or override, before anything runs.
    """
    if not strategies:
        raise ProfileError("no strategies to compare: give e.g. --strategies ddp,diloco,fedavg")
    repeated = sorted({s for s in strategies if list(strategies).count(s) > 1})
    if repeated:
        raise ProfileError(f"strategies listed twice: {', '.join(repeated)}")
    base = load_profile(name, config)
    overrides = dict(overrides or {})
    plans = [profile_for_strategy(base, s, overrides) for s in strategies]
    unused = [key for key in overrides
              if not any(key in p.values and p.values[key] == overrides[key] for p in plans)]
    if unused:
        accepted = set().union(*(p.resolved.routing.named for p in plans))
        hints = []
        for key in unused:
            close = difflib.get_close_matches(key, accepted, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ProfileError(f"--set {', '.join(hints)}: no compared strategy, nor the task or the "
                           f"run, accepts {'it' if len(unused) == 1 else 'them'}")
    if output_root is not None:
        root = Path(output_root)
    elif overrides.get("output_dir"):
        root = Path(str(overrides["output_dir"]))
    else:
        root = base.resolved.output_dir / "compare"
    return [p.with_overrides({"output_dir": str(root / s)}) for p, s in zip(plans, strategies)]


def run_comparison(plans: Sequence[Profile],
                   progress: Callable[[Profile], Any] | None = None,
                   on_result: Callable[[StrategyResult], None] | None = None
                   ) -> list[StrategyResult]:
    """Simulate every planned profile locally, one after another.

    Args:
        plans: from :func:`plan_comparison`.
        progress: for each profile, what shows its run (a ``ProgressSink``, or
            True/False); default: nothing.
        on_result: called after each run, e.g. to print a row at once.

    Raises:
        RunFailedError: when a rank of a run fails (the runs before it are lost).
    """
    # Here, not at the top: they bring torch, which planning a comparison (and the wizard's
    # and the CLI's profile listings, which import this module) must not pay for.
    from distributed.app.run import RunFailedError, brief_failure
    from distributed.rank.worker import run_profile
    from exogym.rank import LostRankError
    from exogym.trainer import RankFailedError

    results = []
    for plan in plans:
        sink = progress(plan) if progress is not None else False
        try:
            trainer = run_profile(plan, progress=sink, local=True)
        except (RankFailedError, LostRankError) as exc:
            raise RunFailedError(f"{plan.strategy}: {brief_failure(exc)}") from exc
        curve = [(row["step"], int(row["comm_bytes"]),
                  float(row.get("val_global_loss", row["val_loss"])))
                 for row in trainer.history if row["rank"] == 0 and "val_loss" in row]
        result = StrategyResult(plan.strategy, plan, dict(trainer.summary), curve)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def check_plotting() -> None:
    """Raise ``ImportError`` naming the extra when matplotlib is missing (call it before
    spending minutes on runs whose plot could not be drawn)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError("the comparison plot needs matplotlib: pip install 'exogym[examples]'")


def plot_comparison(results: Sequence[StrategyResult], path: str | Path,
                    title: str | None = None) -> Path:
    """Draw validation loss against step and against bytes sent, one line per strategy,
    and write the PNG atomically.

    Raises:
        ImportError: when matplotlib is not installed (``pip install 'exogym[examples]'``).
    """
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        if not r.curve:
            continue
        steps, sent, loss = zip(*r.curve)
        by_step.plot(steps, loss, marker="o", markersize=3, label=r.strategy)
        by_bytes.plot([max(b, 1) for b in sent], loss, marker="o", markersize=3, label=r.strategy)
    by_step.set_xlabel("step")
    by_bytes.set_xlabel("bytes sent per node")
    by_bytes.set_xscale("log")
    for ax in (by_step, by_bytes):
        ax.set_ylabel("validation loss")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(path, buffer.getvalue())
