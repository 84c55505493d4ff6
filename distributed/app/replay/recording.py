"""A recorded run and what its cluster was: each rank's own time per step, step by step,
the links between the hosts, and when ranks were away.

A :class:`Recording` holds a run's trace as :func:`~.load.load_recording` read and
checked it; its methods say what a replay must reproduce of the cluster:

- each rank's own seconds at each step (:meth:`Recording.compute_schedule`; across
  hosts a step's wall time less its collectives, with a simulated clock the compute
  it charged) and their mean (:meth:`Recording.compute_per_step`), from which the
  ranks' relative speeds follow;
- the links (:meth:`Recording.network`): each host's pre-flight link rate and latency
  (the trace's ``hosts``), else what the ranks' collectives achieved, or a simulation's
  own network;
- the recorded membership timeline as ``rank_failures`` (:meth:`Recording.rank_failures`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exogym.report.trace import TRACE_FILE
from exogym.sim.network import collective_bytes, collective_rounds

from ...profiles.profile import Profile
from ...profiles.run_dir import RunIdentity
from .timelines import absences, detection_waits

__all__ = ["Recording", "ReplayError"]


class ReplayError(ValueError):
    """The run folder, its trace or a what-if cannot be replayed; the message says why."""


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
        """Who recorded the trace: ``simulation`` or ``hosts``."""
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

