"""DES-LOC: local Adam steps; parameters and both moments averaged, each on its own period.

Algorithm (Iacob et al. 2025, "DES-LOC: Desynced Low Communication Adaptive
Optimizers", arXiv 2505.22549). Every rank trains with its own Adam-family
inner optimizer (AdamW by default) on its own data and never averages a
gradient. Three things are averaged across ranks, each on its own period,
after the inner step numbered ``s`` (1-based):

1. the parameters (with the float buffers, such as BatchNorm statistics) when
   ``s % H_params == 0``;
2. Adam's first moment (``exp_avg``) when ``s % H_m1 == 0``;
3. Adam's second moment (``exp_avg_sq``) when ``s % H_m2 == 0``.

Each is ONE bucketed all-reduce of the mean, and the averaged values replace
every rank's own. Local Adam is the special case ``H_params == H_m1 == H_m2``;
the paper's point is that the moments change more slowly than the parameters
(their half-life is ``ln 0.5 / ln beta``: 7 steps for ``beta1 = 0.9``, 693 for
``beta2 = 0.999``), so they can be averaged less often at little cost.

The default periods keep the relation the paper recommends (``K_u = 3 K_x``,
``K_v = 6 K_x``: ``H_m1 = 3 H_params``, ``H_m2 = 6 H_params``), which sends half of
Local Adam's bytes at the same parameter period; their values are
:data:`exogym.strategy.settings.DESLOC`'s. Keep the relation when you change
``H_params``.

Bytes. With ``P`` trainable values, ``B`` float buffer values and ``v`` bytes
per value of ``comm_dtype`` (4 in float32, 2 in bfloat16), a rank sends
``v * (P + B)`` at a parameter average, ``v * P`` at each moment average:
``v * ((P + B)/H_params + P/H_m1 + P/H_m2)`` per step on average, exactly
:func:`exogym.strategy.facts.desloc_sent_bytes` after any number of steps.

Values are averaged as they are, not as changes from a shared copy (as
DiLoCo's deltas are), so they travel in a float type: a quantized or float16
payload would round small second moments to zero and turn Adam's step
``m / (sqrt(v) + eps)`` into a leap. ``bfloat16`` keeps float32's range.

With every period 1 every rank holds the same parameters and moments after
each step; with periods beyond the run it is independent AdamW on each rank.
The moments live in the inner optimizer's state, so a checkpoint (which saves
that state) resumes exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from exogym.comm.wire import FLOAT_DTYPES, ModelFacts, Traffic, is_quantized, wire_bytes

from .communicate_optimize_strategy import CommunicateOptimizeStrategy, CommunicationModule
from .context import RankContext
from .optim import OptimSpec
from .settings import DESLOC

MOMENTS = ("exp_avg", "exp_avg_sq")  #: the optimizer state DES-LOC averages, as torch names it

_UNSAFE_FLOATS = ("float16", *FLOAT_DTYPES["float16"])


def check_settings(owner: object, H_params: int, H_m1: int, H_m2: int, comm_dtype: Any) -> None:
    """Refuse DES-LOC settings its declarations refuse, naming ``owner``; a quantized or
    float16 ``comm_dtype`` is refused with the reason."""
    if is_quantized(comm_dtype) or str(comm_dtype).lower() in _UNSAFE_FLOATS:
        raise ValueError(
            f"DESLOCStrategy averages parameters and Adam's moments as values, not as changes: "
            f"comm_dtype={comm_dtype!r} would round small second moments to zero and blow "
            "Adam's step up; use 'float32' or 'bfloat16' (float32's range, half the bytes)")
    DESLOC.check(owner, H_params=H_params, H_m1=H_m1, H_m2=H_m2, comm_dtype=comm_dtype)


def check_adam_moments(spec: OptimSpec) -> None:
    """Refuse an inner optimizer that keeps no ``exp_avg`` and ``exp_avg_sq`` for each parameter.

    The optimizer is built on two throw-away parameters (a matrix and a vector, as a
    Muon split would see them) and stepped once; its state must then hold both moments
    for each. An optimizer that cannot even take that step is left to fail on the ranks.
    """
    probe = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]
    try:
        optim = spec.build(probe)
        for p in probe:
            p.grad = torch.ones_like(p)
        optim.step()
    except Exception:  # noqa: BLE001 - not ours to judge: the ranks report it
        return
    missing = [key for key in MOMENTS if not all(key in optim.state.get(p, {}) for p in probe)]
    if missing:
        raise ValueError(
            f"DESLOCStrategy averages Adam's moments (exp_avg, exp_avg_sq), but the inner "
            f"optimizer {spec.cls.__name__} keeps no {' or '.join(missing)}: use an Adam-family "
            "optimizer ('adamw', 'adam', 'nadam' or 'radam')")


class DESLOCCommunicator(CommunicationModule):
    """DES-LOC's three averages as a composable module; the moments are read from the owning
    strategy's optimizer (``strategy.optim``).

    Args:
        H_params: steps between averages of the parameters (and float buffers).
        H_m1: steps between averages of Adam's first moment.
        H_m2: steps between averages of Adam's second moment.
        comm_dtype: type the averages travel in (``'float32'``, ``'bfloat16'``).
    """

    def __init__(self, H_params: int = DESLOC.H_params.default, H_m1: int = DESLOC.H_m1.default,
                 H_m2: int = DESLOC.H_m2.default, comm_dtype: str = DESLOC.comm_dtype.default):
        super().__init__()
        check_settings(self, H_params, H_m1, H_m2, comm_dtype)
        self.H_params, self.H_m1, self.H_m2 = H_params, H_m1, H_m2
        self.comm_dtype = comm_dtype

    def setup(self, context: RankContext) -> None:
        super().setup(context)
        model = context.model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]

    @torch.no_grad()
    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int,
                    local_step: int) -> None:
        step = local_step + 1
        if step % self.H_params == 0:
            self.collectives.all_reduce_tensors(self.params + self.buffers, average=True,
                                                dtype=self.comm_dtype)
            if self.strategy is not None:
                self.strategy.mark_synced(step)  # every rank now holds the same model
        for key, period in zip(MOMENTS, (self.H_m1, self.H_m2)):
            if step % period == 0:
                self.collectives.all_reduce_tensors(self.moment(key), average=True,
                                                    dtype=self.comm_dtype)

    def moment(self, key: str) -> list[torch.Tensor]:
        """The inner optimizer's ``key`` state of every trainable parameter, in order.

        A parameter that has had no gradient on this rank yet has no state; it gets
        one shaped as the others' (zero moments, their step count), so that every rank
        hands the all-reduce the same tensors and takes the average in.
        """
        optim = self.strategy.optim
        states = [optim.state.get(p) for p in self.params]
        template = next((s for s in states if s), None)
        if template is not None and key not in template:
            raise ValueError(f"DESLOCStrategy averages {key!r}, but the inner optimizer "
                             f"{type(optim).__name__} keeps no such state: use an Adam-family "
                             "optimizer ('adamw', 'adam', 'nadam' or 'radam')")
        tensors = []
        for p, state in zip(self.params, states):
            if not state:
                state = optim.state[p] = self._fresh_state(p, template)
            tensors.append(state[key])
        return tensors

    @staticmethod
    def _fresh_state(p: torch.Tensor, template: dict[str, Any] | None) -> dict[str, Any]:
        if template is None:
            return {"step": torch.tensor(0.0), **{k: torch.zeros_like(p) for k in MOMENTS}}
        fresh = {}
        for k, v in template.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 or k in MOMENTS:
                fresh[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                fresh[k] = v.clone() if isinstance(v, torch.Tensor) else v
        return fresh


class DESLOCStrategy(CommunicateOptimizeStrategy):
    """DES-LOC: local Adam steps; parameters, first and second moments averaged on their own periods.

    Args:
        optim_spec: the inner optimizer, Adam-family (default AdamW; ``inner_optim=`` is the
            same). One without ``exp_avg`` and ``exp_avg_sq`` state (SGD, Muon) is refused.
        H_params: inner steps between averages of the parameters and float buffers.
        H_m1: inner steps between averages of Adam's first moment ``exp_avg``.
        H_m2: inner steps between averages of Adam's second moment ``exp_avg_sq``.
        comm_dtype: type the averages travel in: ``'float32'`` or ``'bfloat16'`` (half the
            bytes, float32's range). Quantized types and float16 are refused: the values
            are averaged as they are, and small second moments would round to zero.
        **kwargs: inner optimizer, schedule and clipping arguments of ``Strategy``.

    The defaults keep the relation of Iacob et al. 2025 (``H_m1 = 3 H_params``,
    ``H_m2 = 6 H_params``); they and the accepted values are
    :data:`exogym.strategy.settings.DESLOC`'s (the settings table in
    ``docs/strategies.md``). Per step a rank sends ``v * ((P + B)/H_params + P/H_m1 +
    P/H_m2)`` bytes on average (``v`` bytes per value, ``P`` trainable values, ``B`` float
    buffer values).
    """

    stackable = True

    def __init__(
        self,
        optim_spec: OptimSpec | str | None = None,
        H_params: int = DESLOC.H_params.default,
        H_m1: int = DESLOC.H_m1.default,
        H_m2: int = DESLOC.H_m2.default,
        comm_dtype: str = DESLOC.comm_dtype.default,
        **kwargs: Any,
    ):
        check_settings(self, H_params, H_m1, H_m2, comm_dtype)
        self.desloc = DESLOCCommunicator(H_params, H_m1, H_m2, comm_dtype)
        self.H_params, self.H_m1, self.H_m2 = H_params, H_m1, H_m2
        self.comm_dtype = comm_dtype
        super().__init__(communication_modules=[self.desloc], optim_spec=optim_spec, **kwargs)
        check_adam_moments(self._inner_spec())

    @property
    def round_steps(self) -> int:
        """A rank that comes back joins when the parameters are next averaged."""
        return self.H_params

    def traffic(self, model: ModelFacts, num_nodes: int) -> list[Traffic]:
        """Three all-reduces: the parameters and float buffers every ``H_params`` steps,
        the first moment every ``H_m1``, the second every ``H_m2``."""
        params = wire_bytes(model.num_params, self.comm_dtype)
        return [Traffic("all_reduce", wire_bytes(model.num_params + model.num_buffers,
                                                 self.comm_dtype), every=self.H_params),
                Traffic("all_reduce", params, every=self.H_m1),
                Traffic("all_reduce", params, every=self.H_m2)]

    def __config__(self) -> dict[str, Any]:
        config = super().__config__()
        config.update(H_params=self.H_params, H_m1=self.H_m1, H_m2=self.H_m2)
        return config
