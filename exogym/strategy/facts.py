"""What the strategies' traffic depends on, as plain numbers: no torch here.

The strategy classes take their defaults from this module, the comm module its
bucket size, DeMo its chunk arithmetic; the planner
(``distributed/planning/projection.py``) reads the same names to predict bytes
and time without building a model. A default changed here changes the run and
its prediction together.

Per strategy, the settings its bytes per step depend on (:data:`TRAFFIC_DEFAULTS`):

- ``ddp``: nothing; every gradient, in its own dtype, every step;
- ``diloco``: ``H`` (steps per all-reduce) and ``comm_dtype``;
- ``fedavg``: ``H``, ``island_size`` (None: one island of every rank) and ``comm_dtype``;
- ``sparta``: ``p_sparta`` (the fraction of each tensor averaged per step) and ``comm_dtype``;
- ``sparta_diloco``: ``H``, ``p_sparta``, ``sparta_interval`` and ``comm_dtype``;
- ``streaming_diloco``: ``H``, ``num_fragments`` and ``comm_dtype`` (see
  :func:`streaming_sync_bytes` and :func:`fragment_offset`);
- ``demo``: ``compression_topk`` and ``compression_chunk`` (see :class:`ChunkGeometry`)
  and ``comm_dtype``.

A ``comm_dtype`` is either a float type (values travel in it) or one of the
quantized types of :data:`QUANTIZED_BITS` (``exogym.quantize``): packed values
plus one float32 scale per chunk of ``chunk`` values, gathered rather than
reduced; :func:`quantized_payload_bytes` is what one rank sends for them.
- ``sparseloco``: ``H``, ``topk``, ``chunk`` and ``quant_bits``
  (:func:`sparseloco_payload_bytes`, with the ``SPARSELOCO_*`` defaults).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "BUCKET_BYTES",
    "COMM_DTYPE",
    "DEMO_CHUNK",
    "DEMO_TOPK",
    "DILOCO_H",
    "FEDAVG_H",
    "SPARSELOCO_CHUNK",
    "SPARSELOCO_H",
    "SPARSELOCO_QUANT_BITS",
    "SPARSELOCO_TOPK",
    "SPARTA_INTERVAL",
    "SPARTA_P",
    "STREAMING_FRAGMENTS",
    "TRAFFIC_DEFAULTS",
    "VALUE_BYTES",
    "QUANTIZED_BITS",
    "QUANT_CHUNK",
    "SCALE_BYTES",
    "ChunkGeometry",
    "chunk_size",
    "demo_payload_bytes",
    "fragment_offset",
    "is_quantized",
    "quantized_payload_bytes",
    "sparse_chunking",
    "sparseloco_payload_bytes",
    "streaming_sync_bytes",
    "value_bytes_of",
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

#: Bits per value of each quantized ``comm_dtype`` (``exogym.quantize``).
QUANTIZED_BITS: dict[str, int] = {"int8": 8, "float8_e4m3fn": 8, "int4": 4, "int2": 2}

#: Values per quantization chunk (one scale each) unless a strategy says otherwise.
QUANT_CHUNK = 64

#: Bytes of one chunk's scale: scales travel as float32.
SCALE_BYTES = 4

DILOCO_H = 100  #: DiLoCo's (and SPARTA-DiLoCo's) inner steps per outer round.
FEDAVG_H = 1  #: FedAvg's local steps per averaging round.
SPARTA_P = 0.005  #: SPARTA's fraction of each tensor averaged per round.
SPARTA_INTERVAL = 1  #: SPARTA-DiLoCo's steps between sparse rounds.
DEMO_TOPK = 32  #: DeMo's DCT coefficients sent per chunk.
DEMO_CHUNK = 64  #: DeMo's largest chunk side.
SPARSELOCO_H = 30  #: SparseLoCo's inner steps per outer round.
SPARSELOCO_CHUNK = 4096  #: SparseLoCo's values per chunk (a 64x64 block's worth).
SPARSELOCO_TOPK = 64  #: SparseLoCo's values sent per chunk (1.56 % of 4,096).
SPARSELOCO_QUANT_BITS = 2  #: bits per value SparseLoCo sends (None: float32).
STREAMING_FRAGMENTS = 4  #: Streaming DiLoCo's fragments (its H is DiLoCo's).

#: Per strategy (by its profile name), the settings its traffic depends on,
#: with the defaults its class uses when a setting is not given.
TRAFFIC_DEFAULTS: dict[str, dict[str, object]] = {
    "ddp": {},
    "diloco": {"H": DILOCO_H, "comm_dtype": COMM_DTYPE},
    "fedavg": {"H": FEDAVG_H, "island_size": None, "comm_dtype": COMM_DTYPE},
    "sparta": {"p_sparta": SPARTA_P, "comm_dtype": COMM_DTYPE},
    "sparta_diloco": {"H": DILOCO_H, "p_sparta": SPARTA_P, "sparta_interval": SPARTA_INTERVAL,
                      "comm_dtype": COMM_DTYPE},
    "streaming_diloco": {"H": DILOCO_H, "num_fragments": STREAMING_FRAGMENTS,
                         "comm_dtype": COMM_DTYPE},
    "sparseloco": {"H": SPARSELOCO_H, "topk": SPARSELOCO_TOPK, "chunk": SPARSELOCO_CHUNK,
                   "quant_bits": SPARSELOCO_QUANT_BITS},
    "demo": {"compression_topk": DEMO_TOPK, "compression_chunk": DEMO_CHUNK,
             "comm_dtype": COMM_DTYPE},
}


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


def fragment_offset(fragment: int, H: int, num_fragments: int) -> int:
    """The step within each ``H`` at which Streaming DiLoCo's ``fragment`` syncs.

    Fragment ``p`` starts its round after the 1-based inner step ``s`` with
    ``s % H == (p * H // num_fragments) % H``: the offset ``p·H/F`` rounded down.
    """
    return (fragment * H // num_fragments) % H


def streaming_sync_bytes(fragment_numel: int, comm_dtype: str = COMM_DTYPE,
                         chunk: int = QUANT_CHUNK) -> int:
    """Bytes one rank sends in one Streaming DiLoCo round of a fragment of ``fragment_numel`` values.

    In a float type, ``fragment_numel`` values of it (``4 * n`` in float32: about
    ``1/num_fragments`` of DiLoCo's round); in a quantized type,
    :func:`quantized_payload_bytes` (one payload while the fragment fits one bucket).
    """
    if is_quantized(comm_dtype):
        return quantized_payload_bytes(fragment_numel, comm_dtype, chunk)
    return int(value_bytes_of(comm_dtype)) * fragment_numel


def chunk_size(dim: int, limit: int) -> int:
    """The largest divisor of ``dim`` that is not above ``limit`` (DeMo's chunk side)."""
    for d in range(min(dim, limit), 0, -1):
        if dim % d == 0:
            return d
    return 1


@dataclass(frozen=True)
class ChunkGeometry:
    """How DeMo cuts one tensor into chunks, and what it sends for it per step.

    A tensor is seen as a matrix: 0-D and 1-D as one row, higher ranks with
    their trailing dimensions flattened. Each side is cut into chunks of
    :func:`chunk_size` of that side; each chunk sends ``k`` values and as many
    indices in the narrowest integer that holds the chunk area.

    Args:
        rows, cols: the matrix the tensor is seen as.
        chunk_rows, chunk_cols: one chunk's sides.
        k: coefficients sent per chunk (``min(topk, area)``).
    """

    rows: int
    cols: int
    chunk_rows: int
    chunk_cols: int
    k: int

    @classmethod
    def for_shape(cls, shape: Sequence[int], chunk: int, topk: int) -> ChunkGeometry:
        """The geometry of a tensor of ``shape`` with ``compression_chunk`` and ``compression_topk``."""
        if len(shape) < 2:
            rows, cols = 1, (int(shape[0]) if len(shape) == 1 else 1)
        else:
            rows, cols = int(shape[0]), math.prod(int(s) for s in shape[1:])
        cr, cc = chunk_size(rows, chunk), chunk_size(cols, chunk)
        return cls(rows, cols, cr, cc, min(topk, cr * cc))

    @property
    def chunks(self) -> int:
        return (self.rows // self.chunk_rows) * (self.cols // self.chunk_cols)

    @property
    def area(self) -> int:
        return self.chunk_rows * self.chunk_cols

    @property
    def index_bytes(self) -> int:
        """Bytes per index: the narrowest integer holding ``0 .. area-1``."""
        return 1 if self.area <= 2**8 else 2 if self.area <= 2**16 else 4

    def bytes_per_step(self, value_bytes: int = 4) -> int:
        """What a rank sends for this tensor in one step."""
        return self.chunks * self.k * (value_bytes + self.index_bytes)


def demo_payload_bytes(shapes: Iterable[Sequence[int]], chunk: int = DEMO_CHUNK,
                       topk: int = DEMO_TOPK, value_bytes: int = 4) -> int:
    """Bytes one rank contributes to DeMo's all-gather per step.

    Args:
        shapes: the shape of every trainable tensor.
        chunk: ``compression_chunk``.
        topk: ``compression_topk``.
        value_bytes: bytes per value (4 for float32).
    """
    return sum(ChunkGeometry.for_shape(tuple(shape), chunk, topk).bytes_per_step(value_bytes)
               for shape in shapes)


def sparse_chunking(numel: int, chunk: int, topk: int) -> tuple[int, int, int, int]:
    """How SparseLoCo cuts a tensor of ``numel`` values: ``(chunks, size, k, index_bits)``.

    The tensor is flattened and cut into chunks of ``size = min(chunk, numel)``
    values (the last one padded with zeros); each sends its ``k = min(topk, size)``
    largest-magnitude values, each index in ``index_bits = ceil(log2(size))``
    bits (at least 1): 12 bits for a chunk of 4,096.
    """
    size = max(1, min(chunk, numel))
    chunks = -(-numel // size)
    return chunks, size, min(topk, size), max(1, (size - 1).bit_length())


def sparseloco_payload_bytes(sizes: Iterable[int], chunk: int = SPARSELOCO_CHUNK,
                             topk: int = SPARSELOCO_TOPK,
                             quant_bits: int | None = SPARSELOCO_QUANT_BITS) -> int:
    """Bytes one rank contributes to SparseLoCo's all-gather per outer round.

    Per tensor of ``n`` values (:func:`sparse_chunking`): the indices, packed
    ``index_bits`` to a value, ``ceil(chunks·k·index_bits / 8)`` bytes; the values,
    ``ceil(chunks·k·quant_bits / 8)`` bytes plus 8 per chunk for its range (a float32
    low end and a float32 step), or ``4·chunks·k`` bytes unquantized. Float buffers
    (BatchNorm statistics) are averaged densely beside this: add 4 bytes each.

    Args:
        sizes: the number of values of every trainable tensor.
        chunk: values per chunk.
        topk: values sent per chunk.
        quant_bits: bits per sent value (1-8), or None for float32.
    """
    total = 0
    for n in sizes:
        if n <= 0:
            continue
        chunks, _, k, index_bits = sparse_chunking(int(n), chunk, topk)
        sent = chunks * k
        total += -(-sent * index_bits // 8)
        if quant_bits is None:
            total += 4 * sent
        else:
            total += -(-sent * quant_bits // 8) + 8 * chunks
    return total
