"""DiLoCo: many local steps, then one outer step on the averaged change.

Algorithm (Douillard et al., 2023). Every rank keeps a copy of the global
("outer") parameters and an outer optimizer. Between rounds it takes ``H``
inner optimizer steps on its own data. After every ``H``-th inner step:

1. outer gradient = mean over ranks of (global params - local params),
   computed with ONE all-reduce of the trainable parameters' deltas
   (float buffers such as BatchNorm statistics are averaged in the same call);
2. every rank applies the same outer optimizer step (default: SGD, lr 0.7,
   Nesterov momentum 0.9) to its copy of the global parameters;
3. the local model takes the new global parameters. The inner optimizer's
   state carries over to the next round.

Because every rank holds the outer state and applies the same update to the
same numbers, the round needs nothing but that one all-reduce: ``4 * P``
bytes per rank per round for ``P`` float32 trainable parameters (half with
``comm_dtype='bfloat16'``).
"""

from __future__ import annotations

from typing import Any

import torch

from exogym import comm

from .communicate_optimize_strategy import CommunicateOptimizeStrategy, CommunicationModule
from .facts import COMM_DTYPE, DILOCO_H
from .optim import OptimSpec, ensure_optim_spec


class DiLoCoCommunicator(CommunicationModule):
    """The DiLoCo outer round as a composable module.

    Args:
        H: inner steps per round.
        outer_optim_spec: the outer optimizer (an ``OptimSpec``).
        comm_dtype: type the deltas travel in (``'float32'``, ``'bfloat16'``, ``'float16'``).
    """

    def __init__(self, H: int, outer_optim_spec: OptimSpec, comm_dtype: str = COMM_DTYPE):
        super().__init__()
        if not isinstance(H, int) or H < 1:
            raise ValueError(f"H must be an integer >= 1, got {H!r}")
        self.H = H
        self.outer_optim_spec = outer_optim_spec
        self.comm_dtype = comm_dtype
        comm.resolve_dtype(comm_dtype)

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.master = [p.detach().clone() for p in self.params]
        self.outer_optim = self.outer_optim_spec.build(self.master)

    @torch.no_grad()
    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int,
                    local_step: int) -> None:
        if (local_step + 1) % self.H != 0:
            return
        deltas = [m - p.detach() for m, p in zip(self.master, self.params)]
        comm.all_reduce_tensors(deltas + self.buffers, average=True, dtype=self.comm_dtype)
        for master, delta in zip(self.master, deltas):
            master.grad = delta
        self.outer_optim.step()
        for master in self.master:
            master.grad = None
        for p, master in zip(self.params, self.master):
            p.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        return {"master": [m.clone() for m in self.master],
                "outer_optim": self.outer_optim.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
        self.outer_optim.load_state_dict(state["outer_optim"])


def outer_spec(
    outer_optim_spec: OptimSpec | str | None,
    outer_lr: float,
    outer_momentum: float,
    nesterov: bool,
) -> OptimSpec:
    """The outer optimizer: the given spec, or SGD(outer_lr, outer_momentum, nesterov)."""
    if outer_optim_spec is None or (
        isinstance(outer_optim_spec, str) and outer_optim_spec.lower() == "sgd"
    ):
        return OptimSpec(
            torch.optim.SGD,
            lr=outer_lr,
            momentum=outer_momentum,
            nesterov=bool(nesterov and outer_momentum > 0),
        )
    if isinstance(outer_optim_spec, str):
        return OptimSpec.from_string(outer_optim_spec, lr=outer_lr)
    return ensure_optim_spec(outer_optim_spec)


class DiLoCoStrategy(CommunicateOptimizeStrategy):
    """DiLoCo: ``H`` local steps with the inner optimizer, then an outer round.

    Args:
        optim_spec: the inner optimizer (default AdamW); ``inner_optim=`` is the same.
        outer_optim_spec: the outer optimizer as an ``OptimSpec`` or name; default
            SGD with ``outer_lr``, ``outer_momentum`` and ``nesterov``.
        outer_optim: alias of ``outer_optim_spec``.
        H: inner steps per round (default 100).
        outer_lr: outer learning rate (0.7).
        outer_momentum: outer momentum (0.9).
        nesterov: Nesterov momentum for the outer SGD (True).
        comm_dtype: type the outer deltas travel in (``'float32'``).
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
        comm_dtype: str = COMM_DTYPE,
        **kwargs: Any,
    ):
        if outer_optim_spec is not None and outer_optim is not None:
            raise TypeError("DiLoCoStrategy: give outer_optim_spec= or outer_optim=, not both")
        self.H = H
        self.comm_dtype = comm_dtype
        self.outer_optim_spec = outer_spec(
            outer_optim_spec if outer_optim_spec is not None else outer_optim,
            outer_lr, outer_momentum, nesterov,
        )
        self.diloco = DiLoCoCommunicator(H, self.outer_optim_spec, comm_dtype)
        super().__init__(communication_modules=[self.diloco], optim_spec=optim_spec, **kwargs)
