"""Faults injected into a real run across hosts: the spec, its checks, and the plan.

``python cli_typer.py distributed-train PROFILE --hosts HOSTS --inject SPEC`` takes
specs such as::

    kill:127.0.0.3@step=300      SIGKILL rank(s) of host 127.0.0.3 when it reaches step 300
    kill:2@90s+30s               SIGKILL rank 2 at 90 s; its host is down 30 s, then it restarts
    freeze:2@60s+20s             SIGSTOP rank 2 60 s after training starts, SIGCONT 20 s later
    slow:1@step=100x0.5          from step 100 rank 1 computes at half its speed, to the end
    slow:1@30s+20sx0.25          at a quarter of its speed, for 20 s
    cut:2@step=500+15s           block the traffic of rank 2's host for 15 s (its firewall)

``KIND:TARGET@WHEN`` then the kind's own suffixes, in any order:

- ``KIND``: ``kill``, ``freeze``, ``slow`` or ``cut``;
- ``TARGET``: a host as the hosts file writes it (every rank it runs), or a rank number;
- ``WHEN``: ``step=N`` (when the target's rank reaches step N) or ``Ts`` (T seconds
  after training starts: after the first step any rank reports);
- ``+Ds``: how long (``freeze`` and ``cut`` need it; ``slow`` lasts to the end
  without it; a ``kill`` with it keeps its host down that long before the launcher
  starts the rank again, as a machine that reboots, and needs ``--min-nodes``);
- ``xF``: ``slow`` only, and needed: the rank computes at F of its speed, 0 < F < 1.

With ``--inject-random SEED --every 30s`` faults are drawn instead (:class:`RandomFaults`);
with ``--inject-random SEED --mtbf 2m --down 30s`` each host fails on average once every
two minutes and is down 30 s each time (a freeze, or a cut where the hosts permit it;
``--failures kill`` makes every failure a kill whose host restarts the rank 30 s later).

Everything here is checked before anything starts (:func:`plan_faults` raises
:class:`FaultSpecError`, a ``ValueError``, naming the spec and what is accepted), except
whether a host lets the launcher change its firewall (``cut``): that needs the host, and
is asked right after pre-flight, still before any rank starts
(:mod:`distributed.launch.injector`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from exogym.base.plural import plural

from ..hosts.hostsfile import HostsConfig

__all__ = ["FAILURE_KINDS", "KILL_AWAY_S", "KINDS", "FaultLog", "FaultPlan", "FaultSpec",
           "FaultSpecError", "RandomFaults", "describe_fault_event", "parse_every",
           "parse_failures", "parse_fault", "parse_faults", "parse_mtbf", "plan_faults"]

#: The kinds of fault, in the order the help lists them.
KINDS = ("kill", "freeze", "slow", "cut")
#: Seconds a killed rank is counted away when faults at seconds are checked for overlap
#: before the run (its host probed, the rank started again and readmitted); while the
#: run goes, the injector counts what the launcher sees instead.
KILL_AWAY_S = 60.0
#: The kinds ``--failures`` may name: those that take a host down for ``--down``.
FAILURE_KINDS = ("kill", "freeze", "cut")
#: ``--failures`` when not given.
DEFAULT_FAILURES = ("freeze", "cut")

_NUMBER = r"\d+(?:\.\d+)?|\.\d+"
_WHEN = re.compile(rf"^(?:step=(?P<step>-?\d+)|(?P<seconds>{_NUMBER})s)")
_SUFFIX = re.compile(rf"^(?:\+(?P<duration>{_NUMBER})s|x(?P<factor>{_NUMBER}))")

ACCEPTED = ("KIND:TARGET@WHEN[+Ds][xF], KIND one of kill, freeze, slow, cut; TARGET a host "
            "of the hosts file or a rank number; WHEN step=N or Ts (seconds after training "
            "starts); e.g. kill:127.0.0.3@step=300, kill:2@90s+30s, freeze:2@60s+20s, "
            "slow:1@step=100x0.5, cut:2@step=500+15s")


class FaultSpecError(ValueError):
    """An ``--inject``/``--inject-random`` value that cannot be run; the message names it,
    what is wrong, and what is accepted."""


@dataclass(frozen=True)
class FaultSpec:
    """One fault to inject.

    Args:
        kind: ``kill``, ``freeze``, ``slow`` or ``cut``.
        target: the target as written (a host of the hosts file, or a rank number).
        at_step: fire when the target's rank reaches this step (or None).
        at_s: fire this many seconds after training starts (or None).
        duration_s: how long it lasts (``freeze``, ``cut``; ``slow`` optionally).
        factor: ``slow``'s share of the rank's speed, 0 < F < 1.
        text: the spec as given (or as drawn, for a random fault).
        ranks: the ranks it hits, once resolved against the hosts file.
        host: the host of those ranks, as the hosts file writes it.
        random: drawn by ``--inject-random`` rather than given.
    """

    kind: str
    target: str
    at_step: int | None = None
    at_s: float | None = None
    duration_s: float | None = None
    factor: float | None = None
    text: str = ""
    ranks: tuple[int, ...] = ()
    host: str = ""
    random: bool = False

    @property
    def when(self) -> str:
        """The trigger in the spec's words: ``step=N`` or ``Ts``."""
        return f"step={self.at_step}" if self.at_step is not None else f"{self.at_s:g}s"

    @property
    def takes_down(self) -> bool:
        """Whether its ranks stop taking part while it lasts (kill, freeze, cut)."""
        return self.kind != "slow"

    def describe(self) -> str:
        """The fault in words, for messages and the dashboards."""
        who = f"{self.host} (rank{'s' if len(self.ranks) > 1 else ''} " \
              f"{', '.join(map(str, self.ranks))})" if self.ranks else self.target
        when = f"at step {self.at_step}" if self.at_step is not None else \
            f"{self.at_s:g} s after training started"
        what = {"kill": "kill", "freeze": "freeze", "slow": "slow down", "cut": "cut off"}[self.kind]
        extra = ""
        if self.factor is not None:
            extra += f" to {self.factor:g} of its speed"
        if self.duration_s is not None and self.kind == "kill":
            extra += f", its host down {self.duration_s:g} s"
        elif self.duration_s is not None:
            extra += f" for {self.duration_s:g} s"
        elif self.kind == "slow":
            extra += " to the end of the run"
        return f"{what} {who} {when}{extra}"

    def as_dict(self) -> dict[str, object]:
        """The fault as the trace, the events and ``summary.json`` record it."""
        return {"what": self.kind, "target": self.target, "host": self.host,
                "ranks": list(self.ranks), "at_step": self.at_step, "at_s": self.at_s,
                "duration_s": self.duration_s, "factor": self.factor, "spec": self.text,
                "random": self.random}


def _bad(text: str, problem: str) -> FaultSpecError:
    return FaultSpecError(f"--inject {text!r}: {problem}. Accepted: {ACCEPTED}")


def parse_fault(text: str) -> FaultSpec:
    """One spec (``kill:127.0.0.3@step=300``) as a :class:`FaultSpec`, its target not yet
    resolved against a hosts file.

    Raises:
        FaultSpecError: naming what is malformed and what is accepted.
    """
    raw = text.strip()
    if ":" not in raw:
        raise _bad(text, "no KIND: before the target")
    kind, rest = raw.split(":", 1)
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise _bad(text, f"unknown kind {kind!r} (the kinds are {', '.join(KINDS)})")
    if "@" not in rest:
        raise _bad(text, "no @WHEN after the target (step=N or Ts)")
    target, when_text = rest.rsplit("@", 1)
    target = target.strip()
    if not target:
        raise _bad(text, "no target before @ (a host of the hosts file or a rank number)")
    when = _WHEN.match(when_text)
    if when is None:
        raise _bad(text, f"the time {when_text!r} is neither step=N nor a number of seconds "
                         "such as 60s")
    at_step = at_s = None
    if when.group("step") is not None:
        at_step = int(when.group("step"))
        if at_step < 1:
            raise _bad(text, f"step={at_step}: the step must be 1 or more")
    else:
        at_s = float(when.group("seconds"))
    suffix = when_text[when.end():]
    duration = factor = None
    while suffix:
        part = _SUFFIX.match(suffix)
        if part is None:
            raise _bad(text, f"{suffix!r} after the time is neither +Ds (a duration such as "
                             "+20s) nor xF (a speed factor such as x0.5)")
        if part.group("duration") is not None:
            if duration is not None:
                raise _bad(text, "two durations")
            duration = float(part.group("duration"))
            if duration <= 0:
                raise _bad(text, f"+{part.group('duration')}s: a duration must be more than "
                                 "0 s")
        else:
            if factor is not None:
                raise _bad(text, "two speed factors")
            factor = float(part.group("factor"))
        suffix = suffix[part.end():]
    if kind == "slow":
        if factor is None:
            raise _bad(text, "slow needs its speed factor xF (0 < F < 1), e.g. x0.5")
        if not 0 < factor < 1:
            raise _bad(text, f"x{factor:g}: the speed factor must be between 0 and 1 "
                             "(exclusive): the rank computes at F of its speed")
    elif factor is not None:
        raise _bad(text, f"x{factor:g}: only slow takes a speed factor")
    if kind in ("freeze", "cut") and duration is None:
        raise _bad(text, f"{kind} needs a duration +Ds (e.g. +20s): how long it lasts")
    return FaultSpec(kind=kind, target=target, at_step=at_step, at_s=at_s, duration_s=duration,
                     factor=factor, text=raw)


def parse_faults(values: Iterable[str] | None) -> list[FaultSpec]:
    """Every spec of repeated ``--inject`` options, each possibly a comma list.

    Raises:
        FaultSpecError: for the first malformed spec, or an empty one.
    """
    specs = []
    for value in values or ():
        for text in value.split(","):
            if not text.strip():
                raise FaultSpecError(f"--inject {value!r}: an empty spec (two commas, or one "
                                     f"at an end). Accepted: {ACCEPTED}")
            specs.append(parse_fault(text))
    return specs


def _seconds(option: str, text: str | float) -> float:
    """A duration as ``30s``, ``2m`` or a plain number of seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    found = re.fullmatch(rf"\s*({_NUMBER})\s*(s|m)?\s*", str(text))
    if found is None:
        raise FaultSpecError(f"{option} {text!r}: give seconds such as 30s, or minutes such as "
                             "2m")
    return float(found.group(1)) * (60 if found.group(2) == "m" else 1)


def parse_every(text: str | float | None) -> float:
    """``--every``: ``30s``, ``2m`` or a plain number of seconds; at least 6 s.

    Raises:
        FaultSpecError: naming the value and what is accepted.
    """
    if text is None:
        return 30.0
    seconds = _seconds("--every", text)
    if seconds < 6:
        raise FaultSpecError(f"--every {text!r}: at least 6 s (faults are drawn every 2/3 to "
                             "4/3 of it, and a freeze or cut lasts a sixth to a half of it)")
    return seconds


def parse_mtbf(mtbf: str | float, down: str | float | None) -> tuple[float, float]:
    """``--mtbf`` and ``--down`` in seconds: each host's mean time between failures, and how
    long each failure keeps it down (default a quarter of the mtbf). The mtbf is at least
    6 s and longer than the down time; the down time is at least 1 s.

    Raises:
        FaultSpecError: naming the value and what is accepted.
    """
    mtbf_s = _seconds("--mtbf", mtbf)
    down_s = mtbf_s / 4 if down is None else _seconds("--down", down)
    if mtbf_s < 6:
        raise FaultSpecError(f"--mtbf {mtbf!r}: at least 6 s (each host fails on average "
                             "once per mtbf)")
    if down_s < 1:
        raise FaultSpecError(f"--down {down!r}: at least 1 s (how long a failure keeps its "
                             "host down)")
    if down_s >= mtbf_s:
        raise FaultSpecError(f"--down {down_s:g}s is not shorter than --mtbf {mtbf_s:g}s: a "
                             "host fails once per mtbf on average and is down part of it; "
                             "give a shorter --down or a longer --mtbf")
    return mtbf_s, down_s


def parse_failures(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """``--failures``: the kinds ``--mtbf``'s failures are drawn from, a comma list of
    ``kill``, ``freeze`` and ``cut`` (default :data:`DEFAULT_FAILURES`), in that order.

    Raises:
        FaultSpecError: naming the value and what is accepted.
    """
    if text is None:
        return DEFAULT_FAILURES
    items = text.split(",") if isinstance(text, str) else list(text)
    kinds = [k.strip().lower() for k in items]
    wrong = [k for k in kinds if k not in FAILURE_KINDS]
    if wrong or not kinds:
        raise FaultSpecError(f"--failures {text!r}: give a comma list of "
                             f"{', '.join(FAILURE_KINDS)} (each takes a host down for --down: a "
                             "kill restarts its rank when the time is up)")
    return tuple(k for k in FAILURE_KINDS if k in kinds)


def _resolve(spec: FaultSpec, config: HostsConfig) -> FaultSpec:
    hosts = {h.host: h for h in config.hosts}
    if spec.target in hosts:
        host = hosts[spec.target]
        return replace(spec, ranks=tuple(host.ranks), host=host.host)
    if re.fullmatch(r"-?\d+", spec.target):
        rank = int(spec.target)
        if not 0 <= rank < config.world_size:
            raise FaultSpecError(f"--inject {spec.text!r}: there is no rank {rank}: the hosts "
                                 f"file runs ranks 0..{config.world_size - 1}")
        return replace(spec, ranks=(rank,), host=config.host_of(rank).host)
    raise FaultSpecError(f"--inject {spec.text!r}: {spec.target!r} is not a host of the hosts "
                         f"file ({', '.join(hosts)}) nor a rank number (0.."
                         f"{config.world_size - 1})")


def _away_windows(spec: FaultSpec) -> tuple[float, float] | None:
    """The seconds during which a fault at seconds keeps its ranks away (None: a fault at
    a step, or one that takes nothing away)."""
    if spec.at_s is None or not spec.takes_down:
        return None
    length = KILL_AWAY_S + float(spec.duration_s or 0.0) if spec.kind == "kill" \
        else float(spec.duration_s or 0.0)
    return spec.at_s, spec.at_s + length


def _check_overlaps(specs: Sequence[FaultSpec], world: int, min_nodes: int) -> None:
    """Refuse faults that certainly keep more than ``world - min_nodes`` ranks away at once:
    faults at seconds whose windows overlap, faults at the same step."""
    spare = world - min_nodes
    for spec in specs:
        if spec.takes_down and len(set(spec.ranks)) > spare:
            raise FaultSpecError(
                f"--inject {spec.text!r}: it takes {plural(len(spec.ranks), 'rank')} away, "
                f"leaving fewer than min_nodes={min_nodes} of {world}")
    down = [s for s in specs if s.takes_down]
    # Faults at seconds: at each start, what is away then.
    for spec in down:
        window = _away_windows(spec)
        if window is None:
            continue
        start = window[0]
        away: set[int] = set()
        together = []
        for other in down:
            w = _away_windows(other)
            if w is not None and w[0] <= start < w[1]:
                away |= set(other.ranks)
                together.append(other.text)
        if len(away) > spare:
            raise FaultSpecError(
                f"--inject: {', '.join(repr(t) for t in together)} keep "
                f"{plural(len(away), 'rank')} away at once at {start:g} s (a kill counts "
                f"{KILL_AWAY_S:g} s away, more its +Ds), leaving fewer than min_nodes={min_nodes} of "
                f"{world}; move them apart or raise --min-nodes' margin")
    by_step: dict[int, list[FaultSpec]] = {}
    for spec in down:
        if spec.at_step is not None:
            by_step.setdefault(spec.at_step, []).append(spec)
    for step, group in sorted(by_step.items()):
        away = set().union(*(set(s.ranks) for s in group))
        if len(away) > spare:
            raise FaultSpecError(
                f"--inject: {', '.join(repr(s.text) for s in group)} take "
                f"{plural(len(away), 'rank')} away at step {step} at once, leaving fewer than "
                f"min_nodes={min_nodes} of {world}")


@dataclass(frozen=True)
class RandomFaults:
    """Faults drawn from a seed (``--inject-random SEED --every 30s``), one after another.

    The draws are a fixed sequence for a seed: the k-th fault comes an interval after
    the (k-1)-th fired (the first an interval after training starts), the interval
    drawn uniformly from [2/3, 4/3] of ``every`` (20-40 s for 30 s); its kind
    uniformly from ``kinds``; its target uniformly from ``targets`` (hosts; a cut
    from ``cut_targets``); a freeze or cut lasts uniformly [1/6, 1/2] of ``every``
    (5-15 s for 30 s); a slow lasts [1/3, 1] of ``every`` at a speed factor drawn
    uniformly from [0.25, 0.75].

    With ``mtbf_s`` (``--mtbf``) each of the ``targets`` fails on average once per
    ``mtbf_s``: the intervals between failures are exponential with mean ``mtbf_s``
    over the number of targets (each failure's host drawn uniformly, so each host's
    failures come at a rate of one per ``mtbf_s``), and each failure takes its host
    down for ``down_s``: its kind drawn uniformly from ``failures`` (a cut only where
    the host permits it; by default a freeze or a cut); a kill keeps its host down
    ``down_s`` before the launcher starts the rank again. No slow-down.

    Args:
        seed: the seed.
        every_s: the mean interval, seconds.
        targets: the hosts a kill, freeze or slow may hit.
        cut_targets: the hosts a cut may hit (empty: no cut is drawn).
        config: the hosts file, for each host's ranks.
        mtbf_s: each host's mean time between failures, seconds (None: faults every
            ``every_s``).
        down_s: with ``mtbf_s``, how long each failure keeps its host down.
        failures: with ``mtbf_s``, the kinds drawn (:data:`FAILURE_KINDS`).
    """

    seed: int
    every_s: float
    targets: tuple[str, ...]
    cut_targets: tuple[str, ...]
    config: HostsConfig = field(repr=False)
    mtbf_s: float | None = None
    down_s: float | None = None
    failures: tuple[str, ...] = DEFAULT_FAILURES

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds drawn: cut only where some host permits it; with ``mtbf_s`` those of
        ``failures``, which take a host down for a set time."""
        if self.mtbf_s is not None:
            return tuple(k for k in self.failures if k != "cut" or self.cut_targets)
        return ("kill", "freeze", "slow", "cut") if self.cut_targets else ("kill", "freeze",
                                                                          "slow")

    def draws(self) -> Iterable[tuple[float, FaultSpec]]:
        """The endless sequence of ``(interval after the previous fault, fault)``."""
        if self.mtbf_s is not None:
            yield from self._failures()
            return
        rng = random.Random(self.seed)
        hosts = {h.host: h for h in self.config.hosts}
        kinds = self.kinds
        every = self.every_s
        while True:
            interval = rng.uniform(every * 2 / 3, every * 4 / 3)
            kind = rng.choice(kinds)
            target = rng.choice(self.cut_targets if kind == "cut" else self.targets)
            duration = factor = None
            if kind in ("freeze", "cut"):
                duration = round(rng.uniform(every / 6, every / 2), 1)
            elif kind == "slow":
                duration = round(rng.uniform(every / 3, every), 1)
                factor = round(rng.uniform(0.25, 0.75), 2)
            text = f"{kind}:{target}@+{interval:.1f}s" + (
                f"+{duration:g}s" if duration is not None else "") + (
                f"x{factor:g}" if factor is not None else "")
            yield interval, FaultSpec(kind=kind, target=target, duration_s=duration,
                                      factor=factor, text=text, ranks=tuple(hosts[target].ranks),
                                      host=target, random=True)

    def _failures(self) -> Iterable[tuple[float, FaultSpec]]:
        """``--mtbf``'s draws: exponential intervals, a host down ``down_s`` each time."""
        assert self.mtbf_s is not None and self.down_s is not None
        rng = random.Random(self.seed)
        hosts = {h.host: h for h in self.config.hosts}
        # only cuts: only the hosts a cut may hit fail (none else can be taken down)
        targets = self.cut_targets if self.kinds == ("cut",) else self.targets
        mean = self.mtbf_s / len(targets)
        while True:
            interval = rng.expovariate(1.0 / mean)
            target = rng.choice(targets)
            # cut first: a freeze or a cut, drawn as before --failures existed
            kinds = sorted(k for k in self.kinds if k != "cut" or target in self.cut_targets)
            kind = kinds[0] if len(kinds) == 1 else \
                kinds[min(int(rng.random() * len(kinds)), len(kinds) - 1)]
            text = f"{kind}:{target}@+{interval:.1f}s+{self.down_s:g}s"
            yield interval, FaultSpec(kind=kind, target=target, duration_s=self.down_s,
                                      text=text, ranks=tuple(hosts[target].ranks), host=target,
                                      random=True)


@dataclass(frozen=True)
class FaultPlan:
    """What to inject into one run: the given faults and, optionally, random ones.

    Args:
        faults: the ``--inject`` faults, resolved and checked.
        random: the ``--inject-random`` draws, or None.
        min_nodes: the run's ``min_nodes`` (None: every rank is needed).
        world_size: the run's ranks.
        master: the master host (rank 0's), as the hosts file writes it.
    """

    faults: tuple[FaultSpec, ...] = ()
    random: RandomFaults | None = None
    min_nodes: int | None = None
    world_size: int = 1
    master: str = ""

    def __bool__(self) -> bool:
        return bool(self.faults) or self.random is not None

    @property
    def has_slow(self) -> bool:
        """Whether some fault slows a rank down (every rank then watches its throttle file)."""
        return self.random is not None or any(f.kind == "slow" for f in self.faults)

    @property
    def cut_hosts(self) -> tuple[str, ...]:
        """The hosts a cut may hit: those of the given cuts, and those random cuts may draw."""
        hosts = [f.host for f in self.faults if f.kind == "cut"]
        if self.random is not None:
            hosts += list(self.random.cut_targets)
        return tuple(dict.fromkeys(hosts))

    def without_random_cuts(self, refused: Iterable[str]) -> FaultPlan:
        """The plan with ``refused`` hosts no longer drawn for a random cut."""
        if self.random is None:
            return self
        left = tuple(h for h in self.random.cut_targets if h not in set(refused))
        return replace(self, random=replace(self.random, cut_targets=left))

    def describe(self) -> list[str]:
        """One line per given fault, and one for the random draws."""
        lines = [f"inject {f.describe()}" for f in self.faults]
        if self.random is not None and self.random.mtbf_s is not None:
            r = self.random
            lines.append(f"inject random failures (seed {r.seed}): each of {', '.join(r.targets)} "
                         f"down {r.down_s:g} s ({' or '.join(r.kinds)}) on average once every "
                         f"{r.mtbf_s:g} s")
        elif self.random is not None:
            r = self.random
            lines.append(f"inject random faults (seed {r.seed}): every {r.every_s * 2 / 3:g}-"
                         f"{r.every_s * 4 / 3:g} s one of {', '.join(r.kinds)} on "
                         f"{', '.join(r.targets)}" + (
                             f" (cut on {', '.join(r.cut_targets)})" if r.cut_targets else ""))
        return lines


def plan_faults(inject: Iterable[str] | None, config: HostsConfig, *, max_steps: int | None,
                min_nodes: int | None, max_restarts: int = 0,
                random_seed: int | None = None, every: str | float | None = None,
                mtbf: str | float | None = None, down: str | float | None = None,
                failures: str | Sequence[str] | None = None) -> FaultPlan:
    """Parse and check ``--inject`` specs and ``--inject-random``/``--every`` (or
    ``--mtbf``/``--down``) against the hosts file and the run's settings; the plan,
    before anything starts.

    Refused, naming the spec: a malformed spec, an unknown kind, a host not in the
    hosts file or a rank out of range, a step at or past ``max_steps``, a kill in a
    run that can neither readmit nor restart a rank (no ``min_nodes``, no
    ``max_restarts``), a cut of the master host, faults that certainly keep more than
    ``world - min_nodes`` ranks away at once, ``--every`` or ``--mtbf`` without
    ``--inject-random``, ``--every`` with ``--mtbf``, ``--down`` without ``--mtbf``,
    ``--inject-random`` without a ``min_nodes`` below the number of ranks, ``--failures``
    without ``--mtbf`` or naming only cuts where no host may be cut, a kill with a
    duration (``+Ds``) without ``min_nodes``.

    Raises:
        FaultSpecError: the first problem found.
    """
    if every is not None and random_seed is None:
        raise FaultSpecError(f"--every {every!r} without --inject-random: --every sets how often "
                             "random faults are drawn; add --inject-random SEED, or drop --every")
    if mtbf is not None and random_seed is None:
        raise FaultSpecError(f"--mtbf {mtbf!r} without --inject-random: --mtbf sets how often "
                             "each host fails; add --inject-random SEED, or drop --mtbf")
    if mtbf is not None and every is not None:
        raise FaultSpecError(f"--every {every!r} and --mtbf {mtbf!r} both set how often faults "
                             "come: give one (--mtbf: each host's mean time between failures)")
    if down is not None and mtbf is None:
        raise FaultSpecError(f"--down {down!r} without --mtbf: --down is how long each of "
                             "--mtbf's failures lasts; add --mtbf, or drop --down")
    if failures is not None and mtbf is None:
        raise FaultSpecError(f"--failures {failures!r} without --mtbf: --failures is what "
                             "kind each of --mtbf's failures is; add --mtbf, or drop --failures")
    kinds = parse_failures(failures)
    world = config.world_size
    master = config.master.host
    specs = [_resolve(s, config) for s in parse_faults(inject)]
    for spec in specs:
        if spec.at_step is not None and max_steps is not None and spec.at_step >= max_steps:
            raise FaultSpecError(f"--inject {spec.text!r}: step {spec.at_step} is not before "
                                 f"max_steps={max_steps}: the run ends there; pick a step "
                                 f"from 1 to {max_steps - 1}")
        if spec.kind == "cut" and spec.host == master:
            raise FaultSpecError(
                f"--inject {spec.text!r}: {master} is the master host: the launcher runs there "
                "(and with min_nodes the run's rendezvous store), so cutting it cuts every "
                "host off at once; cut another host")
        if spec.kind == "kill" and spec.duration_s is not None and min_nodes is None:
            raise FaultSpecError(
                f"--inject {spec.text!r}: a kill with a duration keeps its host down "
                f"{spec.duration_s:g} s while the others go on, which needs --min-nodes N "
                "(without it, drop the +Ds: --max-restarts restarts the whole run at once)")
        if spec.kind == "kill" and min_nodes is None and not max_restarts:
            raise FaultSpecError(
                f"--inject {spec.text!r}: without --min-nodes every rank is needed and "
                "without --max-restarts nothing restarts it: the kill would end the run; "
                "give --min-nodes N (the rank is restarted and readmitted) or --max-restarts N")
    if min_nodes is not None:
        _check_overlaps(specs, world, min_nodes)
    chaos = None
    if random_seed is not None:
        if min_nodes is None or min_nodes >= world:
            raise FaultSpecError(
                f"--inject-random {random_seed}: random faults take hosts away one at a time; "
                f"the run needs --min-nodes below its {plural(world, 'rank')} to go on "
                f"without one (now: {'unset' if min_nodes is None else min_nodes})")
        mtbf_s, down_s = parse_mtbf(mtbf, down) if mtbf is not None else (None, None)
        every_s = parse_every(every) if mtbf_s is None else mtbf_s
        spare = world - min_nodes
        targets = tuple(h.host for h in config.hosts if h.slots <= spare)
        if not targets:
            raise FaultSpecError(f"--inject-random {random_seed}: every host runs more ranks "
                                 f"than the {spare} the run may lose (min_nodes={min_nodes})")
        cut_targets = tuple(t for t in targets if t != master)
        if mtbf_s is not None and kinds == ("cut",) and not cut_targets:
            raise FaultSpecError(f"--failures {failures!r}: only cuts, and no host may be cut "
                                 f"(the master {master} may not; the others run more ranks "
                                 f"than the {spare} the run may lose); add kill or freeze")
        chaos = RandomFaults(seed=int(random_seed), every_s=every_s, targets=targets,
                             cut_targets=cut_targets, config=config, mtbf_s=mtbf_s,
                             down_s=down_s, failures=kinds)
    return FaultPlan(faults=tuple(specs), random=chaos, min_nodes=min_nodes, world_size=world,
                     master=master)


def describe_fault_event(event: dict[str, Any]) -> str:
    """An injected fault's event in one line, for the dashboards' logs."""
    ranks = event.get("ranks") or []
    who = f"{event.get('host')} (rank{'s' if len(ranks) > 1 else ''} " \
          f"{', '.join(map(str, ranks))})"
    step = event.get("step")
    at = event.get("at_s")
    when = ", ".join(p for p in (f"step {step}" if step is not None else "",
                                 f"{at:.1f} s into training" if at is not None else "") if p)
    what = event.get("what")
    phase = event.get("phase")
    if phase == "start":
        extra = f" to {event['factor']:g} of its speed" if event.get("factor") else ""
        if event.get("duration_s") is not None:
            extra += (f", its host down {event['duration_s']:g} s" if what == "kill" else
                      f" for {event['duration_s']:g} s")
        late = f" (held {event['delayed_s']:.1f} s)" if event.get("delayed_s") else ""
        return f"injected {what} on {who}{extra} at {when}{late}"
    if phase == "end":
        how = ""
        if what == "cut":
            how = " (restored)" if event.get("restored") else \
                f" (restore not confirmed: {event.get('error')})"
        if what == "kill":
            return f"injected kill on {who}: its host is up again at {when}"
        return f"injected {what} on {who} ended at {when}{how}"
    if phase == "failed":
        return f"injected {what} on {who} failed: {event.get('error')}"
    return f"injected {what} on {who} not fired: {event.get('reason')}"


class FaultLog:
    """The injected faults of a run, from their events (the dashboards keep one)."""

    def __init__(self) -> None:
        self._by_id: dict[int, dict[str, Any]] = {}

    def add(self, event: dict[str, Any]) -> None:
        """Take one ``fault`` event with ``injected`` set."""
        entry = self._by_id.setdefault(int(event.get("id", len(self._by_id))), {
            "id": event.get("id"), "what": event.get("what"), "target": event.get("target"),
            "host": event.get("host"), "ranks": event.get("ranks"), "spec": event.get("spec"),
            "random": event.get("random", False), "duration_s": event.get("duration_s"),
            "factor": event.get("factor"), "injected": True})
        phase = event.get("phase")
        if phase == "start":
            entry.update(state="active" if event.get("duration_s") is not None else "done",
                         fired_step=event.get("step"), fired_at_s=event.get("at_s"),
                         delayed_s=event.get("delayed_s", 0.0))
        elif phase == "end":
            entry.update(state="done", ended_step=event.get("step"),
                         ended_at_s=event.get("at_s"))
            if "restored" in event:
                entry["restored"] = event["restored"]
        elif phase == "failed":
            entry.update(state="failed", error=event.get("error"))
        else:
            entry.update(state="not fired", reason=event.get("reason"))

    def entries(self) -> list[dict[str, Any]]:
        """Every fault seen, by id."""
        return [dict(self._by_id[k]) for k in sorted(self._by_id)]

    def active(self) -> list[dict[str, Any]]:
        """The faults under way now."""
        return [e for e in self.entries() if e.get("state") == "active"]

    def __bool__(self) -> bool:
        return bool(self._by_id)
