"""Which profile runs a strategy ``recommend`` predicts: a profile of the config file, and
the ``--set`` options that make it the planned run with that strategy.

For a candidate (a strategy and its settings, ``DiLoCo H=100``) of a planned
profile, :func:`run_with` looks, in this order, for

1. the planned profile itself, when ``--set`` reaches the candidate (``digits-diloco
   --set H=100``);
2. a profile of the same task that names the candidate's strategy, the planned
   profile's family first (its children, then its siblings: ``digits-ddp`` beside
   ``digits-diloco``), then the rest of the file: its own strategy settings (a tuned
   ``lr``, say) stay, the candidate's settings are set;
3. a profile of the same task that ``--set strategy=...`` turns into the candidate
   (``digits-base --set strategy=sparta``).

Whatever the planned run sets differently (the task's arguments, the run's keys such
as ``num_nodes``, the person's own ``--set`` values) is set too, and a task argument or
run key another profile sets and the planned one leaves at its default is set back to
that default, so the command trains the model that was measured, on the same run; how a
profile checkpoints, evaluates and logs stays its own. Of the profiles that fit, the one needing
the fewest ``--set`` options is named.
"""

from __future__ import annotations

import dataclasses
import inspect
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..profiles.profile import (
    LAUNCH_KEYS,
    RUN_KEYS,
    Profile,
    ProfileError,
    ProfileSet,
    strategy_class,
)
from ..worker.command import set_args

__all__ = ["RunWith", "run_with"]

#: Keys that say what a profile is or how it checkpoints, evaluates and reports, not what
#: it trains: never carried from the planned profile to another.
_OWN_KEYS = {"base_profile", "description", "output_dir", "strategy", "checkpoint_interval",
             "keep_checkpoints", "log_interval", "logger", "wandb_project", "val_size",
             "val_interval", "correlation_interval", "timeout_s", "stall_after"}
_NO_DEFAULT = object()


def _defaults(profile: Profile) -> dict[str, Any]:
    """The default of every task argument (from the task function's signature) and of every
    run key (``fit``'s), for the keys a profile leaves unset."""
    from exogym.config.fit_args import FitArgs

    found = {f.name: f.default for f in dataclasses.fields(FitArgs)
             if f.default is not dataclasses.MISSING}
    for parameter in inspect.signature(profile.resolved.task_fn).parameters.values():
        if parameter.default is not inspect.Parameter.empty:
            found[parameter.name] = parameter.default
    return found


def _same_training(a: Profile, b: Profile, defaults: Mapping[str, Any]) -> bool:
    """Whether ``a`` and ``b`` train the same: the same task, its arguments and the run's
    keys equal, defaults filled in (the strategy and what :data:`_OWN_KEYS` name aside)."""
    keys = (set(a.resolved.task_kwargs) | set(b.resolved.task_kwargs) | RUN_KEYS
            | LAUNCH_KEYS) - _OWN_KEYS
    return a.values.get("task") == b.values.get("task") and all(
        a.values.get(k, defaults.get(k, _NO_DEFAULT))
        == b.values.get(k, defaults.get(k, _NO_DEFAULT)) for k in keys)


@dataclass(frozen=True)
class RunWith:
    """A profile and the ``--set`` values that run a candidate.

    Args:
        profile: the profile's name.
        overrides: the keys to set on it (``--set KEY=VALUE``), in order.
    """

    profile: str
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def args(self) -> str:
        """``digits-diloco --set H=100``: what follows ``distributed-train``, quoted."""
        return shlex.join([self.profile, *set_args(self.overrides)])

    def to_dict(self) -> dict[str, Any]:
        """``{"profile", "overrides", "args"}`` for ``--json``."""
        return {"profile": self.profile, "overrides": dict(self.overrides), "args": self.args}


def _same_strategy(name: Any, strategy: str) -> bool:
    try:
        return strategy_class(str(name)) is strategy_class(strategy)
    except (ValueError, ImportError, ProfileError):
        return False


def _carried(planned: Profile, user: Mapping[str, Any]) -> dict[str, Any]:
    """What the planned run sets that another profile must set too: its task's arguments
    and run keys, and of ``user``'s own ``--set`` values those and the settings every
    strategy takes (``lr``, ...); the planned strategy's own settings are left behind."""
    from exogym.base.arg_errors import init_arg_names
    from exogym.strategy import Strategy

    keys = set(planned.resolved.task_kwargs) | RUN_KEYS | LAUNCH_KEYS
    carried = {k: v for k, v in planned.values.items() if k in keys and k not in _OWN_KEYS}
    every_strategy = init_arg_names(Strategy)
    carried.update({k: v for k, v in user.items()
                    if (k in keys or k in every_strategy) and k not in _OWN_KEYS})
    return carried


def _fit(profiles: ProfileSet, name: str, wanted: dict[str, Any], planned: Profile
         ) -> dict[str, Any] | None:
    """The ``--set`` values that turn profile ``name`` into ``wanted``'s keys and
    ``planned``'s training (a task argument or run key it sets that ``planned`` leaves at
    its default goes back to that default); None when it cannot take them."""
    defaults = _defaults(planned)
    try:
        base = profiles.get(name)
        own = set(base.resolved.task_kwargs) | ((RUN_KEYS | LAUNCH_KEYS) & set(base.values))
        for key in own - set(planned.values) - _OWN_KEYS - set(wanted):
            if key not in defaults:
                return None  # a setting of its own that no --set can take back
            wanted = {**wanted, key: defaults[key]}
        overrides = {k: v for k, v in wanted.items() if base.values.get(k, _NO_DEFAULT) != v}
        fitted = base.with_overrides(overrides) if overrides else base
        if not _same_training(fitted, planned, defaults):
            return None
    except ProfileError:
        return None
    return overrides


def _family_first(profiles: ProfileSet, name: str) -> list[str]:
    """Every profile of the file: ``name``, its children, its siblings, then the rest."""
    names = profiles.names()
    parent = profiles.raw.get(name, {}).get("base_profile")
    children = [n for n in names if profiles.raw[n].get("base_profile") == name]
    siblings = [n for n in names if parent is not None and n != name
                and profiles.raw[n].get("base_profile") == parent]
    ordered = [name, *children, *siblings, *names]
    return list(dict.fromkeys(n for n in ordered if n in profiles.raw))


def run_with(planned: Profile, strategy: str, settings: Mapping[str, Any],
             config: str | None = None, user_overrides: Mapping[str, Any] | None = None
             ) -> RunWith | None:
    """The profile, and its ``--set`` values, that run ``planned``'s training with
    ``strategy`` and ``settings`` (see the module's docstring); None when no profile of
    ``config`` can.

    Args:
        planned: the profile recommend measured, overrides applied.
        strategy: the candidate's strategy (``ddp``, ``diloco``, ...).
        settings: its settings (``{"H": 100}``).
        config: the profiles file (default: the project's ``config.ini``).
        user_overrides: the person's own ``--set`` values, carried to whichever profile.
    """
    profiles = ProfileSet(config)
    user = dict(user_overrides or {})
    carried = _carried(planned, user)
    same_task = []
    for name in _family_first(profiles, planned.name):
        try:
            values = profiles.values(name)
        except ProfileError:
            continue  # a broken profile runs nothing
        if values.get("task") == planned.values.get("task"):
            same_task.append((name, values.get("strategy")))
    found: list[tuple[int, int, RunWith]] = []  # (rank of the rule, --set count, run)
    if planned.name in profiles.raw:
        own = _fit(profiles, planned.name, {**user, "strategy": strategy, **settings}, planned)
        if own is not None:
            if _same_strategy(planned.values.get("strategy", "diloco"), strategy):
                own.pop("strategy", None)
            found.append((1, len(own), RunWith(planned.name, own)))
    for name, named in same_task:
        if named is not None and _same_strategy(named, strategy):
            overrides = _fit(profiles, name, {**carried, **settings}, planned)
            if overrides is not None:
                found.append((2, len(overrides), RunWith(name, overrides)))
    if not found:
        for name, _ in same_task:
            overrides = _fit(profiles, name, {**carried, "strategy": strategy, **settings},
                             planned)
            if overrides is not None:
                found.append((3, len(overrides), RunWith(name, overrides)))
    if not found:
        return None
    # the planned profile when --set reaches it; else the fewest --set values, family first
    return min(enumerate(found), key=lambda item: (item[1][0] != 1, item[1][1], item[0]))[1][2]
