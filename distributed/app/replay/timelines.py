"""What a run took, on one rank's clock: the arithmetic of a trace's steps.

From a trace's lines (:mod:`exogym.report.trace`), recorded or replayed: the
:class:`Timeline` of one rank (the lowest present at every step,
:func:`reference_rank`; wall seconds across hosts, simulated seconds in a clocked
simulation) with the total time, each round's time (the strategy's ``round_steps``:
``H``, or one step), the time each membership change cost (the rounds around it
beyond the median round) and the validation loss at each evaluation; when each rank
was away (:func:`absences`); what the ranks that stayed waited for a hung rank to be
declared lost (:func:`detection_waits`); and what an evaluation (:func:`eval_seconds`)
and a readmission's hand-over (:func:`hand_over_seconds`) added to a measured run,
which a replay's timeline adds back where the simulated clock charged nothing.

Pure functions of the parsed lines: nothing here reads a file or runs a simulation.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from exogym.report.metrics import time_to_loss as loss_reached_at

__all__ = ["Timeline", "absences", "detection_waits", "eval_seconds", "hand_over_seconds",
           "membership_lines", "reference_rank", "rounded", "time_to_loss", "timeline"]


@dataclass
class Timeline:
    """What one run took, on one rank's clock.

    Args:
        clock: ``wall`` (measured seconds) or ``simulated`` (a simulated clock's).
        rank: the rank whose clock it is.
        round_steps: steps per round of the run's strategy.
        times: seconds at the end of each step known (evaluations' extra included).
        rounds: seconds of each whole round, in order.
        evaluations: ``(step, validation loss, seconds)`` at each evaluation.
        membership: each change of the ranks that train: ``step``, ``ranks``,
            ``reason``, ``lost_s`` (what the rounds around it took beyond the median round).
        eval_s: seconds one evaluation adds, at a round's end and inside one (in ``times``).
    """

    clock: str
    rank: int
    round_steps: int
    times: dict[int, float]
    rounds: list[float]
    evaluations: list[tuple[int, float, float]]
    membership: list[dict[str, Any]] = field(default_factory=list)
    eval_s: dict[str, float] = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        """Seconds to the last step."""
        return self.times[max(self.times)] if self.times else 0.0

    @property
    def steps(self) -> int:
        return max(self.times) if self.times else 0

    def round_quantile(self, q: float) -> float | None:
        if not self.rounds:
            return None
        if len(self.rounds) == 1:
            return self.rounds[0]
        return statistics.quantiles(self.rounds, n=20, method="inclusive")[round(q * 20) - 1] \
            if 0 < q < 1 else (min(self.rounds) if q == 0 else max(self.rounds))

    @property
    def round_s_median(self) -> float | None:
        return statistics.median(self.rounds) if self.rounds else None

    @property
    def final_val_loss(self) -> float | None:
        return self.evaluations[-1][1] if self.evaluations else None

    def to_dict(self) -> dict[str, Any]:
        """The figures as JSON values."""
        return {"clock": self.clock, "rank": self.rank, "steps": self.steps,
                "wall_s": rounded(self.wall_s), "round_steps": self.round_steps,
                "rounds": len(self.rounds), "round_s_median": rounded(self.round_s_median),
                "round_s_p10": rounded(self.round_quantile(0.1)),
                "round_s_p90": rounded(self.round_quantile(0.9)),
                "evaluations": [[step, loss] for step, loss, _ in self.evaluations],
                "evaluation_s": [rounded(t) for _, _, t in self.evaluations],
                "final_val_loss": self.final_val_loss,
                "membership": self.membership, "eval_s": self.eval_s}


def rounded(value: float | None) -> float | None:
    """``value`` to six decimals, as a report gives figures (None stays None)."""
    return None if value is None else round(float(value), 6)


def _step_points(lines: Sequence[Mapping[str, Any]], key: str) -> dict[int, dict[int, Any]]:
    """Per rank, ``step -> line`` for every ``step`` line and each ``steps`` block's last step
    (a block's times are at its last step); later lines replace earlier ones (restarts)."""
    points: dict[int, dict[int, Any]] = {}
    for line in lines:
        kind = line.get("kind")
        if kind == "step" and line.get(key) is not None:
            points.setdefault(line["rank"], {})[line["step"]] = line
        elif kind == "steps" and line.get(key) is not None:
            points.setdefault(line["rank"], {})[line["last"]] = line
    return points


def membership_lines(lines: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The run's membership changes, in order (the start's included)."""
    return [dict(line) for line in lines if line.get("kind") == "membership"]


def absences(lines: Sequence[Mapping[str, Any]], num_nodes: int
             ) -> list[tuple[int, int, int | None]]:
    """When each rank was away: ``(rank, first step it missed, first step it trained
    again or None)``, from the steps each rank recorded (a ``steps`` block counts as
    present from its first step to its last). The steps say it whether or not a
    membership change was announced: a rank lost in the middle of a round and back
    before the round ended leaves no change of its own."""
    present: dict[int, set[int]] = {}
    last = 0
    for line in lines:
        if line.get("kind") == "step":
            present.setdefault(line["rank"], set()).add(line["step"])
            last = max(last, line["step"])
        elif line.get("kind") == "steps":
            present.setdefault(line["rank"], set()).update(range(line["first"],
                                                                 line["last"] + 1))
            last = max(last, line["last"])
    found: list[tuple[int, int, int | None]] = []
    for rank in range(num_nodes):
        mine = present.get(rank, set())
        away = None
        for step in range(1, last + 1):
            if step not in mine and away is None:
                away = step
            elif step in mine and away is not None:
                found.append((rank, away, step))
                away = None
        if away is not None:
            found.append((rank, away, None))
    return found


def detection_waits(lines: Sequence[Mapping[str, Any]], num_nodes: int
                    ) -> list[tuple[int, int, float]]:
    """What the ranks that stayed waited for a lost rank to be declared lost: ``(rank,
    step, seconds)`` for each loss of a run across hosts.

    A rank that hangs (frozen, cut off) is declared lost only after the launcher's
    ``lost_after`` seconds without a heartbeat; meanwhile the others wait in the
    collective it does not join. The simulator drops an absent rank at once, so a
    replay adds this wait, as recorded: at each membership change that lost a rank, the
    collective seconds of each remaining rank's step (or block of steps) that holds
    the step before it, beyond that rank's usual collective seconds per step.
    """
    records: dict[int, list[tuple[int, int, float]]] = {}
    for line in lines:  # (first step, last step, collective seconds)
        if line.get("kind") == "step" and line.get("comm_s") is not None:
            records.setdefault(line["rank"], []).append(
                (line["step"], line["step"], float(line["comm_s"])))
        elif line.get("kind") == "steps" and line.get("comm_s") is not None:
            records.setdefault(line["rank"], []).append(
                (line["first"], line["last"], float(line["comm_s"])))
    usual = {rank: statistics.median(c / (b - a + 1) for a, b, c in mine)
             for rank, mine in records.items() if mine}
    waits: list[tuple[int, int, float]] = []
    changes = membership_lines(lines)
    for before, after in zip(changes, changes[1:]):
        if not set(after["ranks"]) < set(before["ranks"]):
            continue  # no rank lost here
        stalled = after["step"] - 1
        for rank in after["ranks"]:
            for first, last, comm in records.get(rank, []):
                if first <= stalled <= last and 0 <= rank < num_nodes:
                    extra = comm - usual[rank] * (last - first + 1)
                    if extra > 0:
                        waits.append((rank, stalled, extra))
                    break
    return waits


def reference_rank(lines: Sequence[Mapping[str, Any]], num_nodes: int) -> int:
    """The lowest rank present at every step: no membership change leaves it out."""
    changes = membership_lines(lines)
    everywhere = set(range(num_nodes))
    for change in changes:
        everywhere &= set(change.get("ranks") or ())
    return min(everywhere) if everywhere else 0


def eval_seconds(lines: Sequence[Mapping[str, Any]], rank: int, round_steps: int = 1
                 ) -> dict[str, float]:
    """What one evaluation added to a measured run's step, on ``rank``'s clock, apart for
    evaluations that end a round (``round_end``) and those inside one (``mid_round``: the
    averaged model's loss then needs the ranks' models gathered first): for each, the
    median step with an evaluation less the median step without, each less its compute
    and collectives. Where the run had no evaluation of a kind, the other's figure
    stands for it; 0 when the run has a simulated clock (it charges no evaluation)."""
    steps = {line["step"]: line for line in lines
             if line.get("kind") == "step" and line.get("rank") == rank}
    evaluated = {line["step"] for line in lines
                 if line.get("kind") == "eval" and line.get("rank") == rank}
    extra: dict[str, list[float]] = {"round_end": [], "mid_round": [], "none": []}
    for step, line in steps.items():
        before = steps.get(step - 1)
        if before is None or line.get("sim_time_s") is not None or "wall_s" not in line:
            continue
        rest = (line["wall_s"] - before["wall_s"] - (line.get("compute_s") or 0.0)
                - (line.get("comm_s") or 0.0))
        kind = "none" if step not in evaluated else \
            "round_end" if step % round_steps == 0 else "mid_round"
        extra[kind].append(rest)
    base = statistics.median(extra["none"]) if extra["none"] else 0.0
    found = {kind: max(0.0, statistics.median(extra[kind]) - base)
             for kind in ("round_end", "mid_round") if extra[kind]}
    if not found:
        return {"round_end": 0.0, "mid_round": 0.0}
    return {kind: round(found.get(kind, next(iter(found.values()))), 6)
            for kind in ("round_end", "mid_round")}


def hand_over_seconds(lines: Sequence[Mapping[str, Any]], rank: int) -> list[float]:
    """The seconds each readmission's hand-over of the state took ``rank``, in order (the
    trace's ``hand_over`` lines: one per rank and readmission)."""
    return [float(line.get("seconds") or 0.0) for line in lines
            if line.get("kind") == "hand_over" and line.get("rank") == rank]


def timeline(lines: Sequence[Mapping[str, Any]], round_steps: int, num_nodes: int, *,
             rank: int | None = None, add_eval_s: Mapping[str, float] | None = None,
             measured_eval: bool = False,
             add_hand_overs: Sequence[float] = ()) -> Timeline:
    """A run's :class:`Timeline` from its trace lines.

    Args:
        lines: the trace, parsed.
        round_steps: steps per round of its strategy.
        num_nodes: its ranks.
        rank: whose clock (default :func:`reference_rank`).
        add_eval_s: seconds to add at each evaluation, by where it falls in a round of
            this run (``round_end``, ``mid_round``: :func:`eval_seconds`), for a replay of a
            measured run: the simulated clock charges no evaluation, the run paid for them.
        measured_eval: note the evaluation's cost measured in ``lines`` as ``eval_s``.
        add_hand_overs: seconds to add at each readmission, in order (a replay: the
            simulation hands a returning rank the state without charging the clock, the
            recorded run paid for it, :func:`hand_over_seconds`).
    """
    rank = reference_rank(lines, num_nodes) if rank is None else rank
    clocked = any(line.get("kind") in ("step", "steps") and line.get("sim_time_s") is not None
                  for line in lines)
    key = "sim_time_s" if clocked else "wall_s"
    mine = _step_points(lines, key).get(rank, {})
    evals = sorted((line["step"], float(line.get("val_global_loss", line.get("val_loss"))))
                   for line in lines if line.get("kind") == "eval" and line.get("rank") == rank
                   and line.get("val_loss") is not None)
    eval_steps = [step for step, _ in evals]
    rejoins = sorted(back for _, _, back in absences(lines, num_nodes) if back is not None)
    paid = list(zip(rejoins, add_hand_overs))
    times: dict[int, float] = {}
    for step in sorted(mine):
        extra = sum(_eval_cost(add_eval_s, s, round_steps) for s in eval_steps if s <= step) + \
            sum(seconds for at, seconds in paid if at <= step)
        times[step] = float(mine[step][key]) + extra
    rounds = _rounds(times, round_steps)
    evaluations = [(step, loss, times[step]) for step, loss in evals if step in times]
    membership = _membership_costs(lines, num_nodes, rounds, round_steps)
    return Timeline("simulated" if clocked else "wall", rank, round_steps, times,
                    [rounds[i] for i in sorted(rounds)], evaluations, membership,
                    eval_seconds(lines, rank, round_steps) if measured_eval
                    else dict(add_eval_s or {"round_end": 0.0, "mid_round": 0.0}))


def _membership_costs(lines: Sequence[Mapping[str, Any]], num_nodes: int,
                      rounds: Mapping[int, float], round_steps: int) -> list[dict[str, Any]]:
    """Each change of the ranks that train, in step order: the announced ones and the
    absences the steps show (:func:`absences`) that no announced change tells, each after
    the first with ``lost_s``, what the rounds around it took beyond the median round.

    One event is one change: a rank lost in the middle of a step records no step from
    that step on, while the change that tells its loss takes effect at the next step
    (or round), so an announced change that leaves the rank out between its first step
    away and its return tells that absence; one that takes it in again by its return
    tells the return."""
    changes = membership_lines(lines)
    announced = [(int(c.get("step") or 1), set(c.get("ranks") or ())) for c in changes]
    for away_rank, first, back in absences(lines, num_nodes):
        until = back if back is not None else float("inf")
        left = [i for i, (step, ranks) in enumerate(announced)
                if first <= step < until and away_rank not in ranks]
        if left:  # the steps the replay takes the rank away at (rank_failures)
            changes[left[0]].setdefault("away_from", first)
        else:
            changes.append({"step": first, "ranks": None,
                            "reason": f"rank {away_rank} recorded no step from step {first}"})
        if back is not None and not any(first < step <= back and away_rank in ranks
                                        for step, ranks in announced):
            changes.append({"step": back, "ranks": None,
                            "reason": f"rank {away_rank} recorded steps again from step {back}"})
    changes.sort(key=lambda c: int(c.get("step") or 1))
    median = statistics.median(rounds.values()) if rounds else 0.0
    membership = []
    for change in changes:
        step = int(change.get("step") or 1)
        entry = {"step": step, "ranks": change.get("ranks"), "reason": change.get("reason")}
        if "away_from" in change:
            entry["away_from"] = change["away_from"]
        if step > 1:
            around = {(step - 2) // round_steps, (step - 1) // round_steps}
            entry["lost_s"] = rounded(sum(max(0.0, rounds[i] - median) for i in around
                                          if i in rounds))
        membership.append(entry)
    return membership


def _eval_cost(costs: Mapping[str, float] | None, step: int, round_steps: int) -> float:
    if not costs:
        return 0.0
    return costs["round_end" if step % round_steps == 0 else "mid_round"]


def _rounds(times: Mapping[int, float], round_steps: int) -> dict[int, float]:
    """Seconds of each whole round ``i`` (steps ``i*R+1 .. (i+1)*R``), from the times at the
    rounds' last steps; a gap of several rounds (steps summarised in blocks) is shared
    evenly among them."""
    ends = [0] + sorted(s for s in times if s % round_steps == 0)
    at = {0: 0.0, **times}
    rounds: dict[int, float] = {}
    for before, after in zip(ends, ends[1:]):
        count = (after - before) // round_steps
        each = (at[after] - at[before]) / count
        for i in range(before // round_steps, after // round_steps):
            rounds[i] = each
    return rounds


def time_to_loss(evaluations: Sequence[tuple[int, float, float]], target: float) -> float | None:
    """The first time the validation loss reaches ``target`` (linear between
    evaluations); None when it never does."""
    return loss_reached_at([(t, loss) for _, loss, t in evaluations], target)


def replayed_change(replayed: Mapping[int, Mapping[str, Any]],
                    change: Mapping[str, Any]) -> Mapping[str, Any]:
    """The replay's change for the real ``change``: at its step, or where the replay took
    the rank away (a rank lost within a step is away from that step in the replay, and
    announced at the next)."""
    return replayed.get(change["step"]) or replayed.get(change.get("away_from", -1)) or {}
