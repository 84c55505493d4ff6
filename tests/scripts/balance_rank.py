"""One rank of a DDP run with ``balance='batch'`` across real rank processes, rank 1 held back.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p PYTHONPATH=.:tests \
        python tests/scripts/balance_rank.py

(the project and the tests' helpers on PYTHONPATH).

Rank 1's training forward waits 50 ms without using the CPU, as a host held
to part of its core by a quota does. Each rank prints its batch size of the
last step as its last line: ``{"rank": r, "batch_size": b}``.
"""

import json
import os
import time

import torch
from toys import TinyNet, toy_dataset

from distributed.worker.environment import rank_environment
from distributed.worker.rank_trainer import RankTrainer
from exogym.strategy import OptimSpec, SimpleReduceStrategy


class HeldBackOnRankOne(TinyNet):
    """A TinyNet whose training forward sleeps 50 ms in the process of rank 1."""

    def forward(self, batch):
        if torch.is_grad_enabled() and os.environ["RANK"] == "1":
            time.sleep(0.05)
        return super().forward(batch)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = toy_dataset()
    trainer = RankTrainer(rank_environment(), HeldBackOnRankOne(), data, data)
    trainer.fit(strategy=SimpleReduceStrategy(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1)),
                max_steps=8, batch_size=8, balance="batch", num_threads=1, val_size=0,
                device="cpu", progress=False, logger=None)
    last = trainer.history[-1]
    print(json.dumps({"rank": last["rank"], "batch_size": last["batch_size"]}), flush=True)
