"""Fine-tune the converted Whisper tiny.en on espeak-ng speech with plain AdamW, one process.

A benchmark, not a test: it prints validation loss and word error rate on held-out
sentences before and after training, and seconds per step, to choose settings (learning
rate, steps, LoRA or full, frozen encoder) for the multi-node DiLoCo example. Run from
the project root:

    python -m bench.whisper_finetune_cpu --steps 30 --lr 3e-5
    python -m bench.whisper_finetune_cpu --steps 30 --lr 1e-3 --lora-rank 8
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils.data import DataLoader

from distributed.tasks.whisper.lora import count_trainable
from distributed.tasks.whisper.speech_data import collate_whisper_batch
from distributed.tasks.whisper.task import build_whisper_task, evaluate_wer


@torch.no_grad()
def mean_loss(model: torch.nn.Module, dataset, batch_size: int) -> float:
    """Token-weighted mean cross-entropy of ``dataset``."""
    was_training = model.training
    model.eval()
    total = tokens = 0.0
    for batch in DataLoader(dataset, batch_size=batch_size, collate_fn=collate_whisper_batch):
        n = float((batch["labels"] != -100).sum())
        total += float(model(batch)) * n
        tokens += n
    model.train(was_training)
    return total / tokens


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.whisper_finetune_cpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-sentences", type=int, default=40)
    parser.add_argument("--voices", default="en-us", help="comma-separated espeak-ng voices")
    parser.add_argument("--speeds", default="160", help="comma-separated words per minute")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--freeze-encoder", action="store_true")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    start = time.perf_counter()
    model, train, val = build_whisper_task(
        checkpoint="tiny.en", num_sentences=args.num_sentences, lora_rank=args.lora_rank,
        seed=args.seed, cache_dir=args.cache_dir, freeze_encoder=args.freeze_encoder,
        voices=tuple(args.voices.split(",")), speeds=tuple(int(s) for s in args.speeds.split(",")),
    )
    print(f"setup {time.perf_counter() - start:.1f}s: {len(train)} train / {len(val)} val "
          f"utterances, {count_trainable(model):,} trainable parameters, "
          f"{torch.get_num_threads()} threads")

    def report(tag: str) -> None:
        t0 = time.perf_counter()
        loss = mean_loss(model, val, args.batch_size)
        wer = evaluate_wer(model, val, batch_size=args.batch_size)
        print(f"{tag}: val_loss {loss:.4f}  val_wer {wer:.4f}  "
              f"(eval {time.perf_counter() - t0:.1f}s)", flush=True)

    report("before")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.lr, weight_decay=0.0)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        collate_fn=collate_whisper_batch,
                        generator=torch.Generator().manual_seed(args.seed))
    epoch_batches = iter(loader)
    model.train()
    step_times = []
    for step in range(1, args.steps + 1):
        try:
            batch = next(epoch_batches)
        except StopIteration:
            epoch_batches = iter(loader)
            batch = next(epoch_batches)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch)
        loss.backward()
        optimizer.step()
        step_times.append(time.perf_counter() - t0)
        value = loss.item()
        if not math.isfinite(value):
            raise SystemExit(f"step {step}: loss is {value}; lower --lr")
        if step % 5 == 0 or step == 1:
            print(f"step {step:3d}  train_loss {value:.4f}  {step_times[-1]:.1f}s/step",
                  flush=True)
    print(f"train: {args.steps} steps, mean {sum(step_times) / len(step_times):.1f}s/step, "
          f"total {sum(step_times):.0f}s")
    report("after")


if __name__ == "__main__":
    main()
