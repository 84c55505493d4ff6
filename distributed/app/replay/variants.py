"""The replays to run: the recorded run on its recorded cluster, and each what-if.

:func:`replay_profile` puts a profile on the recorded cluster: its links, its ranks'
speeds (``rank_speeds`` on ``compute_time_s``, the fastest rank's mean), each rank's
own seconds at each step as the clock's ``compute_schedule``, and its membership
changes as ``rank_failures``; it trains the run's samples. :func:`plan_variants`
adds the what-ifs (other strategies or settings on the same cluster), every one
checked before the first replay starts.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exogym.strategy import registry

from ...profiles.profile import Profile, ProfileError
from ..compare import COMPARE_SETTINGS, profile_for_strategy
from .recording import Recording, ReplayError

__all__ = ["RECORDED_KEYS", "Variant", "plan_variants", "replay_profile"]

#: Keys a what-if may not set: the replay sets them from the recording.
RECORDED_KEYS = frozenset({"network", "rank_speeds", "compute_time_s", "speed_mode",
                           "rank_failures", "num_nodes", "output_dir", "task"})


@dataclass(frozen=True)
class Variant:
    """One replay: the run as recorded, or a what-if.

    Args:
        label: how tables name it (``as recorded``, ``diloco``, ``diloco H=50``).
        strategy: the strategy's name.
        settings: the ``--set`` values it adds.
        profile: the profile that runs, the recorded cluster applied.
        rank_failures: the recorded membership changes, as ``fit`` takes them.
        compute_schedule: each rank's compute at each step, as ``fit`` takes it.
        recorded: True for the run as recorded.
    """

    label: str
    strategy: str
    settings: dict[str, Any]
    profile: Profile
    rank_failures: list[list[int | None]] | None = None
    compute_schedule: list[list[float]] | None = None
    recorded: bool = False


def replay_profile(recording: Recording, out: Path, base: Profile | None = None,
                   label: str = "as recorded", max_steps: Any = None
                   ) -> tuple[Profile, dict[str, Any]]:
    """``base`` (default: the recorded profile) on the recorded cluster: its links, its
    ranks' speeds, its membership changes; the simulated clock charges what the run took.
    It trains the run's samples: as many steps as the run made, scaled when ``base``
    has another ``batch_size``, unless ``max_steps`` is given.

    The clock charges each rank, step by step, what it took in the recorded run
    (``compute_schedule``, in full-speed seconds so that ``rank_speeds`` divides them
    back), scaled by ``base``'s batch size over the run's.

    Returns:
        The profile, and the cluster's settings as applied (for the report); the
        membership changes (``rank_failures``) and the schedule (``compute_schedule``),
        arguments of a simulation and no profile keys, are in the latter alone.
    """
    base = base or recording.profile
    compute = recording.compute_per_step()
    reference = min(compute)
    network, links_from = recording.network()
    failures = recording.rank_failures()
    steps = recording.steps
    batch = recording.profile.values.get("batch_size")
    own_batch = base.values.get("batch_size")
    if max_steps is not None:
        steps = max_steps
    elif isinstance(batch, int) and isinstance(own_batch, int) and own_batch != batch:
        steps = max(1, math.ceil(steps * batch / own_batch))  # the same samples
    cluster: dict[str, Any] = {
        "compute_time_s": reference,
        "rank_speeds": [round(reference / c, 6) if c > 0 else 1.0 for c in compute],
        "speed_mode": "clock",
        "network": network,
    }
    values = {**cluster, "max_steps": steps, "num_nodes": recording.num_nodes,
              "logger": None, "checkpoint_interval": None,
              "output_dir": str(out / _slug(label))}
    try:
        profile = base.with_overrides(values)
    except ProfileError as exc:
        raise ReplayError(f"the recorded cluster does not fit {label}: {exc}") from None
    scale = own_batch / batch if isinstance(batch, int) and isinstance(own_batch, int) else 1.0
    schedule = [[own * speed * scale for own in row]
                for row, speed in zip(recording.compute_schedule(), cluster["rank_speeds"])]
    report = {**cluster, "rank_failures": failures, "links_from": links_from, "max_steps": steps,
              "compute_per_step_s": [round(c, 6) for c in compute],
              "compute_schedule": schedule}
    return profile, report


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in label).strip("-") or "run"


def plan_variants(recording: Recording, strategies: Sequence[str],
                  overrides: Mapping[str, Any], out: Path) -> list[Variant]:
    """The run as recorded, then each what-if: every strategy of ``strategies`` (or the
    recorded one, when only ``overrides`` are given) with ``overrides`` where it takes
    them. Checked whole before any replay: an unknown strategy, a key no variant
    takes, a value of the wrong type, a key the recording fixes.

    Raises:
        ReplayError: naming the strategy, key or value and what is accepted.
    """
    fixed = sorted(set(overrides) & RECORDED_KEYS)
    if fixed:
        raise ReplayError(f"--set {', '.join(fixed)}: the replay takes "
                          f"{'it' if len(fixed) == 1 else 'them'} from the recording (the "
                          f"cluster, its links and events); a what-if may change the "
                          "strategy's and the run's other settings")
    wrong = [_value_problem(key, value, recording) for key, value in overrides.items()]
    wrong = [w for w in wrong if w]
    if wrong:
        raise ReplayError("; ".join(wrong))
    names = _strategy_names(strategies)
    recorded_strategy = registry.canonical(recording.profile.strategy)
    if not names and overrides:
        names = [recorded_strategy]
    base, cluster = replay_profile(recording, out, label="as recorded")
    failures = cluster["rank_failures"]
    variants = [Variant("as recorded", recorded_strategy, {}, base, failures,
                        cluster["compute_schedule"], recorded=True)]
    used: set[str] = set()
    for name in names:
        source = recording.profile
        try:
            plan = profile_for_strategy(source, name, dict(overrides)) \
                if name != recorded_strategy else source.with_overrides(dict(overrides))
        except ProfileError as exc:
            raise ReplayError(f"what if {name}: {exc}") from None
        taken = {k: v for k, v in overrides.items() if plan.values.get(k) == v}
        used |= set(taken)
        extra = COMPARE_SETTINGS.get(name, {}) if name != recorded_strategy else {}
        label = " ".join([name, *(f"{k}={v}" for k, v in {**extra, **taken}.items())])
        profile, own = replay_profile(recording, out, plan, label,
                                      max_steps=overrides.get("max_steps"))
        variants.append(Variant(label, name, taken, profile, failures, own["compute_schedule"]))
    unused = sorted(set(overrides) - used)
    if unused:
        raise ReplayError("; ".join(_unused_problems(unused, variants)))
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise ReplayError("two what-ifs are the same run: give each strategy once")
    return variants


def _strategy_names(strategies: Sequence[str]) -> list[str]:
    """The canonical name of each strategy of ``--strategy``, each given once."""
    names = []
    for given in strategies:
        try:
            names.append(registry.canonical(given))
        except (TypeError, ValueError):
            key = str(given).strip().lower().replace("-", "_")
            close = difflib.get_close_matches(key, list(registry.KNOWN), n=1)
            raise ReplayError(f"--strategy {given!r} is not a strategy"
                              + (f" (did you mean {close[0]!r}?)" if close else "")
                              + f": the known ones are {', '.join(registry.KNOWN)}") from None
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ReplayError(f"--strategy {', '.join(repeated)} given twice")
    return names


def _unused_problems(unused: Sequence[str], variants: Sequence[Variant]) -> list[str]:
    """Why each ``--set`` key of ``unused`` went to no variant: a setting of a strategy not
    asked about, or a key nothing replayed accepts (with the closest one that is)."""
    whatifs = [v for v in variants if not v.recorded]
    problems = []
    for key in unused:
        takers = [v.strategy for v in variants
                  if key in v.profile.resolved.routing.named]
        if takers:  # a setting, only not of the strategies asked about
            problems.append(
                f"--set {key}: {' and '.join(v.strategy for v in whatifs) or 'the replay'} "
                f"{'has' if len(whatifs) == 1 else 'have'} no setting {key} (it is "
                f"{registry.canonical(takers[0])}'s, the recorded run's); leave it out, "
                "or replay a strategy that has it")
            continue
        accepted = set().union(*(v.profile.resolved.routing.named for v in variants))
        close = [c for c in difflib.get_close_matches(key, accepted, n=2) if c != key]
        problems.append(f"--set {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                        + ": no replayed strategy, nor the task or the run, accepts it")
    return problems


def _value_problem(key: str, value: Any, recording: Recording) -> str | None:
    """Why ``--set key=value`` is of the wrong kind: the run's own value of ``key`` (or,
    where it had none, the default of a strategy's argument of that name) is a number or
    a flag and ``value`` is not; None when it fits or nothing says what it should be."""
    import inspect

    reference = recording.identity.settings.get(key, recording.identity.may_change.get(key))
    if reference is None:
        for known in registry.KNOWN.values():
            if key in known.traffic_defaults and known.traffic_defaults[key] is not None:
                reference = known.traffic_defaults[key]
                break
        if reference is None:
            try:
                parameter = inspect.signature(recording.profile.resolved.strategy_cls
                                              ).parameters.get(key)
            except (TypeError, ValueError):
                parameter = None
            if parameter is not None and parameter.default is not inspect.Parameter.empty:
                reference = parameter.default
    if isinstance(reference, bool):
        if not isinstance(value, bool):
            return f"--set {key}={value!r}: {key} is true or false (the run had {reference})"
    elif isinstance(reference, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"--set {key}={value!r}: {key} is a number (the run had {reference})"
    return None

