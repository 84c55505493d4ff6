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

import math
from typing import Any

from exogym.comm.wire import ModelFacts, Traffic, wire_bytes, wire_collective

from .communicate_optimize_strategy import CommunicateOptimizeStrategy
from .diloco import DiLoCoCommunicator
from .optim import OptimSpec
from .outer import OuterOptimizer
from .settings import SPARTA_DILOCO
from .sparta import IndexSelector, SparseCommunicator, make_selector


class SPARTADiLoCoStrategy(CommunicateOptimizeStrategy):
    """SPARTA rounds every ``sparta_interval`` steps plus a DiLoCo round every ``H`` steps.

    Args:
        optim_spec: the inner optimizer (default AdamW); ``inner_optim=`` is the same.
        outer_optim_spec: the outer optimizer as an ``OptimSpec`` or name; default
            SGD with ``outer_lr``, ``outer_momentum`` and ``nesterov``.
        outer_optim: alias of ``outer_optim_spec``.
        H: inner steps per DiLoCo round.
        outer_lr: outer learning rate.
        outer_momentum: outer momentum.
        nesterov: Nesterov momentum for the outer SGD.
        p_sparta: fraction of each tensor averaged per SPARTA round (None: the selector's
            ``p`` when it is an instance, else the default).
        sparta_interval: local steps between SPARTA rounds.
        index_selector: ``'random'``, ``'shuffled'``, ``'partitioned'`` or an ``IndexSelector``.
        comm_dtype: type both kinds of round send their values in.
        inner_optim_spec: alias of ``optim_spec`` (the name exo gym used here).
        **kwargs: inner optimizer, schedule and clipping arguments of ``Strategy``.

    Defaults and accepted values: :data:`exogym.strategy.settings.SPARTA_DILOCO` (the
    settings table in ``docs/strategies.md``).
    """

    stackable = True

    def __init__(
        self,
        optim_spec: OptimSpec | str | None = None,
        outer_optim_spec: OptimSpec | str | None = None,
        H: int = SPARTA_DILOCO.H.default,
        outer_optim: OptimSpec | str | None = None,
        outer_lr: float = SPARTA_DILOCO.outer_lr.default,
        outer_momentum: float = SPARTA_DILOCO.outer_momentum.default,
        nesterov: bool = SPARTA_DILOCO.nesterov.default,
        p_sparta: float | None = None,
        sparta_interval: int = SPARTA_DILOCO.sparta_interval.default,
        index_selector: str | IndexSelector = SPARTA_DILOCO.index_selector.default,
        comm_dtype: str = SPARTA_DILOCO.comm_dtype.default,
        inner_optim_spec: OptimSpec | str | None = None,
        **kwargs: Any,
    ):
        if inner_optim_spec is not None:
            if optim_spec is not None:
                raise TypeError("SPARTADiLoCoStrategy: give optim_spec= or inner_optim_spec=, "
                                "not both")
            optim_spec = inner_optim_spec
        SPARTA_DILOCO.check(self, H=H, outer_lr=outer_lr, outer_momentum=outer_momentum,
                            nesterov=nesterov, sparta_interval=sparta_interval,
                            comm_dtype=comm_dtype)
        selector = make_selector(index_selector, p_sparta, self)
        self.H = H
        self.p_sparta = selector.p
        self.sparta_interval = sparta_interval
        self.index_selector = selector
        self.comm_dtype = comm_dtype
        self.outer_optim_spec = OuterOptimizer.from_args(
            "SPARTADiLoCoStrategy", outer_optim_spec, outer_optim, outer_lr, outer_momentum, nesterov,
        ).optim_spec()
        self.sparta = SparseCommunicator(selector, comm_dtype, interval=sparta_interval)
        self.diloco = DiLoCoCommunicator(H, self.outer_optim_spec, comm_dtype)
        super().__init__(communication_modules=[self.sparta, self.diloco], optim_spec=optim_spec,
                         **kwargs)

    traffic_needs = ("H",)

    def traffic(self, model: ModelFacts, num_nodes: int) -> list[Traffic]:
        """SPARTA's sparse average every ``sparta_interval`` steps, except at a DiLoCo round
        (every ``H`` steps), which averages the whole change instead."""
        kind = wire_collective(self.comm_dtype)
        full = Traffic(kind, wire_bytes(model.num_params + model.num_buffers, self.comm_dtype),
                       every=self.H)
        share = 1.0 / self.sparta_interval - 1.0 / math.lcm(self.sparta_interval, self.H)
        if share <= 0:
            return [full]
        sparse = wire_bytes(self.p_sparta * model.num_params, self.comm_dtype)
        return [Traffic(kind, sparse, every=1.0 / share), full]

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
