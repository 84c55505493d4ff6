"""FedAvg with islands and client sampling.

Every ``H`` local steps the ranks average their models. The ranks are split
into islands of ``island_size`` (the last may be smaller), redrawn every round
from a seed all ranks share, so no assignment is ever sent. Inside an island a
fraction ``client_sampling`` of the ranks take part; the others sit the round
out and then adopt their island's average.

One all-reduce over the island does it all: a taking-part rank contributes its
parameters, a sitting-out rank contributes zeros, and the sum is divided by the
number taking part. Each rank thus sends ``4 * P`` bytes per round (``P``
float32 trainable parameters plus float buffers), the cost of a plain
all-reduce over its island.
"""

from __future__ import annotations

from typing import Any

import torch

from exogym import comm
from exogym.comm.averaging import averaged_tensors
from exogym.comm.wire import ModelFacts, Traffic, wire_bytes, wire_collective

from .communicate_optimize_strategy import CommunicateOptimizeStrategy, CommunicationModule
from .context import RankContext
from .optim import OptimSpec
from .settings import FEDAVG


def island_plan(
    num_nodes: int, island_size: int, client_sampling: float, seed: int, round_index: int
) -> tuple[list[list[int]], set[int]]:
    """Islands and taking-part ranks of one round; the same on every rank.

    Returns the islands (lists of ranks) and the set of ranks that take part.
    Every island has at least one taking-part rank.
    """
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + round_index)
    if island_size >= num_nodes:
        islands = [list(range(num_nodes))]
    else:
        order = torch.randperm(num_nodes, generator=gen).tolist()
        islands = [sorted(order[i:i + island_size]) for i in range(0, num_nodes, island_size)]
    taking_part: set[int] = set()
    for island in islands:
        if client_sampling >= 1.0:
            taking_part.update(island)
            continue
        count = max(1, round(client_sampling * len(island)))
        pick = torch.randperm(len(island), generator=gen)[:count].tolist()
        taking_part.update(island[i] for i in pick)
    return islands, taking_part


class AveragingCommunicator(CommunicationModule):
    """Average models every ``H`` steps within islands, with client sampling.

    Args:
        island_size: ranks per island (default: all ranks).
        client_sampling: fraction of each island's ranks that take part in a round.
        H: local steps per round.
        comm_dtype: type the values travel in.
    """

    def __init__(self, island_size: int | None = FEDAVG.island_size.default,
                 client_sampling: float = FEDAVG.client_sampling.default,
                 H: int = FEDAVG.H.default, comm_dtype: str = FEDAVG.comm_dtype.default):
        super().__init__()
        FEDAVG.check(self, island_size=island_size, client_sampling=client_sampling, H=H,
                     comm_dtype=comm_dtype)
        comm.resolve_dtype(comm_dtype)
        self.island_size = island_size
        self.client_sampling = float(client_sampling)
        self.H = H
        self.comm_dtype = comm_dtype
        self._groups: dict[tuple[int, ...], Any] = {}

    def setup(self, context: RankContext) -> None:
        super().setup(context)
        self.tensors = averaged_tensors(context.model)
        self.round = 0

    def _group(self, island: list[int], num_nodes: int):
        return None if len(island) == num_nodes else self._groups[tuple(island)]

    def _ensure_groups(self, islands: list[list[int]], num_nodes: int) -> None:
        # new_group is collective over the world: every rank creates every
        # missing group, in the same order, because every rank has the same plan.
        if not self.collectives.active:
            return
        for island in islands:
            key = tuple(island)
            if len(island) < num_nodes and key not in self._groups:
                self._groups[key] = self.collectives.new_group(island)

    @torch.no_grad()
    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int,
                    local_step: int) -> None:
        if (local_step + 1) % self.H != 0:
            return
        seed = self.strategy.seed if self.strategy is not None else 0
        size = self.island_size or num_nodes
        islands, taking_part = island_plan(num_nodes, size, self.client_sampling, seed, self.round)
        self.round += 1
        if num_nodes == 1:
            return
        self._ensure_groups(islands, num_nodes)
        island = next(i for i in islands if rank in i)
        if len(island) == 1:
            return
        present = set(self.context.membership.present())  # every rank, unless some are away
        members = sum(1 for r in island if r in taking_part and r in present)
        if members == 0:
            return  # the island's sampled ranks are all away: its present ranks keep their models
        if rank not in taking_part:
            for t in self.tensors:
                t.zero_()
        self.collectives.all_reduce_tensors(self.tensors, group=self._group(island, num_nodes),
                                            average=True, world_size=members,
                                            dtype=self.comm_dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = state["round"]


class FedAvgStrategy(CommunicateOptimizeStrategy):
    """Federated averaging: ``H`` local steps, then average within islands.

    Args:
        optim_spec: the local optimizer (default AdamW); ``inner_optim=`` is the same.
        H: local steps per round.
        island_size: ranks per island, redrawn each round (None: one island of all ranks).
        client_sampling: fraction of each island taking part in a round.
        comm_dtype: type the values travel in.
        **kwargs: optimizer, schedule and clipping arguments of ``Strategy``.

    Defaults and accepted values: :data:`exogym.strategy.settings.FEDAVG` (the settings
    table in ``docs/strategies.md``).
    """

    stackable = True

    def __init__(
        self,
        optim_spec: OptimSpec | str | None = None,
        H: int = FEDAVG.H.default,
        island_size: int | None = FEDAVG.island_size.default,
        client_sampling: float = FEDAVG.client_sampling.default,
        comm_dtype: str = FEDAVG.comm_dtype.default,
        **kwargs: Any,
    ):
        FEDAVG.check(self, H=H, island_size=island_size, client_sampling=client_sampling,
                     comm_dtype=comm_dtype)
        self.H = H
        self.island_size = island_size
        self.client_sampling = client_sampling
        self.comm_dtype = comm_dtype
        self.averaging = AveragingCommunicator(island_size, client_sampling, H, comm_dtype)
        super().__init__(communication_modules=[self.averaging], optim_spec=optim_spec, **kwargs)

    traffic_needs = ("H",)

    def traffic(self, model: ModelFacts, num_nodes: int) -> list[Traffic]:
        """Whole models (parameters and float buffers) averaged every ``H`` steps, per island."""
        values = model.num_params + model.num_buffers
        return [Traffic(wire_collective(self.comm_dtype), wire_bytes(values, self.comm_dtype),
                        every=self.H, ranks=self.island_size)]
