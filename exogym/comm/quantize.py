"""Per-chunk quantization of a flat float tensor: what narrow collectives send.

A tensor is flattened and cut into chunks of ``chunk`` values (the last chunk
may be shorter; it has its own scale, computed from the values it holds). Each
chunk gets one **float32 scale**, its largest magnitude divided by the largest
level of the type, and each value travels as ``round(value / scale)``:

- ``'int8'``: integer levels -127..127, one byte each;
- ``'int4'``: levels -7..7, two to a byte;
- ``'int2'``: levels -1, 0, 1, four to a byte (symmetric, so zero stays exact
  and stochastic rounding stays unbiased; the fourth code is unused);
- ``'float8_e4m3fn'``: the value scaled into +-448 and cast to float8 e4m3fn.

Packed values fill a byte from its low bits up; the last byte is padded with
zero codes. A chunk of zeros has scale 0 and decodes to zeros.

Rounding is ``'nearest'`` or ``'stochastic'``: a value between two levels goes
to the upper one with probability equal to its distance from the lower one, so
``E[dequantize(quantize(x))] == x`` (values never leave the levels' range, since
the scale comes from the chunk's largest magnitude). Stochastic rounding draws
from ``generator`` (or torch's default generator when None is given).

:func:`payload_bytes` is what one quantized tensor weighs on the wire, values
and scales together; it is :func:`exogym.strategy.facts.quantized_payload_bytes`,
which the planner reads too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exogym.comm.wire import QUANT_CHUNK, QUANTIZED_BITS, quantized_payload_bytes

__all__ = ["DTYPES", "Quantized", "dequantize", "from_bytes", "payload_bytes", "quantize",
           "to_bytes"]

#: The quantized types, by the names ``comm_dtype`` takes.
DTYPES = tuple(QUANTIZED_BITS)

ROUNDINGS = ("nearest", "stochastic")

_LEVELS = {"int8": 127, "int4": 7, "int2": 1}
_FP8_MAX = 448.0
_FP8_TOP_CODE = 0x7E  # 448; 0x7F is NaN in e4m3fn


@dataclass
class Quantized:
    """A quantized flat tensor: what travels, and what is needed to read it back.

    Args:
        values: the packed values: uint8 (int4/int2, several to a byte), int8, or
            float8_e4m3fn; one entry per value for the 8-bit types.
        scales: float32, one per chunk.
        numel: how many values were quantized.
        chunk: values per scale.
        dtype: the quantized type's name.
    """

    values: torch.Tensor
    scales: torch.Tensor
    numel: int
    chunk: int
    dtype: str

    @property
    def nbytes(self) -> int:
        """Bytes of values and scales: :func:`payload_bytes` of this tensor."""
        return (self.values.numel() * self.values.element_size()
                + self.scales.numel() * self.scales.element_size())


def check(dtype: str, chunk: int = QUANT_CHUNK, rounding: str = "nearest") -> str:
    """``dtype`` as a quantized type's name, after checking ``chunk`` and ``rounding``.

    Raises:
        ValueError: naming the wrong value and the accepted ones.
    """
    name = str(dtype).lower()
    if name not in QUANTIZED_BITS:
        raise ValueError(f"quantized dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk (values per quantization scale) must be an integer >= 1, "
                         f"got {chunk!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    return name


def payload_bytes(numel: int, dtype: str, chunk: int = QUANT_CHUNK) -> int:
    """Bytes one rank sends for ``numel`` values quantized to ``dtype``: values packed, plus scales."""
    return quantized_payload_bytes(numel, dtype, chunk)


def _chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``x`` flat float32, zero-padded to whole chunks, as ``(chunks, chunk)``."""
    flat = x.detach().reshape(-1).float()
    pad = -flat.numel() % chunk
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, chunk)


def _stochastic_round(v: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    noise = torch.rand(v.shape, generator=generator, device=v.device, dtype=v.dtype)
    return torch.floor(v + noise)


def _fp8_stochastic(v: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``v`` (within +-448) to float8 e4m3fn, rounding up in magnitude with the right odds."""
    mag = v.abs()
    nearest = mag.to(torch.float8_e4m3fn)
    code = nearest.view(torch.uint8).to(torch.int16)
    above = nearest.float() > mag
    lo = torch.where(above, code - 1, code)
    hi = torch.clamp(lo + 1, max=_FP8_TOP_CODE)
    lo_v = lo.to(torch.uint8).view(torch.float8_e4m3fn).float()
    hi_v = hi.to(torch.uint8).view(torch.float8_e4m3fn).float()
    gap = hi_v - lo_v
    p_up = torch.where(gap > 0, (mag - lo_v) / torch.where(gap > 0, gap, 1.0), 0.0)
    up = torch.rand(v.shape, generator=generator, device=v.device) < p_up
    codes = torch.where(up, hi, lo).to(torch.uint8)
    codes = codes | torch.where(v < 0, 0x80, 0).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes below ``2**bits``, ``8 // bits`` to a byte from the low bits up."""
    per = 8 // bits
    pad = -codes.numel() % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    grouped = codes.view(-1, per).to(torch.uint8)
    packed = torch.zeros(grouped.shape[0], dtype=torch.uint8, device=codes.device)
    for i in range(per):
        packed |= grouped[:, i] << (i * bits)
    return packed


def _unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (i * bits)) & mask for i in range(per)]
    return torch.stack(parts, dim=1).reshape(-1)[:numel]


def quantize(x: torch.Tensor, dtype: str, chunk: int = QUANT_CHUNK, rounding: str = "nearest",
             generator: torch.Generator | None = None) -> Quantized:
    """Quantize the values of ``x`` (any shape, read flat) to ``dtype`` with a scale per chunk.

    Args:
        x: a float tensor.
        dtype: ``'int8'``, ``'float8_e4m3fn'``, ``'int4'`` or ``'int2'``.
        chunk: values per float32 scale; the last chunk may be partial.
        rounding: ``'nearest'`` or ``'stochastic'`` (unbiased).
        generator: the random source of stochastic rounding, on ``x``'s device.

    Raises:
        ValueError: for an unknown dtype or rounding, or a chunk below 1.
    """
    name = check(dtype, chunk, rounding)
    numel = x.numel()
    rows = _chunked(x, chunk)
    absmax = rows.abs().amax(dim=1, keepdim=True)
    top = _FP8_MAX if name == "float8_e4m3fn" else float(_LEVELS[name])
    scales = absmax / top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    v = torch.clamp(rows / safe, -top, top).reshape(-1)[:numel]
    if name == "float8_e4m3fn":
        values = (_fp8_stochastic(v, generator) if rounding == "stochastic"
                  else v.to(torch.float8_e4m3fn))
    else:
        q = _stochastic_round(v, generator) if rounding == "stochastic" else torch.round(v)
        q = torch.clamp(q, -top, top)
        if name == "int8":
            values = q.to(torch.int8)
        else:
            bits = QUANTIZED_BITS[name]
            values = _pack((q + (1 << (bits - 1))).to(torch.uint8), bits)
    return Quantized(values, scales.reshape(-1).contiguous(), numel, chunk, name)


def dequantize(q: Quantized) -> torch.Tensor:
    """The values ``q`` stands for, as a flat float32 tensor of ``q.numel`` values."""
    if q.dtype in ("int8", "float8_e4m3fn"):
        v = q.values.float()
    else:
        bits = QUANTIZED_BITS[q.dtype]
        v = _unpack(q.values, bits, q.numel).float() - (1 << (bits - 1))
    pad = -q.numel % q.chunk
    if pad:
        v = torch.cat([v, v.new_zeros(pad)])
    return (v.view(-1, q.chunk) * q.scales.view(-1, 1)).reshape(-1)[:q.numel]


def to_bytes(q: Quantized) -> torch.Tensor:
    """``q``'s scales then values as one flat uint8 tensor of :func:`payload_bytes` bytes.

    Scales come first so that they stay aligned for reading back as float32.
    """
    return torch.cat([q.scales.view(torch.uint8), q.values.reshape(-1).view(torch.uint8)])


def from_bytes(data: torch.Tensor, numel: int, dtype: str, chunk: int = QUANT_CHUNK) -> Quantized:
    """Read back :func:`to_bytes`'s result, given what was quantized."""
    name = check(dtype, chunk)
    bits = QUANTIZED_BITS[name]
    scale_bytes = 4 * -(-numel // chunk)
    scales = data[:scale_bytes].view(torch.float32)
    raw = data[scale_bytes:scale_bytes + -(-numel * bits // 8)]
    values = (raw.view(torch.int8) if name == "int8"
              else raw.view(torch.float8_e4m3fn) if name == "float8_e4m3fn" else raw)
    return Quantized(values, scales, numel, chunk, name)
