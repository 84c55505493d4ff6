"""Compare strategies on one profile's task: the same run simulated once per strategy.

For each strategy the profile is re-resolved with ``strategy`` replaced: keys
that only the profile's own strategy takes (``H`` of DiLoCo, say) are left
out. Where the config file holds a profile for that strategy in the same
family (one whose ``base_profile`` is the compared profile or its base, as
``digits-fedavg`` beside ``digits-diloco``), that profile's own strategy
settings apply (FedAvg runs with its H=10, not the default H=1); the user's
overrides apply last, where the strategy accepts them. Every
strategy is checked before the first run starts, so a typo costs nothing.
The results give the final validation loss, the bytes each node sent, the
time each strategy trained and, apart, its start-up (the first run pays for
what the later ones reuse, so start-up is never charged to a strategy's time),
and the validation curve (against steps and against bytes) that
:func:`plot_comparison` draws into the comparison's output folder. Bytes are
drawn on a symmetric-log axis, linear near 0, so a point where nothing was
sent yet sits at 0, not at a made-up 1 byte. What a face shows of it is built here
too: the settings each strategy runs with (:func:`settings_table`), a line per
finished run (:func:`result_line`) and the results (:func:`results_table`).
"""

from __future__ import annotations

import difflib
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exogym.base.arg_errors import init_arg_names
from exogym.base.plural import plural
from exogym.report.comparison_plot import (  # the CLI's and exogym.compare's own
    check_plotting as check_plotting,
)
from exogym.report.comparison_plot import (
    comparison_figure as comparison_figure,
)
from exogym.report.comparison_plot import (
    plot_comparison as plot_comparison,
)
from exogym.strategy import registry

from ..profiles.profile import (
    KeyRouting,
    Profile,
    ProfileError,
    ProfileSet,
    builtin_strategy,
    parse_overrides,
    parse_value,
    strategy_class,
)
from ..tasks.extras import require_extra

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = ["COMPARE_SETTINGS", "PLOT_NAME", "TIMES_NOTE", "StartClock", "StrategyResult",
           "check_extras", "check_plotting", "comparison_figure", "comparison_folder",
           "comparison_heading", "comparison_progress", "parse_overrides", "plan_comparison",
           "plot_comparison", "profile_for_strategy", "result_line", "results_table",
           "run_comparison", "settings_table", "strategy_profiles", "strategy_settings",
           "write_plot"]

#: The plot's file name in the comparison's output folder.
PLOT_NAME = "compare.png"

#: What the results' times mean, said under their table.
TIMES_NOTE = ("train time: each strategy's ranks training, first step to last; start-up (the "
              "task built, the rank processes started and joined) is apart, as the first run "
              "also starts what the later ones reuse.")

#: Settings a compared strategy takes when the profile gives none: Streaming DiLoCo
#: in two fragments (the smallest models, digits' two-layer MLP, have two layers),
#: each overlapped by one inner step.
COMPARE_SETTINGS: dict[str, dict[str, Any]] = {
    "streaming_diloco": {"num_fragments": 2, "fragment_delay": 1},
}

#: The strategies ``compare`` simulates unless told otherwise.
DEFAULT_STRATEGIES = ",".join(registry.COMPARED)


@dataclass
class StrategyResult:
    """One strategy's simulated run.

    Args:
        strategy: the strategy's name as given.
        profile: the resolved profile that ran.
        summary: the trainer's final figures (``exogym.report.summary.summarize``).
        curve: ``(step, bytes sent by rank 0 so far, validation loss)`` at every evaluation.
        sim_curve: ``(simulated seconds, validation loss)`` at every evaluation, when the
            run kept a simulated clock (``network=``).
        startup_s: seconds from the run's start until every rank was training: building
            the task, starting the rank processes (the first run of a comparison also
            starts what the later ones reuse, such as the process server), joining them.
    """

    strategy: str
    profile: Profile
    summary: dict[str, Any]
    curve: list[tuple[int, int, float]] = field(default_factory=list)
    sim_curve: list[tuple[float, float]] = field(default_factory=list)
    startup_s: float | None = None

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
        """Seconds the trainer's ``fit`` took, start to end (its start-up included)."""
        return float(self.summary.get("wall_s") or 0.0)

    @property
    def train_s(self) -> float:
        """Seconds the strategy trained: its ranks' training loops (the slowest rank's),
        from the first step to the last, evaluations included and start-up left out; what
        strategies are compared by, whichever ran first."""
        return float(self.summary.get("train_s") or 0.0)


class StartClock:
    """A progress sink that notes when every rank of a run has begun training, passing
    every call on to the sink it wraps.

    Training has begun when every rank has sent its ``start`` event (the first ``step``
    event, should a rank be away at the start).

    Args:
        inner: the sink shown the run (None: nothing is shown).
        ranks: the run's ranks.
        clock: the clock read (seconds).
    """

    def __init__(self, inner: Any, ranks: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.inner = inner
        self.ranks = ranks
        self.clock = clock
        self.started: set[int] = set()
        #: When the last rank began training; None until then.
        self.training_since: float | None = None

    def on_event(self, event: dict[str, Any]) -> None:
        """Note a ``start`` (or first ``step``), then pass the event on."""
        if self.training_since is None:
            kind = event.get("event")
            if kind == "start":
                self.started.add(int(event.get("rank", 0)))
            if len(self.started) >= self.ranks or kind == "step":
                self.training_since = self.clock()
        if self.inner is not None:
            self.inner.on_event(event)

    def close(self) -> None:
        """Stop the wrapped sink's live display."""
        if self.inner is not None:
            self.inner.close()

    def finish(self, summary: dict[str, Any], title: str = "run summary") -> None:
        """Show the final figures in the wrapped sink."""
        if self.inner is not None:
            self.inner.finish(summary, title)

    def __getattr__(self, name: str) -> Any:
        # what else the wrapped sink offers (on_output, set_status, ...)
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


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


def strategy_profiles(name: str, strategies: Sequence[str], config: str | Path | None = None
                      ) -> dict[str, str | None]:
    """For each strategy, the profile of ``name``'s family in ``config`` that runs it, or None.

    The family: ``name`` itself, the profiles whose ``base_profile`` is ``name``, and those
    sharing ``name``'s own ``base_profile`` (its siblings), in file order; ``name`` first.
    Only a profile that names its strategy counts (``digits-base`` names none).

    Raises:
        ProfileError: when the config file or ``name`` cannot be read, or a strategy is unknown.
    """
    profiles = ProfileSet(config)
    if name not in profiles.raw:
        profiles.values(name)  # raises, naming the close ones
    parent = profiles.raw[name].get("base_profile")
    family = [name] + [other for other, raw in profiles.raw.items() if other != name
                       and raw.get("base_profile") in {name, parent} - {None}]
    found: dict[str, str | None] = {}
    for strategy in strategies:
        wanted = strategy_class(strategy)
        found[strategy] = None
        for other in family:
            try:
                named = profiles.values(other).get("strategy")
                if named is not None and strategy_class(str(named)) is wanted:
                    found[strategy] = other
                    break
            except (ProfileError, ValueError, ImportError):
                continue  # a broken relative is not a source of settings
    return found


def _own_strategy_settings(profiles: ProfileSet, name: str, strategy: str) -> dict[str, Any]:
    """The keys profile ``name`` sets itself (not inherited) that ``strategy`` takes."""
    takes = init_arg_names(strategy_class(strategy))
    return {key: parse_value(text) for key, text in profiles.raw[name].items()
            if key in takes}


def strategy_settings(plan: Profile) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``plan``'s strategy runs with: (settings the profile gives, defaults of the
    strategy's own settings it leaves unset). Settings every strategy shares (``lr``,
    ``max_steps``, ...) are left out, but for ``lr``."""
    from exogym.strategy import Strategy  # here, not at the top: it brings torch (see below)

    cls = plan.resolved.strategy_cls
    shared = init_arg_names(Strategy)
    given = {k: v for k, v in plan.resolved.strategy_kwargs.items()
             if k not in shared or k == "lr"}
    defaults: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for param in inspect.signature(init).parameters.values():
            key = param.name
            if (key in shared or key in given or key in defaults or key == "self"
                    or param.default is inspect.Parameter.empty
                    or not isinstance(param.default, (int, float, str, bool))):
                continue
            defaults[key] = param.default
    return given, defaults


def comparison_folder(plans: Sequence[Profile]) -> Path:
    """The folder holding the compared runs' folders, where the plot goes too."""
    return Path(str(plans[0].values["output_dir"])).parent


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
    profiles = ProfileSet(config)
    base = profiles.get(name)
    overrides = dict(overrides or {})
    sources = strategy_profiles(name, strategies, config)
    plans = []
    for s in strategies:
        source = sources[s]
        named = (_own_strategy_settings(profiles, source, s)
                 if source is not None and source != name else {})
        plans.append(profile_for_strategy(base, s, {**named, **overrides}))
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
    from exogym.report.summary import RunReporter
    from exogym.run.run_rank import LostRankError
    from exogym.run.trainer import RankFailedError

    from ..worker.run_profile import run_profile
    from .run import RunFailedError, brief_failure

    results = []
    for plan in plans:
        sink = progress(plan) if progress is not None else False
        ranks = plan.num_nodes
        if isinstance(sink, bool):
            sink = RunReporter(ranks, log_interval=int(plan.values.get("log_interval") or 10)) \
                if sink else None
        clock = StartClock(sink, ranks)
        began = clock.clock()
        try:
            trainer = run_profile(plan, progress=clock, local=True)
        except (RankFailedError, LostRankError) as exc:
            raise RunFailedError(f"{plan.strategy}: {brief_failure(exc)}") from exc
        ended = clock.clock()
        curve = [(row["step"], int(row["comm_bytes"]),
                  float(row.get("val_global_loss", row["val_loss"])))
                 for row in trainer.history if row["rank"] == 0 and "val_loss" in row]
        sim_curve = [(float(row["sim_time_s"]),
                      float(row.get("val_global_loss", row["val_loss"])))
                     for row in trainer.history
                     if row["rank"] == 0 and "val_loss" in row and "sim_time_s" in row]
        summary = dict(trainer.summary)
        startup = (clock.training_since if clock.training_since is not None else ended) - began
        result = StrategyResult(plan.strategy, plan, summary, curve, sim_curve, startup)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def check_extras(plans: Sequence[Profile]) -> None:
    """Raise ``ImportError`` naming the extra and the command that installs it when the
    compared task needs an extra this machine lacks (call it before any run starts)."""
    for task in sorted({plan.task for plan in plans}):
        require_extra(task)




# ------------------------------------------------------------------ what a face shows


def comparison_heading(name: str, strategies: Sequence[str], plans: Sequence[Profile]) -> str:
    """One line before the runs: the strategies, the profile, its nodes and steps."""
    nodes = plans[0].num_nodes
    steps = plans[0].values.get("max_steps")
    return (f"Comparing {', '.join(strategies)} on {name} "
            f"({plural(nodes, 'simulated node')}, "
            f"{plural(steps, 'step') if steps is not None else '? steps'} each).")


def settings_table(name: str, strategies: Sequence[str], plans: Sequence[Profile],
                   config: str | Path | None = None) -> Table:
    """What each strategy runs with, shown before the runs: the profile its settings come
    from (:func:`strategy_profiles`), the settings it is given and the defaults of the
    strategy's own settings it leaves unset (:func:`strategy_settings`)."""
    from rich.table import Table

    sources = strategy_profiles(name, strategies, config)
    table = Table(title="Settings each strategy runs with", title_justify="left")
    for column in ("strategy", "settings from", "settings", "strategy defaults"):
        table.add_column(column, overflow="fold")
    for plan in plans:
        given, defaults = strategy_settings(plan)
        source = sources[plan.strategy]
        table.add_row(plan.strategy,
                      f"profile {source}" if source else f"{name} (no "
                      f"{plan.strategy} profile)",
                      " ".join(f"{k}={v}" for k, v in given.items()) or "-",
                      " ".join(f"{k}={v}" for k, v in defaults.items()) or "-")
    return table


def comparison_progress(console: Console, page: Any, name: str
                        ) -> Callable[[Profile], Any]:
    """What shows each compared run: a terminal dashboard on ``console`` and, when
    ``page`` (a ``WebDashboard``) is given, the run on the page too."""
    from .dashboard import Dashboard
    from .fanout import FanOut

    def dashboard(plan: Profile) -> Any:
        nodes = plan.num_nodes
        if page is not None:
            page.begin_run(plan.strategy, plan.values, nodes)
        return FanOut(Dashboard(nodes, console=console, title=f"{plan.strategy} on {name}",
                                show_summary=False), page)

    return dashboard


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def result_line(result: StrategyResult) -> str:
    """One finished run in a line: its validation loss, bytes per node and times."""
    from exogym.report.summary import human_bytes

    val = result.final_val_loss
    return (f"{result.strategy}: val loss {'-' if val is None else f'{val:.4f}'},"
            f" {human_bytes(result.bytes_per_node)} per node, "
            f"{result.train_s:.1f} s training (start-up "
            f"{_seconds(result.startup_s)})")


def results_table(name: str, results: Sequence[StrategyResult],
                  network: str | None = None) -> Table:
    """The comparison: each strategy's final validation loss (and accuracy, when the task
    reports one), bytes per node and their share of DDP's, train time and start-up, and
    with a ``network`` the simulated time (:data:`TIMES_NOTE` says what the times are)."""
    from rich.table import Table

    from exogym.report.summary import human_bytes

    ddp = next((r.bytes_per_node for r in results if builtin_strategy(r.strategy) == "ddp"),
               None)
    table = Table(title=f"{name}: {plural(len(results), 'strategy')}", title_justify="left")
    accuracy = any(r.summary.get("final_val_accuracy") is not None for r in results)
    for column in ("strategy", "final val loss", *(("val acc (rank 0)",) if accuracy else ()),
                   "bytes per node", "vs ddp", "train time", "start-up",
                   *(("simulated time",) if network else ())):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for r in results:
        val = r.final_val_loss
        acc = r.summary.get("final_val_accuracy")
        relative = f"{r.bytes_per_node / ddp:.2%}" if ddp else "-"
        table.add_row(r.strategy, "-" if val is None else f"{val:.4f}",
                      *(("-" if acc is None else f"{acc:.1%}",) if accuracy else ()),
                      human_bytes(r.bytes_per_node), relative, f"{r.train_s:.1f} s",
                      _seconds(r.startup_s),
                      *((f"{r.summary.get('sim_time_s', 0.0):.2f} s",) if network else ()))
    return table


def write_plot(name: str, plans: Sequence[Profile], results: Sequence[StrategyResult],
               out: str | Path | None = None, network: str | None = None) -> Path:
    """Draw the comparison's plot (:func:`plot_comparison`) into ``out``, by default
    :data:`PLOT_NAME` in the comparison's folder; returns where it went."""
    return plot_comparison(results, out or comparison_folder(plans) / PLOT_NAME,
                           title=f"{name}: validation loss", network=network)
