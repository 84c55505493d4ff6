"""A cost model of distributed training: bytes each rank sends per step, and the speedup to expect.

Pure functions, no torch: the wizard uses them to show, before anything runs,
why DiLoCo is the default on slow links; benchmarks hold them against
measured runs.

The model, per rank and per optimizer step, with ``P`` values in the payload
(the trainable parameters, plus the float buffers for the strategies that
average whole models), ``v`` bytes per value (4 in float32, 2 in bf16/fp16)
and ``K`` ranks:

- **Ring all-reduce.** ``K`` ranks reduce a payload of ``B`` bytes in a
  reduce-scatter then an all-gather, ``2(K-1)`` hops around the ring, each
  rank sending ``B/K`` bytes per hop: ``2(K-1)/K * B`` bytes in all.
- **Ring all-gather.** Each rank's own ``B`` bytes travel to the ``K-1``
  others: ``(K-1) * B`` bytes sent per rank, in ``K-1`` hops.
- ``ddp``: all-reduce of the gradients every step: ``B = v * P``.
- ``diloco``: all-reduce of the model deltas every ``H`` steps: ``B = v * P / H``
  per step on average.
- ``fedavg``: all-reduce of the models every ``H`` steps within an island of
  ``island_size`` ranks (default: all), so the ring has ``m = min(island_size, K)``
  ranks; sampled-out ranks send zeros, at the same cost.
- ``sparta``: all-reduce of a fraction ``p_sparta`` of every tensor every
  step: ``B = v * p * P`` (the indices come from a shared seed and are not sent).
- ``sparta_diloco``: SPARTA rounds every ``sparta_interval`` steps except
  where a DiLoCo round (every ``H`` steps) replaces them, plus the DiLoCo rounds.
- ``demo``: all-gather of the top-``compression_topk`` DCT coefficients of
  every chunk of ``compression_chunk`` x ``compression_chunk`` entries, each
  coefficient a value (``v`` bytes) and an index in the narrowest integer
  that holds the chunk area (1, 2 or 4 bytes). The chunk count is taken as
  ``ceil(P / chunk_area)``, exact for matrices whose sides divide by the
  chunk; vectors and odd shapes make more, smaller chunks.

Time per step is ``compute_s + comm_s``: communication is assumed not to
overlap compute, ``comm_s = wire bytes / link bandwidth + hops * latency``.
The speedup is throughput in samples per second against one machine
training alone at the same per-machine batch: ``K * compute_s / step_s``. It
says nothing about how much a step of each strategy improves the loss.

``payload_bytes_per_step`` is the figure the comm module's counters report
(``comm_bytes``: what a rank hands to its collectives); ``bytes_per_step`` is
what actually leaves a rank on the wire in a ring.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: Strategies the model knows, in the order the faces show them.
STRATEGIES = ("ddp", "diloco", "sparta", "fedavg", "demo", "sparta_diloco")
_ALIASES = {"allreduce": "ddp", "simplereduce": "ddp", "sparta-diloco": "sparta_diloco"}

#: Settings each strategy's cost depends on, with their defaults (those of the strategy classes).
SETTINGS: dict[str, dict[str, Any]] = {
    "ddp": {"comm_dtype": "float32"},
    "diloco": {"H": 100, "comm_dtype": "float32"},
    "fedavg": {"H": 1, "island_size": None, "comm_dtype": "float32"},
    "sparta": {"p_sparta": 0.005, "comm_dtype": "float32"},
    "sparta_diloco": {"H": 100, "p_sparta": 0.005, "sparta_interval": 1, "comm_dtype": "float32"},
    "demo": {"compression_topk": 32, "compression_chunk": 64, "comm_dtype": "float32"},
}

#: One line per strategy: what it sends, for people choosing one.
DESCRIPTIONS = {
    "ddp": "all-reduce every gradient every step: the reference, and the most traffic",
    "diloco": "H local steps, then one all-reduce of the model change: traffic divided by H",
    "sparta": "every step, average a small random fraction p of the weights: traffic times p",
    "fedavg": "H local steps, then average whole models, optionally in islands of ranks",
    "demo": "send only the top-k DCT components of each rank's momentum every step",
    "sparta_diloco": "SPARTA's sparse averaging between DiLoCo rounds",
}

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2,
                "fp16": 2, "half": 2, "float64": 8, "double": 8}


@dataclass(frozen=True)
class Traffic:
    """What one rank sends per optimizer step, on average over a long run.

    Args:
        strategy: the strategy's canonical name.
        payload_bytes: bytes handed to collectives (what ``comm_bytes`` counts).
        wire_bytes: bytes that leave the rank in a ring (what the link carries).
        hops: sequential ring hops, each paying the link's latency once.
    """

    strategy: str
    payload_bytes: float
    wire_bytes: float
    hops: float


@dataclass(frozen=True)
class Prediction:
    """The expected cost of one optimizer step for one strategy.

    Args:
        strategy: the strategy's canonical name.
        num_hosts: ranks, one per machine.
        payload_bytes: bytes per step handed to collectives (``comm_bytes``).
        wire_bytes: bytes per step each rank sends on the link.
        compute_s: seconds of forward and backward per step.
        comm_s: seconds of communication per step.
        step_s: ``compute_s + comm_s``.
        speedup: samples per second against one machine alone (``K`` at best).
    """

    strategy: str
    num_hosts: int
    payload_bytes: float
    wire_bytes: float
    compute_s: float
    comm_s: float
    step_s: float
    speedup: float

    @property
    def efficiency(self) -> float:
        """``speedup / num_hosts``: 1.0 when communication costs nothing."""
        return self.speedup / self.num_hosts


def canonical(strategy: str) -> str:
    """The model's name for ``strategy`` (``'allreduce'`` -> ``'ddp'``).

    Raises:
        ValueError: for a strategy the model does not know.
    """
    key = strategy.strip().lower().replace(" ", "_")
    key = _ALIASES.get(key, key)
    if key not in SETTINGS:
        raise ValueError(f"no cost model for strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    return key


def relevant_settings(strategy: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of ``values`` (e.g. a profile's) that ``strategy``'s cost depends on.

    ``p`` is taken as ``p_sparta``, as exo gym's SPARTA spelled it.
    """
    wanted = SETTINGS[canonical(strategy)]
    picked = {k: v for k, v in values.items() if k in wanted and v is not None}
    if "p_sparta" in wanted and "p_sparta" not in picked and values.get("p") is not None:
        picked["p_sparta"] = values["p"]
    return picked


def _settings(strategy: str, given: Mapping[str, Any]) -> dict[str, Any]:
    defaults = SETTINGS[strategy]
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise TypeError(f"{strategy}: unknown setting(s) {', '.join(unknown)}; its cost depends "
                        f"on {', '.join(defaults)} (relevant_settings() picks them from a profile)")
    merged = {**defaults, **given}
    for key in ("H", "sparta_interval", "compression_topk", "compression_chunk"):
        if key in merged and (isinstance(merged[key], bool) or not isinstance(merged[key], int)
                              or merged[key] < 1):
            raise ValueError(f"{strategy}: {key} must be a whole number >= 1, got {merged[key]!r}")
    if "p_sparta" in merged and not 0.0 <= float(merged["p_sparta"]) <= 1.0:
        raise ValueError(f"{strategy}: p_sparta must be within [0, 1], got {merged['p_sparta']!r}")
    island = merged.get("island_size")
    if island is not None and (isinstance(island, bool) or not isinstance(island, int)
                               or island < 1):
        raise ValueError(f"{strategy}: island_size must be a whole number >= 1 or None, "
                         f"got {island!r}")
    return merged


def value_bytes(comm_dtype: str) -> int:
    """Bytes per value for a communication dtype name (``'bfloat16'`` -> 2)."""
    name = str(comm_dtype).lower().removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown comm_dtype {comm_dtype!r}; use one of "
                         f"{', '.join(sorted(_DTYPE_BYTES))}")
    return _DTYPE_BYTES[name]


def index_bytes(chunk_area: int) -> int:
    """Bytes of the narrowest integer that indexes ``chunk_area`` coefficients."""
    if chunk_area <= 256:
        return 1
    return 2 if chunk_area <= 65536 else 4


def ring_all_reduce_bytes(payload_bytes: float, num_ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``payload_bytes``: ``2(K-1)/K * B``."""
    if num_ranks <= 1:
        return 0.0
    return 2.0 * (num_ranks - 1) / num_ranks * payload_bytes


def ring_all_gather_bytes(own_bytes: float, num_ranks: int) -> float:
    """Bytes each rank sends in a ring all-gather of ``own_bytes`` per rank: ``(K-1) * B``."""
    if num_ranks <= 1:
        return 0.0
    return float(num_ranks - 1) * own_bytes


def traffic(strategy: str, num_params: int, num_hosts: int, **settings: Any) -> Traffic:
    """Bytes and ring hops per rank per step for ``strategy`` (see the module docstring).

    Args:
        strategy: ``ddp``, ``diloco``, ``sparta``, ``fedavg``, ``demo`` or ``sparta_diloco``.
        num_params: values in the model's payload (trainable parameters).
        num_hosts: ranks K.
        **settings: the strategy's settings (``SETTINGS[strategy]``), defaults otherwise.

    Raises:
        ValueError: for an unknown strategy or an out-of-range setting.
        TypeError: for a setting the strategy's cost does not depend on.
    """
    name = canonical(strategy)
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be a whole number >= 0, got {num_params!r}")
    if isinstance(num_hosts, bool) or not isinstance(num_hosts, int) or num_hosts < 1:
        raise ValueError(f"num_hosts must be a whole number >= 1, got {num_hosts!r}")
    s = _settings(name, settings)
    v = value_bytes(s["comm_dtype"])
    k = num_hosts
    full = float(v * num_params)
    ring_hops = 2 * (k - 1)
    if name == "ddp":
        return Traffic(name, full, ring_all_reduce_bytes(full, k), ring_hops)
    if name == "diloco":
        h = s["H"]
        return Traffic(name, full / h, ring_all_reduce_bytes(full, k) / h, ring_hops / h)
    if name == "fedavg":
        h = s["H"]
        island = min(s["island_size"] or k, k)
        return Traffic(name, full / h, ring_all_reduce_bytes(full, island) / h,
                       2 * (island - 1) / h)
    if name == "sparta":
        sparse = full * float(s["p_sparta"])
        return Traffic(name, sparse, ring_all_reduce_bytes(sparse, k), ring_hops)
    if name == "sparta_diloco":
        h, interval = s["H"], s["sparta_interval"]
        sparse_rounds = 1.0 / interval - 1.0 / math.lcm(interval, h)  # DiLoCo rounds replace them
        sparse = full * float(s["p_sparta"])
        payload = sparse * sparse_rounds + full / h
        wire = (ring_all_reduce_bytes(sparse, k) * sparse_rounds
                + ring_all_reduce_bytes(full, k) / h)
        return Traffic(name, payload, wire, ring_hops * (sparse_rounds + 1.0 / h))
    # demo
    chunk = s["compression_chunk"]
    area = chunk * chunk
    topk = min(s["compression_topk"], area)
    chunks = math.ceil(num_params / area)
    own = float(chunks * topk * (v + index_bytes(area)))
    return Traffic(name, own, ring_all_gather_bytes(own, k), k - 1)


def bytes_per_step(strategy: str, num_params: int, num_hosts: int, **settings: Any) -> float:
    """Bytes each rank sends on the link per step (ring cost); see :func:`traffic`."""
    return traffic(strategy, num_params, num_hosts, **settings).wire_bytes


def payload_bytes_per_step(strategy: str, num_params: int, num_hosts: int,
                           **settings: Any) -> float:
    """Bytes each rank hands to collectives per step, as ``comm_bytes`` counts them."""
    return traffic(strategy, num_params, num_hosts, **settings).payload_bytes


def predict(strategy: str, num_params: int, num_hosts: int, compute_s_per_step: float,
            link_bytes_per_s: float, latency_s: float = 0.0, **settings: Any) -> Prediction:
    """Expected step time and speedup of ``strategy``.

    Args:
        strategy: see :func:`traffic`.
        num_params: values in the model's payload.
        num_hosts: ranks K, one per machine.
        compute_s_per_step: seconds of forward and backward per step on one machine.
        link_bytes_per_s: bandwidth each rank can send at (bytes per second).
        latency_s: one-way latency of the link, paid once per ring hop.
        **settings: the strategy's settings.

    Returns:
        The ``Prediction``; ``speedup`` is ``K * compute / (compute + comm)``.
    """
    if not compute_s_per_step > 0:
        raise ValueError(f"compute_s_per_step must be > 0 seconds, got {compute_s_per_step!r}")
    if not link_bytes_per_s > 0:
        raise ValueError(f"link_bytes_per_s must be > 0, got {link_bytes_per_s!r}")
    if latency_s < 0:
        raise ValueError(f"latency_s must be >= 0 seconds, got {latency_s!r}")
    t = traffic(strategy, num_params, num_hosts, **settings)
    comm_s = t.wire_bytes / link_bytes_per_s + t.hops * latency_s
    step_s = compute_s_per_step + comm_s
    return Prediction(strategy=t.strategy, num_hosts=num_hosts, payload_bytes=t.payload_bytes,
                      wire_bytes=t.wire_bytes, compute_s=compute_s_per_step, comm_s=comm_s,
                      step_s=step_s, speedup=num_hosts * compute_s_per_step / step_s)


def predict_all(num_params: int, num_hosts: int, compute_s_per_step: float,
                link_bytes_per_s: float, latency_s: float = 0.0,
                strategies: Iterable[str] = STRATEGIES[:5],
                settings: Mapping[str, Mapping[str, Any]] | None = None) -> list[Prediction]:
    """:func:`predict` for several strategies, each with its own settings.

    Args:
        settings: per strategy name, its settings (missing: the defaults).
    """
    settings = settings or {}
    return [predict(name, num_params, num_hosts, compute_s_per_step, link_bytes_per_s,
                    latency_s, **dict(settings.get(name, {}))) for name in strategies]


def mbit_to_bytes_per_s(mbit_per_s: float) -> float:
    """Megabits per second (as links are sold) to bytes per second."""
    return mbit_per_s * 1e6 / 8.0
