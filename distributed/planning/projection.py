"""Projection: time per step and speedup of a strategy on N hosts, from two measurements.

Inputs are what one can measure on a small setup: the compute time of one
training step on one host (forward, backward, optimizer, the strategy's own
local work) and the link throughput between hosts. The model then says what
happens with 2, 8 or 64 hosts, for every strategy, with nothing but arithmetic
(no torch, no processes), so the CLI and the wizard can use it freely.

Cost model. The links and collectives are :mod:`exogym.network`'s model, the
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
measurement (``bench/multihost.py``) before trusting its 64-host ones.

The same model serves the faces: :func:`predict` with a profile's settings
(:func:`relevant_settings`) is what the wizard shows before a run, and
``bench/project_speedup.py`` holds it against the benchmark's measurements.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from exogym.network import (  # the one cost model of links and collectives
    Network,
    allgather_bytes,
    allgather_rounds,
    ring_allreduce_bytes,
    ring_allreduce_rounds,
)
from exogym.strategy.facts import (
    BUCKET_BYTES,
    DEMO_CHUNK,
    DEMO_TOPK,
    SPARSELOCO_CHUNK,
    SPARSELOCO_QUANT_BITS,
    SPARSELOCO_TOPK,
    SPARTA_INTERVAL,
    SPARTA_P,
    STREAMING_FRAGMENTS,
    TRAFFIC_DEFAULTS,
    chunk_size,
    demo_payload_bytes,
    is_quantized,
    quantized_payload_bytes,
    sparseloco_payload_bytes,
    value_bytes_of,
)

__all__ = [
    "BUCKET_BYTES",
    "DEFAULTS",
    "STRATEGIES",
    "Prediction",
    "Projection",
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
    "step_traffic",
    "value_bytes_of",
]

#: Strategies the model knows, in the order the faces show them, each with what it sends.
STRATEGIES: dict[str, str] = {
    "ddp": "all-reduce every gradient every step: the reference, and the most traffic",
    "diloco": "H local steps, then one all-reduce of the model change: traffic divided by H",
    "sparta": "every step, average a small random fraction p of the weights: traffic times p",
    "fedavg": "H local steps, then average whole models, optionally in islands of ranks",
    "demo": "send only the top-k DCT components of each rank's momentum every step",
    "sparta_diloco": "SPARTA's sparse averaging between DiLoCo rounds",
    "streaming_diloco": "DiLoCo's round cut into fragments synced in turn: same total, "
                        "peak per sync divided by the fragments",
    "sparseloco": "H local steps, then all-gather the top-k of every chunk of the "
                  "error-fed change, quantized: a percent of DiLoCo's bytes",
    "none": "no communication (one host, or independent training)",
}
_ALIASES = {"allreduce": "ddp", "all_reduce": "ddp", "simple_reduce": "ddp",
            "simplereduce": "ddp"}

#: The settings each strategy's traffic depends on, with the strategy classes' defaults
#: (``exogym.strategy.facts``, where the classes take them from); :func:`relevant_settings`
#: reads them from a profile.
DEFAULTS: dict[str, dict[str, object]] = {**TRAFFIC_DEFAULTS, "none": {}}


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
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a name such as 'ddp', got {strategy!r}")
    name = strategy.strip().lower().replace("-", "_").replace(" ", "_")
    name = _ALIASES.get(name, name)
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: the projection knows "
                         f"{', '.join(STRATEGIES)}")
    return name


def _whole(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def step_traffic(strategy: str, num_params: int, hosts: int, *, H: int | None = None,
                 p_sparta: float = SPARTA_P, demo_payload: float | None = None,
                 shapes: Iterable[Sequence[int]] | None = None, compression_chunk: int = DEMO_CHUNK,
                 compression_topk: int = DEMO_TOPK, value_bytes: int = 4, num_buffers: int = 0,
                 bucket_bytes: int = BUCKET_BYTES, island_size: int | None = None,
                 sparta_interval: int = SPARTA_INTERVAL, comm_dtype: str | None = None,
                 num_fragments: int = STREAMING_FRAGMENTS, topk: int = SPARSELOCO_TOPK,
                 chunk: int = SPARSELOCO_CHUNK,
                 quant_bits: int | None = SPARSELOCO_QUANT_BITS) -> StepTraffic:
    """Bytes and rounds per step for ``strategy`` on ``hosts`` hosts (see the module docstring).

    Args:
        strategy: ``ddp``, ``diloco``, ``sparta``, ``fedavg``, ``demo``,
            ``sparta_diloco`` or ``none``.
        num_params: trainable parameters ``P``.
        hosts: the number of hosts ``N``.
        H: inner steps per round (required for ``diloco``, ``fedavg`` and
            ``sparta_diloco``).
        p_sparta: SPARTA's fraction of entries averaged per step.
        demo_payload: DeMo's bytes per host per step; computed from ``shapes``
            when not given.
        shapes: the trainable tensors' shapes, for DeMo.
        compression_chunk, compression_topk: DeMo's settings, with ``shapes``.
        value_bytes: bytes per value on the wire (4 for float32, 2 for bf16).
        num_buffers: float buffers DiLoCo and FedAvg average with the parameters
            (BatchNorm statistics).
        bucket_bytes: largest buffer per all-reduce call.
        island_size: FedAvg's hosts per island (None: all of them).
        sparta_interval: SPARTA-DiLoCo's steps between sparse rounds.
        num_fragments: Streaming DiLoCo's fragments; each syncs once per ``H`` steps
            with ``1/num_fragments`` of the values (equal fragments assumed).
        topk, chunk, quant_bits: SparseLoCo's values sent per chunk, values per chunk
            and bits per sent value (None: float32); its payload is sized per tensor
            from ``shapes`` when given, else as one tensor of ``num_params`` values.
        comm_dtype: the wire type by name (``'bfloat16'``), instead of ``value_bytes``;
            a quantized type (``'int8'``, ``'float8_e4m3fn'``, ``'int4'``, ``'int2'``)
            sends packed values and a float32 scale per 64 as an all-gather.

    Raises:
        ValueError: for an unknown strategy, a missing setting or an impossible value.
    """
    name = canonical(strategy)
    hosts = _check_hosts(hosts)
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be an integer >= 0, got {num_params!r}")
    quantized = is_quantized(comm_dtype)
    if comm_dtype is not None and not quantized:
        value_bytes = value_bytes_of(comm_dtype)
    if quantized and name == "demo":
        raise ValueError(f"demo sends its coefficients in a float type; comm_dtype="
                         f"{comm_dtype!r} is quantized: use 'float32', 'bfloat16' or 'float16'")
    if value_bytes not in (1, 2, 4, 8):
        raise ValueError(f"value_bytes must be 1, 2, 4 or 8, got {value_bytes!r}")
    _check_positive("bucket_bytes", bucket_bytes)

    def calls(payload: float) -> int:
        return max(1, math.ceil(payload / bucket_bytes)) if payload > 0 else 0

    def wire(values: float) -> float:
        """Bytes a host hands to the collective for ``values`` values."""
        if quantized:
            return float(quantized_payload_bytes(math.ceil(values), str(comm_dtype)))
        return float(value_bytes * values)

    def sent(payload: float, ring: int) -> float:
        # A quantized payload is all-gathered and summed by each host.
        return allgather_bytes(payload, ring) if quantized else ring_allreduce_bytes(payload, ring)

    def rounds(payload: float, ring: int) -> float:
        if quantized:
            return float(allgather_rounds(ring) * calls(payload))
        return float(ring_allreduce_rounds(ring, calls(payload)))

    collective = "all-gather" if quantized else "all-reduce"

    def allreduce(payload: float, every: int = 1, ring: int = hosts) -> StepTraffic:
        return StepTraffic(name, hosts, payload / every, sent(payload, ring) / every,
                           rounds(payload, ring) / every, collective, every)

    def needs_h() -> int:
        if isinstance(H, bool) or not isinstance(H, int) or H < 1:
            raise ValueError(f"{name} needs H, an integer >= 1 (inner steps per round), "
                             f"got {H!r}")
        return H

    def fraction() -> float:
        if isinstance(p_sparta, bool) or not isinstance(p_sparta, (int, float)) \
                or not 0.0 <= p_sparta <= 1.0:
            raise ValueError(f"p_sparta must be a fraction within [0, 1], got {p_sparta!r}")
        return float(p_sparta)

    if name == "none":
        return StepTraffic(name, hosts, 0.0, 0.0, 0.0, "none", 0)
    if name == "ddp":
        return allreduce(wire(num_params))
    if name == "diloco":
        return allreduce(wire(num_params + num_buffers), every=needs_h())
    if name == "streaming_diloco":
        every, fragments = needs_h(), _whole("num_fragments", num_fragments)
        fragment = wire(math.ceil((num_params + num_buffers) / fragments))
        return StepTraffic(name, hosts, fragment * fragments / every,
                           sent(fragment, hosts) * fragments / every,
                           rounds(fragment, hosts) * fragments / every, collective,
                           max(1, every // fragments))
    if name == "sparseloco":
        every = needs_h()
        if quant_bits is not None:
            _whole("quant_bits", quant_bits)
        sizes = ([math.prod(shape) for shape in shapes] if shapes is not None
                 else [num_params])
        gathered = float(sparseloco_payload_bytes(sizes, _whole("chunk", chunk),
                                                  _whole("topk", topk), quant_bits))
        dense = 4.0 * num_buffers  # float buffers are averaged densely, as DiLoCo does
        return StepTraffic(
            name, hosts, (gathered + dense) / every,
            (allgather_bytes(gathered, hosts) + ring_allreduce_bytes(dense, hosts)) / every,
            (allgather_rounds(hosts) + ring_allreduce_rounds(hosts, calls(dense))) / every,
            "all-gather", every)
    if name == "fedavg":
        every = needs_h()
        if island_size is not None:
            _whole("island_size", island_size)
        ring = min(island_size or hosts, hosts)
        return allreduce(wire(num_params + num_buffers), every=every, ring=ring)
    if name == "sparta":
        return allreduce(wire(fraction() * num_params))
    if name == "sparta_diloco":
        every, interval = needs_h(), _whole("sparta_interval", sparta_interval)
        sparse_share = 1.0 / interval - 1.0 / math.lcm(interval, every)  # DiLoCo replaces some
        sparse = wire(fraction() * num_params)
        full = wire(num_params + num_buffers)
        return StepTraffic(
            name, hosts, sparse * sparse_share + full / every,
            sent(sparse, hosts) * sparse_share + sent(full, hosts) / every,
            rounds(sparse, hosts) * sparse_share + rounds(full, hosts) / every, collective, 1)
    # demo
    if demo_payload is None:
        if shapes is None:
            raise ValueError("demo needs demo_payload= (bytes per host per step) or shapes= "
                             "(the trainable tensors' shapes) to size its all-gather")
        demo_payload = demo_payload_bytes(shapes, _whole("compression_chunk", compression_chunk),
                                          _whole("compression_topk", compression_topk),
                                          value_bytes)
    demo_payload = _check_nonnegative("demo_payload", demo_payload)
    return StepTraffic(name, hosts, demo_payload, allgather_bytes(demo_payload, hosts),
                       float(allgather_rounds(hosts)), "all-gather")


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


def predict_step_time(strategy: str, num_params: int, hosts: int, compute_s: float,
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
    _check_nonnegative("compute_s", compute_s)
    _check_positive("throughput_bytes_per_s", throughput_bytes_per_s)
    _check_nonnegative("latency_s", latency_s)
    traffic = step_traffic(strategy, num_params, hosts, **settings)  # type: ignore[arg-type]
    skew = skew_per_step(compute_sd_s, hosts, traffic.period) if traffic.period else 0.0
    link = Network(bandwidth=throughput_bytes_per_s * 8.0, latency_s=latency_s)
    return compute_s + skew + link.transfer_s(traffic.bytes_sent, traffic.rounds)


def single_host_step_time(hosts: int, minibatch_s: float) -> float:
    """Seconds one host needs for the work ``hosts`` hosts do in one step: ``N * t_minibatch``."""
    return _check_hosts(hosts) * _check_nonnegative("minibatch_s", minibatch_s)


def speedup(strategy: str, num_params: int, hosts: int, compute_s: float,
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


def project(strategy: str, num_params: int, hosts: Iterable[int], compute_s: float,
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
    """

    strategy: str
    hosts: int
    payload_bytes: float
    wire_bytes: float
    compute_s: float
    comm_s: float
    step_s: float
    speedup: float

    @property
    def efficiency(self) -> float:
        """``speedup / hosts``: 1.0 when communication costs nothing."""
        return self.speedup / self.hosts


def predict(strategy: str, num_params: int, hosts: int, compute_s: float,
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
    step = predict_step_time(strategy, num_params, hosts, compute_s, throughput_bytes_per_s,
                             latency_s, compute_sd_s, **settings)
    gain = speedup(strategy, num_params, hosts, compute_s, throughput_bytes_per_s,
                   minibatch_s=minibatch_s, latency_s=latency_s, compute_sd_s=compute_sd_s,
                   **settings)
    return Prediction(strategy=traffic.strategy, hosts=hosts, payload_bytes=traffic.payload,
                      wire_bytes=traffic.bytes_sent, compute_s=compute_s,
                      comm_s=step - compute_s, step_s=step, speedup=gain)


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
