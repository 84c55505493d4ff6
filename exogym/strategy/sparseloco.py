"""SparseLoCo: DiLoCo rounds that send a 2-bit top-k of an error-feedback buffer.

Algorithm (Sarfi et al. 2025, arXiv 2508.15706). Every rank keeps a copy of
the global parameters ``θ`` and its own error-feedback buffer ``e`` (zero at
the start). Between rounds it takes ``H`` inner optimizer steps on its own
data. After every ``H``-th inner step:

1. ``Δ = θ − θ_local`` (the drift over the round) and ``e ← β·e + Δ``, with
   ``β = error_decay``;
2. each trainable tensor's ``e`` is flattened and cut into chunks of ``chunk``
   values (a tensor smaller than ``chunk`` is one chunk; the last chunk is
   padded with zeros), and in every chunk the ``topk`` values of largest
   magnitude are chosen;
3. their values are quantized to ``quant_bits`` bits on a uniform grid spanning
   the chunk's chosen values (``lo`` to ``hi``, ``2**quant_bits`` levels, round to
   nearest), or sent as float32 with ``quant_bits=None``;
4. what was sent, dequantized, is subtracted from ``e`` (the rest waits for a
   later round);
5. the ranks all-gather the payloads; every rank decodes them and scatter-adds
   them in rank order 0, 1, ... into a zero buffer, divides by the number of
   ranks and applies ``θ ← θ − outer_lr · mean`` (an SGD step without momentum:
   the error feedback takes the place of DiLoCo's outer momentum). Every rank
   does the same arithmetic on the same numbers, so all end bitwise equal;
6. the local model takes ``θ``; the inner optimizer's state carries over.

Float buffers (BatchNorm statistics) are averaged densely in float32, as DiLoCo does.

The reference quantizes with a range set from the values' statistics; here the
range is the chosen values' minimum and maximum, so the extremes are exact.

Bytes. One all-gather per round; per tensor of ``n`` values with
``size = min(chunk, n)``, ``chunks = ceil(n / size)``, ``k = min(topk, size)``
and ``b = max(1, ceil(log2(size)))`` index bits (12 for a chunk of 4,096):
``ceil(chunks·k·b / 8)`` bytes of indices, ``ceil(chunks·k·quant_bits / 8)`` of values
and ``8·chunks`` of ranges (two float32 per chunk), or ``4·chunks·k`` of values
and no ranges unquantized; plus ``4·B`` for ``B`` float buffer values.
:func:`exogym.strategy.facts.sparseloco_payload_bytes` is that formula.

Guarantee: with ``topk == chunk``, ``quant_bits=None`` and ``error_decay=0`` a
round sends every drift value exactly, and the update equals DiLoCo's with
outer SGD at ``outer_lr`` and no momentum: bitwise with two ranks (a sum of two
numbers does not depend on its order); with more ranks up to float rounding,
because the all-reduce may add the ranks' values in another order than rank
order.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from exogym.comm.wire import ModelFacts, Traffic

from .communicate_optimize_strategy import CommunicateOptimizeStrategy, CommunicationModule
from .context import RankContext
from .facts import sparse_chunking, sparseloco_payload_bytes
from .optim import OptimSpec
from .outer import OuterOptimizer
from .settings import SPARSELOCO

__all__ = ["SparseLoCoCommunicator", "SparseLoCoStrategy", "SparsePlan", "pack_bits", "unpack_bits"]

_BIT_WEIGHTS = 1 << torch.arange(8, dtype=torch.int64)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below ``2**bits`` packed ``bits`` apiece, little-endian, into uint8.

    The result has ``ceil(values.numel() * bits / 8)`` bytes.
    """
    flat = values.reshape(-1).to(torch.int64)
    shifts = torch.arange(bits, dtype=torch.int64, device=flat.device)
    stream = ((flat.unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = -stream.numel() % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    bits_by_place = stream.view(-1, 8)
    packed = torch.zeros(bits_by_place.shape[0], dtype=torch.uint8, device=flat.device)
    for place in range(8):
        packed |= bits_by_place[:, place] << place
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` integers, as int64."""
    weights = _BIT_WEIGHTS.to(packed.device)
    stream = ((packed.to(torch.int64).unsqueeze(1) & weights) != 0).to(torch.int64).reshape(-1)
    stream = stream[:count * bits].view(count, bits)
    shifts = torch.arange(bits, dtype=torch.int64, device=packed.device)
    return (stream << shifts).sum(dim=1)


def _ceil_bytes(count: int, bits: int) -> int:
    return -(-count * bits // 8)


class SparsePlan:
    """How one tensor is chunked, chosen, quantized and laid out in the payload.

    Args:
        numel: values in the tensor.
        chunk: values per chunk.
        topk: values sent per chunk.
        quant_bits: bits per sent value, or None for float32.
    """

    def __init__(self, numel: int, chunk: int, topk: int, quant_bits: int | None):
        self.numel = numel
        self.chunks, self.size, self.k, self.index_bits = sparse_chunking(numel, chunk, topk)
        self.quant_bits = quant_bits
        self.sent = self.chunks * self.k
        self.index_bytes = _ceil_bytes(self.sent, self.index_bits)
        if quant_bits is None:
            self.value_bytes, self.range_bytes = 4 * self.sent, 0
        else:
            self.value_bytes = _ceil_bytes(self.sent, quant_bits)
            self.range_bytes = 8 * self.chunks
        self.nbytes = self.index_bytes + self.value_bytes + self.range_bytes

    def chunked(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` padded with zeros to whole chunks, as ``(chunks, size)``."""
        pad = self.chunks * self.size - self.numel
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(self.chunks, self.size)

    def encode(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Choose and quantize ``e``'s top-k per chunk.

        Returns:
            (payload bytes, chosen indices ``(chunks, k)``, their dequantized values).
        """
        blocks = self.chunked(e.reshape(-1))
        idx = torch.topk(blocks.abs(), self.k, dim=1, sorted=False).indices
        values = torch.gather(blocks, 1, idx)
        parts = [pack_bits(idx, self.index_bits)]
        if self.quant_bits is None:
            parts.append(values.contiguous().view(-1).view(torch.uint8))
            sent = values
        else:
            levels = (1 << self.quant_bits) - 1
            lo = values.amin(dim=1, keepdim=True)
            step = (values.amax(dim=1, keepdim=True) - lo) / levels
            safe = torch.where(step > 0, step, torch.ones_like(step))
            q = torch.round((values - lo) / safe).clamp_(0, levels)
            q = torch.where(step > 0, q, torch.zeros_like(q))
            parts.append(pack_bits(q, self.quant_bits))
            ranges = torch.cat([lo, step], dim=1).contiguous()
            parts.append(ranges.view(-1).view(torch.uint8))
            sent = self._dequantize(q.to(torch.int64), ranges)
        return torch.cat(parts), idx, sent

    def decode(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices ``(chunks, k)`` and dequantized values from a rank's payload bytes."""
        at = self.index_bytes
        idx = unpack_bits(payload[:at], self.index_bits, self.sent).view(self.chunks, self.k)
        value_bytes = payload[at:at + self.value_bytes]
        if self.quant_bits is None:
            values = value_bytes.clone().view(torch.float32).view(self.chunks, self.k)
            return idx, values
        q = unpack_bits(value_bytes, self.quant_bits, self.sent).view(self.chunks, self.k)
        ranges = payload[at + self.value_bytes:at + self.value_bytes + self.range_bytes]
        return idx, self._dequantize(q, ranges.clone().view(torch.float32).view(self.chunks, 2))

    @staticmethod
    def _dequantize(q: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
        return ranges[:, :1] + q.to(torch.float32) * ranges[:, 1:]


class SparseLoCoCommunicator(CommunicationModule):
    """The SparseLoCo outer round as a composable module.

    Args:
        H: inner steps per round.
        topk: values sent per chunk.
        chunk: values per chunk.
        quant_bits: bits per sent value (1-8), or None for float32.
        error_decay: ``β`` in ``e ← β·e + Δ`` (0 keeps no memory of unsent values).
        outer_lr: ``θ ← θ − outer_lr · mean``.
    """

    def __init__(self, H: int = SPARSELOCO.H.default, topk: int = SPARSELOCO.topk.default,
                 chunk: int = SPARSELOCO.chunk.default,
                 quant_bits: int | None = SPARSELOCO.quant_bits.default,
                 error_decay: float = SPARSELOCO.error_decay.default,
                 outer_lr: float = SPARSELOCO.outer_lr.default):
        super().__init__()
        check_settings(self, H, topk, chunk, quant_bits, error_decay, outer_lr)
        self.H, self.topk, self.chunk = H, topk, chunk
        self.quant_bits = quant_bits
        self.error_decay = float(error_decay)
        self.outer_lr = float(outer_lr)

    def setup(self, context: RankContext) -> None:
        super().setup(context)
        model = context.model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.master = [p.detach().clone() for p in self.params]
        self.errors = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.plans = [SparsePlan(p.numel(), self.chunk, self.topk, self.quant_bits)
                      for p in self.params]
        # The same SGD (no momentum) DiLoCo builds for outer_momentum=0, so the two agree.
        self.outer_optim = OuterOptimizer(None, self.outer_lr, 0.0, False).optim_spec().build(
            self.master)

    def payload_bytes(self) -> int:
        """Bytes this rank's all-gather carries per round (float buffers not included)."""
        return sum(plan.nbytes for plan in self.plans)

    @torch.no_grad()
    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int,
                    local_step: int) -> None:
        if (local_step + 1) % self.H != 0:
            return
        payloads = []
        for master, p, e, plan in zip(self.master, self.params, self.errors, self.plans):
            e.mul_(self.error_decay).add_(master - p.detach())
            payload, idx, sent = plan.encode(e)
            flat = plan.chunked(e.view(-1).clone())
            flat.scatter_add_(1, idx, -sent)
            e.copy_(flat.view(-1)[:plan.numel].view_as(e))
            payloads.append(payload)
        mine = torch.cat(payloads)
        collectives = self.collectives
        ranks = collectives.group_size()  # the ranks present: fewer than num_nodes while some are away
        gathered = [torch.empty_like(mine) for _ in range(ranks)]
        collectives.all_gather(gathered, mine)
        if self.buffers:
            collectives.all_reduce_tensors(self.buffers, average=True)
        offsets = [0]
        for plan in self.plans:
            offsets.append(offsets[-1] + plan.nbytes)
        for i, (master, plan) in enumerate(zip(self.master, self.plans)):
            total = torch.zeros(plan.chunks, plan.size, dtype=torch.float32, device=master.device)
            for payload in gathered:
                idx, values = plan.decode(payload[offsets[i]:offsets[i + 1]])
                total.scatter_add_(1, idx.to(master.device), values.to(master.device))
            mean = total.view(-1)[:plan.numel].div_(ranks)
            master.grad = mean.view_as(master).to(master.dtype)
        self.outer_optim.step()
        for master, p in zip(self.master, self.params):
            master.grad = None
            p.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        return {"master": [m.detach() for m in self.master],
                "errors": [e.detach() for e in self.errors],
                "outer_optim": self.outer_optim.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
            for e, saved in zip(self.errors, state["errors"]):
                e.copy_(saved)
        self.outer_optim.load_state_dict(state["outer_optim"])


def check_settings(owner: object, H: int, topk: int, chunk: int, quant_bits: int | None,
                   error_decay: float, outer_lr: float) -> None:
    """Refuse settings SparseLoCo cannot run, naming ``owner`` and the value: each against
    its declaration, then ``topk`` against ``chunk``."""
    SPARSELOCO.check(owner, H=H, topk=topk, chunk=chunk, quant_bits=quant_bits,
                     error_decay=error_decay, outer_lr=outer_lr)
    if topk > chunk:
        raise ValueError(f"{type(owner).__name__}: topk ({topk}) cannot exceed chunk ({chunk}); "
                         "topk is the number of values sent out of each chunk")


class SparseLoCoStrategy(CommunicateOptimizeStrategy):
    """SparseLoCo: ``H`` local steps, then a top-k, quantized, error-fed outer round.

    Args:
        H: inner steps per round.
        topk: values sent per chunk.
        chunk: values per chunk (``topk / chunk`` is the density sent).
        quant_bits: bits per sent value, 1-8, or None to send float32.
        error_decay: ``β`` of the error-feedback buffer.
        outer_lr: the outer step size.
        optim_spec: the inner optimizer (default AdamW); ``inner_optim=`` is the same.
        **kwargs: inner optimizer, schedule and clipping arguments of ``Strategy``.

    Defaults and accepted values: :data:`exogym.strategy.settings.SPARSELOCO` (the
    settings table in ``docs/strategies.md``).
    """

    stackable = True

    def __init__(
        self,
        H: int = SPARSELOCO.H.default,
        topk: int = SPARSELOCO.topk.default,
        chunk: int = SPARSELOCO.chunk.default,
        quant_bits: int | None = SPARSELOCO.quant_bits.default,
        error_decay: float = SPARSELOCO.error_decay.default,
        outer_lr: float = SPARSELOCO.outer_lr.default,
        optim_spec: OptimSpec | str | None = None,
        **kwargs: Any,
    ):
        check_settings(self, H, topk, chunk, quant_bits, error_decay, outer_lr)
        self.sparseloco = SparseLoCoCommunicator(H, topk, chunk, quant_bits, error_decay, outer_lr)
        self.H, self.topk, self.chunk = H, topk, chunk
        self.quant_bits, self.error_decay, self.outer_lr = quant_bits, error_decay, outer_lr
        super().__init__(communication_modules=[self.sparseloco], optim_spec=optim_spec, **kwargs)

    traffic_needs = ("H",)

    def traffic(self, model: ModelFacts, num_nodes: int) -> list[Traffic]:
        """Every ``H`` steps, one all-gather of each tensor's top-k per chunk (indices and
        quantized values, :func:`sparseloco_payload_bytes`) and a dense float32 average of
        the float buffers."""
        sizes = ([math.prod(shape) for shape in model.shapes] if model.shapes is not None
                 else [model.num_params])
        gathered = sparseloco_payload_bytes(sizes, self.chunk, self.topk, self.quant_bits)
        stated = [Traffic("all_gather", float(gathered), every=self.H, calls=1)]
        if model.num_buffers:
            stated.append(Traffic("all_reduce", 4.0 * model.num_buffers, every=self.H))
        return stated

    def __config__(self) -> dict[str, Any]:
        config = super().__config__()
        config.update(topk=self.topk, chunk=self.chunk, quant_bits=self.quant_bits,
                      error_decay=self.error_decay, outer_lr=self.outer_lr)
        return config
