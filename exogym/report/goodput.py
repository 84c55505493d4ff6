"""Goodput: the share of what the hosts could have trained while up that reached the final model.

One definition serves a simulation (``fit(rank_failures=...)``, the simulated
clock) and a run across hosts (``--inject``, ``--inject-random``); both hand
their step events to :func:`measure_goodput`::

    goodput = useful samples / sum over hosts of (time up x its samples/s alone)

- **Useful samples** are those that reached the final model, counted per rank
  from its step events (``step_samples``: the samples the step trained):

  - a strategy that meets in rounds of ``round_steps`` steps (``Strategy.round_steps``:
    DiLoCo's ``H``; 1 for DDP and other per-step strategies): a rank's step counts
    when the rank also completed the step that closes its round (the next multiple
    of ``round_steps``, or the run's last step, whose models ``fit`` averages). So
    DDP counts every step a rank completed (a rank that died in a step the others
    completed without it reported no event for it), and DiLoCo loses the inner
    steps of a round a rank left before its outer step;
  - AsyncDiLoCo (its step events carry ``merge`` records): a rank's step counts
    when the contribution it went into was merged; a contribution dropped (older
    than ``max_staleness``) or lost with its worker (``left``) does not count.

  A step repeated after a restart from a checkpoint supersedes the one before it,
  which did not reach the final model.
- **Samples/s alone** of a host: the samples its steps trained over the sum of
  their ``compute_s``, each step's own work without the time in collectives (the
  simulated clock's charge in a simulation that has one; a step that trained a
  short batch, or an idle one, counts with what it took). Waiting is not in it:
  it is what the host trains when nothing holds it up.
- **Time up**: the run's span, from the start of its first step to the end of its
  last, less the time the host was down. In a simulation ``rank_failures`` says
  when: rank ``r`` away for steps ``a`` to ``b - 1`` is down from the end of step
  ``a - 1`` to the end of step ``b - 1``; joining later, at a round boundary, it
  is up and waiting. Across hosts an injected fault says when: a freeze or a cut
  for its duration, a kill until the rank's process has started again; a loss
  nobody injected is not counted as down (the launcher cannot tell a dead host
  from a slow one).
- **Time** is the simulated clock's in a simulation that has one (each event's
  ``sim_time_s``); across hosts, the wall time at which the launcher received
  each event. A simulation without a clock has no time of the hosts': its
  ranks share this machine's cores, take turns on them, and wait in their
  collectives for the ranks that compute meanwhile (a fault-free K=1024 run
  would read 0.1%). There the fraction is not given (``goodput`` None, with a
  ``note`` saying why): only the samples are, those trained and those that
  reached the final model. Nor is a fraction above 1 given, which no host
  could reach: hosts whose speed changes with the others' (sharing one
  machine's cores, one of them down) have no speed alone to measure it by.

So a host's downtime is not held against goodput, but what it costs the others
is: their waiting in collectives, the rounds thrown away, the time a host that
is back waits to be admitted, and the hand-over. Evaluation and checkpoints
count as time not training (across hosts; the simulated clock does not charge
them). The loss splits per host into ``dropped`` samples (trained, not in the
final model), ``wait_s`` (in collectives, waiting included) and ``idle_s`` (up,
outside any step: waiting to rejoin, hand-overs, done before the slowest rank);
over all hosts, ``lost`` gives each as a share of their time up, which with
``goodput`` makes up the whole.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DownSpan", "GoodputMeter", "goodput_summary", "measure_goodput", "rejoin_wait"]

#: Why a trained step did not reach the final model.
LEFT, STALE, ROLLED_BACK = "left", "stale", "rolled back"


@dataclass(frozen=True)
class DownSpan:
    """Rank ``rank`` was down from ``start`` to ``end`` (seconds on the run's time axis)."""

    rank: int
    start: float
    end: float


@dataclass
class _Row:
    """One step event, as goodput reads it."""

    rank: int
    step: int
    samples: int
    compute_s: float
    comm_s: float
    end: float = 0.0
    start: float = 0.0
    useful: bool = False
    why: str | None = None  # why it did not reach the final model


def _number(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return 0.0
    return out if math.isfinite(out) else 0.0


def _rows(events: Sequence[Mapping[str, Any]], simulated: bool) -> list[_Row]:
    """The step events as rows, in the order given; a step's samples are its
    ``step_samples`` (else the growth of its rank's cumulative ``samples``)."""
    out = []
    seen: dict[int, int] = {}
    for event in events:
        rank, cumulative = int(event["rank"]), int(event.get("samples") or 0)
        if "step_samples" in event:
            samples = int(event["step_samples"])
        else:  # a fresh process counts from zero again
            before = seen.get(rank, 0)
            samples = cumulative - before if cumulative >= before else cumulative
        seen[rank] = cumulative
        comm = event.get("sim_comm_s") if simulated else event.get("comm_s")
        out.append(_Row(rank, int(event["step"]), samples, _number(event.get("compute_s")),
                        _number(comm)))
    return out


def _supersede(rows: list[_Row]) -> None:
    """Steps a rank repeated (a restart from a checkpoint): the earlier ones did not reach
    the final model."""
    latest: dict[int, list[_Row]] = {}
    for row in rows:
        mine = latest.setdefault(row.rank, [])
        while mine and mine[-1].step >= row.step:
            gone = mine.pop()
            gone.why = ROLLED_BACK
        mine.append(row)


def _mark_rounds(rows: list[_Row], round_steps: int) -> None:
    """Synchronous rounds: a step counts when its rank completed its round's closing step."""
    live = [r for r in rows if r.why is None]
    last = max((r.step for r in live), default=0)
    done = {(r.rank, r.step) for r in live}
    h = max(1, round_steps)
    for row in live:
        closing = min(-(-row.step // h) * h, last)
        row.useful = (row.rank, closing) in done
        if not row.useful:
            row.why = LEFT


def _mark_merges(rows: list[_Row], merges: list[Mapping[str, Any]]) -> None:
    """AsyncDiLoCo: a step counts when the contribution it went into was merged."""
    closings: dict[int, list[tuple[int, str | None]]] = {}
    for merge in merges:
        step = int(merge["step"])
        for rank in merge.get("contributors", ()):
            closings.setdefault(int(rank), []).append((step, None))
        for rank in merge.get("dropped", ()):
            closings.setdefault(int(rank), []).append((step, STALE))
        for gone in merge.get("left", ()):
            # noticed at its step: the steps before it were the lost round's
            closings.setdefault(int(gone["rank"]), []).append((int(gone["step"]) - 1, LEFT))
    for marks in closings.values():
        marks.sort(key=lambda mark: mark[0])
    for row in rows:
        if row.why is not None:
            continue
        fate = next((why for step, why in closings.get(row.rank, ()) if step >= row.step),
                    LEFT)
        row.useful, row.why = fate is None, fate


def _place_in_time(rows: list[_Row], axis: str, events: Sequence[Mapping[str, Any]],
                   times: Sequence[float] | None) -> None:
    """Each row's end and start on the run's time axis."""
    if axis == "steps":
        longest: dict[int, float] = {}
        for row in rows:
            longest[row.step] = max(longest.get(row.step, 0.0), row.compute_s + row.comm_s)
        ends: dict[int, float] = {}
        total = 0.0
        for step in range(1, max(longest, default=0) + 1):
            total += longest.get(step, 0.0)
            ends[step] = total
        for row in rows:
            row.end, row.start = ends[row.step], ends.get(row.step - 1, 0.0)
        return
    for i, row in enumerate(rows):
        row.end = _number(events[i].get("sim_time_s")) if axis == "simulated" else float(times[i])
        row.start = row.end - row.compute_s - row.comm_s


def _s(seconds: float) -> float:
    """Seconds as the summary keeps them (to the microsecond)."""
    return round(seconds, 6)


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def rejoin_wait(first_back_start: float, downs: Sequence[DownSpan]) -> float:
    """Seconds a rank that came back was up before its first step back began: from the end
    of the last down span before that step (0 when none ended before it)."""
    ended = [span.end for span in downs if span.end <= first_back_start]
    return max(0.0, first_back_start - max(ended)) if ended else 0.0


def measure_goodput(events: Sequence[Mapping[str, Any]], round_steps: int, num_nodes: int, *,
                    failures: Sequence[Sequence[Any]] = (),
                    down: Sequence[DownSpan] = (),
                    changes: Sequence[Mapping[str, Any]] = (),
                    hand_overs: Sequence[Mapping[str, Any]] = (),
                    times: Sequence[float] | None = None) -> dict[str, Any]:
    """A run's goodput from its step events (the module says what each part means).

    Args:
        events: the run's step events (or ``trainer.history`` rows), in the order they
            arrived; each with ``rank``, ``step``, ``step_samples`` (or cumulative
            ``samples``), ``compute_s``, ``comm_s``, and ``sim_time_s`` and
            ``sim_comm_s`` under a simulated clock.
        round_steps: the strategy's steps per round (``Strategy.round_steps``).
        num_nodes: the run's ranks.
        failures: a simulation's ``rank_failures``, ``(rank, at_step, back_at_step or
            None)``: when each rank was down, in steps.
        down: when ranks were down, in seconds on the run's time axis (across hosts).
        changes: the run's membership changes (``summary['membership']``: ``step``,
            ``ranks``, ``reason``), each of which gets the time lost to it.
        hand_overs: ``hand_over`` events; their seconds count on the wall clock only
            (the simulated clock does not charge a hand-over).
        times: when each event arrived, seconds (the wall clock: across hosts); None in
            a simulation.

    Returns:
        ``{"goodput", "note", "time", "useful_samples", "trained_samples",
        "dropped_samples", "possible_samples", "lost", "span_s", "up_s", "down_s",
        "ranks": [...], "changes": [...]}``; ``goodput`` is None where it is not
        defined, ``note`` then says why: no time of the hosts' own (a simulation
        without a clock), a fraction above 1, or no step that took compute time.
        ``lost``: the shares of the hosts' time up spent in collectives, idle, and
        on work dropped (None with ``goodput``).

    Raises:
        ValueError: ``times`` not one per event, or ``round_steps`` not an integer >= 1.
    """
    if times is not None and len(times) != len(events):
        raise ValueError(f"times must hold one arrival time per event: {len(times)} for "
                         f"{len(events)} events")
    if not isinstance(round_steps, int) or round_steps < 1:
        raise ValueError(f"round_steps must be an integer >= 1, got {round_steps!r}")
    if times is not None:
        axis = "wall"
    elif events and all(e.get("sim_time_s") is not None for e in events):
        axis = "simulated"
    else:
        axis = "steps"
    rows = _rows(events, axis == "simulated")
    _supersede(rows)
    merges = [e["merge"] for e in events if e.get("merge")]
    if merges:
        _mark_merges(rows, merges)
    else:
        _mark_rounds(rows, round_steps)
    _place_in_time(rows, axis, events, times)

    # the start of the first step (0 on a fresh simulated clock; later for a resumed run)
    origin = min((r.start for r in rows), default=0.0)
    finish = max((r.end for r in rows), default=origin)
    span = max(0.0, finish - origin)
    step_end: dict[int, float] = {}
    for row in rows:
        step_end[row.step] = max(step_end.get(row.step, origin), row.end)

    def end_of(step: int) -> float:
        """When step ``step`` ended (the run's start for step 0, its end past the last)."""
        if step <= 0:
            return origin
        if step in step_end:
            return step_end[step]
        earlier = [s for s in step_end if s < step]
        if not earlier or step > max(step_end):
            return finish if earlier else origin
        return step_end[max(earlier)]

    spans = list(down)
    for rank, at, back in failures:
        end = finish if back is None or back - 1 >= max(step_end, default=0) else end_of(back - 1)
        spans.append(DownSpan(int(rank), end_of(at - 1), end))
    downs: dict[int, list[DownSpan]] = {}
    for given in spans:
        start, end = max(origin, given.start), min(finish, given.end)
        if end > start:
            downs.setdefault(given.rank, []).append(DownSpan(given.rank, start, end))

    by_rank: dict[int, list[_Row]] = {}
    for row in rows:
        by_rank.setdefault(row.rank, []).append(row)
    ranks = []
    for rank in range(num_nodes):
        mine = by_rank.get(rank, [])
        trained = sum(r.samples for r in mine)
        useful = sum(r.samples for r in mine if r.useful)
        compute = sum(r.compute_s for r in mine)
        wait = sum(r.comm_s for r in mine)
        rate = trained / compute if compute > 0 else None
        down_s = _union_length([(s.start, s.end) for s in downs.get(rank, [])])
        up = max(0.0, span - down_s)
        ranks.append({"rank": rank, "up_s": _s(up), "down_s": _s(down_s),
                      "compute_s": _s(compute), "wait_s": _s(wait),
                      "idle_s": _s(max(0.0, up - compute - wait)),
                      "samples_per_s": rate, "trained": trained, "useful": useful,
                      "dropped": trained - useful,
                      "possible": up * rate if rate is not None else 0.0})
    possible = sum(r["possible"] for r in ranks)
    useful_total = sum(r["useful"] for r in ranks)
    trained_total = sum(r["trained"] for r in ranks)
    goodput, note = _defined(useful_total / possible if possible > 0 else None, axis)
    up_total = sum(r["up_s"] for r in ranks)
    lost = None
    if goodput is not None and up_total > 0:
        dropped_s = sum(r["dropped"] / r["samples_per_s"] for r in ranks
                        if r["dropped"] and r["samples_per_s"])
        lost = {"collectives": sum(r["wait_s"] for r in ranks) / up_total,
                "idle": sum(r["idle_s"] for r in ranks) / up_total,
                "dropped": dropped_s / up_total}
    measured = {
        "goodput": goodput,
        "note": note,
        "lost": lost,
        "time": axis,
        "useful_samples": useful_total,
        "trained_samples": trained_total,
        "dropped_samples": trained_total - useful_total,
        "possible_samples": possible,
        "span_s": _s(span),
        "up_s": _s(sum(r["up_s"] for r in ranks)),
        "down_s": _s(sum(r["down_s"] for r in ranks)),
        "ranks": ranks,
        "changes": _changes(changes, rows, by_rank, ranks, downs, hand_overs, axis, num_nodes),
    }
    if axis == "steps":  # no time of the hosts': only the samples are measured
        _without_time(measured)
    return measured


#: The seconds a measurement holds, which a simulation without a clock does not have.
_TIMED = ("possible_samples", "span_s", "up_s", "down_s")
_TIMED_RANK = ("up_s", "down_s", "compute_s", "wait_s", "idle_s", "samples_per_s", "possible")
_TIMED_CHANGE = ("dropped_s", "rejoin_wait_s", "hand_over_s", "lost_s")


def _without_time(measured: dict[str, Any]) -> None:
    """Every figure in seconds (or counted from them) of ``measured`` set to None."""
    for key in _TIMED:
        measured[key] = None
    for rank in measured["ranks"]:
        rank.update(dict.fromkeys(_TIMED_RANK))
    for change in measured["changes"]:
        change.update(dict.fromkeys(_TIMED_CHANGE))


#: Why a simulation without a clock gives no goodput.
NO_CLOCK = ("the ranks shared this machine's cores, taking turns on them, so they had no "
            "time of their own to measure it in; give fit a network (network='1gbit') or "
            "compute_time_s for a simulated clock")
#: Why a fraction above 1 is not given.
ABOVE_ONE = ("the hosts trained more than their speed alone allows in their time up: "
             "their speed changed with the others' (hosts that share a machine's cores "
             "speed up while one is down)")


def _defined(fraction: float | None, axis: str) -> tuple[float | None, str | None]:
    """The goodput fraction where it is defined, else None and why (:data:`NO_CLOCK`,
    :data:`ABOVE_ONE`, or no compute time)."""
    if axis == "steps":
        return None, NO_CLOCK
    if fraction is None:
        return None, "no step took compute time"
    if fraction > 1.0 + 1e-9:
        return None, ABOVE_ONE
    return fraction, None


def _changes(changes: Sequence[Mapping[str, Any]], rows: list[_Row],
             by_rank: dict[int, list[_Row]], ranks: list[dict[str, Any]],
             downs: dict[int, list[DownSpan]], hand_overs: Sequence[Mapping[str, Any]],
             axis: str, num_nodes: int) -> list[dict[str, Any]]:
    """The time lost to each membership change: the work thrown away by the ranks that
    left there, the time the ranks that came back waited to be admitted, the hand-over.
    A change at step 1 is the start (every rank before it, otherwise)."""
    ordered = sorted(changes, key=lambda c: int(c["step"]))
    start = set(range(num_nodes))
    if ordered and int(ordered[0]["step"]) <= 1:
        start = {int(r) for r in ordered.pop(0).get("ranks", ())}
    leaves: dict[int, list[int]] = {}  # rank -> steps at which it left
    out = []
    previous = start
    for change in ordered:
        now = {int(r) for r in change.get("ranks", ())}
        for rank in previous - now:
            leaves.setdefault(rank, []).append(int(change["step"]))
        previous = now
    lost_at: dict[tuple[int, int], int] = {}  # (rank, leave step) -> samples dropped
    for row in rows:
        if row.why != LEFT:
            continue
        step = next((s for s in sorted(leaves.get(row.rank, ())) if s > row.step), None)
        if step is not None:
            lost_at[(row.rank, step)] = lost_at.get((row.rank, step), 0) + row.samples
    previous = start
    for change in ordered:
        step = int(change["step"])
        now = {int(r) for r in change.get("ranks", ())}
        left, joined = sorted(previous - now), sorted(now - previous)
        previous = now
        dropped = {r: lost_at.get((r, step), 0) for r in left}
        dropped_s = sum(n / ranks[r]["samples_per_s"] for r, n in dropped.items()
                        if n and ranks[r]["samples_per_s"])
        waited = 0.0
        for rank in joined:
            back = next((r for r in by_rank.get(rank, ()) if r.step >= step), None)
            if back is not None:
                waited += rejoin_wait(back.start, downs.get(rank, ()))
        handing = 0.0
        if axis == "wall":
            handing = sum(_number(h.get("seconds")) for h in hand_overs
                          if h.get("step") == step and h.get("rank") == h.get("source"))
        out.append({"step": step, "reason": change.get("reason", ""), "left": left,
                    "joined": joined, "dropped_samples": sum(dropped.values()),
                    "dropped_s": _s(dropped_s), "rejoin_wait_s": _s(waited),
                    "hand_over_s": _s(handing), "lost_s": _s(dropped_s + waited + handing)})
    return out


def goodput_summary(measured: Mapping[str, Any], detail: bool) -> dict[str, Any]:
    """``summary['goodput']``: the whole measurement when the run had a membership change
    or faults (``detail``); otherwise the fraction (or the note saying why there is none),
    its two sums, the samples trained and the shares lost."""
    if detail:
        return dict(measured)
    return {k: measured[k] for k in ("goodput", "note", "time", "useful_samples",
                                     "possible_samples", "trained_samples", "lost")}


#: What goodput reads of a step event (the meter keeps no more of it).
_STEP_KEYS = ("rank", "step", "step_samples", "samples", "compute_s", "comm_s", "merge")


class GoodputMeter:
    """Collects what goodput needs from a run's events as they arrive (the launcher of a
    run across hosts: every rank's events, stamped with when they arrived).

    Args:
        num_nodes: the run's ranks.
        clock: the wall clock that stamps each event (seconds).
    """

    def __init__(self, num_nodes: int, clock: Callable[[], float] = time.monotonic):
        self.num_nodes = num_nodes
        self.clock = clock
        self.steps: list[dict[str, Any]] = []
        self.times: list[float] = []
        self.hand_overs: list[dict[str, Any]] = []
        self.round_steps = 1
        self._starts: dict[int, list[float]] = {}  # rank -> when each of its processes began
        self._faults: dict[Any, dict[str, Any]] = {}

    def on_event(self, event: Mapping[str, Any]) -> None:
        """Take one event of the run (step, start, hand_over, or an injected fault)."""
        kind = event.get("event")
        now = self.clock()
        if kind == "step" and "rank" in event:
            self.steps.append({k: event[k] for k in _STEP_KEYS if k in event})
            self.times.append(now)
        elif kind == "start" and "rank" in event:
            self._starts.setdefault(int(event["rank"]), []).append(now)
            if isinstance(event.get("round_steps"), int) and event["round_steps"] >= 1:
                self.round_steps = event["round_steps"]
        elif kind == "hand_over":
            self.hand_overs.append(dict(event))
        elif kind == "fault" and event.get("injected"):
            entry = self._faults.setdefault(event.get("id"), {"what": event.get("what"),
                                                              "ranks": event.get("ranks") or []})
            entry["length"] = _number(event.get("cut_s") or event.get("duration_s")) or \
                entry.get("length")
            if event.get("phase") == "start":
                entry["start"] = now
            elif event.get("phase") == "end":
                entry["end"] = now

    def down_spans(self, until: float) -> list[DownSpan]:
        """When injected faults kept ranks down (``until`` ends one still under way):

        - a freeze or a cut for its duration (a cut's as its host measured it), from
          when it was fired: its start was announced, or its end less its duration,
          whichever came first (a freeze is announced once the host has answered,
          which may be at its end);
        - a kill from its start until the rank's process started again.
        """
        spans = []
        for fault in self._faults.values():
            if "start" not in fault or fault["what"] not in ("kill", "freeze", "cut"):
                continue
            for rank in fault["ranks"]:
                start = fault["start"]
                if fault["what"] == "kill":
                    again = [t for t in self._starts.get(int(rank), ()) if t > start]
                    end = min(again) if again else until
                elif fault.get("length"):
                    if "end" in fault:
                        start = min(start, fault["end"] - fault["length"])
                    end = min(until, start + fault["length"])
                else:
                    end = fault.get("end", until)
                spans.append(DownSpan(int(rank), start, end))
        return spans

    @property
    def faulted(self) -> bool:
        """Whether a fault was injected that takes ranks down."""
        return any("start" in f and f["what"] in ("kill", "freeze", "cut")
                   for f in self._faults.values())

    def measure(self, changes: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
        """The run's goodput (:func:`measure_goodput`) from what it has seen."""
        until = max(self.times, default=0.0)
        return measure_goodput(self.steps, self.round_steps, self.num_nodes,
                               down=self.down_spans(until), changes=changes,
                               hand_overs=self.hand_overs, times=self.times)
