"""MuLoCo: DiLoCo with Muon inner steps and a quantized, error-fed outer delta.

Algorithm (Thérien et al. 2025, "MuLoCo: Muon is a practical inner optimizer
for DiLoCo", arXiv 2505.23725): DiLoCo's rounds (see
:mod:`exogym.strategy.diloco`) with two changes of default:

1. the inner optimizer is Muon on the hidden 2-D weight matrices and AdamW on
   the rest (embeddings, the output head, norms, biases):
   :class:`exogym.strategy.MuonAdamW`;
2. the outer delta travels quantized, here to 4 bits with a float32 scale per
   64 values, and each rank keeps what quantization lost (error feedback) and
   adds it to its next round's delta.

The paper finds that Muon's updates compress better than AdamW's: with error
feedback its delta goes down to 2 bits with next to no loss, where AdamW's
DiLoCo degrades. The default here is ``'int4'``, a step short of that: give
``comm_dtype='int2'`` for the paper's most compressed setting. Everything else
(``H``, the outer Nesterov SGD) is DiLoCo's.

Bytes per rank per round, ``P`` trainable and ``B`` float buffer values, one
bucket: ``ceil((P + B) * bits / 8) + 4 * ceil((P + B) / 64)``
(:func:`exogym.comm.quantize.payload_bytes`), about ``0.56 * (P + B)`` for int4,
a seventh of DiLoCo's float32 round.
"""

from __future__ import annotations

from typing import Any

from .diloco import DiLoCoStrategy
from .facts import is_quantized
from .optim import OptimSpec
from .settings import MULOCO


class MuLoCoStrategy(DiLoCoStrategy):
    """MuLoCo: DiLoCo with Muon inner steps and an int4, error-fed outer delta.

    Args:
        optim_spec: the inner optimizer (default ``'muon'``: Muon on hidden matrices,
            AdamW on the rest); ``inner_optim=`` is the same.
        H: inner steps per round (DiLoCo's).
        comm_dtype: type the outer deltas travel in (``'int2'`` is the paper's most
            compressed setting; DiLoCo's float and quantized types all work).
        error_feedback: carry each round's quantization residual into the next round;
            None: on whenever ``comm_dtype`` is quantized.
        **kwargs: DiLoCo's outer optimizer arguments (``outer_lr``, ``outer_momentum``,
            ``nesterov``, ``outer_optim_spec``) and the schedule and clipping of ``Strategy``.

    Defaults and accepted values: :data:`exogym.strategy.settings.MULOCO` (the settings
    table in ``docs/strategies.md``).
    """

    def __init__(
        self,
        optim_spec: OptimSpec | str | None = None,
        *,
        H: int = MULOCO.H.default,
        comm_dtype: str = MULOCO.comm_dtype.default,
        error_feedback: bool | None = MULOCO.error_feedback.default,
        inner_optim: OptimSpec | str | None = None,
        **kwargs: Any,
    ):
        MULOCO.check(self, H=H, comm_dtype=comm_dtype, error_feedback=error_feedback)
        if optim_spec is None and inner_optim is None:
            optim_spec = "muon"
        if error_feedback is None:
            error_feedback = is_quantized(comm_dtype)
        super().__init__(optim_spec=optim_spec, H=H, comm_dtype=comm_dtype,
                         error_feedback=error_feedback, inner_optim=inner_optim, **kwargs)
