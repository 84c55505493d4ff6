"""Mirrored collectives: every peer holds exactly this rank's tensors, and nothing is sent.

``EXOGYM_COLLECTIVES=mirror`` makes every training collective return what it
would if every member of its group held this rank's tensors (a sum is the
group's size times the tensor, a gather that many copies of it). A mirrored
run does all of a strategy's own work per step (selection, packing,
compression, decoding) with no network and no waiting for peers, which is how
``python -m bench.multihost`` and :mod:`exogym.run.step_time` measure a strategy's
compute time. Bytes are counted as usual (by :mod:`exogym.comm`). The mirrored
world may be larger than the process group: one process then does the work of
one of ``world_size`` ranks. The side channel is the inner transport's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from exogym.comm.protocol import Collectives, ReduceOp, done


class MirroredGroup:
    """A subgroup of a mirrored world: nothing is sent over it, only its size counts."""

    def __init__(self, size: int):
        self.size = size


class Mirror(Collectives):
    """Collectives that act as if every peer held this rank's tensors.

    Args:
        inner: the transport for identity and the side channel (a process group,
            or a world of one).
        world_size: ranks of the mirrored world (None: the inner transport's).
    """

    name = "mirror"

    def __init__(self, inner: Collectives, world_size: int | None = None):
        self.inner = inner
        self.mirror_world = world_size

    @property
    def active(self) -> bool:
        return self.inner.active

    def rank(self) -> int:
        return self.inner.rank()

    def world_size(self) -> int:
        return self.mirror_world or self.inner.world_size()

    def new_group(self, ranks: Sequence[int]) -> Any:
        return MirroredGroup(len(ranks))

    def group_size(self, group: Any = None) -> int:
        if isinstance(group, MirroredGroup):
            return group.size
        if self.mirror_world is not None and (group is None or group is dist.group.WORLD):
            return self.mirror_world
        return self.inner.group_size(group)

    def group_ranks(self, group: Any = None) -> list[int]:
        return list(range(self.group_size(group)))

    def enter_step(self, step: int, members: Sequence[int] | None,
                   epoch: int | None = None) -> None:
        self.inner.enter_step(step, members, epoch)

    def pause(self, seconds: float) -> None:
        self.inner.pause(seconds)

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None,
                   async_op: bool = False) -> Any:
        if tensor.dtype != torch.bool:
            if op is None or op == ReduceOp.SUM:
                tensor.mul_(self.group_size(group))
            elif op == ReduceOp.PRODUCT:
                tensor.pow_(self.group_size(group))
        # AVG, MAX, MIN and the bitwise ops of equal tensors give the tensor itself.
        return done(async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None,
                  async_op: bool = False) -> Any:
        return done(async_op)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                   group: Any = None, async_op: bool = False) -> Any:
        for out in tensor_list:
            out.copy_(tensor)
        return done(async_op)

    def side_size(self) -> int:
        return self.inner.side_size()

    def side_all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        self.inner.side_all_reduce(tensor, op)

    def side_broadcast(self, tensor: torch.Tensor, src: int,
                       ranks: Sequence[int] | None = None) -> None:
        self.inner.side_broadcast(tensor, src, ranks)

    def side_all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.inner.side_all_gather(tensor_list, tensor)

    def side_barrier(self) -> None:
        self.inner.side_barrier()

    def close(self) -> None:
        self.inner.close()
