"""What ``recommend`` measures, and how: step times here and on the hosts, and the links.

- **step time on every host**: short runs through the launcher, one rank per
  host, all hosts at once as in a real run, with mirrored collectives
  (``EXOGYM_COLLECTIVES=mirror``: each rank does all of its strategy's own work
  and sends nothing); the time per step is read from the ranks' step events
  (``wall_s``). One run of the profile as it is, then one per compute kind
  (AdamW for DDP, DiLoCo and FedAvg; SPARTA's selection; DeMo's transform) and
  one of the reference (one host doing the minibatches of every host, one after
  the other), each where ``--set`` alone reaches it.
- **what ``--set`` cannot reach, here**: :func:`distributed.planning.estimate.measure_model`
  times every kind on this machine (twice, keeping the faster); its ratio to the
  profile's own step scales the hosts' measured time.
- **the links**: :func:`distributed.hosts.linkspeed.measure_between`, TCP
  transfers from the master to every worker (the slowest sets the pace of a ring),
  repeated until two in a row agree within :data:`LINK_AGREE` (at most
  :data:`LINK_TRIES`), the median kept; each also times one-byte round trips,
  and the shortest sets the latency.

The measurement is taken until it is steady, and its spread is kept: a step
timing whose steps vary by more than :data:`NOISY` is timed once more with twice
the steps, and the spread from step to step is a robust one (the median absolute
deviation, so that one step slowed by a peer's start-up does not set it). The
ranges measured (:class:`Measurements`) let ``recommend`` make its pick again at
each end of them.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import shlex
import statistics
import tempfile
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console

from exogym.base.plural import plural

from ..hosts.hostsfile import HostsConfig
from ..hosts.linkspeed import PROBE_PINGS, LinkError, LinkMeasurement, measure_between
from ..planning import projection
from ..planning.estimate import measure_model
from ..profiles.profile import Profile, ProfileError
from .compare import profile_for_strategy
from .console import StageReport
from .hosts_check import ssh_files
from .run import TrainRequest, hosts_config, make_launcher, resolve_profile

#: DiLoCo's inner steps per round among the candidates (those below the run's max_steps).
CANDIDATE_H = (10, 50, 100, 500)

__all__ = ["COMPUTE_KIND", "CONTAINS", "CandidateSpec", "HostTiming", "LINK_AGREE",
           "LINK_TRIES", "LOCAL_ROUNDS", "Measurements", "NOISY", "RecommendError",
           "TOO_NOISY", "candidate_specs", "measure", "robust_sd", "spec_for",
           "with_contained_steps"]

#: A spread (from step to step, or between transfers) above this share of the typical
#: value makes a measurement noisy: it is taken again, and said.
NOISY = 0.2
#: A spread above this share of the typical value says nothing about how the candidates
#: compare: each kind's step is timed at its own moment, and noise this wide can reorder
#: them however the pick is made again at the ends of the ranges measured.
TOO_NOISY = 1.0
#: Transfers per link at most; two in a row within :data:`LINK_AGREE` of each other end it.
LINK_TRIES = 4
LINK_AGREE = 0.1
#: Overrides under which the timing run sends nothing and leaves the profile's results alone:
#: each timing run writes into a scratch folder of its own under this name, removed after it.
PROBE_OUTPUT = "runs/recommend-probe"


def _remove_probe_folder(launcher: Any, config: HostsConfig, folder: str) -> None:
    """Remove a timing run's scratch ``folder`` (and its ``.latest`` pointer) from the
    master's project folder; one that cannot be removed is left (it holds no result)."""
    from ..hosts.remote import shell_path

    master = config.hosts[0]
    command = (f"cd {shell_path(master.project_path)} && rm -rf -- {shlex.quote(folder)} "
               f"{shlex.quote(folder + '.latest')}")
    shell = launcher.session.shell(0)
    if shell is not None:
        try:
            shell.run("sh -c " + shlex.quote(command), timeout=30.0)
        except OSError:
            pass  # the master is gone: a scratch folder left behind, no result lost


class RecommendError(RuntimeError):
    """A measurement failed or nothing can be picked; the message says which and what to do."""


@dataclass(frozen=True)
class HostTiming:
    """One host's measured training step (the profile's own strategy, nothing sent).

    Args:
        host: the host's name in the hosts file.
        step_s: median seconds per step over the timed steps.
        step_sd_s: their spread from step to step: the median absolute deviation scaled
            to a normal distribution's standard deviation (1.4826 MAD), so that a step
            slowed by something else on the host does not set it.
        steps_s: every timed step, in seconds.
    """

    host: str
    step_s: float
    step_sd_s: float
    steps_s: tuple[float, ...] = ()

    @property
    def spread(self) -> float:
        """``step_sd_s`` as a share of ``step_s``."""
        return self.step_sd_s / self.step_s if self.step_s > 0 else 0.0


def robust_sd(values: Sequence[float]) -> float:
    """1.4826 times the median absolute deviation: a standard deviation one outlier
    does not move (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    middle = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - middle) for v in values)


@dataclass(frozen=True)
class Measurements:
    """What the predictions start from.

    Args:
        hosts: the hosts (ranks) planned.
        num_params: the model's trainable parameters.
        shapes: the trainable tensors' shapes (DeMo's payload depends on them).
        compute_s: seconds of one step on the hosts per compute kind (``ddp`` for
            AdamW steps: DDP, DiLoCo, FedAvg; ``sparta``; ``demo``).
        compute_sd_s: their standard deviation from step to step.
        minibatch_s: seconds per minibatch of one host doing every host's work.
        throughput_bytes_per_s: payload bytes per second on the slowest link.
        link: ``measured`` or ``modelled``.
        host_steps: every host's measured step (empty when modelled here).
        links: every link measured (empty when modelled).
        local_s: the steps timed on this machine, per compute kind and ``own``/``reference``.
        latency_s: the slowest link's one-way latency (0 when modelled or not measured).
        throughput_range: the slowest and fastest pace-setting transfer, bytes per second
            (equal ends when the link was modelled or measured once).
        compute_range: the compute times' lowest and highest factor over the figures used,
            from run to run (``(1, 1)``: timed once).
        sd_range: the lowest and highest spread from step to step among the timing runs.
        timing_runs: how many times the hosts' steps were timed.
        compute_range_from: where ``compute_range`` comes from: ``hosts`` (the timing
            runs on the hosts) or ``here`` (the passes timed on this machine, when its
            step stands in for the hosts').
    """

    hosts: int
    num_params: int
    shapes: tuple[tuple[int, ...], ...]
    compute_s: dict[str, float]
    compute_sd_s: float
    minibatch_s: float
    throughput_bytes_per_s: float
    link: str
    host_steps: tuple[HostTiming, ...] = ()
    links: tuple[LinkMeasurement, ...] = ()
    local_s: dict[str, float] = field(default_factory=dict)
    latency_s: float = 0.0
    throughput_range: tuple[float, float] | None = None
    compute_range: tuple[float, float] = (1.0, 1.0)
    sd_range: tuple[float, float] | None = None
    timing_runs: int = 1
    compute_range_from: str = "hosts"

    @property
    def mbit(self) -> float:
        """The slowest link in Mbit/s."""
        return self.throughput_bytes_per_s * 8 / 1e6

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (links with their Mbit/s)."""
        out = asdict(self)
        out["shapes"] = [list(s) for s in self.shapes]
        out["links"] = [{"link": m.host, "bytes": m.bytes, "seconds": m.seconds,
                         "mbit_per_s": m.mbit_per_s, "latency_s": m.latency_s}
                        for m in self.links]
        out["mbit_per_s"] = self.mbit
        return out


@dataclass(frozen=True)
class CandidateSpec:
    """A strategy with its settings, as a row of the recommendation names it.

    Args:
        label: how tables name it (``DiLoCo H=100``).
        name: the strategy's name (``diloco``).
        settings: the profile keys that select it (``{"H": 100}``).
        compute: the compute kind its step takes (``ddp``, ``sparta``, ``demo``).
    """

    label: str
    name: str
    settings: dict[str, Any]
    compute: str


#: The compute kind of each candidate strategy's step: AdamW steps for DDP, DiLoCo and
#: FedAvg; SPARTA's selection; DeMo's transform.
COMPUTE_KIND = {"ddp": "ddp", "diloco": "ddp", "fedavg": "ddp", "sparta": "sparta",
                "demo": "demo"}


#: The compute kinds whose step contains another's: SPARTA's step is an AdamW step and its
#: selection. (And one host doing every host's minibatches, the speedup's reference,
#: contains an AdamW step's forward, backward and optimizer: ``minibatch_s`` is at least
#: a ``ddp`` step over the hosts.)
CONTAINS = {"sparta": "ddp"}


def with_contained_steps(m: Measurements) -> Measurements:
    """``m`` with every step at least as long as a step it contains (:data:`CONTAINS`).

    Each kind is timed at its own moment, so on a busy machine a step can measure shorter
    than one it contains, or the reference shorter than one AdamW step; the predictions
    would then contradict themselves (SPARTA's step shorter than the AdamW step in it, or
    DDP slower than one host with nothing to send). Such a figure is the noise of the
    machine: it is raised to the step it contains.
    """
    compute = dict(m.compute_s)
    for kind, inner in CONTAINS.items():
        if kind in compute and inner in compute:
            compute[kind] = max(compute[kind], compute[inner])
    minibatch_s = m.minibatch_s
    if "ddp" in compute:
        minibatch_s = max(minibatch_s, compute["ddp"] / max(1, m.hosts))
    if compute == m.compute_s and minibatch_s == m.minibatch_s:
        return m
    return dataclasses.replace(m, compute_s=compute, minibatch_s=minibatch_s)


def spec_for(name: str, settings: Mapping[str, Any]) -> CandidateSpec:
    """The candidate of strategy ``name`` with ``settings``, labelled as tables show it
    (``DiLoCo H=100``, ``SPARTA p=0.005``, ``DeMo top-32``)."""
    name = projection.canonical(name)
    settings = dict(settings)
    if name in ("diloco", "fedavg"):
        H = settings.get("H", projection.DEFAULTS[name]["H"])
        label = f"{'DiLoCo' if name == 'diloco' else 'FedAvg'} H={H}"
    elif name == "sparta":
        label = f"SPARTA p={settings.get('p_sparta', projection.DEFAULTS['sparta']['p_sparta']):g}"
    elif name == "demo":
        topk = settings.get("compression_topk", projection.DEFAULTS["demo"]["compression_topk"])
        label = f"DeMo top-{topk}"
    elif name == "ddp":
        label = "DDP"
    else:
        label = name + "".join(f" {k}={v}" for k, v in settings.items())
    return CandidateSpec(label, name, settings, COMPUTE_KIND.get(name, "ddp"))


def candidate_specs(profile: Profile) -> list[CandidateSpec]:
    """DDP, DiLoCo at every :data:`CANDIDATE_H` below ``max_steps``, SPARTA, DeMo and FedAvg.

    Each with the profile's own settings where it has them (SPARTA's ``p_sparta``,
    DeMo's compression, FedAvg's ``H``), else the strategy's defaults, written out: the
    command a row prints sets what the row predicts.
    """
    values = profile.values
    own = projection.canonical(profile.strategy) if profile.strategy else None
    max_steps = int(values.get("max_steps") or 0)
    specs = [spec_for("ddp", {})]
    for H in CANDIDATE_H:
        if not max_steps or H < max_steps:
            specs.append(spec_for("diloco", {"H": H}))
    p = values.get("p_sparta", values.get("p")) if own == "sparta" else None
    p = p if p is not None else projection.DEFAULTS["sparta"]["p_sparta"]
    specs.append(spec_for("sparta", {"p_sparta": p}))
    # Always explicit: the command a row prints then sets what the row predicts, also in
    # a profile of DeMo's own whose compression differs from the default.
    demo = {k: values[k] if own == "demo" and values.get(k) is not None
            else projection.DEFAULTS["demo"][k] for k in ("compression_topk", "compression_chunk")}
    specs.append(spec_for("demo", demo))
    fed_h = values.get("H") if own == "fedavg" else None
    fed_h = int(fed_h if fed_h is not None else projection.DEFAULTS["fedavg"]["H"])
    specs.append(spec_for("fedavg", {"H": fed_h}))
    return specs



#: How progress names each compute kind timed here.
KIND_WORDS = {"ddp": "an AdamW step (DDP, DiLoCo, FedAvg)", "sparta": "SPARTA's step",
              "demo": "DeMo's step", "reference": "one machine doing every node's work"}


def _local_plan(profile: Profile, specs: Sequence[CandidateSpec]
                ) -> tuple[list[tuple[str, Profile]], set[str]]:
    """What to time here besides the reference: ``(kind, profile)`` for the profile's own
    step and each compute kind; and the kinds the own step's time stands in for."""
    plans: dict[str, tuple[str, dict[str, Any]]] = {}
    for spec in specs:
        plans.setdefault(spec.compute, (spec.name, spec.settings))
    own = projection.canonical(profile.strategy)
    timed: list[tuple[str, Profile]] = [("own", profile)]
    for kind, (name, settings) in plans.items():
        if name == own and own in ("ddp", "sparta", "demo") \
                and all(profile.values.get(k) == v for k, v in settings.items()):
            continue  # the profile's own step: measured as "own"
        try:
            timed.append((kind, profile_for_strategy(profile, name, settings)))
        except ProfileError:
            continue  # the task cannot run it: the DDP time stands in
    kinds = {kind for kind, _ in timed}
    as_own = {kind for kind, (name, _) in plans.items() if kind not in kinds and name == own}
    return timed, as_own


def _reference(profile: Profile, hosts: int, batch: int) -> Profile | None:
    """The reference: one machine doing the minibatches of every host each step (DDP with
    gradient accumulation); None when the task cannot run it."""
    try:
        return profile_for_strategy(profile, "ddp", {"batch_size": hosts * batch,
                                                     "minibatch_size": batch})
    except ProfileError:
        return None


def _local_steps(profile: Profile, timed: Sequence[tuple[str, Profile]], as_own: set[str],
                 hosts: int, ranks_here: int, stage: Callable[[str], None], task: Any,
                 steps: int = 20, rounds: int = 2) -> tuple[dict[str, float], float]:
    """Seconds of one step on this machine: the profile's own, each compute kind, the
    reference; and the slowest pass's time of the profile's own step over the fastest's."""
    # Every step is timed in each of ``rounds`` passes and the fastest pass kept: other
    # processes only ever slow a step down, and the ratios between kinds are what count.
    local: dict[str, float] = {}
    own: list[float] = []
    for _ in range(rounds):
        for kind, planned in timed:
            stage(f"timing {KIND_WORDS.get(kind, f'{profile.name} as it is')} here")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # built only to be timed
                seconds = measure_model(planned, ranks_here=ranks_here, num_nodes=hosts,
                                        task=task, steps=steps).compute_s_per_step
            local[kind] = min(seconds, local.get(kind, seconds))
            if kind == "own":
                own.append(seconds)
    for kind in as_own:
        local[kind] = local["own"]
    return local, max(own) / min(own) if own and min(own) > 0 else 1.0


class _StepRecorder:
    """Collects the ranks' step events of the timing run (what a dashboard would show)."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[int, float]] = {}

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("event") == "step" and "wall_s" in event:
            self.steps.setdefault(int(event["rank"]), {})[int(event["step"])] = \
                float(event["wall_s"])

    def on_output(self, line: Any) -> None:
        """Rank output is not shown while timing."""


def _host_steps(request: TrainRequest, config: HostsConfig, console: Console,
                warmup: int, steps: int,
                extra: Mapping[str, Any] | None = None) -> tuple[HostTiming, ...]:
    """Time ``steps`` steps after ``warmup`` on every host at once, nothing sent.

    ``extra`` adds ``--set`` values (another strategy, the reference's batch).
    """
    total = warmup + steps
    # A folder of its own: two timing runs at once (two recommends on one master, or one
    # beside --strategy auto) never replace each other's run in one folder.
    scratch = f"{PROBE_OUTPUT}-{secrets.token_hex(4)}"
    overrides = {**request.overrides, **(extra or {}), "max_steps": total, "val_interval": total + 1,
                 "val_size": 0, "checkpoint_interval": None, "logger": None,
                 "output_dir": scratch}
    with tempfile.TemporaryDirectory(prefix="exogym-recommend-") as run_dir:
        timing = TrainRequest(
            profile=request.profile, config=request.config, overrides=overrides,
            hosts=config, accept_new_host_keys=request.accept_new_host_keys,
            known_hosts=request.known_hosts, ssh_config=request.ssh_config, run_dir=run_dir,
            overwrite=True,  # the scratch folder is this timing run's alone
            launcher_options={**request.launcher_options, "env": {
                **dict(request.launcher_options.get("env") or {}),
                "EXOGYM_COLLECTIVES": "mirror"}})
        recorder = _StepRecorder()
        with make_launcher(timing, config, console=console,
                           dashboard=recorder) as launcher:  # type: ignore[arg-type]
            try:
                launcher.session.preflight()
                result = launcher.run()
            finally:
                _remove_probe_folder(launcher, config, scratch)
    if not result.ok:
        raise RecommendError(f"timing the profile on the hosts failed: {result.describe()}")
    timings = []
    for rank, host in enumerate(config.rank_hosts):
        walls = recorder.steps.get(rank, {})
        if warmup not in walls or total not in walls:
            raise RecommendError(f"rank {rank} on {host.host} reported no step {warmup} or "
                                 f"{total} while timing; its log is in the launcher's output")
        each = [walls[k] - walls[k - 1] for k in range(warmup + 1, total + 1)
                if k in walls and k - 1 in walls]
        # The median step and a robust spread: a burst of other work on the host (a peer's
        # start-up, the launcher) during a few of the timed steps must not set either.
        typical = statistics.median(each) if each else (walls[total] - walls[warmup]) / steps
        timings.append(HostTiming(host.host, typical, robust_sd(each), tuple(each)))
    return tuple(timings)


def _steady_host_steps(request: TrainRequest, config: HostsConfig, console: Console,
                       warmup: int, steps: int, stage: _Stages
                       ) -> tuple[tuple[HostTiming, ...], list[tuple[HostTiming, ...]]]:
    """The hosts' steps, timed again with twice the steps when they varied by more than
    :data:`NOISY`: every step of both runs kept; and each timing run's own figures."""
    timings = _host_steps(request, config, console, warmup, steps)
    runs_found = [timings]
    if max(t.spread for t in timings) > NOISY:
        stage.more(1)
        stage(f"timing again: steps varied by {max(t.spread for t in timings):.0%}")
        runs_found.append(_host_steps(request, config, console, warmup, 2 * steps))
        timings = _joined(*runs_found)
    return timings, runs_found


def _joined(first: Sequence[HostTiming], second: Sequence[HostTiming]) -> tuple[HostTiming, ...]:
    """Two timing runs of the same hosts as one: every step of both."""
    joined = []
    for a, b in zip(first, second):
        each = [*a.steps_s, *b.steps_s] or [a.step_s, b.step_s]
        joined.append(HostTiming(a.host, statistics.median(each), robust_sd(each), tuple(each)))
    return tuple(joined)


def _steady_link(measure_once: Callable[[int], LinkMeasurement]) -> list[LinkMeasurement]:
    """Transfers over one link until two in a row agree within :data:`LINK_AGREE` (at
    most :data:`LINK_TRIES`); ``measure_once(i)`` makes the ``i``-th."""
    found = [measure_once(0)]
    while len(found) < LINK_TRIES:
        found.append(measure_once(len(found)))
        last, before = found[-1].bytes_per_s, found[-2].bytes_per_s
        if abs(last - before) <= LINK_AGREE * max(last, before):
            break
    return found


def _median_link(found: Sequence[LinkMeasurement]) -> LinkMeasurement:
    """The transfer of median rate, with the shortest latency of any."""
    ordered = sorted(found, key=lambda m: m.bytes_per_s)
    middle = ordered[(len(ordered) - 1) // 2]
    latencies = [m.latency_s for m in found if m.latency_s is not None]
    return dataclasses.replace(middle, latency_s=min(latencies) if latencies else None)


def _links(request: TrainRequest, config: HostsConfig, console: Console,
           seconds: float) -> tuple[list[LinkMeasurement], ...]:
    """Transfers from the master to every worker, through the hosts' own shells, until
    steady (:func:`_steady_link`); each also times round trips for the latency."""
    from ..hosts.session import HostSession
    from ..launch.options import split_options

    launch, options = split_options({**ssh_files(request.known_hosts, request.ssh_config),
                                "accept_new_host_keys": request.accept_new_host_keys,
                                **request.launcher_options}, owner="TrainRequest")
    found = []
    with HostSession(config, ssh=options, console=console,
                     master_local=launch.master_local) as session:
        errors = session.connect()
        if errors:
            raise RecommendError("cannot reach every host to measure the links: "
                                 + "; ".join(f"{config.hosts[r].host}: {e}"
                                             for r, e in errors.items()))
        master = config.master
        for worker in config.workers:
            address = session.targets[worker.rank].hostname

            def once(_: int, worker: Any = worker, address: str = address) -> LinkMeasurement:
                return measure_between(session.shell(0), master, session.shell(worker.rank),
                                       worker, address, seconds=seconds, pings=PROBE_PINGS)

            try:
                found.append(_steady_link(once))
            except LinkError as exc:
                raise RecommendError(f"measuring the link {master.host} -> {worker.host} "
                                     f"failed: {exc}") from exc
    return tuple(found)


def _remote_kinds(profile: Profile, specs: Sequence[CandidateSpec], hosts: int,
                  local: Collection[str]) -> dict[str, dict[str, Any]]:
    """The ``--set`` values that time each compute kind and the reference on the hosts.

    Only kinds measured here, other than the profile's own step, and only where
    ``--set`` alone turns the profile into them.
    """
    own = projection.canonical(profile.strategy)
    batch = int(profile.resolved.run_kwargs.get("batch_size") or 1)
    wanted: dict[str, dict[str, Any]] = {}
    for spec in specs:
        if spec.compute in local and spec.compute != own and spec.compute not in wanted:
            wanted[spec.compute] = {"strategy": spec.name, **spec.settings}
    wanted["reference"] = {"strategy": "ddp", "batch_size": hosts * batch,
                           "minibatch_size": batch}
    usable = {}
    for kind, extra in wanted.items():
        try:
            if not profile.with_overrides(extra).problems():
                usable[kind] = extra
        except ProfileError:
            continue
    return usable


#: Passes over the steps timed here; the fastest of them is kept.
LOCAL_ROUNDS = 2


def measure(request: TrainRequest, console: Console, *, link_mbit: float | None = None,
            warmup: int = 3, steps: int = 10, link_seconds: float = 2.0,
            specs: Sequence[CandidateSpec] | None = None,
            time_hosts: bool = True, progress: StageReport | None = None,
            trace: Any = None) -> Measurements:
    """Measure what the predictions need: step times here and on the hosts, and the links.

    With ``trace`` (a recorded run, :func:`distributed.app.replay.load_recording`) the hosts'
    steps and links are read from its trace instead of measured again: each rank's recorded
    compute per step, each host's pre-flight link (or a simulation's network).

    Args:
        request: the profile (and ``--set``) and, for real hosts, the hosts file and SSH files.
        console: where the hosts' own messages go.
        link_mbit: a modelled link instead of measuring one (required without hosts).
        warmup, steps: steps run before timing, and steps timed, on every host.
        link_seconds: how long each link transfer lasts.
        specs: the candidates (default :func:`candidate_specs`).
        time_hosts: time the step on the hosts; False lets this machine's step
            stand in for every host (what the wizard's estimates do).
        progress: told as each stage starts (default: nothing is told).
        trace: a recorded run whose hosts and links stand in for measuring them.

    Raises:
        ProfileError, HostsFileError: bad input, before any work.
        ValueError: no hosts and no ``link_mbit``.
        RecommendError: a measurement failed.
    """
    if trace is not None:
        return _measure_recorded(request, trace, link_mbit=link_mbit, specs=specs,
                                 progress=progress)
    config = hosts_config(request) if request.multi_host else None  # bad files fail first
    profile = resolve_profile(request)
    if link_mbit is not None:
        link_mbit = float(link_mbit)
        if not link_mbit > 0:
            raise ValueError(f"--link-mbit must be a number of Mbit/s > 0, got {link_mbit}")
    on_hosts = config is not None
    if not on_hosts and link_mbit is None:
        raise ValueError("without --hosts nothing crosses a network, so there is no link "
                         "to measure: give --hosts FILE to measure real hosts, or "
                         "--link-mbit N to pick for a modelled link of N Mbit/s")
    specs = list(specs or candidate_specs(profile))
    hosts = config.world_size if on_hosts else profile.num_nodes
    if hosts < 2:
        raise RecommendError(f"{plural(hosts, 'rank')} planned: strategies differ only with 2 "
                             "or more")

    timed, as_own = _local_plan(profile, specs)
    remote_kinds = _remote_kinds(profile, specs, hosts, {kind for kind, _ in timed} | as_own) \
        if on_hosts and time_hosts else {}
    total = (1 + LOCAL_ROUNDS * (len(timed) + 1)  # + 1: the reference
             + ((1 + len(remote_kinds)) if on_hosts and time_hosts else 0)
             + (1 if on_hosts and link_mbit is None else 0))
    stage = _stages(progress, total)

    stage(f"building {profile.name}'s model and warming up")
    resolved = profile.resolved
    task = resolved.task_fn(**resolved.task_kwargs)
    # A first run warms this process up (threads, allocator, caches); its time is not kept.
    ranks_here = 1 if on_hosts else hosts
    facts = measure_model(profile, ranks_here=ranks_here, num_nodes=hosts, task=task, steps=3)
    reference_run = _reference(profile, hosts, facts.batch_size)
    if reference_run is not None:
        timed.append(("reference", reference_run))
    local, local_range = _local_steps(profile, timed, as_own, hosts, ranks_here, stage, task,
                                      rounds=LOCAL_ROUNDS)
    timings: tuple[HostTiming, ...] = ()
    links: tuple[LinkMeasurement, ...] = ()
    tries: tuple[list[LinkMeasurement], ...] = ()
    scale, sd = 1.0, 0.0
    compute_range, sd_range, runs = (1.0, local_range), None, 1
    range_from = "here"
    remote: dict[str, float] = {}
    if on_hosts and time_hosts:
        assert config is not None
        stage(f"timing {plural(steps, 'step')} of {profile.name} on {plural(hosts, 'host')} "
              "at once, nothing sent")
        timings, runs_found = _steady_host_steps(request, config, console, warmup, steps, stage)
        runs = len(runs_found)
        host_mean = statistics.fmean(t.step_s for t in timings)
        scale = host_mean / local["own"]
        sd = statistics.fmean(t.step_sd_s for t in timings)
        means = [statistics.fmean(t.step_s for t in found) for found in runs_found]
        sds = [statistics.fmean(t.step_sd_s for t in found) for found in runs_found]
        compute_range = (min(means) / host_mean, max(means) / host_mean)
        range_from = "hosts"
        sd_range = (min(sds), max(sds))
        # Each kind's own step, and the reference, on the hosts too where --set reaches them
        # (the same conditions as the run; this machine's ratios stand in for the rest).
        for kind, extra in remote_kinds.items():
            stage(f"timing {plural(steps, 'step')} of {KIND_WORDS.get(kind, kind)} on the hosts")
            found = _host_steps(request, config, console, warmup, steps, extra)
            remote[kind] = statistics.fmean(t.step_s for t in found)
    if on_hosts and link_mbit is None:
        assert config is not None
        stage("measuring the link from the master to every worker")
        tries = _links(request, config, console, link_seconds)
        links = tuple(_median_link(found) for found in tries)
    stage.finish()
    throughput = projection.mbit_to_bytes_per_s(link_mbit) if link_mbit is not None \
        else min(m.bytes_per_s for m in links)
    if not throughput > 0:
        raise RecommendError("the link measurement received nothing; check that the hosts "
                             "can reach each other, or give --link-mbit")
    compute = {kind: remote.get(kind, s * scale) for kind, s in local.items()
               if kind not in ("own", "reference")}
    compute.setdefault("ddp", local["own"] * scale)
    reference = remote.get("reference", local.get("reference", math.inf) * scale)
    # One host doing every host's minibatches each step (gradient accumulation) never
    # spends more per minibatch than a step of one: a larger figure is noise.
    minibatch_s = min(reference / hosts, compute["ddp"])
    latencies = [m.latency_s for m in links if m.latency_s is not None]
    throughput_range = None
    if tries:  # the pace-setting link at its slowest and at its fastest transfer
        throughput_range = (min(min(m.bytes_per_s for m in found) for found in tries),
                            min(max(m.bytes_per_s for m in found) for found in tries))
    return Measurements(
        hosts=hosts, num_params=facts.num_params, shapes=facts.shapes, compute_s=compute,
        compute_sd_s=sd, minibatch_s=minibatch_s,
        throughput_bytes_per_s=throughput, link="modelled" if link_mbit is not None
        else "measured", host_steps=timings, links=links, local_s=local,
        latency_s=max(latencies) if latencies else 0.0, throughput_range=throughput_range,
        compute_range=compute_range, sd_range=sd_range, timing_runs=runs,
        compute_range_from=range_from)


def _measure_recorded(request: TrainRequest, recording: Any, *, link_mbit: float | None,
                      specs: Sequence[CandidateSpec] | None,
                      progress: StageReport | None) -> Measurements:
    """:func:`measure` with the hosts' steps and links read from a recorded run."""
    from .replay import ReplayError

    profile = resolve_profile(request)
    if profile.name != recording.profile.name:
        raise ReplayError(f"--trace {recording.folder} is a run of profile "
                          f"{recording.profile.name}, not {profile.name}: give its profile")
    hosts = recording.num_nodes
    if hosts < 2:
        raise RecommendError(f"the recorded run had {plural(hosts, 'rank')}: strategies differ "
                             "only with 2 or more")
    specs = list(specs or candidate_specs(profile))
    timed, as_own = _local_plan(profile, specs)
    total = 1 + LOCAL_ROUNDS * (len(timed) + 1)
    stage = _stages(progress, total)

    stage(f"building {profile.name}'s model and warming up")
    resolved = profile.resolved
    task = resolved.task_fn(**resolved.task_kwargs)
    facts = measure_model(profile, ranks_here=1, num_nodes=hosts, task=task, steps=3)
    reference_run = _reference(profile, hosts, facts.batch_size)
    if reference_run is not None:
        timed.append(("reference", reference_run))
    local, _ = _local_steps(profile, timed, as_own, hosts, 1, stage, task,
                            rounds=LOCAL_ROUNDS)
    names = {h["rank"]: h["host"] for h in recording.header.get("hosts") or []}
    per_rank: dict[int, list[float]] = {}
    for line in recording.lines:
        if line.get("kind") == "step" and line.get("compute_s") is not None:
            per_rank.setdefault(line["rank"], []).append(float(line["compute_s"]))
    mean = recording.compute_per_step()
    timings = tuple(HostTiming(names.get(r, f"rank {r}"), mean[r],
                               robust_sd(per_rank.get(r, [])),
                               tuple(per_rank.get(r, []))) for r in range(hosts))
    links: tuple[LinkMeasurement, ...] = ()
    if link_mbit is None:
        network, _ = recording.network()
        if network is None:
            raise RecommendError(f"{recording.folder} is a simulation without a network: "
                                 "nothing to take the link from; give --link-mbit")
        rates = network.get("rank_bandwidth") or [network["bandwidth"]] * hosts
        links = tuple(LinkMeasurement(f"{names.get(r, f'rank {r}')} (recorded)",
                                      round(float(rate) / 8), 1.0, network.get("latency_s"))
                      for r, rate in enumerate(rates))
    stage.finish()
    scale = statistics.fmean(t.step_s for t in timings) / local["own"]
    throughput = projection.mbit_to_bytes_per_s(float(link_mbit)) if link_mbit is not None \
        else min(m.bytes_per_s for m in links)
    compute = {kind: s * scale for kind, s in local.items() if kind not in ("own", "reference")}
    compute.setdefault("ddp", local["own"] * scale)
    reference = local.get("reference", math.inf) * scale
    return Measurements(
        hosts=hosts, num_params=facts.num_params, shapes=facts.shapes, compute_s=compute,
        compute_sd_s=statistics.fmean(t.step_sd_s for t in timings),
        minibatch_s=min(reference / hosts, compute["ddp"]),
        throughput_bytes_per_s=throughput,
        link="modelled" if link_mbit is not None else "recorded", host_steps=timings,
        links=links, local_s=local,
        latency_s=max((m.latency_s or 0.0 for m in links), default=0.0))


class _Stages:
    """Reports each stage of a measurement to ``progress`` (when given), counting; the
    total grows when a stage is added on the way (a noisy timing taken again)."""

    def __init__(self, progress: Callable[[str, int, int], None] | None, total: int) -> None:
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text, self.done, self.total)
        self.done += 1

    def more(self, stages: int) -> None:
        """``stages`` more than planned."""
        self.total += stages

    def finish(self) -> None:
        if self.progress is not None:
            self.progress("done", self.total, self.total)


def _stages(progress: Callable[[str, int, int], None] | None, total: int) -> _Stages:
    """A function that reports each stage of ``total`` to ``progress`` (when given), counting."""
    return _Stages(progress, total)
