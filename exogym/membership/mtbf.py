"""``rank_failures`` drawn from a mean time between failures: hosts that fail at a given rate.

:func:`draw_rank_failures` gives a simulation (``fit(rank_failures=...)``) hosts
that each fail, independently, on average once every ``mtbf`` and stay down
``down`` each time, from a seed: the same seed draws the same failures.

Each host's failures are a renewal process: the time from one failure's start
to the next one's is ``down`` plus an exponential up time of mean ``mtbf -
down``, so a host fails on average once per ``mtbf`` (``mtbf=120, down=30``:
down a quarter of the time). Times are in steps, or in seconds of the
simulated clock given ``step_s``, the simulated seconds of one step (e.g. a
fault-free run's ``summary['sim_time_per_step_s']``). A failure at time ``t``
falls in step ``floor(t / step_s) + 1``, which the host does not complete; it is
up again at ``t + down`` and can train from the next step that begins after
that (it rejoins at the next round boundary, :mod:`exogym.membership.simulated`).
A host that fails again before it was readmitted stays away until it is back
from that failure.

A failure that would leave fewer than ``min_present`` ranks present, or a rank
coming back with no rank that stayed to hand it the state, is not drawn (the
host does not fail then); the rest are kept as drawn.
"""

from __future__ import annotations

import math
import random
from typing import Any

from exogym.membership.simulated import Failure

__all__ = ["draw_rank_failures"]


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def _count(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or \
            (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return value


def draw_rank_failures(num_nodes: int, max_steps: int, *, mtbf: float, down: float, seed: int,
                       step_s: float | None = None, round_steps: int = 1,
                       min_present: int = 1) -> list[Failure]:
    """``rank_failures`` for a run of ``num_nodes`` ranks and ``max_steps`` steps, each host
    failing on average once per ``mtbf`` and down ``down`` each time (see the module).

    Args:
        num_nodes: ranks (hosts) in the run, at least 2.
        max_steps: the run's steps.
        mtbf: mean time between one failure of a host and its next (steps, or seconds
            with ``step_s``); more than ``down``.
        down: how long a failure keeps its host down (steps, or seconds with ``step_s``).
        seed: the seed of the draws.
        step_s: simulated seconds per step: ``mtbf`` and ``down`` are in seconds (None:
            in steps).
        round_steps: the strategy's steps per round (``Strategy.round_steps``): a host
            back rejoins at a round boundary, and cannot fail again before.
        min_present: ranks that must be present at every step (1 ..
            ``num_nodes - 1``).

    Returns:
        ``(rank, at_step, back_at_step or None)`` entries, sorted, that
        ``fit(rank_failures=...)`` accepts for this run.

    Raises:
        ValueError: an argument out of range, naming it and its value.
    """
    _count("num_nodes", num_nodes, 2)
    _count("max_steps", max_steps, 1)
    _count("seed", seed, -(1 << 63))
    _count("round_steps", round_steps, 1)
    _count("min_present", min_present, 1, num_nodes - 1)
    mtbf = _positive("mtbf", mtbf)
    down = _positive("down", down)
    unit = "s" if step_s is not None else " steps"
    if mtbf <= down:
        raise ValueError(f"mtbf must be longer than down (a host fails on average once per "
                         f"mtbf, down for down of it): mtbf={mtbf:g}{unit}, "
                         f"down={down:g}{unit}")
    per_step = 1.0 if step_s is None else _positive("step_s", step_s)
    rng = random.Random(seed)

    def round_start(step: int) -> int:
        return -(-(step - 1) // round_steps) * round_steps + 1

    drawn: list[tuple[int, int, int]] = []
    for rank in range(num_nodes):
        t = 0.0
        while True:
            t += rng.expovariate(1.0 / (mtbf - down))
            at = math.floor(t / per_step) + 1
            if at >= max_steps:
                break
            t += down
            back = max(at + 1, math.ceil(t / per_step) + 1)
            drawn.append((rank, at, back))

    # A failure before the rank was readmitted extends the absence it is in.
    merged: list[list[int]] = []
    for rank, at, back in sorted(drawn):
        last = merged[-1] if merged and merged[-1][0] == rank else None
        if last is not None and at <= round_start(last[2]):
            last[2] = max(last[2], back)
        else:
            merged.append([rank, at, back])

    # Accepted in the order they start: a rank's latest absence is the only one that can
    # reach the step a later failure starts at, so each check looks at one per rank.
    latest: dict[int, tuple[int, float]] = {}  # rank -> (at, join step or inf)
    kept: list[Failure] = []

    def away(other: int, step: float) -> bool:
        span = latest.get(other)
        return span is not None and span[0] <= step < span[1]

    def stays(other: int, step: float, leaving: int) -> bool:
        """``other`` trains ``step`` and the one before (it can hand the state over) when
        ``leaving`` is away."""
        span = latest.get(other)
        return other != leaving and not away(other, step) and \
            not (span is not None and span[1] == step)

    for rank, at, back in sorted(merged, key=lambda f: (f[1], f[0])):
        join = round_start(back) if back <= max_steps else math.inf
        if sum(away(other, at) for other in range(num_nodes)) + 1 > num_nodes - min_present:
            continue  # too few would be left: the host does not fail
        if join != math.inf and not any(stays(other, join, rank) for other in range(num_nodes)):
            continue  # nobody that stayed would be there to hand it the state
        # ranks rejoining while it is away need another rank that stays to hand them over
        rejoins = {span[1] for other, span in latest.items()
                   if other != rank and at <= span[1] < join}
        if any(not any(stays(other, step, rank) for other in range(num_nodes)) for step in rejoins):
            continue
        latest[rank] = (at, join)
        kept.append((rank, at, back if back <= max_steps else None))
    return sorted(kept)
