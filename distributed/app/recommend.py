"""Choose the strategy: measure the hosts and their links, predict every candidate, pick one.

``cli_typer.py recommend``, ``distributed-train --strategy auto`` and the
wizard call :func:`recommend`. It measures the hosts' steps and links
(:mod:`distributed.app.measurements`: until steady, keeping the spread), and makes
its pick again at each end of what was measured (the slowest and fastest
transfer, each timing run): :attr:`Recommendation.noise` says when the
measurement was noisy, and whether the pick would change within it.

Then ``distributed.planning.projection.predict`` -- the one cost model -- gives
each candidate's step time, bytes per step and speedup. The speedup is the one
``python -m bench.multihost`` measures: ``N`` hosts' throughput over that of one host
doing all ``N`` hosts' minibatches each step (gradient accumulation).

The pick (:func:`pick`): the candidate of highest predicted throughput (samples
per second, i.e. speedup); candidates within :data:`TIE` of it count as equal,
and among those the one sending fewest bytes per step wins. Only candidates the
profile can switch to with ``--set`` (its other keys fit the new strategy) may be
picked; the rest are shown with why not. The model predicts time, not loss:
DiLoCo with a larger ``H`` sends less and may need more steps for the same loss.

Without hosts (a local simulation) nothing crosses a network: the pick then
needs a modelled link (``link_mbit``), and the nodes share this machine's cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console

from exogym.base.plural import plural
from exogym.base.terminal import output_console
from exogym.report.summary import human_bytes

from ..planning import projection
from ..profiles.profile import Profile, ProfileError
from .compare import profile_for_strategy
from .console import StageReport, stage_progress
from .measurements import (
    COMPUTE_KIND,
    LOCAL_ROUNDS,
    NOISY,
    TOO_NOISY,
    CandidateSpec,
    HostTiming,
    Measurements,
    RecommendError,
    candidate_specs,
    measure,
    spec_for,
    with_contained_steps,
)
from .run import TrainRequest, resolve_profile
from .run_with import RunWith, run_with

__all__ = ["COMPUTE_KIND", "Candidate", "CandidateSpec", "HostTiming", "Measurements",
           "Recommendation", "RecommendError", "StageReport", "TIE", "candidate_specs",
           "figures", "measure", "pick", "predict_candidates", "predict_with", "recommend",
           "spec_for", "table_rows", "what_it_sends", "with_recommended_strategy"]

#: Candidates whose predicted speedup is within this fraction of the best one count as tied.
TIE = 0.01


@dataclass(frozen=True)
class Candidate:
    """One candidate's prediction, as ``recommend`` prints it and ``--json`` gives it.

    Args:
        label, name, settings: as in :class:`CandidateSpec`.
        step_s: predicted seconds per step.
        comm_s: the part of it spent waiting and communicating.
        speedup: predicted, over one host doing all hosts' work.
        wire_bytes: bytes each host puts on its link per step.
        applies: whether the profile can switch to it with ``--set``.
        why_not: why it cannot, when it cannot.
        parts: the step part by part (:class:`distributed.planning.projection.StepParts`):
            what ``comm_s`` is spent on.
        run_with: the profile, and its ``--set`` values, that trains the planned run with
            this strategy (``digits-ddp``, ``digits-diloco --set H=100``;
            :func:`distributed.app.run_with.run_with`); None when no profile of the config
            file can, or a profile of its own is to be written (the wizard).
    """

    label: str
    name: str
    settings: dict[str, Any]
    step_s: float
    comm_s: float
    speedup: float
    wire_bytes: float
    applies: bool = True
    why_not: str | None = None
    parts: projection.StepParts | None = None
    run_with: RunWith | None = None

    @property
    def comm_fraction(self) -> float:
        """Share of the step spent waiting and communicating."""
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready row."""
        return {**asdict(self), "comm_fraction": self.comm_fraction}


@dataclass(frozen=True)
class Recommendation:
    """The pick, why, every candidate and the measurements.

    Args:
        profile: the profile planned.
        pick: the chosen candidate.
        reason: one line saying why.
        candidates: every candidate, in the order shown.
        measurements: what the predictions start from.
        new_profile: a profile of its own will be written for the pick (the wizard's
            case): every candidate the task can run applies.
        noise: when the measurement was noisy, how much, and whether the pick would
            change within it (None: steady).
    """

    profile: str
    pick: Candidate
    reason: str
    candidates: tuple[Candidate, ...]
    measurements: Measurements
    new_profile: bool = False
    noise: str | None = None

    @property
    def overrides(self) -> dict[str, Any]:
        """The ``--set`` values that apply the pick to the profile."""
        return {"strategy": self.pick.name, **self.pick.settings}

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object: ``strategy``, ``reason``, ``candidates``, ``measurements``."""
        return {"profile": self.profile,
                "strategy": {"name": self.pick.name, **self.pick.settings},
                "label": self.pick.label, "reason": self.reason, "noise": self.noise,
                "rule": RULE,
                "candidates": [c.to_dict() for c in self.candidates],
                "measurements": self.measurements.to_dict()}


RULE = (f"highest predicted throughput; within {TIE:.0%} of it, fewest bytes per step; "
        "only strategies the profile can switch to with --set")


# --------------------------------------------------------------------------- candidates


def _why_not(profile: Profile, spec: CandidateSpec, new_profile: bool) -> str | None:
    """None when ``profile`` can run ``spec``, else why not.

    With ``new_profile`` a profile of its own will be written for it (the wizard
    does), so only the task must be able to run it; otherwise ``--set
    strategy=... KEY=...`` must turn ``profile`` into it, its other keys fitting.
    """
    try:
        if new_profile:
            profile_for_strategy(profile, spec.name, spec.settings)
            return None
        problems = profile.with_overrides({"strategy": spec.name, **spec.settings}).problems()
    except ProfileError as exc:
        problems = [str(exc)]
    if not problems:
        return None
    lines = [line.strip() for line in problems[0].strip().splitlines() if line.strip()]
    first = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]
    if new_profile:
        return f"{first.split(';')[0]} (the task cannot run it)"
    return f"{first.split(';')[0]} (a profile of its own would run it)"


def predict_candidates(measurements: Measurements, specs: Sequence[CandidateSpec],
                       why_not: Mapping[str, str | None] | None = None) -> list[Candidate]:
    """Every candidate's prediction from the measurements (``projection.predict``).

    Args:
        measurements: compute times, spread, reference and link.
        specs: the candidates.
        why_not: per label, why the profile cannot switch to it (absent or None: it can).
    """
    why_not = why_not or {}
    measurements = with_contained_steps(measurements)
    rows = []
    for spec in specs:
        compute = measurements.compute_s.get(spec.compute, measurements.compute_s["ddp"])
        settings = projection.relevant_settings(spec.name, spec.settings)
        p = projection.predict(spec.name, measurements.num_params, measurements.hosts, compute,
                               measurements.throughput_bytes_per_s,
                               minibatch_s=measurements.minibatch_s,
                               latency_s=measurements.latency_s,
                               compute_sd_s=measurements.compute_sd_s,
                               shapes=measurements.shapes or None, **settings)
        reason = why_not.get(spec.label)
        rows.append(Candidate(spec.label, spec.name, dict(spec.settings), p.step_s, p.comm_s,
                              p.speedup, p.wire_bytes, reason is None, reason, p.parts))
    return rows


def _ends(measurements: Measurements) -> list[Measurements]:
    """The measurements at each corner of what was measured: the slowest and fastest
    transfer, the lowest and highest compute times and spreads of the timing runs."""
    m = measurements
    rates = sorted(set(m.throughput_range or (m.throughput_bytes_per_s,)))
    factors = sorted(set(m.compute_range))
    sds = sorted(set(m.sd_range or (m.compute_sd_s,)))
    return [dataclasses.replace(
                m, throughput_bytes_per_s=rate, compute_sd_s=sd, minibatch_s=m.minibatch_s * f,
                compute_s={kind: s * f for kind, s in m.compute_s.items()})
            for rate in rates for f in factors for sd in sds]


def _span(low: float, high: float, unit: Callable[[float], str]) -> str:
    return unit(low) if unit(low) == unit(high) else f"{unit(low)} to {unit(high)}"


def noise_report(measurements: Measurements, specs: Sequence[CandidateSpec],
                 why_not: Mapping[str, str | None], chosen: Candidate) -> str | None:
    """None when the measurement was steady; else how noisy it was and whether the pick
    would be another candidate anywhere within it.

    The pick is made again at every end of the measured ranges (:func:`_ends`); a
    measurement is noisy when a range is wider than :data:`NOISY` of its middle.
    """
    m = measurements
    said = []
    widest = 0.0  # the widest spread said, as a share of its typical value
    if m.throughput_range is not None:
        low, high = m.throughput_range
        if high - low > NOISY * m.throughput_bytes_per_s:
            said.append("the link measured " + _span(low * 8 / 1e6, high * 8 / 1e6, _rate))
            widest = max(widest, (high - low) / m.throughput_bytes_per_s)
    if m.host_steps:
        worst = max(m.host_steps, key=lambda t: t.spread)
        if worst.spread > NOISY:
            said.append(f"steps on {worst.host} varied by {worst.spread:.0%} from step to step "
                        f"(median {worst.step_s * 1000:.3g} ms)")
            widest = max(widest, worst.spread)
    low, high = m.compute_range
    if high - low > NOISY:
        between = (f"the {plural(m.timing_runs, 'timing run')} on the hosts"
                   if m.compute_range_from == "hosts"
                   else f"the {LOCAL_ROUNDS} passes timed on this machine")
        said.append(f"step times differed by {high / low - 1:.0%} between {between}")
        widest = max(widest, high / low - 1)
    others = []
    for corner in _ends(m):
        rows = predict_candidates(corner, specs, why_not)
        other = pick(rows)
        if other.label != chosen.label and other.label not in others:
            others.append(other.label)
    if not said and not others:
        return None
    where = "; ".join(said) if said else "the spread of the measurements"
    if others:
        return (f"the measurement was noisy ({where}): within it "
                f"{' or '.join(others)} would be picked instead of {chosen.label}; "
                "measure again, on quieter hosts, before trusting the pick")
    if widest > TOO_NOISY:
        return (f"the measurement was too noisy to tell ({where}): each strategy's step was "
                f"timed at its own moment, and a spread this wide can reorder them, so "
                f"{chosen.label} is a guess; measure again when the machines are quieter "
                "before trusting it")
    return f"the measurement was noisy ({where}), but the pick is {chosen.label} anywhere within it"


def pick(candidates: Sequence[Candidate], tie: float = TIE) -> Candidate:
    """The candidate to run: highest predicted speedup; within ``tie`` of it, fewest bytes.

    Only candidates that apply to the profile are considered.

    Raises:
        RecommendError: when none applies.
    """
    usable = [c for c in candidates if c.applies]
    if not usable:
        raise RecommendError("no candidate strategy fits this profile's keys: "
                             + "; ".join(f"{c.label}: {c.why_not}" for c in candidates))
    best = max(c.speedup for c in usable)
    close = [c for c in usable if c.speedup >= best * (1 - tie)]
    return min(close, key=lambda c: (c.wire_bytes, -c.speedup))


def _rate(mbit: float) -> str:
    return f"{mbit / 1000:.3g} Gbit/s" if mbit >= 1000 else f"{mbit:.3g} Mbit/s"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2g} ms"


def _spent_on(c: Candidate, m: Measurements) -> str:
    """What a candidate's time beyond compute goes to, in words: its largest part."""
    link = _rate(m.mbit)
    sent = human_bytes(c.wire_bytes)
    parts = c.parts
    main = parts.main_cost() if parts is not None else "transfer"
    if main == "wait" and parts is not None:
        return (f"waiting for the slowest host (steps vary by {_ms(m.compute_sd_s)}), not on "
                f"the link ({sent} a step take {_ms(parts.transfer_s)} at {link})")
    if main == "latency" and parts is not None:
        return (f"on the link's {_ms(m.latency_s)} latency, not its bandwidth ({sent} a step "
                f"take {_ms(parts.transfer_s)} at {link})")
    return f"sending {sent} a step on the {link} link"


def reason_for(chosen: Candidate, candidates: Sequence[Candidate],
               measurements: Measurements, new_profile: bool = False) -> str:
    """One line: the pick's communication share and speedup, and what DDP would spend its
    time on (``new_profile``: the candidates that do not apply are ones the task cannot run).

    Time beyond compute is named by its largest part: waiting for the slowest host, the
    link's latency, or the bytes on the link."""
    hosts = measurements.hosts
    text = (f"{chosen.label}: communication is {chosen.comm_fraction:.0%} of the step, "
            f"{chosen.speedup:.2f}x predicted on {hosts} hosts")
    if chosen.parts is not None and chosen.parts.main_cost() == "wait" \
            and chosen.comm_fraction >= 0.05:
        text += " (most of it waiting for the slowest host)"
    ddp = next((c for c in candidates if c.name == "ddp"), None)
    if ddp is not None and ddp is not chosen:
        text += (f"; DDP would spend {ddp.comm_fraction:.0%} of each step "
                 f"{_spent_on(ddp, measurements)} ({ddp.speedup:.2f}x)")
    elif ddp is chosen:
        text += f" on the {_rate(measurements.mbit)} link: the link is fast enough for DDP"
    faster = [c for c in candidates if not c.applies and c.speedup > chosen.speedup * (1 + TIE)
              and not new_profile]
    if faster:
        run = faster[0].run_with
        text += (f" ({faster[0].label} would be faster: distributed-train {run.args} runs it)"
                 if run
                 else f" ({faster[0].label} would be faster, but no profile of this task "
                      "runs it)")
    return text


def recommend(request: TrainRequest, console: Console | None = None, *,
              link_mbit: float | None = None, steps: int = 10,
              link_seconds: float = 2.0, time_hosts: bool = True,
              new_profile: bool = False, progress: StageReport | None = None,
              trace: Any = None) -> Recommendation:
    """Measure, predict every candidate, pick one and say why.

    Args:
        request: the profile, ``--set`` values, hosts and SSH files.
        console: where progress goes (default: stdout).
        link_mbit: a modelled link in Mbit/s instead of a measured one.
        steps: steps timed on every host.
        link_seconds: how long each link transfer lasts.
        time_hosts: time the step on the hosts (False: this machine's stands in).
        new_profile: a profile of its own will be written for the pick (the wizard's
            case), so any strategy the task can run may be picked, not only those
            ``--set`` can switch the profile to.
        progress: told as each stage of the measurement starts (default: a progress
            bar in a terminal, else one ``[recommend]`` line per stage).
        trace: a recorded run (:func:`distributed.app.replay.load_recording`) whose hosts'
            steps and links stand in for measuring them again.

    Raises:
        ProfileError, HostsFileError, ValueError: bad input, before any work.
        RecommendError: a measurement failed, or nothing fits the profile.
    """
    console = console or output_console()
    profile = resolve_profile(request)
    specs = candidate_specs(profile)
    with contextlib.ExitStack() as stack:
        if progress is None:
            progress = stack.enter_context(
                stage_progress(console, "Measuring", log_prefix="[recommend]"))
        measured = measure(request, console, link_mbit=link_mbit, steps=steps,
                           link_seconds=link_seconds, specs=specs, time_hosts=time_hosts,
                           progress=progress, trace=trace)
    rows = predict_candidates(measured, specs,
                              {s.label: _why_not(profile, s, new_profile) for s in specs})
    if not new_profile:
        rows = [dataclasses.replace(c, run_with=_run_with(profile, c, request)) for c in rows]
    chosen = pick(rows)
    why_not = {c.label: c.why_not for c in rows}
    return Recommendation(profile.name, chosen, reason_for(chosen, rows, measured, new_profile),
                          tuple(rows), measured, new_profile,
                          noise_report(measured, specs, why_not, chosen))


def with_recommended_strategy(request: TrainRequest, console: Console | None = None, *,
                              link_mbit: float | None = None
                              ) -> tuple[TrainRequest, Recommendation]:
    """``request`` with the strategy :func:`recommend` picks for it (``--strategy auto``):
    its ``--set`` values joined by the pick's, and the recommendation that says why."""
    rec = recommend(request, console, link_mbit=link_mbit)
    return dataclasses.replace(request, overrides={**request.overrides, **rec.overrides}), rec


def _run_with(profile: Profile, candidate: Candidate, request: TrainRequest) -> RunWith | None:
    return run_with(profile, candidate.name, candidate.settings, request.config,
                    request.overrides)


def predict_with(rec: Recommendation, name: str, settings: Mapping[str, Any]) -> Candidate:
    """Strategy ``name`` with ``settings`` (the pick with another ``H``, say) predicted from
    ``rec``'s measurements, by the model that predicted its rows."""
    return predict_candidates(rec.measurements, [spec_for(name, settings)])[0]


def what_it_sends(name: str) -> str:
    """What strategy ``name`` sends, in words (empty for a strategy the planner does not know)."""
    return projection.STRATEGIES.get(name, "")


def figures(candidate: Candidate) -> str:
    """A candidate's predicted figures in words: ``2.11x, 577 B per step``."""
    return f"{candidate.speedup:.2f}x, {human_bytes(candidate.wire_bytes)} per step"


def table_rows(rec: Recommendation) -> list[list[str]]:
    """The candidates as text cells: label, step, comm share, speedup, bytes/step, note (the
    pick; for a profile of its own, a candidate the task cannot run). What runs each
    candidate is its ``run_with``."""
    rows = []
    cannot = "not available for this task" if rec.new_profile else ""
    for c in rec.candidates:
        note = "<- pick" if c is rec.pick else ("" if c.applies else cannot)
        rows.append([c.label, f"{c.step_s * 1000:.1f} ms", f"{c.comm_fraction:.0%}",
                     f"{c.speedup:.2f}x", human_bytes(c.wire_bytes), note])
    return rows
