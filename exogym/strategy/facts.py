"""The strategies' payload arithmetic, as plain numbers: no torch here.

The payload formulas the strategies' ``traffic`` statements use (DeMo's chunk
geometry, SparseLoCo's top-k payload, Streaming DiLoCo's fragments, DES-LOC's
three periods). The wire's own facts (bucket size, bytes per value, quantized
payloads) are :mod:`exogym.comm.wire`'s, re-exported here. The strategies'
defaults (``DILOCO_H``, ``SPARTA_P``, ...) are re-exported too, for the code that
reads them by these names: each is read from its declaration in
:mod:`exogym.strategy.settings`, the one place a default is written.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from exogym.comm.wire import (  # the wire's facts, re-exported for the strategies
    BUCKET_BYTES,
    COMM_DTYPE,
    QUANT_CHUNK,
    QUANTIZED_BITS,
    SCALE_BYTES,
    VALUE_BYTES,
    is_quantized,
    quantized_payload_bytes,
    value_bytes_of,
)

from .settings import (
    ASYNC_DILOCO,
    DEMO,
    DESLOC,
    DILOCO,
    FEDAVG,
    MULOCO,
    SPARSELOCO,
    SPARTA,
    SPARTA_DILOCO,
    STREAMING_DILOCO,
)

__all__ = [
    "ASYNC_GRACE_S",
    "ASYNC_MAX_STALENESS",
    "ASYNC_QUORUM",
    "BUCKET_BYTES",
    "COMM_DTYPE",
    "DEMO_CHUNK",
    "DEMO_TOPK",
    "DESLOC_H_M1",
    "DESLOC_H_M2",
    "DESLOC_H_PARAMS",
    "DILOCO_H",
    "FEDAVG_H",
    "MULOCO_COMM_DTYPE",
    "SPARSELOCO_CHUNK",
    "SPARSELOCO_H",
    "SPARSELOCO_QUANT_BITS",
    "SPARSELOCO_TOPK",
    "SPARTA_INTERVAL",
    "SPARTA_P",
    "STREAMING_FRAGMENTS",
    "VALUE_BYTES",
    "QUANTIZED_BITS",
    "QUANT_CHUNK",
    "SCALE_BYTES",
    "ChunkGeometry",
    "chunk_size",
    "demo_payload_bytes",
    "desloc_sent_bytes",
    "fragment_offset",
    "is_quantized",
    "quantized_payload_bytes",
    "sparse_chunking",
    "sparseloco_payload_bytes",
    "streaming_sync_bytes",
    "value_bytes_of",
]

DILOCO_H = DILOCO.H.default  #: DiLoCo's (and SPARTA-DiLoCo's) inner steps per outer round.
ASYNC_QUORUM = ASYNC_DILOCO.quorum.default  #: AsyncDiLoCo's share of the workers that calls a merge.
ASYNC_GRACE_S = ASYNC_DILOCO.grace_s.default  #: AsyncDiLoCo's wait past its quorum, in seconds.
ASYNC_MAX_STALENESS = ASYNC_DILOCO.max_staleness.default  #: AsyncDiLoCo's versions a contribution may lag.
FEDAVG_H = FEDAVG.H.default  #: FedAvg's local steps per averaging round.
SPARTA_P = SPARTA.p_sparta.default  #: SPARTA's fraction of each tensor averaged per round.
SPARTA_INTERVAL = SPARTA_DILOCO.sparta_interval.default  #: SPARTA-DiLoCo's steps between sparse rounds.
DEMO_TOPK = DEMO.compression_topk.default  #: DeMo's DCT coefficients sent per chunk.
DEMO_CHUNK = DEMO.compression_chunk.default  #: DeMo's largest chunk side.
SPARSELOCO_H = SPARSELOCO.H.default  #: SparseLoCo's inner steps per outer round.
SPARSELOCO_CHUNK = SPARSELOCO.chunk.default  #: SparseLoCo's values per chunk.
SPARSELOCO_TOPK = SPARSELOCO.topk.default  #: SparseLoCo's values sent per chunk.
SPARSELOCO_QUANT_BITS = SPARSELOCO.quant_bits.default  #: bits per value SparseLoCo sends.
STREAMING_FRAGMENTS = STREAMING_DILOCO.num_fragments.default  #: Streaming DiLoCo's fragments.
DESLOC_H_PARAMS = DESLOC.H_params.default  #: DES-LOC's steps between averages of the parameters.
DESLOC_H_M1 = DESLOC.H_m1.default  #: DES-LOC's steps between averages of Adam's first moment.
DESLOC_H_M2 = DESLOC.H_m2.default  #: DES-LOC's steps between averages of Adam's second moment.
MULOCO_COMM_DTYPE = MULOCO.comm_dtype.default  #: the type MuLoCo's outer deltas travel in.


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


def desloc_sent_bytes(steps: int, num_params: int, H_params: int = DESLOC_H_PARAMS,
                      H_m1: int = DESLOC_H_M1, H_m2: int = DESLOC_H_M2,
                      comm_dtype: str = COMM_DTYPE, num_buffers: int = 0) -> int:
    """Bytes one DES-LOC rank has sent after ``steps`` inner steps.

    Every ``H_params`` steps the parameters and float buffers, every ``H_m1`` steps
    Adam's first moment, every ``H_m2`` steps its second moment, each ``v`` bytes a
    value (4 in float32, 2 in bfloat16)::

        v * ((P + B) * (steps // H_params) + P * (steps // H_m1) + P * (steps // H_m2))

    that is ``v * (P/H_params + P/H_m1 + P/H_m2)`` per step on average without buffers.
    """
    v = int(value_bytes_of(comm_dtype))
    return v * ((num_params + num_buffers) * (steps // H_params)
                + num_params * (steps // H_m1) + num_params * (steps // H_m2))


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
