"""The outer optimizer of the DiLoCo family, specified once.

DiLoCo, SPARTA-DiLoCo and Streaming DiLoCo (and SparseLoCo, without momentum)
end each round with an outer step on the averaged change of the weights. They
accept the same arguments for it, checked and resolved here by one spec:

- ``outer_optim_spec`` (or its alias ``outer_optim``, not both): an
  :class:`~exogym.strategy.optim.OptimSpec` or a name such as ``'adam'``;
- otherwise SGD with ``outer_lr``, ``outer_momentum`` and ``nesterov``
  (Nesterov only with a momentum above 0).

:class:`OuterState` is the outer parameters and optimizer one round holds;
ranks packed in one process share one (``RankContext.held_once``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .optim import OptimSpec, ensure_optim_spec
from .settings import DILOCO

__all__ = ["OuterOptimizer", "OuterState"]


@dataclass(frozen=True)
class OuterOptimizer:
    """How a DiLoCo-family strategy steps its outer parameters.

    Args:
        spec: an ``OptimSpec`` or optimizer name; None (or ``'sgd'``) for SGD
            with the three values below.
        lr: the outer learning rate (``outer_lr``).
        momentum: SGD's momentum (``outer_momentum``).
        nesterov: Nesterov momentum for SGD (ignored at momentum 0).

    The defaults are DiLoCo's settings (:mod:`exogym.strategy.settings`).
    """

    spec: OptimSpec | str | None = None
    lr: float = DILOCO.outer_lr.default
    momentum: float = DILOCO.outer_momentum.default
    nesterov: bool = DILOCO.nesterov.default

    @classmethod
    def from_args(cls, owner: str, outer_optim_spec: OptimSpec | str | None = None,
                  outer_optim: OptimSpec | str | None = None,
                  outer_lr: float = DILOCO.outer_lr.default,
                  outer_momentum: float = DILOCO.outer_momentum.default,
                  nesterov: bool = DILOCO.nesterov.default) -> OuterOptimizer:
        """The spec from a strategy's keyword arguments; ``owner`` names the strategy in errors.

        Raises:
            TypeError: both ``outer_optim_spec`` and its alias ``outer_optim`` given.
            ValueError: ``outer_lr``, ``outer_momentum`` or ``nesterov`` out of range, named.
        """
        if outer_optim_spec is not None and outer_optim is not None:
            raise TypeError(f"{owner}: give outer_optim_spec= or outer_optim=, not both")
        DILOCO.check(owner, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov)
        chosen = outer_optim_spec if outer_optim_spec is not None else outer_optim
        return cls(chosen, outer_lr, outer_momentum, nesterov)

    def optim_spec(self) -> OptimSpec:
        """The outer optimizer as an ``OptimSpec``: the given one, or SGD from ``lr`` and momentum."""
        if self.spec is None or (isinstance(self.spec, str) and self.spec.lower() == "sgd"):
            return OptimSpec(torch.optim.SGD, lr=self.lr, momentum=self.momentum,
                             nesterov=bool(self.nesterov and self.momentum > 0))
        if isinstance(self.spec, str):
            return OptimSpec.from_string(self.spec, lr=self.lr)
        return ensure_optim_spec(self.spec)


class OuterState:
    """DiLoCo's outer parameters and optimizer, and the round whose outer step they hold.

    Args:
        params: the trainable parameters they start from.
        spec: the outer optimizer.
    """

    def __init__(self, params: list[torch.Tensor], spec: OptimSpec):
        self.master = [p.detach().clone() for p in params]
        self.optim = spec.build(self.master)
        self.applied: int | None = None  # local_step of the last round applied

    @torch.no_grad()
    def step(self, deltas: list[torch.Tensor]) -> None:
        """Step the outer parameters with the averaged (or merged) change ``deltas``, as
        every rank does."""
        for master, delta in zip(self.master, deltas):
            master.grad = delta
        self.optim.step()
        for master in self.master:
            master.grad = None
