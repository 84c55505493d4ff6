"""Stacked ranks: the ranks of one packed process computed as one batched model.

Packed ranks (:mod:`exogym.comm.packed`) run in turn, each its own forward and
backward. With ``fit(stack=True)`` the ranks of a process keep their models,
strategies and optimizers, but their parameters and buffers are views into
one tensor per name, stacked over the process's ranks (shape ``(ranks,
*shape)``). Each rank draws its own batch; the last rank of the process to
arrive at a forward pass computes every present rank's loss at once with
``torch.func.vmap`` over ``functional_call``, and the gradients of each rank's
loss land in its parameters' ``.grad`` as views of one stacked gradient. The
strategies then step as they do packed: what one rank does to its parameters
in place is what the stacked model computes with next.

Equal to one process per rank up to floating-point reassociation of the
batched kernels (the tests hold it within 1e-5); random draws inside
``forward`` (dropout) are drawn for every rank at once, so they differ from a
run without stacking, as two seeds would.

Not every model or strategy can be stacked: :func:`strategy_problem` and
:func:`model_problem` say why, before any rank starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from exogym.run.model_loss import call_arguments, loss_of
from exogym.run.stack_attention import batched_attention

__all__ = ["RankStack", "StackError", "model_problem", "probe_model", "strategy_problem"]


class StackError(ValueError):
    """A run asked to stack ranks that cannot be stacked; the message says why."""


def strategy_problem(strategy: Any) -> str | None:
    """Why ``strategy``'s ranks cannot be stacked (None: they can)."""
    name = type(strategy).__name__
    if strategy.paces_steps:
        return (f"{name} paces each rank at its own speed, so its ranks do not compute a "
                "step together")
    if not getattr(strategy, "stackable", False):
        return (f"{name} does not declare itself stackable: a strategy written outside "
                "exogym sets `stackable = True` once its step changes the model's "
                "parameters only in place (docs/writing-a-strategy.md)")
    return None


def model_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot be stacked, from its modules alone (None: none seen)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) \
                and module.track_running_stats:
            return (f"module {name or '(the model)'} ({type(module).__name__}) updates its "
                    "running statistics in place in every forward pass; use "
                    "track_running_stats=False, GroupNorm or LayerNorm to stack it")
    return None


def probe_model(model: torch.nn.Module, batch: Any) -> str | None:
    """Compute two stacked copies of ``model`` on ``batch`` (forward and backward) as the
    ranks would; why that fails or changes a buffer (None: it works).

    The model itself is left as it was: the copies are stacked from its tensors.
    """
    problem = model_problem(model)
    if problem is not None:
        return problem
    leaves, spec = tree_flatten(batch)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        kinds = sorted({type(leaf).__name__ for leaf in leaves
                        if not isinstance(leaf, torch.Tensor)})
        return (f"a batch holds {', '.join(kinds)} beside tensors; stacked ranks stack "
                "every part of their batches, so a batch must be tensors only")
    params = {name: torch.stack([p.detach()] * 2).requires_grad_(p.requires_grad)
              for name, p in model.named_parameters()}
    buffers = {name: torch.stack([b.detach()] * 2) for name, b in model.named_buffers()}
    before = {name: b.clone() for name, b in buffers.items()}
    batches = tree_unflatten([torch.stack([leaf] * 2) for leaf in leaves], spec)
    inside: list[str] = []
    hooks = []
    for name, module in model.named_modules():
        def enter(_module, _args, name=name):
            inside.append(name)

        def leave(_module, _args, _output, name=name):
            if inside and inside[-1] == name:
                inside.pop()

        hooks.append(module.register_forward_pre_hook(enter))
        hooks.append(module.register_forward_hook(leave))
    try:
        losses = _vmapped(model)(params, buffers, batches)
        if losses.shape != (2,):
            return None  # not a scalar loss: the ranks' own check says so
        trainable = [p for p in params.values() if p.requires_grad]
        torch.autograd.grad(losses.sum(), trainable, allow_unused=True)
    except Exception as exc:  # noqa: BLE001 - any failure is the reason it cannot stack
        where = inside[-1] if inside else ""
        module = model.get_submodule(where) if where else model
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (f"module {where or '(the model)'} ({type(module).__name__}) cannot be "
                f"computed for all ranks at once (torch.func.vmap): {line}")
    finally:
        for hook in hooks:
            hook.remove()
    for name, value in buffers.items():
        if not torch.equal(value, before[name]):
            owner = name.rpartition(".")[0]
            module = model.get_submodule(owner) if owner else model
            return (f"module {owner or '(the model)'} ({type(module).__name__}) changes its "
                    f"buffer {name.rpartition('.')[2]} in place in forward; stacked ranks "
                    "would share one update")
    return None


def _rank_loss(model: torch.nn.Module, params: dict[str, torch.Tensor],
               buffers: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    """One rank's loss: ``model`` computed with ``params`` and ``buffers`` on ``batch``,
    called and read as every rank's model is (:mod:`exogym.run.model_loss`)."""
    from torch.func import functional_call

    args, kwargs = call_arguments(model, batch)
    return loss_of(functional_call(model, (params, buffers), args, kwargs)).reshape(())


def _vmapped(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """Every rank's loss at once: ``vmap`` over the ranks of ``functional_call``, with
    attention computed for all ranks in one call (:mod:`exogym.run.stack_attention`)."""
    from torch.func import vmap

    def one(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
            batch: Any) -> torch.Tensor:
        return _rank_loss(model, params, buffers, batch)

    ranks = vmap(one, in_dims=(0, 0, 0), randomness="different")

    def losses(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
               batches: Any) -> torch.Tensor:
        with batched_attention():
            return ranks(params, buffers, batches)

    return losses


class _Rank:
    """What the stack holds of one rank: its parameters and where its gradients go."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params = dict(model.named_parameters())


class RankStack:
    """The ranks of one packed process, computed as one batched model.

    Created once per process (:meth:`exogym.comm.packed.PackedWorld.held_once`);
    each rank :meth:`join`\\ s with its model, then hands each minibatch to
    :meth:`backward`.

    Args:
        meet: hands a rank's part to a meeting of the process's ranks present at its
            step; the last to arrive runs the given function on every part and each
            rank gets its own result (:meth:`exogym.comm.packed.PackedWorld.meet_here`).
        ranks: the process's ranks, in order.
    """

    def __init__(self, meet: Callable[[Any, Callable[[dict[int, Any]], dict[int, Any]]], Any],
                 ranks: Sequence[int]):
        self._meet = meet
        self._slot = {rank: i for i, rank in enumerate(ranks)}
        self._ranks: dict[int, _Rank] = {}
        self._params: dict[str, torch.Tensor] = {}  # name -> (ranks, *shape)
        self._buffers: dict[str, torch.Tensor] = {}
        self._leaves: dict[str, torch.Tensor] | None = None  # the stack, as autograd leaves
        self._trainable: dict[str, bool] = {}  # by parameter name: requires_grad
        self._forward: Callable[..., torch.Tensor] | None = None

    def join(self, rank: int, model: torch.nn.Module) -> None:
        """Make ``model``'s parameters and buffers rank ``rank``'s views of the stack."""
        if rank not in self._slot:
            raise ValueError(f"rank {rank} is not one of this stack's ranks {list(self._slot)}")
        slot = self._slot[rank]
        count = len(self._slot)
        for name, p in model.named_parameters():
            stacked = self._params.get(name)
            if stacked is None:
                stacked = self._params[name] = p.new_empty((count, *p.shape))
            stacked[slot].copy_(p.detach())
            p.data = stacked[slot]
            self._trainable[name] = p.requires_grad
        for name, b in model.named_buffers():
            stacked = self._buffers.get(name)
            if stacked is None:
                stacked = self._buffers[name] = b.new_empty((count, *b.shape))
            stacked[slot].copy_(b)
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            module._buffers[attr] = stacked[slot]
        self._ranks[rank] = _Rank(model)
        if self._forward is None:
            self._forward = _vmapped(model)

    def backward(self, rank: int, batch: Any, scale: float,
                 autocast: AbstractContextManager | None = None) -> tuple[torch.Tensor, float, float]:
        """Rank ``rank``'s loss on ``batch``, with ``scale`` times its gradient added to its
        parameters' ``.grad``, computed with every present rank of the process at once.

        Returns the loss (detached) and this rank's share of the computation, in wall
        and CPU seconds (the whole, over the ranks computed together).
        """
        return self._meet((batch, scale), lambda parts: self._compute(parts, autocast))

    def _compute(self, parts: dict[int, tuple[Any, float]],
                 autocast: AbstractContextManager | None) -> dict[int, tuple[torch.Tensor, float, float]]:
        wall, cpu = time.perf_counter(), time.thread_time()
        ranks = sorted(parts)
        missing = [r for r in ranks if r not in self._ranks]
        if missing:
            raise RuntimeError(f"ranks {missing} computed before they joined the stack")
        full = len(ranks) == len(self._slot)
        if full:
            if self._leaves is None:
                self._leaves = {name: t.detach().requires_grad_(self._trainable[name])
                                for name, t in self._params.items()}
            params, buffers = self._leaves, self._buffers
        else:
            index = torch.tensor([self._slot[r] for r in ranks],
                                 device=next(iter(self._params.values())).device)
            params = {name: t.index_select(0, index).requires_grad_(self._trainable[name])
                      for name, t in self._params.items()}
            buffers = {name: t.index_select(0, index) for name, t in self._buffers.items()}
        batches = [parts[r][0] for r in ranks]
        scales = torch.tensor([parts[r][1] for r in ranks], dtype=torch.float32)
        with autocast or nullcontext():
            losses = self._losses(params, buffers, batches)
        trainable = [name for name, t in params.items() if t.requires_grad]
        total = (losses.float() * scales.to(losses.device)).sum()
        grads = torch.autograd.grad(total, [params[n] for n in trainable], allow_unused=True)
        # A batched kernel may hand a gradient back in another memory order (a linear
        # layer's, transposed); optimizers' fused kernels and the collectives take each
        # rank's gradient as one contiguous block.
        grads = [g if g is None or g.is_contiguous() else g.contiguous() for g in grads]
        for j, r in enumerate(ranks):
            own = self._ranks[r].params
            for name, grad in zip(trainable, grads):
                if grad is None:
                    continue
                p = own[name]
                if p.grad is None:
                    p.grad = grad[j]
                else:
                    p.grad.add_(grad[j])
        losses = losses.detach()
        share_wall = (time.perf_counter() - wall) / len(ranks)
        share_cpu = (time.thread_time() - cpu) / len(ranks)
        return {r: (losses[j], share_wall, share_cpu) for j, r in enumerate(ranks)}

    def _losses(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                batches: list[Any]) -> torch.Tensor:
        flat = [tree_flatten(b) for b in batches]
        spec = flat[0][1]
        same = all(s == spec and len(leaves) == len(flat[0][0])
                   and all(isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                           and x.shape == y.shape and x.dtype == y.dtype
                           for x, y in zip(leaves, flat[0][0]))
                   for leaves, s in flat)
        assert self._forward is not None
        if same:
            stacked = tree_unflatten([torch.stack(column) for column in
                                      zip(*(leaves for leaves, _ in flat))], spec)
            losses = self._forward(params, buffers, stacked)
        else:
            # Batches of different shapes (an epoch's short last batch): each rank's
            # loss on its own slice of the stack, still one backward.
            model = next(iter(self._ranks.values())).model
            losses = torch.stack([
                _rank_loss(model, {n: t[j] for n, t in params.items()},
                           {n: t[j] for n, t in buffers.items()}, batch)
                for j, batch in enumerate(batches)])
        if losses.shape != (len(batches),):
            raise TypeError("model.forward(batch) must return a scalar loss tensor, got "
                            f"shape {tuple(losses.shape[1:])} for each rank")
        return losses
