"""Scaled dot-product attention for stacked ranks: every rank's heads in one kernel call.

``torch.func.vmap`` has no batching rule for the fused attention kernels torch
picks on the CPU: under ``vmap`` it calls the kernel once per rank, and in the
backward pass it writes each rank's gradient into a zeroed tensor the size of
every rank's together, so the work grows with the square of the ranks.
Attention batches over its leading dimensions, so the ranks' dimension can
join them: inside :func:`batched_attention` (the forward pass of stacked ranks,
:mod:`exogym.run.stack`), ``torch.nn.functional.scaled_dot_product_attention``
computes all the ranks in one call, and its backward pass computes the
attention again and takes its gradient (attention's own share of a step is
small; the matrix products around it are not touched).

A model that calls the function as ``F.scaled_dot_product_attention`` (or
through ``torch.nn.MultiheadAttention``) gets it; one that bound the name at
import, or asks for dropout inside attention, keeps ``vmap``'s own way: the
same numbers, more slowly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["batched_attention"]

_TORCH_ATTENTION = F.scaled_dot_product_attention


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
            gqa: bool) -> torch.Tensor:
    extra = {"enable_gqa": True} if gqa else {}
    return _TORCH_ATTENTION(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                            scale=scale, **extra)


class _RanksAttention(torch.autograd.Function):
    """Attention whose ``vmap`` rule folds the ranks into the batch; backward recomputes."""

    generate_vmap_rule = False

    @staticmethod
    def forward(query, key, value, attn_mask, is_causal, scale, gqa):  # type: ignore[override]
        return _attend(query, key, value, attn_mask, is_causal, scale, gqa)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        query, key, value, attn_mask, is_causal, scale, gqa = inputs
        ctx.save_for_backward(query, key, value, attn_mask)
        ctx.settings = (is_causal, scale, gqa)
        device = query.device.type  # recomputed backward as it was computed: autocast too
        ctx.autocast = (device, torch.is_autocast_enabled(device),
                        torch.get_autocast_dtype(device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        saved = ctx.saved_tensors
        wants = ctx.needs_input_grad[:4]
        device, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            inputs = [None if t is None else t.detach().requires_grad_(want)
                      for t, want in zip(saved, wants)]
            out = _attend(*inputs, *ctx.settings)
        needed = [t for t, want in zip(inputs, wants) if t is not None and want]
        found = iter(torch.autograd.grad(out, needed, grad) if needed else ())
        grads = [next(found) if t is not None and want else None
                 for t, want in zip(inputs, wants)]
        return (*grads, None, None, None)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, query, key, value, attn_mask, is_causal, scale, gqa):
        ranks = info.batch_size
        front = []
        for t, dim in zip((query, key, value), in_dims[:3]):
            t = t.unsqueeze(0).expand(ranks, *t.shape) if dim is None else t.movedim(dim, 0)
            front.append(t)
        query, key, value = front
        # (ranks, batch, ..., L, E): the ranks join the first batch dimension, so the
        # kernel sees the layout it was built for.
        fold = query.dim() >= 5
        mask_dim = in_dims[3]
        if fold and attn_mask is not None and mask_dim is None \
                and attn_mask.dim() == query.dim() - 1 and attn_mask.shape[0] != 1:
            # the same mask for every rank, with a batch dimension of its own: once the
            # ranks join that dimension it must be there for each rank
            attn_mask, mask_dim = attn_mask.unsqueeze(0).expand(ranks, *attn_mask.shape), 0
        if attn_mask is not None and mask_dim is not None:
            mask = attn_mask.movedim(mask_dim, 0)
            mask = mask.reshape(ranks, *([1] * (query.dim() - mask.dim())), *mask.shape[1:])
            attn_mask = mask.expand(ranks, *query.shape[1:-1], key.shape[-2]) if fold else mask
        if fold:
            query, key, value = (t.flatten(0, 1) for t in (query, key, value))
            if attn_mask is not None and mask_dim is not None:
                attn_mask = attn_mask.flatten(0, 1)
        out = _RanksAttention.apply(query, key, value, attn_mask, is_causal, scale, gqa)
        if fold:
            out = out.unflatten(0, (ranks, -1))
        return out, 0


def _ranks_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` as stacked ranks compute it (see the module)."""
    if dropout_p > 0.0:  # recomputing would draw other masks: vmap's own way
        extra = {"enable_gqa": True} if enable_gqa else {}
        return _TORCH_ATTENTION(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                is_causal=is_causal, scale=scale, **extra)
    return _RanksAttention.apply(query, key, value, attn_mask, is_causal, scale,
                                 bool(enable_gqa))


@contextmanager
def batched_attention() -> Iterator[None]:
    """Within it, ``torch.nn.functional.scaled_dot_product_attention`` computes the ranks
    of a ``vmap`` in one call. Only the thread holding its process's baton runs then
    (:mod:`exogym.comm.packed`), so swapping the module's attribute touches no other rank."""
    if F.scaled_dot_product_attention is _ranks_attention:
        yield
        return
    F.scaled_dot_product_attention = _ranks_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _TORCH_ATTENTION
