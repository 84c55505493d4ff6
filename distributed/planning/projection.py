"""Projection: time per step and speedup of a strategy on N hosts, from two measurements.

Inputs are what one can measure on a small setup: the compute time of one
training step on one host (forward, backward, optimizer, the strategy's own
local work) and the link throughput between hosts. The model then says what
happens with 2, 8 or 64 hosts, for every strategy, with nothing but arithmetic
(no torch, no processes), so the CLI and the wizard can use it freely.

Cost model. The links and collectives are :mod:`exogym.sim.network`'s model, the
one the simulator's clock uses too. Ranks compute, then talk; exogym's
strategies do not overlap the two (Streaming DiLoCo aside), so a step takes::

    t_step(N) = t_compute + skew(N) + bytes_sent(N) / throughput + rounds(N) * latency

- ``skew`` is the wait for the slowest host: a collective starts when the last
  host arrives. With per-step compute times of standard deviation ``sigma``,
  independent across hosts and steps, and a communication every ``k`` steps
  (1 for DDP, SPARTA and DeMo, ``H`` for DiLoCo), the slowest of ``N`` hosts
  is behind the mean by about ``sigma * sqrt(k) * e_N`` per communication,
  ``e_N`` being the expected maximum of ``N`` standard normal draws
  (:func:`expected_max_of_normals`: 0.56 for 2 hosts, 2.34 for 64). Per step
  that is ``sigma * e_N / sqrt(k)``.

- ``bytes_sent`` is what one host puts on its link per step, on average:

  * an all-reduce of ``S`` bytes runs as a ring (reduce-scatter, then
    all-gather): each host sends ``2 (N-1)/N * S`` bytes in ``2 (N-1)``
    rounds (gloo's ring algorithm; NCCL's ring is the same);
  * an all-gather of ``s`` bytes per host runs as a ring too: each host sends
    ``(N-1) * s`` bytes in ``N-1`` rounds.

- per strategy, with ``P`` trainable parameters and ``v`` bytes per value
  (4 in float32, 2 in bfloat16):

  * DDP: an all-reduce of ``v P`` every step;
  * DiLoCo: an all-reduce of ``v (P + B)`` every ``H`` steps (``B`` float
    buffers), i.e. ``1/H`` of it per step on average;
  * FedAvg: an all-reduce of ``v (P + B)`` every ``H`` steps within an
    island of ``island_size`` hosts (default: all), so the ring has that many;
  * SPARTA: an all-reduce of ``v p P`` every step (the indices are derived
    from a shared seed, never sent);
  * SPARTA-DiLoCo: SPARTA's all-reduce every ``sparta_interval`` steps except
    where a DiLoCo round (every ``H`` steps) replaces it, plus DiLoCo's rounds;
  * DeMo: an all-gather of the top-k DCT coefficients and their indices
    every step (:func:`demo_payload_bytes`);
  * none: no communication (a single host, or independent training).

- ``throughput`` is the payload rate a host achieves while sending and
  receiving at once (what a ring does), in bytes per second: measured, it
  already includes TCP/IP headers and acknowledgements.

The speedup compares with one host doing the same total work at the same
settings: one host processing the ``N`` minibatches the ``N`` hosts process
in a step, one after the other (gradient accumulation), so a step there takes
``N * t_minibatch``::

    speedup(N) = N * t_minibatch / t_step(N)

What the model leaves out: congestion of a shared switch, DeMo's decoding
work growing with N, hosts of unequal speed, latency beyond a per-round
constant, and loss recovery: a burst larger than a router's queue loses its
tail, and TCP then waits a retransmission timeout (200 ms at least) -- DeMo's
190 kB per step over 20 Mbit/s with a 50 ms queue measured 22% slower than
predicted, with a 100 ms queue 5%. Compare its 2-host figures with a
measurement (``python -m bench.multihost``) before trusting its 64-host ones.

The same model serves the faces: :func:`predict` with a profile's settings
(:func:`relevant_settings`) is what the wizard shows before a run, and
``python -m bench.project_speedup`` holds it against the benchmark's measurements.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from exogym.comm.wire import BUCKET_BYTES, ModelFacts, is_quantized, value_bytes_of
from exogym.sim.network import (  # the one cost model of links and collectives
    Network,
    allgather_bytes,
    allgather_rounds,
    ring_allreduce_bytes,
    ring_allreduce_rounds,
    traffic_cost,
)
from exogym.strategy import registry
from exogym.strategy.facts import chunk_size, demo_payload_bytes

__all__ = [
    "BUCKET_BYTES",
    "DEFAULTS",
    "STRATEGIES",
    "Prediction",
    "Projection",
    "StepParts",
    "StepTraffic",
    "allgather_bytes",
    "allgather_rounds",
    "bytes_per_step",
    "chunk_size",
    "demo_payload_bytes",
    "canonical",
    "expected_max_of_normals",
    "mbit_to_bytes_per_s",
    "payload_bytes_per_step",
    "predict",
    "predict_all",
    "predict_step_time",
    "project",
    "relevant_settings",
    "ring_allreduce_bytes",
    "ring_allreduce_rounds",
    "single_host_step_time",
    "skew_per_step",
    "speedup",
    "step_parts",
    "step_traffic",
    "value_bytes_of",
]

#: Strategies the model knows by name, in the order the faces show them, each with what it sends.
STRATEGIES: dict[str, str] = {name: known.summary for name, known in registry.KNOWN.items()}

#: The settings each strategy's traffic depends on, with their declared defaults
#: (:mod:`exogym.strategy.settings`, through the registry); :func:`relevant_settings` reads
#: them from a profile.
DEFAULTS: dict[str, dict[str, object]] = {name: dict(known.traffic_defaults)
                                          for name, known in registry.KNOWN.items()}


def _check_hosts(hosts: int) -> int:
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
        raise ValueError(f"hosts must be an integer >= 1, got {hosts!r}")
    return hosts


def _check_nonnegative(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def _check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------- per strategy


@dataclass(frozen=True)
class StepTraffic:
    """What one host sends per training step, averaged over the strategy's period.

    Args:
        strategy: the strategy's name.
        hosts: the number of hosts.
        payload: bytes the host hands to collectives per step (what exogym's
            comm counters count; independent of ``hosts``).
        bytes_sent: bytes the host puts on its link per step under the ring model.
        rounds: sequential message rounds per step (each pays one latency).
        collective: ``all-reduce``, ``all-gather`` or ``none``.
        period: steps from one communication to the next (0: never).
    """

    strategy: str
    hosts: int
    payload: float
    bytes_sent: float
    rounds: float
    collective: str
    period: int = 1


def canonical(strategy: str) -> str:
    """The model's name for ``strategy`` (``'allreduce'`` -> ``'ddp'``, ``'sparta-diloco'`` too).

    Raises:
        ValueError: for a strategy the model does not know.
    """
    try:
        return registry.canonical(strategy)
    except ValueError:
        raise ValueError(f"unknown strategy {strategy!r}: the projection knows "
                         f"{', '.join(STRATEGIES)}") from None


def _strategy(name: str, settings: Mapping[str, object]) -> Any:
    """The strategy known as ``name``, built with the ``settings`` its traffic depends on."""
    declared = registry.KNOWN[name].settings
    cls = registry.class_of(name)
    for key in cls.traffic_needs:
        if settings.get(key) is None:
            setting = declared[key]
            raise ValueError(f"{name} needs {key} ({setting.help}): {setting.valid}")
    kwargs = {k: v for k, v in settings.items()
              if k in registry.KNOWN[name].traffic_defaults and v is not None}
    declared.check(name, **kwargs)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{name}: {exc}") from exc


def step_traffic(strategy: Any, num_params: int, hosts: int, *,
                 shapes: Iterable[Sequence[int]] | None = None, value_bytes: int = 4,
                 num_buffers: int = 0, bucket_bytes: int = BUCKET_BYTES,
                 demo_payload: float | None = None, **settings: object) -> StepTraffic:
    """Bytes and rounds per step for ``strategy`` on ``hosts`` hosts (see the module docstring).

    What the strategy sends is its own statement (``Strategy.traffic``); this turns
    it into bytes and rounds with the network model (``exogym.sim.network.traffic_cost``).

    Args:
        strategy: a strategy object (any ``exogym.strategy.Strategy`` that states its
            traffic, a researcher's own included), or a name :data:`STRATEGIES` knows
            (``exogym.strategy.registry``; ``none`` for no communication).
        num_params: trainable parameters ``P``.
        hosts: the number of hosts ``N``.
        shapes: the trainable tensors' shapes (DeMo and SparseLoCo size their payload per tensor).
        value_bytes: bytes per value of the model (4 for float32, 2 for bf16): what DDP sends.
        num_buffers: float buffers averaged with the parameters (BatchNorm statistics).
        bucket_bytes: largest buffer per all-reduce call.
        demo_payload: DeMo's bytes per host per step, measured, instead of ``shapes``.
        **settings: with a name, the strategy's settings its traffic depends on
            (:data:`DEFAULTS`: ``H``, ``p_sparta``, ``island_size``, ``sparta_interval``,
            ``num_fragments``, ``topk``, ``chunk``, ``quant_bits``, ``compression_topk``,
            ``compression_chunk``, ``comm_dtype``); missing ones take the class's
            defaults, except ``H``, which an H-strategy needs.

    Raises:
        ValueError: for an unknown strategy, a missing setting or an impossible value.
        TypeError: a setting no strategy's traffic depends on.
    """
    hosts = _check_hosts(hosts)
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be an integer >= 0, got {num_params!r}")
    if value_bytes not in (1, 2, 4, 8):
        raise ValueError(f"value_bytes must be 1, 2, 4 or 8, got {value_bytes!r}")
    _check_positive("bucket_bytes", bucket_bytes)
    known = {k for entry in DEFAULTS.values() for k in entry}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"step_traffic() got unknown settings {', '.join(unknown)}; "
                        f"accepted: {', '.join(sorted(known))}")
    if isinstance(strategy, str):
        name = canonical(strategy)
        if name == "none":
            return StepTraffic(name, hosts, 0.0, 0.0, 0.0, "none", 0)
        comm_dtype = settings.get("comm_dtype")
        if comm_dtype is not None and "comm_dtype" not in DEFAULTS[name]:
            # a strategy without a wire type of its own (DDP) sends the model's dtype
            if is_quantized(comm_dtype):
                raise ValueError(f"{name} sends its gradients in the model's dtype; "
                                 f"comm_dtype={comm_dtype!r} is quantized: give a float type")
            value_bytes = int(value_bytes_of(str(comm_dtype)))
        built = _strategy(name, settings)
    else:
        if settings:
            raise TypeError(f"settings ({', '.join(sorted(settings))}) go with a strategy name; "
                            "a strategy object carries its own")
        built = strategy
        name = registry.name_of(strategy) or type(strategy).__name__
    if demo_payload is not None:
        demo_payload = _check_nonnegative("demo_payload", demo_payload)
    model = ModelFacts(num_params, num_buffers,
                       tuple(tuple(s) for s in shapes) if shapes is not None else None,
                       value_bytes, demo_payload)
    cost = traffic_cost(built.traffic(model, hosts), hosts, int(bucket_bytes))
    return StepTraffic(name, hosts, cost.payload, cost.bytes_sent, cost.rounds, cost.collective,
                       cost.period)


def bytes_per_step(strategy: str, num_params: int, hosts: int, **settings: object) -> float:
    """Bytes one host sends per step, averaged over the strategy's period.

    Args:
        strategy, num_params, hosts, **settings: as for :func:`step_traffic`.
    """
    return step_traffic(strategy, num_params, hosts, **settings).bytes_sent  # type: ignore[arg-type]


def payload_bytes_per_step(strategy: str, num_params: int, hosts: int,
                           **settings: object) -> float:
    """Bytes one host hands to collectives per step: what exogym's ``comm_bytes`` counts."""
    return step_traffic(strategy, num_params, hosts, **settings).payload  # type: ignore[arg-type]


def relevant_settings(strategy: str, values: Mapping[str, object]) -> dict[str, object]:
    """:func:`step_traffic`'s settings for ``strategy``, from a profile's ``values``.

    Keys the strategy's traffic depends on are taken from ``values`` and the
    rest from the strategy classes' defaults (:data:`DEFAULTS`); ``p`` is read
    as ``p_sparta``, as exo gym's SPARTA spelled it.
    """
    wanted = DEFAULTS[canonical(strategy)]
    picked = {k: values[k] for k in wanted if values.get(k) is not None}
    if "p_sparta" in wanted and "p_sparta" not in picked and values.get("p") is not None:
        picked["p_sparta"] = values["p"]
    return {**wanted, **picked}


# --------------------------------------------------------------------------- waiting for the slowest


def expected_max_of_normals(n: int) -> float:
    """``E[max of n independent standard normal draws]``: 0 for 1, 0.564 for 2, 2.344 for 64.

    Computed by Simpson's rule on ``x * n * phi(x) * Phi(x)**(n-1)`` over [-12, 12].
    """
    n = _check_hosts(n)
    if n == 1:
        return 0.0
    steps, low, high = 4000, -12.0, 12.0
    h = (high - low) / steps
    total = 0.0
    for i in range(steps + 1):
        x = low + i * h
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        below = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        weight = 1 if i in (0, steps) else (4 if i % 2 else 2)
        total += weight * x * n * density * below ** (n - 1)
    return total * h / 3


def skew_per_step(compute_sd_s: float, hosts: int, period: int = 1) -> float:
    """Seconds per step spent waiting for the slowest of ``hosts`` hosts.

    Args:
        compute_sd_s: standard deviation of one host's compute time per step.
        hosts: the number of hosts.
        period: steps between communications (the hosts meet once per period).
    """
    _check_nonnegative("compute_sd_s", compute_sd_s)
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period must be an integer >= 1, got {period!r}")
    return compute_sd_s * expected_max_of_normals(hosts) / math.sqrt(period)


# --------------------------------------------------------------------------- time and speedup


@dataclass(frozen=True)
class StepParts:
    """One step's predicted time, part by part: what a step beyond compute is spent on.

    Args:
        compute_s: local work.
        wait_s: waiting for the slowest host (the spread of the hosts' compute times).
        latency_s: the message rounds' latency (``rounds * latency``).
        transfer_s: the bytes on the link (``bytes_sent / throughput``).
        bytes_sent: bytes one host puts on its link per step.
    """

    compute_s: float
    wait_s: float
    latency_s: float
    transfer_s: float
    bytes_sent: float

    @property
    def step_s(self) -> float:
        """The whole step."""
        return self.compute_s + self.wait_s + self.latency_s + self.transfer_s

    @property
    def comm_s(self) -> float:
        """Everything beyond compute: waiting, latency and transfer."""
        return self.wait_s + self.latency_s + self.transfer_s

    def main_cost(self) -> str:
        """Which of ``wait``, ``latency`` and ``transfer`` takes the most time (``none``
        when the step is all compute)."""
        parts = {"wait": self.wait_s, "latency": self.latency_s, "transfer": self.transfer_s}
        largest = max(parts, key=lambda k: parts[k])
        return largest if parts[largest] > 0 else "none"


def step_parts(strategy: Any, num_params: int, hosts: int, compute_s: float,
               throughput_bytes_per_s: float, latency_s: float = 0.0,
               compute_sd_s: float = 0.0, **settings: object) -> StepParts:
    """:func:`predict_step_time`, part by part (arguments as there)."""
    _check_nonnegative("compute_s", compute_s)
    _check_positive("throughput_bytes_per_s", throughput_bytes_per_s)
    _check_nonnegative("latency_s", latency_s)
    traffic = step_traffic(strategy, num_params, hosts, **settings)  # type: ignore[arg-type]
    skew = skew_per_step(compute_sd_s, hosts, traffic.period) if traffic.period else 0.0
    link = Network(bandwidth=throughput_bytes_per_s * 8.0, latency_s=latency_s)
    transfer = link.transfer_s(traffic.bytes_sent, 0)
    talk = link.transfer_s(traffic.bytes_sent, traffic.rounds)
    return StepParts(compute_s, skew, talk - transfer, transfer, traffic.bytes_sent)


def predict_step_time(strategy: Any, num_params: int, hosts: int, compute_s: float,
                      throughput_bytes_per_s: float, latency_s: float = 0.0,
                      compute_sd_s: float = 0.0, **settings: object) -> float:
    """Seconds per training step on ``hosts`` hosts: compute, wait for the slowest, talk.

    Args:
        strategy, num_params, hosts, **settings: as for :func:`step_traffic`.
        compute_s: seconds one host needs per step without communicating (mean).
        throughput_bytes_per_s: payload bytes per second a host achieves while
            sending and receiving at once.
        latency_s: one-way latency per message round.
        compute_sd_s: standard deviation of ``compute_s`` from step to step
            (0 leaves out the wait for the slowest host).
    """
    return step_parts(strategy, num_params, hosts, compute_s, throughput_bytes_per_s,
                      latency_s, compute_sd_s, **settings).step_s


def single_host_step_time(hosts: int, minibatch_s: float) -> float:
    """Seconds one host needs for the work ``hosts`` hosts do in one step: ``N * t_minibatch``."""
    return _check_hosts(hosts) * _check_nonnegative("minibatch_s", minibatch_s)


def speedup(strategy: Any, num_params: int, hosts: int, compute_s: float,
            throughput_bytes_per_s: float, *, minibatch_s: float | None = None,
            latency_s: float = 0.0, compute_sd_s: float = 0.0, **settings: object) -> float:
    """Throughput of ``hosts`` hosts over that of one host doing the same total work.

    Args:
        strategy, num_params, hosts, compute_s, throughput_bytes_per_s, latency_s,
            compute_sd_s, **settings: as for :func:`predict_step_time`.
        minibatch_s: seconds one host needs per minibatch when it does all the
            work alone (plain training, no strategy overhead); default ``compute_s``.
    """
    step = predict_step_time(strategy, num_params, hosts, compute_s, throughput_bytes_per_s,
                             latency_s, compute_sd_s, **settings)
    alone = single_host_step_time(hosts, compute_s if minibatch_s is None else minibatch_s)
    return alone / step if step > 0 else math.inf


@dataclass(frozen=True)
class Projection:
    """One row of a projection: a strategy on a number of hosts.

    Args:
        strategy: the strategy's label (e.g. ``diloco H=100``).
        hosts: the number of hosts.
        step_s: predicted seconds per step.
        comm_s: the part of ``step_s`` beyond compute: waiting for the slowest
            host and communicating.
        bytes_sent: bytes per host per step.
        speedup: over one host doing the same total work.
    """

    strategy: str
    hosts: int
    step_s: float
    comm_s: float
    bytes_sent: float
    speedup: float

    @property
    def comm_fraction(self) -> float:
        """Share of the step spent communicating."""
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0


def project(strategy: Any, num_params: int, hosts: Iterable[int], compute_s: float,
            throughput_bytes_per_s: float, *, minibatch_s: float | None = None,
            latency_s: float = 0.0, compute_sd_s: float = 0.0, label: str | None = None,
            **settings: object) -> list[Projection]:
    """:func:`predict_step_time` and :func:`speedup` for every host count in ``hosts``.

    Args:
        strategy, num_params, compute_s, throughput_bytes_per_s, minibatch_s,
            latency_s, compute_sd_s, **settings: as for :func:`speedup`.
        hosts: host counts, e.g. ``(2, 4, 8, 16, 32, 64)``.
        label: the name rows carry (default: ``strategy``).
    """
    rows = []
    for n in hosts:
        step = predict_step_time(strategy, num_params, n, compute_s, throughput_bytes_per_s,
                                 latency_s, compute_sd_s, **settings)
        traffic = step_traffic(strategy, num_params, n, **settings)  # type: ignore[arg-type]
        rows.append(Projection(
            strategy=label or strategy, hosts=n, step_s=step, comm_s=step - compute_s,
            bytes_sent=traffic.bytes_sent,
            speedup=speedup(strategy, num_params, n, compute_s, throughput_bytes_per_s,
                            minibatch_s=minibatch_s, latency_s=latency_s,
                            compute_sd_s=compute_sd_s, **settings)))
    return rows


@dataclass(frozen=True)
class Prediction:
    """The expected cost of one step of a strategy, as the faces show it.

    Args:
        strategy: the strategy's name.
        hosts: the number of hosts (one rank each).
        payload_bytes: bytes per step each host hands to collectives (``comm_bytes``).
        wire_bytes: bytes per step each host puts on its link.
        compute_s: seconds of local work per step.
        comm_s: seconds per step beyond it: waiting for the slowest host and talking.
        step_s: ``compute_s + comm_s``.
        speedup: throughput over one host doing the same total work (``hosts`` at best).
        parts: ``comm_s`` part by part: waiting for the slowest host, latency, transfer.
    """

    strategy: str
    hosts: int
    payload_bytes: float
    wire_bytes: float
    compute_s: float
    comm_s: float
    step_s: float
    speedup: float
    parts: StepParts | None = None

    @property
    def efficiency(self) -> float:
        """``speedup / hosts``: 1.0 when communication costs nothing."""
        return self.speedup / self.hosts


def predict(strategy: Any, num_params: int, hosts: int, compute_s: float,
            throughput_bytes_per_s: float, *, minibatch_s: float | None = None,
            latency_s: float = 0.0, compute_sd_s: float = 0.0,
            **settings: object) -> Prediction:
    """Step time, traffic and speedup of ``strategy`` on ``hosts`` hosts in one object.

    Args:
        strategy, num_params, hosts, compute_s, throughput_bytes_per_s,
            minibatch_s, latency_s, compute_sd_s, **settings: as for :func:`speedup`.
    """
    if not compute_s > 0:
        raise ValueError(f"compute_s must be > 0 seconds, got {compute_s!r}")
    traffic = step_traffic(strategy, num_params, hosts, **settings)  # type: ignore[arg-type]
    parts = step_parts(strategy, num_params, hosts, compute_s, throughput_bytes_per_s,
                       latency_s, compute_sd_s, **settings)
    gain = speedup(strategy, num_params, hosts, compute_s, throughput_bytes_per_s,
                   minibatch_s=minibatch_s, latency_s=latency_s, compute_sd_s=compute_sd_s,
                   **settings)
    return Prediction(strategy=traffic.strategy, hosts=hosts, payload_bytes=traffic.payload,
                      wire_bytes=traffic.bytes_sent, compute_s=compute_s,
                      comm_s=parts.comm_s, step_s=parts.step_s, speedup=gain, parts=parts)


def predict_all(num_params: int, hosts: int, compute_s: float, throughput_bytes_per_s: float,
                strategies: Iterable[str] = ("ddp", "diloco", "sparta", "fedavg"),
                settings: Mapping[str, Mapping[str, object]] | None = None,
                **common: object) -> list[Prediction]:
    """:func:`predict` for several strategies, each with its own settings.

    Args:
        settings: per strategy name, its settings (missing ones: :data:`DEFAULTS`).
        **common: ``minibatch_s``, ``latency_s``, ``compute_sd_s`` for every strategy.
    """
    settings = settings or {}
    return [predict(name, num_params, hosts, compute_s, throughput_bytes_per_s, **common,
                    **relevant_settings(name, dict(settings.get(name, {}))))
            for name in strategies]


def mbit_to_bytes_per_s(mbit_per_s: float) -> float:
    """Megabits per second (as links are sold) to bytes per second."""
    return _check_positive("mbit_per_s", mbit_per_s) * 1e6 / 8.0
