"""Replay a recorded run in the simulator, and ask "what if" of the same cluster.

``cli_typer.py replay RUN_DIR`` reads a run's folder (``trace.jsonl``,
``summary.json``, ``run.json``; :mod:`exogym.report.trace`) and simulates the
run again on this machine (:func:`replay`):

- **the same run**: the profile and every setting from the run's identity
  (``run.json``: its fingerprint must be the trace's), so the same seed and data
  order, and as many steps as the run made;
- **the same ranks**: each rank's own seconds at each step as recorded (across
  hosts a step's wall time less its collectives; with a simulated clock the
  compute it charged) as the clock's ``compute_schedule``, so the clock charges
  every rank what it took, step by step (a machine busier in one part of the run
  than in another included); ``rank_speeds`` (on ``compute_time_s``, the fastest
  rank's mean) say each rank's mean speed;
- **the same links**: ``network=`` from each host's pre-flight link rate and
  latency across hosts (the trace's ``hosts``), or the simulation's own network;
- **the same events**: the recorded membership timeline (hosts lost and
  readmitted) as ``rank_failures``.

Evaluation and the hand-over of the state to a readmitted rank cost a real run
time that the simulated clock does not charge: the seconds one evaluation added
to the recorded run (:func:`eval_seconds`, apart for an evaluation that ends a
round and one inside a round, which must first gather the ranks' models) are
added to the replay's timeline at each evaluation, by where it falls in the
replayed strategy's rounds, and each recorded hand-over's seconds at the replay's
readmission of the same order (:func:`hand_over_seconds`).

Figures (:class:`Timeline`), for the recorded run and each replay, on one rank's
clock (the lowest rank present at every step; wall seconds across hosts, simulated
seconds in a clocked simulation): total time, the time of every round (the
strategy's ``round_steps``: ``H``, or one step), the time each membership change
cost (the rounds around it beyond the median round) and the validation loss at
each evaluation.

**What if** (:func:`plan_variants`): the same cluster, links and events under
other strategies or settings; each is ranked by the simulated time it takes to
reach the recorded run's final validation loss, or said never to reach it within
the run's samples. Every variant is checked before the first replay starts.
"""

from __future__ import annotations

import difflib
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exogym.base.terminal import stdout_to_stderr
from exogym.report.metrics import time_to_loss as loss_reached_at
from exogym.report.trace import FORMAT_VERSION, TRACE_FILE, read_trace
from exogym.sim.network import Network, collective_bytes, collective_rounds
from exogym.strategy import registry

from ..profiles.profile import Profile, ProfileError, ProfileSet, imported_names
from ..profiles.run_dir import RunIdentity
from .compare import COMPARE_SETTINGS, profile_for_strategy

__all__ = ["REPLAY_FOLDER", "Recording", "ReplayError", "ReplayResult", "Timeline", "Variant",
           "eval_seconds", "load_recording", "plan_variants", "replay", "replay_profile",
           "stdout_to_stderr", "time_to_loss", "timeline", "write_outputs"]

#: The replays' folder inside the run's folder (``--out`` replaces it).
REPLAY_FOLDER = "replay"
#: The trace format a replay needs: its header carries the hosts' pre-flight links.
NEEDED_VERSION = 2
#: Keys a what-if may not set: the replay sets them from the recording.
RECORDED_KEYS = frozenset({"network", "rank_speeds", "compute_time_s", "speed_mode",
                           "rank_failures", "num_nodes", "output_dir", "task"})


class ReplayError(ValueError):
    """The run folder, its trace or a what-if cannot be replayed; the message says why."""


# ------------------------------------------------------------------ the figures of a run


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
                "wall_s": _r(self.wall_s), "round_steps": self.round_steps,
                "rounds": len(self.rounds), "round_s_median": _r(self.round_s_median),
                "round_s_p10": _r(self.round_quantile(0.1)),
                "round_s_p90": _r(self.round_quantile(0.9)),
                "evaluations": [[step, loss] for step, loss, _ in self.evaluations],
                "evaluation_s": [_r(t) for _, _, t in self.evaluations],
                "final_val_loss": self.final_val_loss,
                "membership": self.membership, "eval_s": self.eval_s}


def _r(value: float | None) -> float | None:
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
    changes = membership_lines(lines)
    announced = {int(c.get("step") or 1) for c in changes}
    for away_rank, first, back in absences(lines, num_nodes):
        if first not in announced:
            changes.append({"step": first, "ranks": None,
                            "reason": f"rank {away_rank} recorded no step from step {first}"})
        if back is not None and back not in announced:
            changes.append({"step": back, "ranks": None,
                            "reason": f"rank {away_rank} recorded steps again from step {back}"})
    changes.sort(key=lambda c: int(c.get("step") or 1))
    median = statistics.median(rounds.values()) if rounds else 0.0
    membership = []
    for change in changes:
        step = int(change.get("step") or 1)
        entry = {"step": step, "ranks": change.get("ranks"), "reason": change.get("reason")}
        if step > 1:
            around = {(step - 2) // round_steps, (step - 1) // round_steps}
            entry["lost_s"] = _r(sum(max(0.0, rounds[i] - median) for i in around
                                     if i in rounds))
        membership.append(entry)
    return Timeline("simulated" if clocked else "wall", rank, round_steps, times,
                    [rounds[i] for i in sorted(rounds)], evaluations, membership,
                    eval_seconds(lines, rank, round_steps) if measured_eval
                    else dict(add_eval_s or {"round_end": 0.0, "mid_round": 0.0}))


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


# ------------------------------------------------------------------ the recording


@dataclass
class Recording:
    """A recorded run, read and checked.

    Args:
        folder: the run's folder.
        lines: its trace, parsed.
        header: the trace's ``run`` line.
        identity: the run's identity (``run.json``, else ``summary.json``'s ``run``).
        profile: the run's profile, rebuilt from its identity's settings.
        num_nodes: its ranks.
        round_steps: steps per round of its strategy.
    """

    folder: Path
    lines: list[dict[str, Any]]
    header: dict[str, Any]
    identity: RunIdentity
    profile: Profile
    num_nodes: int
    round_steps: int

    @property
    def source(self) -> str:
        return str(self.header.get("source"))

    @property
    def steps(self) -> int:
        """The last step any rank recorded."""
        return max((line.get("step", line.get("last", 0)) for line in self.lines
                    if line.get("kind") in ("step", "steps")), default=0)

    def compute_per_step(self) -> list[float]:
        """Each rank's mean seconds of its own per step: measured across hosts, the step's
        wall time less its time in collectives (waiting for peers included there), so what
        the rank does between steps counts too; evaluation steps, readmissions' steps (their
        hand-over is paid apart) and a rank's first step after a (re)start are left out.
        With a simulated clock, the compute it charged."""
        own = self._own_wall_time()
        if own is not None:
            return own
        total = [0.0] * self.num_nodes
        count = [0] * self.num_nodes
        latest: dict[tuple[int, int], dict[str, Any]] = {}
        for line in self.lines:  # a restarted job's later lines replace the earlier ones
            if line.get("kind") == "step" and line.get("compute_s") is not None:
                latest[(line["rank"], line["step"])] = line
            elif line.get("kind") == "steps" and line.get("compute_s") is not None:
                latest[(line["rank"], -line["last"])] = line
        for (rank, _), line in latest.items():
            if 0 <= rank < self.num_nodes:
                total[rank] += float(line["compute_s"])
                count[rank] += int(line.get("count", 1))
        missing = [r for r in range(self.num_nodes) if not count[r]]
        if missing:
            raise ReplayError(f"{self.folder / TRACE_FILE}: no compute seconds recorded for "
                              f"rank{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(map(str, missing))}")
        return [total[r] / count[r] for r in range(self.num_nodes)]

    def compute_schedule(self) -> list[list[float]]:
        """Per rank, its own seconds at each step 1..:attr:`steps`, as recorded (what
        :meth:`compute_per_step` averages); a step whose own time is not known (an
        evaluation's, a readmission's, a step the rank was away for, a restart's first)
        gets the rank's mean. A ``steps`` block's steps share its sum evenly."""
        means = self.compute_per_step()
        steps = self.steps
        schedule = [[means[r]] * steps for r in range(self.num_nodes)]
        clocked = any(line.get("sim_time_s") is not None for line in self.lines
                      if line.get("kind") == "step")
        evaluated = {(line["rank"], line["step"]) for line in self.lines
                     if line.get("kind") == "eval"}
        handed = {back for _, _, back in absences(self.lines, self.num_nodes) if back}
        points: dict[int, dict[int, Mapping[str, Any]]] = {}
        for line in self.lines:  # later lines replace earlier ones (a restarted job)
            if line.get("kind") in ("step", "steps") and 0 <= line["rank"] < self.num_nodes:
                points.setdefault(line["rank"], {})[line.get("step", line.get("last"))] = line
        for rank, mine in points.items():
            for end in sorted(mine):
                line = mine[end]
                count = int(line.get("count", 1))
                first = end - count + 1
                if clocked:
                    own = line.get("compute_s")
                else:
                    before = mine.get(first - 1)
                    if (rank, end) in evaluated or end in handed or line.get("wall_s") is None:
                        continue
                    if before is not None and before.get("wall_s") is not None:
                        own = line["wall_s"] - before["wall_s"] - (line.get("comm_s") or 0.0)
                    elif first == 1:  # a rank's clock starts at its training's start
                        own = line["wall_s"] - (line.get("comm_s") or 0.0)
                    else:
                        continue
                if own is None or own < 0 or not 1 <= first <= end <= steps:
                    continue
                for step in range(first, end + 1):
                    schedule[rank][step - 1] = float(own) / count
        if not clocked:
            for rank, step, seconds in detection_waits(self.lines, self.num_nodes):
                if 1 <= step <= steps:
                    schedule[rank][step - 1] += seconds
        return schedule

    def _own_wall_time(self) -> list[float] | None:
        if any(line.get("sim_time_s") is not None for line in self.lines
               if line.get("kind") == "step"):
            return None
        evaluated = {(line["rank"], line["step"]) for line in self.lines
                     if line.get("kind") == "eval"}
        # a readmission's step holds the hand-over, which the replay pays apart
        handed = {back for _, _, back in absences(self.lines, self.num_nodes) if back}
        latest: dict[tuple[int, int], Mapping[str, Any]] = {}
        for line in self.lines:
            if line.get("kind") == "step" and line.get("wall_s") is not None:
                latest[(line["rank"], line["step"])] = line
        spans: dict[int, list[float]] = {}
        for (rank, step), line in latest.items():
            before = latest.get((rank, step - 1))
            if before is None or (rank, step) in evaluated or step in handed \
                    or not 0 <= rank < self.num_nodes:
                continue
            took = line["wall_s"] - before["wall_s"] - (line.get("comm_s") or 0.0)
            if took > 0:  # a restarted rank's clock starts again: no span across it
                spans.setdefault(rank, []).append(took)
        if len(spans) < self.num_nodes:
            return None
        return [statistics.fmean(spans[r]) for r in range(self.num_nodes)]

    def network(self) -> tuple[dict[str, Any] | None, str]:
        """The links to replay on, as a ``network`` value, and where they come from."""
        if self.source == "simulation":
            net = (self.header.get("config") or {}).get("network")
            if not net:
                return None, "none: the simulation had no network (collectives cost nothing)"
            value = {"bandwidth": net["bandwidth_bits_per_s"], "latency_s": net["latency_s"]}
            if net.get("rank_bandwidth_bits_per_s"):
                value["rank_bandwidth"] = list(net["rank_bandwidth_bits_per_s"])
            return value, "the simulation's own network"
        hosts = sorted(self.header.get("hosts") or [], key=lambda h: h["rank"])
        rates = [h.get("link_rate_bps") for h in hosts]
        latencies = [h["latency_s"] for h in hosts if h.get("latency_s") is not None]
        where = "each host's pre-flight probe"
        if len(hosts) != self.num_nodes or any(not r for r in rates):
            achieved = {line["rank"]: line.get("achieved_bytes_per_s") for line in self.lines
                        if line.get("kind") == "link"}
            if len(achieved) < self.num_nodes or any(
                    not achieved.get(r) for r in range(self.num_nodes)):
                raise ReplayError(f"{self.folder / TRACE_FILE}: the hosts' links were not "
                                  "measured before the run (link_probe_s=0, or the probe "
                                  "failed) and no rank's collectives recorded a rate: "
                                  "nothing to replay the links with")
            rates = [achieved[r] * 8 for r in range(self.num_nodes)]
            where = ("what each rank's collectives achieved (a lower bound: the pre-flight "
                     "probe measured no link)")
        value = {"bandwidth": float(min(rates)),
                 "latency_s": float(statistics.median(latencies)) if latencies else 0.0}
        if len(set(rates)) > 1:
            value["rank_bandwidth"] = [float(r) for r in rates]
        floor = self._collective_floor()
        if floor is not None:
            seconds, payload = floor
            rounds = collective_rounds("all_reduce", self.num_nodes)
            moving = collective_bytes("all_reduce", payload, self.num_nodes) * 8.0 / min(rates)
            measured = (seconds - moving) / rounds
            if measured > value["latency_s"]:
                value["latency_s"] = measured
                where += (f"; latency {measured * 1e3:.3g} ms a message round, what the "
                          "recorded collectives took beyond moving their bytes")
        return value, where

    def _collective_floor(self) -> tuple[float, float] | None:
        """What one collective took, as recorded: at each step where every rank sent bytes,
        the shortest collective time among the ranks (the last to arrive waited for no
        one); the median over such steps, with the median bytes sent. None without any."""
        by_step: dict[int, list[tuple[float, float]]] = {}
        for line in self.lines:
            if line.get("kind") == "step" and (line.get("bytes") or 0) > 0 \
                    and line.get("comm_s") is not None:
                by_step.setdefault(line["step"], []).append(
                    (float(line["comm_s"]), float(line["bytes"])))
        floors = [min(parts) for parts in by_step.values() if len(parts) == self.num_nodes]
        if not floors:
            return None
        return (statistics.median(c for c, _ in floors),
                statistics.median(b for _, b in floors))

    def rank_failures(self) -> list[list[int | None]] | None:
        """The recorded absences (:func:`absences`) as ``rank_failures`` entries."""
        return [list(a) for a in absences(self.lines, self.num_nodes)] or None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ReplayError(f"{path} cannot be read: {exc}") from None
    return data if isinstance(data, dict) else None


def rebuild_profile(identity: RunIdentity, header: Mapping[str, Any]) -> Profile:
    """The run's profile from its identity's settings (as it ran, every default filled in);
    a simulation's network from the trace's header (the identity holds only its text)."""
    values = {**identity.settings, **identity.may_change}
    values.pop("network", None)
    net = (header.get("config") or {}).get("network") if header.get("source") == "simulation" \
        else None
    if net:
        values["network"] = {"bandwidth": net["bandwidth_bits_per_s"],
                             "latency_s": net["latency_s"]}
        if net.get("rank_bandwidth_bits_per_s"):
            values["network"]["rank_bandwidth"] = list(net["rank_bandwidth_bits_per_s"])
    elif identity.settings.get("network") is not None:
        values["network"] = identity.settings["network"]
    return Profile(identity.profile, values, "the run's own settings")


def untrusted_code(identity: RunIdentity, where: Path, config: str | Path | None = None,
                   trust_code: bool = False) -> None:
    """Refuse a recorded run whose task or strategy is code to import (``module:name``)
    that none of this person's own profiles (``config``: default the project's) names.

    A run folder is only files: whoever can write there (or hands one over) chooses what
    it names, and the settings' fingerprint is a plain hash anyone can compute again.

    Raises:
        ReplayError: naming the code and the two ways to accept it.
    """
    named = imported_names({**identity.settings, **identity.may_change})
    if not named or trust_code:
        return
    try:
        own = ProfileSet(config)
        mine, files = own.imported_names(), own.files
    except ProfileError:
        mine, files = set(), str(config or "config.ini")
    foreign = [name for name in named if name not in mine]
    if foreign:
        raise ReplayError(
            f"{where} names code to import ({', '.join(map(repr, foreign))}) that none of your "
            f"profiles in {files} names: it is not imported, since a run folder can name any "
            "code and importing it runs that code. If you trust it, name it as the task or "
            "strategy of one of your profiles, or add --trust-code")


def load_recording(folder: str | Path, config: str | Path | None = None,
                   trust_code: bool = False) -> Recording:
    """Read and check a run's folder; every problem is a :class:`ReplayError`.

    Refused: a folder without a trace, a trace of an older format or that ended
    before its first step, a trace whose run is not the folder's (profile,
    settings or ranks differ), settings that make no valid profile here, a task or
    strategy to import that the person's own profiles (``config``) do not name,
    unless ``trust_code`` (:func:`untrusted_code`).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ReplayError(f"{folder} is not a folder: give a run's folder (runs/NAME, as "
                          "distributed-train printed it)")
    path = folder / TRACE_FILE
    if not path.is_file():
        raise ReplayError(f"{folder} holds no {TRACE_FILE}: only a run of this version records "
                          "one (distributed-train, a local simulation or across hosts); run it "
                          "again to replay it")
    try:
        lines = read_trace(path)
    except (OSError, ValueError) as exc:
        raise ReplayError(f"{path} cannot be read: {exc}") from None
    headers = [line for line in lines if line.get("kind") == "run"]
    if not headers:
        raise ReplayError(f"{path} has no run line: not a trace")
    header = headers[0]
    version = header.get("version")
    if version != NEEDED_VERSION:
        raise ReplayError(f"{path} is a trace of format version {version} (an older version "
                          f"recorded it); a replay needs version {NEEDED_VERSION} (written "
                          f"since the hosts' links are probed before a run; this code writes "
                          f"{FORMAT_VERSION}): run it again to replay it")
    if header.get("source") not in ("simulation", "hosts"):
        raise ReplayError(f"{path} is one rank's own trace (source {header.get('source')!r}: "
                          "NetworkTrainer's script mode); a replay needs every rank's, as "
                          "distributed-train records it")
    recorded = RunIdentity.from_dict(header.get("run"))
    if recorded is None:
        raise ReplayError(f"{path} names no run (its header's 'run' is empty): a run of "
                          "distributed-train records its identity")
    untrusted_code(recorded, path, config, trust_code)
    on_file = RunIdentity.from_dict(_read_json(folder / "run.json")) or \
        RunIdentity.from_dict((_read_json(folder / "summary.json") or {}).get("run"))
    if on_file is not None and (on_file.profile, on_file.fingerprint) != (
            recorded.profile, recorded.fingerprint):
        differ = recorded.differences(on_file, there="in the trace", here="in the folder")
        raise ReplayError(f"{path} does not match the run in {folder}: the trace is of profile "
                          f"{recorded.profile} ({recorded.fingerprint[:12]}), the folder's "
                          f"run.json of {on_file.profile} ({on_file.fingerprint[:12]})"
                          + (f"; they differ in {', '.join(differ[:6])}" if differ else ""))
    num_nodes = int(header.get("num_nodes") or 0)
    if recorded.settings.get("num_nodes") not in (None, num_nodes):
        raise ReplayError(f"{path} records {num_nodes} ranks but its run's settings say "
                          f"num_nodes={recorded.settings['num_nodes']}: the trace does not "
                          "match the profile")
    ranks = {line["rank"] for line in lines if line.get("kind") in ("step", "steps")}
    if not ranks:
        raise ReplayError(f"{path} records no step: the run ended before its first step")
    if max(ranks) >= num_nodes:
        raise ReplayError(f"{path} has steps of rank {max(ranks)} in a run of {num_nodes} "
                          "ranks: the trace does not match the profile")
    profile = rebuild_profile(recorded, header)
    problems = profile.problems()
    if problems:
        raise ReplayError(f"the settings of the run in {folder} make no valid profile here "
                          f"(this checkout's code differs from the one that ran it):\n  "
                          + "\n  ".join(problems))
    again = RunIdentity.of(profile, num_nodes)
    if again.fingerprint != recorded.fingerprint:
        differ = recorded.differences(again, there="recorded", here="rebuilt here")
        raise ReplayError(f"the profile rebuilt from {path} is not the run it records (its "
                          f"settings fingerprint differs: "
                          f"{', '.join(differ[:6]) or 'the same keys, other defaults'}); "
                          "this checkout's defaults differ from the ones the run had")
    return Recording(folder, one_timeline(lines), header, recorded, profile, num_nodes,
                     round_steps_of(profile))


#: Trace lines that belong to a step: a resumed run's later lines replace them.
_STEPPED = ("step", "steps", "eval", "hand_over", "membership", "fault")


def one_timeline(lines: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The trace of a run resumed from a checkpoint (one part per ``run`` line), as one run.

    Each later part continues from the step before its first: the earlier part's lines
    after that step (work the interruption lost, done again) are left out, and the later
    part's clocks are moved to go on from where the kept part ends, per rank (its
    ``wall_s`` and ``sim_time_s``) and for the run (``t``). Only the last part's ``end``
    and ``link`` lines stay. A trace of one part comes back as it is.
    """
    parts: list[list[dict[str, Any]]] = []
    for line in lines:
        if line.get("kind") == "run" or not parts:
            parts.append([])
        parts[-1].append(dict(line))
    if len(parts) <= 1:
        return [dict(line) for line in lines]
    out = parts[0]
    for part in parts[1:]:
        firsts = [int(line["step"]) for line in part if line.get("kind") == "step"]
        if not firsts:
            continue  # resumed at its last step: it trained nothing
        resumed_at = min(firsts) - 1
        out = [line for line in out if line.get("kind") not in ("end", "link")
               and not (line.get("kind") in _STEPPED and line.get("step") is not None
                        and int(line["step"]) > resumed_at)]
        wall: dict[int, float] = {}
        sim: dict[int, float] = {}
        t_end = 0.0
        for line in out:
            rank = line.get("rank")
            if line.get("kind") in ("step", "steps") and isinstance(rank, int):
                if isinstance(line.get("wall_s"), (int, float)):
                    wall[rank] = max(wall.get(rank, 0.0), float(line["wall_s"]))
                if isinstance(line.get("sim_time_s"), (int, float)):
                    sim[rank] = max(sim.get(rank, 0.0), float(line["sim_time_s"]))
            if isinstance(line.get("t"), (int, float)):
                t_end = max(t_end, float(line["t"]))
        t_offset = max([t_end, *wall.values()])
        for line in part[1:]:  # its own run line: the first part's stands for the run
            rank = line.get("rank")
            if isinstance(line.get("wall_s"), (int, float)) and rank in wall:
                line["wall_s"] = round(line["wall_s"] + wall[rank], 4)
            if isinstance(line.get("sim_time_s"), (int, float)) and rank in sim:
                line["sim_time_s"] = round(line["sim_time_s"] + sim[rank], 6)
            if isinstance(line.get("t"), (int, float)):
                line["t"] = round(line["t"] + t_offset, 3)
            out.append(line)
    return out


def round_steps_of(profile: Profile) -> int:
    """Steps per round of the profile's strategy (``Strategy.round_steps``: ``H``, or 1)."""
    resolved = profile.resolved
    strategy = resolved.strategy_cls(**resolved.strategy_kwargs)
    return max(1, int(getattr(strategy, "round_steps", 1) or 1))


# ------------------------------------------------------------------ the replays


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
        raise ReplayError("; ".join(problems))
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise ReplayError("two what-ifs are the same run: give each strategy once")
    return variants


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


@dataclass
class ReplayResult:
    """A replay and what it is compared with.

    Args:
        recording: the recorded run.
        real: its figures.
        replays: per variant (the run as recorded first), its figures.
        cluster: the cluster's settings the replays ran with (``rank_failures`` too).
        target: the recorded run's final validation loss.
    """

    recording: Recording
    real: Timeline
    replays: list[tuple[Variant, Timeline]]
    cluster: dict[str, Any]
    target: float | None

    @property
    def replay(self) -> Timeline:
        return self.replays[0][1]

    def ranking(self) -> list[dict[str, Any]]:
        """Every replay, by simulated time to the recorded final validation loss (the ones
        that never reach it last, by their final loss)."""
        rows = []
        for variant, figures in self.replays:
            reach = time_to_loss(figures.evaluations, self.target) \
                if self.target is not None else None
            rows.append({"label": variant.label, "strategy": variant.strategy,
                         "settings": variant.settings, "recorded": variant.recorded,
                         "time_to_target_s": _r(reach), "reaches_target": reach is not None,
                         "wall_s": _r(figures.wall_s),
                         "round_s_median": _r(figures.round_s_median),
                         "final_val_loss": figures.final_val_loss,
                         "evaluations": [[s, v] for s, v, _ in figures.evaluations]})
        rows.sort(key=lambda r: (not r["reaches_target"], r["time_to_target_s"] or 0.0,
                                 r["final_val_loss"] if r["final_val_loss"] is not None
                                 else math.inf))
        for place, row in enumerate(rows, 1):
            row["place"] = place
        return rows

    def timelines(self) -> dict[str, dict[int, float]]:
        """Seconds at each step: ``real``, then each replay by its label (``replay`` for the
        run as recorded)."""
        out = {"real": dict(self.real.times)}
        for variant, figures in self.replays:
            out["replay" if variant.recorded else variant.label] = dict(figures.times)
        return out

    def ratios(self) -> dict[str, Any]:
        """Replay over real: total time, median round, each evaluation's loss."""
        real, rep = self.real, self.replay
        losses = dict((s, v) for s, v, _ in rep.evaluations)
        return {"wall_s": _ratio(rep.wall_s, real.wall_s),
                "round_s_median": _ratio(rep.round_s_median, real.round_s_median),
                "val_loss": [[s, _ratio(losses.get(s), v)] for s, v, _ in real.evaluations]}

    def to_dict(self) -> dict[str, Any]:
        """The comparison as one JSON object: ``real``, ``replay``, ``ratios``, the
        cluster replayed, and the what-ifs' ranking."""
        rec = self.recording
        return {"run_dir": str(rec.folder), "profile": rec.profile.name,
                "strategy": rec.profile.strategy, "source": rec.source,
                "num_nodes": rec.num_nodes, "steps": rec.steps,
                "target_val_loss": self.target,
                "real": self.real.to_dict(), "replay": self.replay.to_dict(),
                "ratios": self.ratios(), "cluster": self.cluster,
                "what_if": self.ranking() if len(self.replays) > 1 else []}


def describe_cluster(cluster: Mapping[str, Any]) -> str:
    """The cluster a replay ran on, in words: its links, the ranks' speeds, who left and
    came back, and what evaluations and hand-overs added (a report's ``cluster``)."""
    net = cluster.get("network")
    if isinstance(net, Mapping):
        links = Network.coerce(dict(net)).describe() + f" (from {cluster['links_from']})"
    elif net:
        links = f"{net} (from {cluster['links_from']})"
    else:
        links = f"no network: {cluster['links_from'].split(': ', 1)[-1]}"
    speeds = cluster.get("rank_speeds") or []
    if speeds and max(speeds) - min(speeds) > 1e-3:
        pace = ("ranks at " + ", ".join(f"{s:.2f}" for s in speeds) + " of the fastest's "
                f"speed ({cluster['compute_time_s']:.3g} s a step)")
    else:
        pace = f"every rank {cluster['compute_time_s']:.3g} s a step"
    failures = cluster.get("rank_failures") or []
    away = "no rank left" if not failures else "; ".join(
        f"rank {rank} away from step {at}" + (f" to {back}" if back is not None else "")
        for rank, at, back in failures)
    evals = cluster.get("eval_s") or {}
    parts = [links, pace, away]
    if evals.get("round_end") or evals.get("mid_round"):
        parts.append(f"an evaluation {evals.get('round_end', 0):.3g} s at a round's end, "
                     f"{evals.get('mid_round', 0):.3g} s inside one")
    hand_overs = cluster.get("hand_over_s") or []
    if hand_overs:
        parts.append("hand-overs of " + ", ".join(f"{h:.3g}" for h in hand_overs) + " s")
    return "; ".join(parts)


def write_outputs(result: ReplayResult, folder: Path) -> tuple[dict[str, Any], str]:
    """Write ``replay.json`` (the comparison) and ``replay.html`` (its page) into
    ``folder``, each atomically; returns the comparison and the page."""
    from exogym.base.io import atomic_write_bytes

    from .web.replay_page import replay_html

    report = result.to_dict()
    page = replay_html(report, result.timelines())
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / "replay.json",
                       (json.dumps(report, indent=1) + "\n").encode("utf-8"))
    atomic_write_bytes(folder / "replay.html", page.encode("utf-8"))
    return report, page


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 6)


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

    from .run import RunFailedError, brief_failure

    real = timeline(recording.lines, recording.round_steps, recording.num_nodes,
                    measured_eval=True)
    eval_s = real.eval_s if real.clock == "wall" else {"round_end": 0.0, "mid_round": 0.0}
    hand_overs = hand_over_seconds(recording.lines, real.rank) if real.clock == "wall" else []
    _, cluster = replay_profile(recording, Path(variants[0].profile.resolved.output_dir).parent)
    schedule = cluster.pop("compute_schedule")
    cluster["compute_schedule"] = (f"each rank's {len(schedule[0])} steps as recorded "
                                   "(full-speed seconds, divided by rank_speeds)")
    cluster["eval_s"] = eval_s
    cluster["hand_over_s"] = [_r(h) for h in hand_overs]
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
