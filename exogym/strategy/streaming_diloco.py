"""Streaming DiLoCo: DiLoCo's outer round cut into fragments that sync in turn.

Algorithm (Douillard et al., 2025, arXiv 2501.18512). Instead of one
all-reduce of every parameter each ``H`` steps, the model is split into
``num_fragments`` fragments and each fragment has its own outer round, every
``H`` steps, staggered so that at most one fragment's worth of bytes is on
the wire at a time.

**Layers and fragments.** For a generic ``nn.Module`` a *layer* is a module
that directly owns (``recurse=False``) at least one trainable parameter or
floating-point buffer not met before (a shared tensor belongs to its first
owner), taken in the order of ``model.named_modules()``; a
layer's tensors are its own parameters then its own buffers. Layer ``i``
belongs to fragment ``i % num_fragments``: fragment ``p`` holds layers
``p, p+F, p+2F, ...``, strided across depth as in the paper, so every fragment
reaches from the bottom of the network to the top. ``num_fragments`` may not
exceed the number of layers (a fragment would be empty).

**Schedule.** With 1-based inner step counts ``s = local_step + 1``, fragment
``p`` starts its round after step ``s`` when ``s % H == (p * H // F) % H``
(``F = num_fragments``; the offset ``p·H/F`` is rounded down when ``H`` is not
divisible by ``F``). Fragment 0 therefore syncs after steps ``H, 2H, ...``
exactly as DiLoCo does, and fragment ``p > 0`` first after ``p * H // F``
steps. ``num_fragments`` may not exceed ``H`` (two fragments would share a step).

**A fragment's round.** When it starts, the rank computes the outer gradient
``master - local`` of the fragment's parameters (and copies its buffers), and
starts one all-reduce of them (average over ranks) through
:func:`exogym.comm.all_reduce_tensors` with ``async_op=True``. With
``fragment_delay=τ`` the rank takes ``τ`` more inner steps while it runs; after
step ``s + τ`` it waits for the result, applies the fragment's own outer
optimizer (by default DiLoCo's: SGD with Nesterov momentum) to the
fragment's global copy, and sets every local tensor of the fragment to
``global + α·(local - global)`` with ``α = fragment_alpha`` and ``local`` the
value at that moment (so ``α = 0`` takes the global value, dropping the ``τ``
steps of local progress on that fragment). Buffers (BatchNorm statistics)
take the average, as in DiLoCo. ``τ`` must be smaller than ``H`` so a
fragment's round ends before its next one starts. Rounds due at the same step
finish before new ones start. A round still in flight when training stops is
not applied.

With ``num_fragments=1``, ``fragment_delay=0`` and ``fragment_alpha=0`` this is
DiLoCo, bitwise.

**Bytes.** Each round sends the fragment's values once: ``4 * n_p`` bytes in
float32 for a fragment of ``n_p`` values (parameters plus floating buffers),
about ``1/F`` of DiLoCo's ``4 * P`` per round, so the peak per sync is ``F``
times lower while the total over ``H`` steps is the same;
``exogym.strategy.facts.streaming_sync_bytes`` gives the number, also for
``'bfloat16'`` and the quantized types (packed values plus a float32 scale per
``chunk`` values).

**Checkpoints.** A checkpoint taken while a fragment's round is in flight
waits for its all-reduce (the result does not depend on when it is waited
for) and saves the averaged outer gradient and buffers with the step at which
they apply; a resumed run applies them at that step, so it ends exactly as an
uninterrupted one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from exogym import comm
from exogym.base.plural import plural
from exogym.comm.wire import ModelFacts, Traffic, wire_bytes, wire_collective

from .communicate_optimize_strategy import CommunicateOptimizeStrategy, CommunicationModule
from .context import RankContext
from .diloco import check_error_feedback
from .facts import QUANT_CHUNK, fragment_offset
from .optim import OptimSpec
from .outer import OuterOptimizer
from .settings import STREAMING_DILOCO


def model_layers(model: torch.nn.Module) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The model's layers in module order: per layer, (trainable parameters, float buffers).

    A layer is a module that directly owns a trainable parameter or a
    floating-point buffer; modules owning neither are skipped.
    """
    layers, seen = [], set()
    for module in model.modules():
        params = [p for p in module.parameters(recurse=False)
                  if p.requires_grad and id(p) not in seen]
        buffers = [b for b in module.buffers(recurse=False)
                   if b.is_floating_point() and id(b) not in seen]
        seen.update(id(t) for t in params + buffers)
        if params or buffers:
            layers.append((params, buffers))
    return layers


@dataclass
class _Fragment:
    """One fragment's tensors, its global copy and its outer optimizer."""

    index: int
    offset: int
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    master: list[torch.Tensor]
    outer_optim: torch.optim.Optimizer | None
    residuals: list[torch.Tensor] | None

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.params + self.buffers)


@dataclass
class _Pending:
    """A fragment's round in flight: what was sent (reduced in place) and when it applies."""

    fragment: int
    apply_after: int  # the local_step after which the result is applied
    deltas: list[torch.Tensor]
    buffers: list[torch.Tensor]
    handle: Any = None  # None once the result is in deltas/buffers


class StreamingDiLoCoCommunicator(CommunicationModule):
    """Streaming DiLoCo's fragment rounds as a composable module.

    Args:
        H: inner steps between two rounds of the same fragment.
        num_fragments: fragments the layers are split into (strided).
        outer_optim_spec: the outer optimizer, one instance per fragment.
        fragment_delay: inner steps taken while a fragment's all-reduce runs (``0 <= τ < H``).
        fragment_alpha: mixing ``α`` in ``[0, 1]``: local = global + α·(local - global).
        comm_dtype: type the fragment travels in (float or quantized, as DiLoCo).
        error_feedback: keep each fragment's quantization residual for its next round
            (quantized ``comm_dtype`` only).
        chunk: values per quantization scale (quantized ``comm_dtype`` only).
    """

    def __init__(self, H: int, num_fragments: int, outer_optim_spec: OptimSpec,
                 fragment_delay: int = STREAMING_DILOCO.fragment_delay.default,
                 fragment_alpha: float = STREAMING_DILOCO.fragment_alpha.default,
                 comm_dtype: str = STREAMING_DILOCO.comm_dtype.default,
                 error_feedback: bool = STREAMING_DILOCO.error_feedback.default,
                 chunk: int = QUANT_CHUNK):
        super().__init__()
        check_settings(self, H, num_fragments, fragment_delay, fragment_alpha)
        STREAMING_DILOCO.comm_dtype.check(comm_dtype, self)
        comm.resolve_dtype(comm_dtype)
        check_error_feedback(error_feedback, comm_dtype, self)
        self.H = H
        self.num_fragments = num_fragments
        self.fragment_delay = fragment_delay
        self.fragment_alpha = float(fragment_alpha)
        self.outer_optim_spec = outer_optim_spec
        self.comm_dtype = comm_dtype
        self.error_feedback = bool(error_feedback)
        self.chunk = chunk
        self.fragments: list[_Fragment] = []
        self.pending: list[_Pending] = []

    def validate(self, model: torch.nn.Module, num_nodes: int) -> None:
        """Every fragment needs a layer of its own: ``num_fragments`` at most the model's
        layers."""
        check_fragments(self.num_fragments, model_layers(model))

    def setup(self, context: RankContext) -> None:
        super().setup(context)
        model = context.model
        layers = model_layers(model)
        check_fragments(self.num_fragments, layers)  # validate() said so before the start
        self.fragments = []
        self.pending = []
        for p in range(self.num_fragments):
            params = [t for params, _ in layers[p::self.num_fragments] for t in params]
            buffers = [t for _, buffers in layers[p::self.num_fragments] for t in buffers]
            master = [t.detach().clone() for t in params]
            residuals = ([torch.zeros_like(t, dtype=torch.float32) for t in params + buffers]
                         if self.error_feedback else None)
            self.fragments.append(_Fragment(
                index=p, offset=fragment_offset(p, self.H, self.num_fragments),
                params=params, buffers=buffers, master=master,
                outer_optim=self.outer_optim_spec.build(master) if master else None,
                residuals=residuals))

    @torch.no_grad()
    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int,
                    local_step: int) -> None:
        due = [p for p in self.pending if p.apply_after == local_step]
        for pending in due:
            self._apply(pending)
        self.pending = [p for p in self.pending if p.apply_after != local_step]
        for fragment in self.fragments:
            if (local_step + 1) % self.H == fragment.offset:
                self._start(fragment, local_step)

    def _start(self, fragment: _Fragment, local_step: int) -> None:
        deltas = [m - p.detach() for m, p in zip(fragment.master, fragment.params)]
        buffers = [b.detach().clone() for b in fragment.buffers]
        handle = self.collectives.all_reduce_tensors(
            deltas + buffers, average=True, dtype=self.comm_dtype, chunk=self.chunk,
            error_feedback=fragment.residuals, async_op=True)
        pending = _Pending(fragment.index, local_step + self.fragment_delay, deltas, buffers,
                           handle)
        if self.fragment_delay == 0:
            self._apply(pending)
        else:
            self.pending.append(pending)

    def _apply(self, pending: _Pending) -> None:
        if pending.handle is not None:
            pending.handle.wait()
            pending.handle = None
        fragment = self.fragments[pending.fragment]
        if fragment.outer_optim is not None:
            for master, delta in zip(fragment.master, pending.deltas):
                master.grad = delta
            fragment.outer_optim.step()
            for master in fragment.master:
                master.grad = None
        alpha = self.fragment_alpha
        for p, master in zip(fragment.params, fragment.master):
            if alpha == 0.0:
                p.copy_(master)
            else:
                p.copy_(master + alpha * (p.detach() - master))
        for b, averaged in zip(fragment.buffers, pending.buffers):
            b.copy_(averaged)

    def state_dict(self) -> dict[str, Any]:
        pending = []
        for p in self.pending:
            if p.handle is not None:
                p.handle.wait()
                p.handle = None
            pending.append({"fragment": p.fragment, "apply_after": p.apply_after,
                            "deltas": [d.detach() for d in p.deltas],
                            "buffers": [b.detach() for b in p.buffers]})
        return {
            "fragments": [{
                "master": [m.detach() for m in f.master],
                "outer_optim": f.outer_optim.state_dict() if f.outer_optim is not None else None,
                "residuals": ([r.detach() for r in f.residuals]
                              if f.residuals is not None else None),
            } for f in self.fragments],
            "pending": pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["fragments"]
        if len(saved) != len(self.fragments):
            raise ValueError(f"the checkpoint has {len(saved)} fragments, this Streaming DiLoCo "
                             f"{len(self.fragments)}: resume with num_fragments={len(saved)}")
        with torch.no_grad():
            for fragment, fs in zip(self.fragments, saved):
                for m, value in zip(fragment.master, fs["master"]):
                    m.copy_(value)
                if fragment.outer_optim is not None:
                    fragment.outer_optim.load_state_dict(fs["outer_optim"])
                if fragment.residuals is not None:
                    if fs.get("residuals") is None:
                        raise ValueError("this Streaming DiLoCo keeps error-feedback residuals, "
                                         "but the checkpoint has none: resume with "
                                         "error_feedback=False, or start afresh")
                    for r, value in zip(fragment.residuals, fs["residuals"]):
                        r.copy_(value)
            self.pending = []
            for p in state.get("pending", []):
                fragment = self.fragments[p["fragment"]]
                deltas = [torch.empty_like(m) for m in fragment.master]
                buffers = [torch.empty_like(b) for b in fragment.buffers]
                for target, value in zip(deltas + buffers, p["deltas"] + p["buffers"]):
                    target.copy_(value)
                self.pending.append(_Pending(p["fragment"], p["apply_after"], deltas, buffers))


def check_fragments(num_fragments: int, layers: list[Any]) -> None:
    """Raise ``ValueError`` when the model has fewer ``layers`` than ``num_fragments``."""
    if len(layers) < num_fragments:
        raise ValueError(f"num_fragments={num_fragments} is more than the model's "
                         f"{plural(len(layers), 'layer')} (modules owning trainable parameters "
                         f"or float buffers): use num_fragments <= {len(layers)}")


def check_settings(owner: object, H: int, num_fragments: int, fragment_delay: int,
                   fragment_alpha: float) -> None:
    """Refuse settings Streaming DiLoCo cannot run, naming ``owner``, the value and the fix:
    each against its declaration, then ``num_fragments`` and ``fragment_delay`` against ``H``."""
    STREAMING_DILOCO.check(owner, H=H, num_fragments=num_fragments,
                           fragment_delay=fragment_delay, fragment_alpha=fragment_alpha)
    if num_fragments > H:
        raise ValueError(f"num_fragments={num_fragments} is more than H={H}: two fragments would "
                         f"sync at the same step; use num_fragments <= H")
    if fragment_delay >= H:
        raise ValueError(f"fragment_delay must be an integer with 0 <= fragment_delay < H={H} "
                         f"(a fragment's round must end before its next one), "
                         f"got {fragment_delay!r}")


class StreamingDiLoCoStrategy(CommunicateOptimizeStrategy):
    """Streaming DiLoCo: DiLoCo's outer round split into staggered, overlapping fragments.

    Args:
        optim_spec: the inner optimizer (default AdamW); ``inner_optim=`` is the same.
        outer_optim_spec: the outer optimizer as an ``OptimSpec`` or name (one per
            fragment); default SGD with ``outer_lr``, ``outer_momentum`` and ``nesterov``.
        H: inner steps between two rounds of the same fragment.
        num_fragments: fragments the model's layers are split into, strided.
        fragment_delay: inner steps taken while a fragment's all-reduce runs (0: none).
        fragment_alpha: after a round, local = global + α·(local - global) (0: take global).
        outer_optim: alias of ``outer_optim_spec``.
        outer_lr: outer learning rate.
        outer_momentum: outer momentum.
        nesterov: Nesterov momentum for the outer SGD.
        comm_dtype: type a fragment travels in (``'float32'``; ``'bfloat16'``, ``'float16'``,
            or quantized ``'int8'``, ``'float8_e4m3fn'``, ``'int4'``, ``'int2'``).
        error_feedback: carry each fragment's quantization residual into its next round.
        **kwargs: inner optimizer, schedule and clipping arguments of ``Strategy``.

    Defaults and accepted values: :data:`exogym.strategy.settings.STREAMING_DILOCO` (the
    settings table in ``docs/strategies.md``).
    """

    stackable = True

    def __init__(
        self,
        optim_spec: OptimSpec | str | None = None,
        outer_optim_spec: OptimSpec | str | None = None,
        H: int = STREAMING_DILOCO.H.default,
        num_fragments: int = STREAMING_DILOCO.num_fragments.default,
        fragment_delay: int = STREAMING_DILOCO.fragment_delay.default,
        fragment_alpha: float = STREAMING_DILOCO.fragment_alpha.default,
        outer_optim: OptimSpec | str | None = None,
        outer_lr: float = STREAMING_DILOCO.outer_lr.default,
        outer_momentum: float = STREAMING_DILOCO.outer_momentum.default,
        nesterov: bool = STREAMING_DILOCO.nesterov.default,
        comm_dtype: str = STREAMING_DILOCO.comm_dtype.default,
        error_feedback: bool = STREAMING_DILOCO.error_feedback.default,
        **kwargs: Any,
    ):
        check_settings(self, H, num_fragments, fragment_delay, fragment_alpha)
        STREAMING_DILOCO.check(self, outer_lr=outer_lr, outer_momentum=outer_momentum,
                               nesterov=nesterov, comm_dtype=comm_dtype,
                               error_feedback=error_feedback)
        self.H = H
        self.num_fragments = num_fragments
        self.fragment_delay = fragment_delay
        self.fragment_alpha = fragment_alpha
        self.comm_dtype = comm_dtype
        self.error_feedback = error_feedback
        self.outer_optim_spec = OuterOptimizer.from_args(
            "StreamingDiLoCoStrategy", outer_optim_spec, outer_optim, outer_lr, outer_momentum, nesterov,
        ).optim_spec()
        self.streaming = StreamingDiLoCoCommunicator(
            H, num_fragments, self.outer_optim_spec, fragment_delay, fragment_alpha,
            comm_dtype, error_feedback)
        super().__init__(communication_modules=[self.streaming], optim_spec=optim_spec, **kwargs)

    traffic_needs = ("H",)

    def traffic(self, model: ModelFacts, num_nodes: int) -> list[Traffic]:
        """One fragment's change (``1/num_fragments`` of the values) averaged every
        ``H / num_fragments`` steps: DiLoCo's bytes, spread over the round."""
        values = math.ceil((model.num_params + model.num_buffers) / self.num_fragments)
        return [Traffic(wire_collective(self.comm_dtype), wire_bytes(values, self.comm_dtype),
                        every=self.H / self.num_fragments)]

    def __config__(self) -> dict[str, Any]:
        config = super().__config__()
        config.update(num_fragments=self.num_fragments, fragment_delay=self.fragment_delay,
                      fragment_alpha=self.fragment_alpha)
        return config
