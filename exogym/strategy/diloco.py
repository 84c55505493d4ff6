"""DiLoCo: many local steps, then one outer step on the averaged change.

Algorithm (Douillard et al., 2023). Every rank keeps a copy of the global
("outer") parameters and an outer optimizer. Between rounds it takes ``H``
inner optimizer steps on its own data. After every ``H``-th inner step:

1. outer gradient = mean over ranks of (global params - local params),
   computed with ONE all-reduce of the trainable parameters' deltas
   (float buffers such as BatchNorm statistics are averaged in the same call);
2. every rank applies the same outer optimizer step (default: SGD with
   Nesterov momentum) to its copy of the global parameters;
3. the local model takes the new global parameters. The inner optimizer's
   state carries over to the next round.

Because every rank holds the outer state and applies the same update to the
same numbers, the round needs nothing but that one all-reduce: ``4 * P``
bytes per rank per round for ``P`` float32 trainable parameters (half with
``comm_dtype='bfloat16'``).

With a quantized ``comm_dtype`` (``'int8'``, ``'float8_e4m3fn'``, ``'int4'``,
``'int2'``) the deltas travel as packed values plus a float32 scale per 64
values, ``exogym.comm.quantize.payload_bytes(P)`` bytes per round (e.g. about
``1.06 * P`` for int8), and are summed in float32 (see
:func:`exogym.comm.all_reduce_tensors`). ``error_feedback=True`` keeps what
quantization lost in a residual per tensor and adds it to the next round's
delta; the residuals are part of the checkpoint.

Every setting's default and accepted values: :data:`exogym.strategy.settings.DILOCO`
(the table in ``docs/strategies.md``).
"""

from __future__ import annotations

from typing import Any

import torch

from exogym import comm
from exogym.comm.wire import ModelFacts, Traffic, wire_bytes, wire_collective

from .communicate_optimize_strategy import CommunicateOptimizeStrategy, CommunicationModule
from .context import RankContext
from .facts import is_quantized
from .optim import OptimSpec
from .outer import OuterOptimizer, OuterState
from .settings import DILOCO


class DiLoCoCommunicator(CommunicationModule):
    """The DiLoCo outer round as a composable module.

    Args:
        H: inner steps per round.
        outer_optim_spec: the outer optimizer (an ``OptimSpec``).
        comm_dtype: type the deltas travel in (``'float32'``, ``'bfloat16'``, ``'float16'``,
            or quantized: ``'int8'``, ``'float8_e4m3fn'``, ``'int4'``, ``'int2'``).
        error_feedback: keep each round's quantization residual and send it with
            the next round (needs a quantized ``comm_dtype``).
    """

    def __init__(self, H: int, outer_optim_spec: OptimSpec,
                 comm_dtype: str = DILOCO.comm_dtype.default,
                 error_feedback: bool = DILOCO.error_feedback.default):
        super().__init__()
        DILOCO.check(self, H=H, comm_dtype=comm_dtype)
        comm.resolve_dtype(comm_dtype)
        check_error_feedback(error_feedback, comm_dtype, self)
        self.H = H
        self.outer_optim_spec = outer_optim_spec
        self.comm_dtype = comm_dtype
        self.error_feedback = bool(error_feedback)
        self.residuals: list[torch.Tensor] | None = None

    def setup(self, context: RankContext) -> None:
        super().setup(context)
        model = context.model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        # Every rank holds the same outer parameters and applies the same outer step: ranks
        # that share a process share them (context.held_once), and the first of them to
        # finish a round's all-reduce applies its outer step for all.
        modules = self.strategy.communication_modules if self.strategy is not None else [self]
        self.outer = context.held_once(("diloco-outer", modules.index(self)),
                                       lambda: OuterState(self.params, self.outer_optim_spec))
        self.master = self.outer.master
        self.outer_optim = self.outer.optim
        if self.error_feedback:
            self.residuals = [torch.zeros_like(t, dtype=torch.float32)
                              for t in self.params + self.buffers]

    @torch.no_grad()
    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int,
                    local_step: int) -> None:
        if (local_step + 1) % self.H != 0:
            return
        # The parameters' own memory holds the deltas (they take the outer parameters'
        # values at the end of the round anyway): a round needs no buffer of its own.
        deltas = [p.detach() for p in self.params]
        for delta, m in zip(deltas, self.master):
            delta.neg_().add_(m)  # master - local, rounded as a subtraction is
        weight = self.strategy.average_weight if self.strategy is not None else 1.0
        if weight != 1.0:  # balance: each rank's change weighted by the samples it trained
            torch._foreach_mul_(deltas + self.buffers, weight)
        self.collectives.all_reduce_tensors(deltas + self.buffers, average=True,
                                            dtype=self.comm_dtype, error_feedback=self.residuals)
        kept = self.kept
        if kept is not None:  # for a rank joining mid-round whose copy predates this round
            kept.append({"step": local_step + 1, "deltas": [d.clone() for d in deltas],
                         "buffers": [b.clone() for b in self.buffers]})
        if self.outer.applied != local_step:  # the all-reduce gave every rank the same deltas
            self.outer.step(deltas)
            self.outer.applied = local_step
        for p, master in zip(self.params, self.master):
            p.copy_(master)
        if self.strategy is not None:
            # Every rank applied the same outer step to the same numbers (the all-reduce's
            # result is the same everywhere): the models are identical after this step.
            self.strategy.mark_synced(local_step + 1)

    #: The rounds' shared updates kept since :meth:`keep_round_updates` (None: none kept).
    kept: list[dict[str, Any]] | None = None

    def keep_round_updates(self, keep: bool) -> None:
        """Keep (or stop keeping and forget) each round's averaged deltas and buffers."""
        self.kept = [] if keep else None

    def round_updates(self, through_step: int) -> list[dict[str, Any]]:
        """The updates kept of rounds that ended at ``through_step`` or before."""
        return [u for u in list(self.kept or []) if u["step"] <= through_step]

    @torch.no_grad()
    def apply_round_update(self, update: dict[str, Any]) -> None:
        """Apply a round's update as every rank did at its end: the outer step on the
        averaged deltas, the averaged buffers, the model at the new outer parameters."""
        self.outer.step([d.to(m.device) for d, m in zip(update["deltas"], self.master)])
        for buffer, averaged in zip(self.buffers, update["buffers"]):
            buffer.copy_(averaged)
        for p, master in zip(self.params, self.master):
            p.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        state = {"master": [m.detach() for m in self.master],
                 "outer_optim": self.outer_optim.state_dict()}
        if self.residuals is not None:
            state["residuals"] = [r.detach() for r in self.residuals]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
            if self.residuals is not None:
                if "residuals" not in state:
                    raise ValueError("this DiLoCo keeps error-feedback residuals, but the "
                                     "checkpoint has none: resume with error_feedback=False, "
                                     "or start afresh")
                for r, saved in zip(self.residuals, state["residuals"]):
                    r.copy_(saved)
        self.outer_optim.load_state_dict(state["outer_optim"])


def check_error_feedback(error_feedback: bool, comm_dtype: str, owner: object) -> None:
    """Refuse an ``error_feedback`` that is not a flag, or that is on without a quantized
    ``comm_dtype`` (nothing would be lost); ``owner`` is named in the error."""
    DILOCO.error_feedback.check(error_feedback, owner)
    if error_feedback and not is_quantized(comm_dtype):
        raise ValueError(f"error_feedback=True needs a quantized comm_dtype ('int8', "
                         f"'float8_e4m3fn', 'int4', 'int2'), got comm_dtype={comm_dtype!r}")


class DiLoCoStrategy(CommunicateOptimizeStrategy):
    """DiLoCo: ``H`` local steps with the inner optimizer, then an outer round.

    Args:
        optim_spec: the inner optimizer (default AdamW); ``inner_optim=`` is the same.
        outer_optim_spec: the outer optimizer as an ``OptimSpec`` or name; default
            SGD with ``outer_lr``, ``outer_momentum`` and ``nesterov``.
        outer_optim: alias of ``outer_optim_spec``.
        H: inner steps per round.
        outer_lr: outer learning rate.
        outer_momentum: outer momentum.
        nesterov: Nesterov momentum for the outer SGD.
        comm_dtype: type the outer deltas travel in (``'float32'``, ``'bfloat16'``,
            ``'float16'``, or the quantized ``'int8'``, ``'float8_e4m3fn'``, ``'int4'``,
            ``'int2'`` with a float32 scale per 64 values).
        error_feedback: carry each round's quantization residual into the next
            round (quantized ``comm_dtype`` only; checkpointed).
        **kwargs: inner optimizer, schedule and clipping arguments of ``Strategy``.

    Defaults and accepted values: :data:`exogym.strategy.settings.DILOCO` (the settings
    table in ``docs/strategies.md``).

    Under ``fit(balance='steps')`` (:mod:`exogym.run.balance`) a slow rank trains fewer
    inner steps per round and the round's average weights each rank's change by the
    samples it trained; the bytes are those of any round.
    """

    stackable = True

    balance_modes = ("batch", "steps")

    def __init__(
        self,
        optim_spec: OptimSpec | str | None = None,
        outer_optim_spec: OptimSpec | str | None = None,
        H: int = DILOCO.H.default,
        outer_optim: OptimSpec | str | None = None,
        outer_lr: float = DILOCO.outer_lr.default,
        outer_momentum: float = DILOCO.outer_momentum.default,
        nesterov: bool = DILOCO.nesterov.default,
        comm_dtype: str = DILOCO.comm_dtype.default,
        error_feedback: bool = DILOCO.error_feedback.default,
        **kwargs: Any,
    ):
        DILOCO.check(self, H=H, outer_lr=outer_lr, outer_momentum=outer_momentum,
                     nesterov=nesterov, comm_dtype=comm_dtype, error_feedback=error_feedback)
        self.H = H
        self.comm_dtype = comm_dtype
        self.error_feedback = error_feedback
        self.outer_optim_spec = OuterOptimizer.from_args(
            "DiLoCoStrategy", outer_optim_spec, outer_optim, outer_lr, outer_momentum, nesterov,
        ).optim_spec()
        self.diloco = DiLoCoCommunicator(H, self.outer_optim_spec, comm_dtype, error_feedback)
        super().__init__(communication_modules=[self.diloco], optim_spec=optim_spec, **kwargs)

    traffic_needs = ("H",)

    @property
    def joins_mid_round(self) -> bool:
        """The ranks meet only at a round's end, and the outer state stays put within it: a
        rank coming back mid-round starts from the outer parameters and joins at once."""
        return True

    def synced_model(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` with each trainable parameter's value as the round began (the outer
        parameters; a tied parameter under each of its names)."""
        outer = {p.data_ptr(): m for p, m in zip(self.diloco.params, self.diloco.master)}
        return {name: outer.get(value.data_ptr(), value) if value.is_floating_point() else value
                for name, value in state.items()}

    def keep_round_updates(self, keep: bool) -> None:
        self.diloco.keep_round_updates(keep)

    def round_updates(self, through_step: int) -> list[dict[str, Any]]:
        return self.diloco.round_updates(through_step)

    def apply_round_update(self, update: dict[str, Any]) -> None:
        self.diloco.apply_round_update(update)

    def traffic(self, model: ModelFacts, num_nodes: int) -> list[Traffic]:
        """The change of the parameters and float buffers, averaged once every ``H`` steps."""
        values = model.num_params + model.num_buffers
        return [Traffic(wire_collective(self.comm_dtype), wire_bytes(values, self.comm_dtype),
                        every=self.H)]
