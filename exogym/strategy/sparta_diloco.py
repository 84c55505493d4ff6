"""SPARTA-DiLoCo: sparse averaging between DiLoCo rounds.

Algorithm. Ranks train with the inner optimizer. After every
``sparta_interval``-th local step a SPARTA round replaces a fraction
``p_sparta`` of each trainable tensor's entries by its mean over the ranks
(see :mod:`exogym.strategy.sparta`); after every ``H``-th local step a DiLoCo
round averages the change since the last round and applies the outer
optimizer (see :mod:`exogym.strategy.diloco`). The sparse rounds keep the
ranks close between outer rounds, which lets ``H`` grow.

On a step that ends with a DiLoCo round the SPARTA round is left out: averaging
some entries does not change their mean over the ranks, which is all the
DiLoCo round reads, and the round then overwrites every rank with the same
parameters anyway. Skipping it saves its bytes and changes the result only by
floating-point rounding (that of the values on the wire, with ``comm_dtype``).

Bytes per rank: after local step ``s`` (1-based), a SPARTA round when
``s % sparta_interval == 0`` and ``s % H != 0`` (``element_size(comm_dtype)``
bytes per selected entry), plus ``element_size(comm_dtype) * P`` for a DiLoCo
round when ``s % H == 0`` (``P`` trainable entries plus float buffers).
"""

from __future__ import annotations

from typing import Any

from .communicate_optimize_strategy import CommunicateOptimizeStrategy
from .diloco import DiLoCoCommunicator, outer_spec
from .facts import COMM_DTYPE, DILOCO_H, SPARTA_INTERVAL
from .optim import OptimSpec
from .sparta import IndexSelector, SparseCommunicator, make_selector


class SPARTADiLoCoStrategy(CommunicateOptimizeStrategy):
    """SPARTA rounds every ``sparta_interval`` steps plus a DiLoCo round every ``H`` steps.

    Args:
        optim_spec: the inner optimizer (default AdamW); ``inner_optim=`` is the same.
        outer_optim_spec: the outer optimizer as an ``OptimSpec`` or name; default
            SGD with ``outer_lr``, ``outer_momentum`` and ``nesterov``.
        outer_optim: alias of ``outer_optim_spec``.
        H: inner steps per DiLoCo round (default 100).
        outer_lr: outer learning rate (0.7).
        outer_momentum: outer momentum (0.9).
        nesterov: Nesterov momentum for the outer SGD (True).
        p_sparta: fraction of each tensor averaged per SPARTA round (default 0.005).
        sparta_interval: local steps between SPARTA rounds (default 1).
        index_selector: ``'random'``, ``'shuffled'``, ``'partitioned'`` or an ``IndexSelector``.
        comm_dtype: type both kinds of round send their values in (``'float32'``).
        inner_optim_spec: alias of ``optim_spec`` (the name exo gym used here).
        **kwargs: inner optimizer, schedule and clipping arguments of ``Strategy``.
    """

    def __init__(
        self,
        optim_spec: OptimSpec | str | None = None,
        outer_optim_spec: OptimSpec | str | None = None,
        H: int = DILOCO_H,
        outer_optim: OptimSpec | str | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        p_sparta: float | None = None,
        sparta_interval: int = SPARTA_INTERVAL,
        index_selector: str | IndexSelector = "random",
        comm_dtype: str = COMM_DTYPE,
        inner_optim_spec: OptimSpec | str | None = None,
        **kwargs: Any,
    ):
        if outer_optim_spec is not None and outer_optim is not None:
            raise TypeError("SPARTADiLoCoStrategy: give outer_optim_spec= or outer_optim=, not both")
        if inner_optim_spec is not None:
            if optim_spec is not None:
                raise TypeError("SPARTADiLoCoStrategy: give optim_spec= or inner_optim_spec=, "
                                "not both")
            optim_spec = inner_optim_spec
        selector = make_selector(index_selector, p_sparta)
        self.H = H
        self.p_sparta = selector.p
        self.sparta_interval = sparta_interval
        self.index_selector = selector
        self.comm_dtype = comm_dtype
        self.outer_optim_spec = outer_spec(
            outer_optim_spec if outer_optim_spec is not None else outer_optim,
            outer_lr, outer_momentum, nesterov,
        )
        self.sparta = SparseCommunicator(selector, comm_dtype, interval=sparta_interval)
        self.diloco = DiLoCoCommunicator(H, self.outer_optim_spec, comm_dtype)
        super().__init__(communication_modules=[self.sparta, self.diloco], optim_spec=optim_spec,
                         **kwargs)

    def _communicate(self) -> None:
        step = self.local_step
        if (step + 1) % self.H != 0:
            self.sparta.communicate(self.model, self.rank, self.num_nodes, step)
        self.diloco.communicate(self.model, self.rank, self.num_nodes, step)

    def __config__(self) -> dict[str, Any]:
        config = super().__config__()
        config.update(p_sparta=self.p_sparta, sparta_interval=self.sparta_interval,
                      index_selector=type(self.index_selector).__name__)
        return config
