"""Strategies that optimize locally, then communicate: the composition kit.

``CommunicateOptimizeStrategy`` runs the inner optimizer step, then hands the
model to each of its ``CommunicationModule``s in order. DiLoCo, FedAvg and
SPARTA are all built this way, and a new strategy can be composed from their
modules (e.g. sparse averaging every step plus a DiLoCo round every H steps).
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from exogym.base.arg_errors import init_arg_names, unknown_args_error

from .context import RankContext
from .optim import OptimSpec
from .strategy import Strategy


class CommunicationModule(ABC):
    """One communication step of a composed strategy.

    ``strategy`` is set to the owning strategy, so a module can read shared
    settings (e.g. ``strategy.seed``, ``strategy.optim``).
    """

    strategy: Strategy | None = None

    def __init__(self, **kwargs: Any):
        if kwargs:
            raise unknown_args_error(type(self).__name__, kwargs, init_arg_names(type(self)))

    @abstractmethod
    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int,
                    local_step: int) -> None:
        """Communicate after the inner step numbered ``local_step`` (0-based)."""

    def validate(self, model: torch.nn.Module, num_nodes: int) -> None:
        """Raise before any rank starts for a setting this model or these ranks cannot run
        (see :meth:`Strategy.validate`); the owning strategy calls it."""

    def setup(self, context: RankContext) -> None:
        """Prepare per-rank state, once the rank's model exists (the owning strategy's
        :meth:`Strategy.setup` calls it). Sets ``self.context`` and ``self.collectives``;
        a module written for exo gym overrides ``_init_node(model, rank, num_nodes)``
        instead, which this calls."""
        self.context = context
        self.collectives = context.collectives
        self._init_node(context.model, context.rank, context.num_nodes)

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        """exo gym's per-rank set-up hook; see :meth:`setup`. Called directly, outside a
        run, it sets a module with a set-up of its own up for a rank alone."""
        context = self.__dict__.get("context")
        if (context is None or not context.describes(model, rank, num_nodes)) \
                and type(self).setup is not CommunicationModule.setup:
            self.setup(RankContext.alone(model, rank, num_nodes))

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (default: none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result."""


class CommunicateOptimizeStrategy(Strategy):
    """Inner optimizer step, then each communication module in turn.

    The gradients are released after the inner step, before the modules run: a
    module communicates (and changes) parameters, never gradients.

    Args:
        communication_modules: modules run after every inner step, in order.
        optim_spec: the inner optimizer (default AdamW).
        max_norm: gradient clipping before the inner step.
        **kwargs: the schedule and optimizer arguments of :class:`Strategy`.
    """

    def __init__(
        self,
        communication_modules: Sequence[CommunicationModule],
        optim_spec: OptimSpec | str | None = None,
        max_norm: float | None = None,
        **kwargs: Any,
    ):
        super().__init__(optim_spec=optim_spec, max_norm=max_norm, **kwargs)
        self.communication_modules = list(communication_modules)
        for module in self.communication_modules:
            if not isinstance(module, CommunicationModule):
                raise TypeError(f"communication_modules must be CommunicationModule, got {module!r}")
            module.strategy = self

    def validate(self, model: torch.nn.Module, num_nodes: int) -> None:
        """Every module's checks (:meth:`CommunicationModule.validate`) besides the base's."""
        super().validate(model, num_nodes)
        for module in self.communication_modules:
            module.validate(model, num_nodes)

    def setup(self, context: RankContext) -> None:
        """The base's set-up, then every module's (:meth:`CommunicationModule.setup`)."""
        super().setup(context)
        for module in self.communication_modules:
            module.setup(context)

    def step(self) -> None:
        self.clip_grads()
        self.optim.step()
        # The modules communicate parameters, not gradients: the gradients go before a
        # round, which may wait for peers (ranks packed in a process then hold none).
        self.zero_grad()
        self._communicate()
        super().step()

    def idle_step(self) -> None:
        """No inner step; the communication modules run as after any step (a round's
        average among them), then the schedule advances."""
        self._communicate()
        with warnings.catch_warnings():
            # an idle step may come first after a resume: no optimizer step yet here
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self._advance_schedule()

    def _communicate(self) -> None:
        self.synced_at = None  # a module that averages the whole model marks it again
        for module in self.communication_modules:
            module.communicate(self.model, self.rank, self.num_nodes, self.local_step)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["modules"] = [m.state_dict() for m in self.communication_modules]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for module, module_state in zip(self.communication_modules, state.get("modules", [])):
            module.load_state_dict(module_state)
