"""The wire's facts, as plain numbers: no torch here.

What a value costs on the wire: the bucket one all-reduce call carries, bytes
per value of each ``comm_dtype`` name, and the packed size of quantized
payloads (values plus one float32 scale per chunk). The comm module sizes its
calls with these, the strategies their payload formulas, and the planner its
predictions, so a change here changes the run and its prediction together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUCKET_BYTES",
    "COLLECTIVES",
    "COMM_DTYPE",
    "FLOAT_DTYPES",
    "QUANTIZED_BITS",
    "QUANT_CHUNK",
    "SCALE_BYTES",
    "VALUE_BYTES",
    "ModelFacts",
    "Traffic",
    "is_quantized",
    "quantized_payload_bytes",
    "value_bytes_of",
    "wire_bytes",
    "wire_collective",
]

#: Largest flat buffer one all-reduce call carries: a larger payload is split
#: into several calls, each paying its own message rounds.
BUCKET_BYTES = 32 * 1024 * 1024

#: The type values travel in unless a strategy is given ``comm_dtype``.
COMM_DTYPE = "float32"

#: Bytes per value of each name a ``comm_dtype`` may be given by.
VALUE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float64": 8, "double": 8,
}

#: The float types a ``comm_dtype`` may name, each with its other spellings: the types the
#: comm module sends values in as they are.
FLOAT_DTYPES: dict[str, tuple[str, ...]] = {
    "float32": ("fp32",), "bfloat16": ("bf16",), "float16": ("fp16", "half"),
}

#: Bits per value of each quantized ``comm_dtype`` (``exogym.comm.quantize``).
QUANTIZED_BITS: dict[str, int] = {"int8": 8, "float8_e4m3fn": 8, "int4": 4, "int2": 2}

#: Values per quantization chunk (one scale each) unless a strategy says otherwise.
QUANT_CHUNK = 64

#: Bytes of one chunk's scale: scales travel as float32.
SCALE_BYTES = 4


def is_quantized(comm_dtype: object) -> bool:
    """True for a quantized communication dtype name (``'int8'``, ``'int4'``, ...)."""
    return isinstance(comm_dtype, str) and comm_dtype.lower() in QUANTIZED_BITS


def quantized_payload_bytes(numel: int, comm_dtype: str, chunk: int = QUANT_CHUNK) -> int:
    """Bytes one rank sends for ``numel`` values quantized to ``comm_dtype``.

    The values packed ``8 // bits`` to a byte (the last byte padded), plus one
    float32 scale per chunk of ``chunk`` values (the last chunk may be partial
    and still has its scale): ``ceil(numel * bits / 8) + 4 * ceil(numel / chunk)``.

    Raises:
        ValueError: for an unknown quantized type, or ``chunk`` or ``numel`` out of range.
    """
    name = str(comm_dtype).lower()
    if name not in QUANTIZED_BITS:
        raise ValueError(f"unknown quantized comm_dtype {comm_dtype!r}; use one of "
                         f"{', '.join(QUANTIZED_BITS)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel!r}")
    bits = QUANTIZED_BITS[name]
    return -(-numel * bits // 8) + SCALE_BYTES * -(-numel // chunk)


def value_bytes_of(comm_dtype: str) -> float:
    """Bytes per value for a communication dtype name (``'bfloat16'`` -> 2).

    For a quantized type, the packed value's share of a byte plus its share of
    a chunk scale at the default chunk (``'int8'`` -> 1 + 4/64).

    Raises:
        ValueError: for a name that is neither a known floating type nor a quantized one.
    """
    name = str(comm_dtype).lower().removeprefix("torch.")
    if name in QUANTIZED_BITS:
        return QUANTIZED_BITS[name] / 8 + SCALE_BYTES / QUANT_CHUNK
    if name not in VALUE_BYTES:
        raise ValueError(f"unknown comm_dtype {comm_dtype!r}; use one of "
                         f"{', '.join(sorted(VALUE_BYTES) + list(QUANTIZED_BITS))}")
    return VALUE_BYTES[name]


# --------------------------------------------------------------------------- traffic a strategy states

COLLECTIVES = ("all_reduce", "all_gather", "broadcast")  #: the collectives the cost model knows


@dataclass(frozen=True)
class Traffic:
    """One collective a strategy runs, as it states it: what kind, what a rank hands to it, how often.

    A strategy's :meth:`~exogym.strategy.Strategy.traffic` returns a list of
    these; the planner turns them into bytes and time on a given network with
    :func:`exogym.sim.network.traffic_cost`, the same cost model the simulated
    clock charges the collectives the strategy actually calls.

    Args:
        collective: ``'all_reduce'``, ``'all_gather'`` or ``'broadcast'``.
        payload: bytes each rank hands to one occurrence (what ``comm_bytes`` counts).
        every: steps from one occurrence to the next, on average (1: every step;
            ``H``: once a round; fractional when it is not periodic).
        ranks: ranks taking part in each occurrence (None: every rank; FedAvg's islands fewer).
        calls: separate calls one occurrence takes (None: one per ``BUCKET_BYTES`` of payload).
    """

    collective: str
    payload: float
    every: float = 1.0
    ranks: int | None = None
    calls: int | None = None

    def __post_init__(self) -> None:
        if self.collective not in COLLECTIVES:
            raise ValueError(f"Traffic: collective must be one of {', '.join(COLLECTIVES)}, "
                             f"got {self.collective!r}")
        if not self.payload >= 0:
            raise ValueError(f"Traffic: payload must be a number of bytes >= 0, got {self.payload!r}")
        if not self.every > 0:
            raise ValueError(f"Traffic: every must be a number of steps > 0, got {self.every!r}")


@dataclass(frozen=True)
class ModelFacts:
    """What a strategy's traffic depends on in the model, without the model.

    Args:
        num_params: trainable parameters (values).
        num_buffers: float buffer values averaged with the parameters (BatchNorm statistics).
        shapes: the trainable tensors' shapes, for strategies that cut tensors
            into chunks (DeMo, SparseLoCo); None when unknown.
        value_bytes: bytes per value of the model's own dtype (what DDP's gradients travel in).
        measured_payload: bytes per rank per step measured for a strategy whose
            payload cannot be derived from the rest (DeMo without ``shapes``).
    """

    num_params: int
    num_buffers: int = 0
    shapes: tuple[tuple[int, ...], ...] | None = None
    value_bytes: int = 4
    measured_payload: float | None = None

    @classmethod
    def of(cls, model: Any) -> ModelFacts:
        """The facts of a ``torch.nn.Module``: its trainable parameters and float buffers."""
        params = [p for p in model.parameters() if p.requires_grad]
        buffers = [b for b in model.buffers() if b.is_floating_point()]
        return cls(num_params=sum(p.numel() for p in params),
                   num_buffers=sum(b.numel() for b in buffers),
                   shapes=tuple(tuple(p.shape) for p in params),
                   value_bytes=params[0].element_size() if params else 4)


def wire_bytes(values: float, comm_dtype: str | None, value_bytes: float = 4) -> float:
    """Bytes a rank hands to a collective for ``values`` values sent in ``comm_dtype``.

    A float type costs its size per value (``value_bytes`` when ``comm_dtype`` is
    None); a quantized one :func:`quantized_payload_bytes`.
    """
    if is_quantized(comm_dtype):
        return float(quantized_payload_bytes(math.ceil(values), str(comm_dtype)))
    size = value_bytes if comm_dtype is None else value_bytes_of(comm_dtype)
    return float(size * values)


def wire_collective(comm_dtype: str | None) -> str:
    """The collective a dense average in ``comm_dtype`` takes: quantized payloads are gathered."""
    return "all_gather" if is_quantized(comm_dtype) else "all_reduce"
