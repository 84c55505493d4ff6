"""DeMo: Decoupled Momentum Optimization (Peng, Quesnelle, Kingma; arXiv 2411.19870).

Algorithm. Each rank keeps its own momentum ``delta`` per parameter, never
synchronised as a whole. At every step, for every parameter with a gradient:

1. decoupled weight decay: ``param *= 1 - lr * weight_decay``;
2. momentum: ``delta = compression_decay * delta + lr * grad``;
3. the "fast components" of ``delta`` are extracted: a chunked orthonormal
   DCT-II of ``delta``, and in every chunk the ``compression_topk``
   coefficients of largest magnitude. Their inverse DCT is subtracted from
   ``delta`` (what stays is the decoupled, slow part: the error feedback);
4. the ranks all-gather the chosen indices and values. Each coefficient is
   averaged over the ranks that sent it (others contribute nothing), the
   result is transformed back, and
5. every rank moves by ``-lr * sign(inverse DCT of the averaged coefficients)``.

Shapes. A tensor is seen as a matrix: 0-D and 1-D tensors as one row
(``(1, n)``), 2-D as themselves, and higher ranks with their trailing
dimensions flattened (a conv weight ``(out, in, kh, kw)`` as
``(out, in*kh*kw)``). Each matrix dimension is cut into chunks of the largest
divisor of that dimension not above ``compression_chunk``, and the chunks get
a separable 2-D DCT. (A prime dimension above the chunk size thus has chunks
of one entry along it: still exact, just less compressive.)

Guarantees:

- all ranks apply the same update to the same parameters, computed from the
  same gathered coefficients;
- with ``compression_decay = 0`` and ``compression_topk`` at least the chunk
  area, every coefficient is sent and the step is sign-SGD on the mean
  gradient;
- per step a rank sends, for every parameter with a gradient,
  ``chunks * k * (value bytes + index bytes)`` with ``k = min(topk, chunk area)``:
  values in ``comm_dtype`` (4 bytes in float32), indices in the narrowest
  integer that holds the chunk area (1 byte up to 256, 2 up to 65536, else 4).
  gloo cannot all-gather int16, so every payload travels as raw bytes: all
  parameters' values and indices are packed into ONE uint8 buffer and ONE
  all-gather per step, and 2-byte indices cost exactly 2 bytes;
- a parameter without a gradient on a rank is skipped there (its momentum is
  left alone). Its slot in the buffer carries NaN values, which the other
  ranks read as "not sent"; a parameter no rank has a gradient for does not move.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from exogym import comm
from exogym.comm.wire import ModelFacts, Traffic, value_bytes_of

from .context import RankCollectives
from .facts import ChunkGeometry, chunk_size, demo_payload_bytes, is_quantized
from .optim import OptimSpec, ensure_optim_spec
from .settings import DEMO
from .strategy import Strategy

__all__ = ["DeMo", "DeMoStrategy", "ChunkPlan", "average_coefficients", "chunk_size", "dct_matrix"]


_DCT_CACHE: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def dct_matrix(n: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D`` of size ``n`` (``D @ x`` transforms, ``D.T @ y`` inverts)."""
    key = (n, dtype, torch.device(device))
    cached = _DCT_CACHE.get(key)
    if cached is None:
        k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
        i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
        d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
        d[0] /= math.sqrt(2.0)
        cached = d.to(dtype=dtype, device=device)
        _DCT_CACHE[key] = cached
    return cached


class ChunkPlan(ChunkGeometry):
    """How one parameter is cut into chunks (:class:`ChunkGeometry`, which the planner
    reads too), and the transforms and packing of its coefficients."""

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Chunked DCT of ``x``: coefficients of shape ``(chunks, area)``."""
        dr = dct_matrix(self.chunk_rows, x.dtype, x.device)
        dc = dct_matrix(self.chunk_cols, x.dtype, x.device)
        blocks = x.reshape(self.rows // self.chunk_rows, self.chunk_rows,
                           self.cols // self.chunk_cols, self.chunk_cols)
        coeffs = torch.einsum("ji,aibk,lk->abjl", dr, blocks, dc)
        return coeffs.reshape(self.chunks, self.area)

    def decode(self, coeffs: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Inverse of :meth:`encode`, back to ``shape``."""
        dr = dct_matrix(self.chunk_rows, coeffs.dtype, coeffs.device)
        dc = dct_matrix(self.chunk_cols, coeffs.dtype, coeffs.device)
        blocks = coeffs.reshape(self.rows // self.chunk_rows, self.cols // self.chunk_cols,
                                self.chunk_rows, self.chunk_cols)
        x = torch.einsum("ji,abjl,lk->aibk", dr, blocks, dc)
        return x.reshape(shape)

    def pack_indices(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices (int64) in their wire type; 2-byte ones are offset into int16's range."""
        if self.index_bytes == 1:
            return idx.to(torch.uint8)
        if self.index_bytes == 2:
            return (idx - 2**15).to(torch.int16)
        return idx.to(torch.int32)

    def unpack_indices(self, wire: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pack_indices`."""
        idx = wire.long()
        return idx + 2**15 if self.index_bytes == 2 else idx

    def index_dtype(self) -> torch.dtype:
        return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[self.index_bytes]


def _pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Concatenate tensors' raw bytes into one uint8 buffer.

    Wider types come first so every piece starts at an offset its type can
    be viewed from. Returns the buffer and each tensor's ``(offset, nbytes)``.
    """
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    layout: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    pieces = []
    offset = 0
    for i in order:
        raw = tensors[i].contiguous().reshape(-1).view(torch.uint8)
        layout[i] = (offset, raw.numel())
        pieces.append(raw)
        offset += raw.numel()
    return torch.cat(pieces), layout


def _unpack(buffer: torch.Tensor, layout: list[tuple[int, int]],
            like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [buffer[off:off + n].view(t.dtype).view(t.shape) for (off, n), t in zip(layout, like)]


def average_coefficients(indices: list[torch.Tensor], values: list[torch.Tensor],
                         area: int) -> torch.Tensor:
    """Dense ``(chunks, area)`` coefficients from the ranks' sparse ones.

    ``indices[r]`` and ``values[r]`` are rank ``r``'s ``(chunks, k)`` picks. Each
    coefficient is the mean over the ranks that sent it; one nobody sent is 0.
    """
    idx = torch.cat(indices, dim=1)
    vals = torch.cat(values, dim=1).float()
    dense = torch.zeros((idx.shape[0], area), dtype=torch.float32, device=vals.device)
    return dense.scatter_reduce_(1, idx, vals, reduce="mean", include_self=False)


def _float_wire_dtype(comm_dtype: str, owner: object) -> torch.dtype | None:
    """DeMo's wire type: a float type only, since its coefficients are gathered as they are;
    ``owner`` is named in the error."""
    if is_quantized(comm_dtype):
        raise ValueError(f"DeMo sends its top-k coefficients in a float type; comm_dtype="
                         f"{comm_dtype!r} is a quantized type: use 'float32', 'bfloat16' or "
                         "'float16'")
    DEMO.comm_dtype.check(comm_dtype, owner)
    return comm.resolve_dtype(comm_dtype)


class DeMo(torch.optim.Optimizer):
    """The DeMo optimizer: decoupled momentum, DCT top-k sync, sign update.

    Usable on its own (outside a trainer it acts as a world of one) or through
    :class:`DeMoStrategy`. Its ``step()`` is a collective: every rank must call it.

    Args:
        params: parameters (or parameter groups) to optimize.
        lr: learning rate: the size of each sign step, and the scale of ``grad``
            in the momentum.
        compression_decay: momentum decay.
        compression_topk: coefficients sent per chunk.
        compression_chunk: largest chunk size per dimension.
        weight_decay: decoupled weight decay.
        comm_dtype: type the coefficient values travel in (a float type).
        collectives: the collectives its all-gather goes through (its strategy's;
            default: this process's).

    Defaults and accepted values: :data:`exogym.strategy.settings.DEMO`.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = DEMO.lr.default,
        compression_decay: float = DEMO.compression_decay.default,
        compression_topk: int = DEMO.compression_topk.default,
        compression_chunk: int = DEMO.compression_chunk.default,
        weight_decay: float = DEMO.weight_decay.default,
        comm_dtype: str = DEMO.comm_dtype.default,
        collectives: RankCollectives | None = None,
    ):
        DEMO.check(self, lr=lr, compression_decay=compression_decay,
                   compression_topk=compression_topk, compression_chunk=compression_chunk,
                   weight_decay=weight_decay)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.compression_decay = float(compression_decay)
        self.compression_topk = int(compression_topk)
        self.compression_chunk = int(compression_chunk)
        self.comm_dtype = comm_dtype
        self.collectives = collectives if collectives is not None else RankCollectives()
        self.wire_dtype = _float_wire_dtype(comm_dtype, self)
        self._plans: dict[int, ChunkPlan] = {}

    def plan(self, p: torch.Tensor) -> ChunkPlan:
        """The chunk plan of parameter ``p`` (computed once)."""
        plan = self._plans.get(id(p))
        if plan is None:
            plan = ChunkPlan.for_shape(p.shape, self.compression_chunk, self.compression_topk)
            self._plans[id(p)] = plan
        return plan

    def bytes_per_step(self) -> int:
        """Bytes a rank sends per step when every parameter has a gradient."""
        value_bytes = torch.empty((), dtype=self.wire_dtype).element_size()
        return sum(self.plan(p).bytes_per_step(value_bytes)
                   for group in self.param_groups for p in group["params"])

    def _extract(self, p: torch.Tensor, group: dict[str, Any],
                 plan: ChunkPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 2-3 for one parameter: update its momentum, take out the fast part."""
        state = self.state[p]
        if "delta" not in state:
            state["delta"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        delta = state["delta"]
        if self.compression_decay != 1.0:
            delta.mul_(self.compression_decay)
        delta.add_(p.grad, alpha=group["lr"])
        coeffs = plan.encode(delta.float())
        idx = coeffs.abs().topk(plan.k, dim=1, sorted=False).indices
        values = coeffs.gather(1, idx).to(self.wire_dtype)
        # Subtract what is actually sent (after rounding to the wire type), so
        # the rounding error stays in the momentum too.
        sent = torch.zeros_like(coeffs).scatter_(1, idx, values.to(coeffs.dtype))
        delta.sub_(plan.decode(sent, p.shape).to(delta.dtype))
        return values, plan.pack_indices(idx)

    @torch.no_grad()
    def step(self, closure=None):
        """One DeMo step for all parameters (a collective over the ranks)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = []
        payload: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                plan = self.plan(p)
                if p.grad is None:
                    values = torch.full((plan.chunks, plan.k), float("nan"),
                                        dtype=self.wire_dtype, device=p.device)
                    wire_idx = torch.zeros((plan.chunks, plan.k), dtype=plan.index_dtype(),
                                           device=p.device)
                else:
                    values, wire_idx = self._extract(p, group, plan)
                entries.append((p, group, plan))
                payload += [values, wire_idx]
        if not entries:
            return loss
        buffer, layout = _pack(payload)
        world = self.collectives.group_size()
        gathered = [torch.empty_like(buffer) for _ in range(world)]
        self.collectives.all_gather(gathered, buffer)
        per_rank = [_unpack(g, layout, payload) for g in gathered]
        for n, (p, group, plan) in enumerate(entries):
            vals, idxs = [], []
            for tensors in per_rank:
                values = tensors[2 * n]
                if torch.isnan(values).all():  # that rank had no gradient here
                    continue
                vals.append(values.float())
                idxs.append(plan.unpack_indices(tensors[2 * n + 1]))
            if not vals:
                continue
            update = plan.decode(average_coefficients(idxs, vals, plan.area), p.shape)
            lr = group["lr"]
            if group["weight_decay"]:
                p.mul_(1.0 - lr * group["weight_decay"])
            p.add_(update.sign().to(p.dtype), alpha=-lr)
        return loss


class DeMoStrategy(Strategy):
    """DeMo as a strategy: clip, then one :class:`DeMo` step (which is where ranks talk).

    DeMo is its own optimizer; ``lr`` and the schedule arguments act on it as on
    any inner optimizer.

    Args:
        lr: learning rate, the size of each sign step (None: ``optim_spec``'s, else the
            default).
        compression_decay: momentum decay.
        compression_topk: DCT coefficients sent per chunk.
        compression_chunk: largest chunk size per dimension.
        weight_decay: decoupled weight decay (None: ``optim_spec``'s, else the default).
        max_norm: clip the local gradient norm before the step.
        comm_dtype: type the coefficient values travel in (a float type).
        optim_spec: accepted for code written against exo gym: its ``lr`` and
            ``weight_decay`` are used when not given directly; its optimizer
            class is replaced by DeMo (with a warning), and any other argument
            in it is an error, since DeMo could not honour it.
        inner_optim: the same as ``optim_spec``.
        **kwargs: the schedule arguments of ``Strategy`` (``lr_scheduler``,
            ``warmup_steps``, ``cosine_anneal``, ...).

    Defaults and accepted values: :data:`exogym.strategy.settings.DEMO` (the settings
    table in ``docs/strategies.md``).
    """

    stackable = True

    def __init__(
        self,
        lr: float | None = None,
        compression_decay: float = DEMO.compression_decay.default,
        compression_topk: int = DEMO.compression_topk.default,
        compression_chunk: int = DEMO.compression_chunk.default,
        weight_decay: float | None = None,
        max_norm: float | None = None,
        comm_dtype: str = DEMO.comm_dtype.default,
        optim_spec: OptimSpec | str | type | None = None,
        inner_optim: OptimSpec | str | type | None = None,
        **kwargs: Any,
    ):
        if optim_spec is not None and inner_optim is not None:
            raise TypeError("DeMoStrategy: give optim_spec= or inner_optim=, not both")
        spec = ensure_optim_spec(optim_spec if optim_spec is not None else inner_optim)
        if spec is not None:
            extra = sorted(set(spec.kwargs) - {"lr", "weight_decay"})
            if extra:
                raise TypeError(
                    f"DeMoStrategy is its own optimizer and cannot honour {', '.join(extra)} from "
                    f"optim_spec={spec!r}; give lr=, weight_decay= and compression_* instead")
            warnings.warn(f"DeMoStrategy replaces {spec.cls.__name__} with DeMo; only lr and "
                          "weight_decay are taken from optim_spec", stacklevel=2)
            lr = spec.kwargs.get("lr") if lr is None else lr
            weight_decay = spec.kwargs.get("weight_decay") if weight_decay is None else weight_decay
        lr = DEMO.lr.default if lr is None else lr
        weight_decay = DEMO.weight_decay.default if weight_decay is None else weight_decay
        DEMO.check(self, lr=lr, compression_decay=compression_decay,
                   compression_topk=compression_topk, compression_chunk=compression_chunk,
                   weight_decay=weight_decay)
        _float_wire_dtype(comm_dtype, self)
        self.compression_decay = compression_decay
        self.compression_topk = compression_topk
        self.compression_chunk = compression_chunk
        self.weight_decay = weight_decay
        self.comm_dtype = comm_dtype
        super().__init__(lr=lr, max_norm=max_norm, **kwargs)

    def traffic(self, model: ModelFacts, num_nodes: int) -> list[Traffic]:
        """Every step, one all-gather of the top-k DCT coefficients of every chunk with
        their indices (:func:`demo_payload_bytes`), or the payload measured for the model."""
        payload = model.measured_payload
        if payload is None:
            if model.shapes is None:
                raise ValueError("demo needs shapes= (the trainable tensors' shapes) or "
                                 "demo_payload= (bytes per host per step) to size its all-gather")
            payload = demo_payload_bytes(model.shapes, self.compression_chunk,
                                         self.compression_topk, int(value_bytes_of(self.comm_dtype)))
        return [Traffic("all_gather", float(payload), calls=1)]

    def _build_optimizer(self) -> torch.optim.Optimizer:
        return DeMo(
            self.trainable_parameters(), lr=self.lr,
            compression_decay=self.compression_decay, compression_topk=self.compression_topk,
            compression_chunk=self.compression_chunk, weight_decay=self.weight_decay,
            comm_dtype=self.comm_dtype, collectives=self.collectives,
        )

    def step(self) -> None:
        self.clip_grads()
        self.optim.step()
        super().step()

    def __config__(self) -> dict[str, Any]:
        config = super().__config__()
        config["optim"] = {
            "optimizer": "DeMo", "lr": self.lr, "compression_decay": self.compression_decay,
            "compression_topk": self.compression_topk,
            "compression_chunk": self.compression_chunk, "weight_decay": self.weight_decay,
        }
        return config
