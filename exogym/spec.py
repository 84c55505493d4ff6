"""RunSpec: one validated description of a training run, the same for every rank.

``make_run_spec`` checks every argument of ``fit`` before any process starts,
so a typo or an impossible value costs an error message, not a hung job.
A rank receives the spec (pickled in a local simulation, rebuilt from a
profile on a remote host) and needs nothing else to train.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from exogym.data import is_factory
from exogym.devices import default_threads, resolve_devices
from exogym.strategy.strategy import Strategy


@dataclass
class RunSpec:
    """Everything a rank needs to train. Built by :func:`make_run_spec`."""

    model: torch.nn.Module
    train_dataset: Any
    val_dataset: Any
    strategy: Strategy
    num_nodes: int
    num_epochs: int
    max_steps: int | None
    batch_size: int
    minibatch_size: int
    shuffle: bool
    val_size: int
    val_interval: int
    autocast: bool
    device_type: str
    devices: list[int] | None
    seed: int
    num_threads: int | None
    dataloader_kwargs: dict[str, Any] = field(default_factory=dict)
    save_dir: str = "./checkpoints"
    checkpoint_interval: int | None = None
    keep_checkpoints: int = 3
    resume_from: str | None = None
    correlation_interval: int | None = None
    run_name: str | None = None
    log_interval: int = 10
    broadcast_init: bool = False
    timeout_s: float = 1800.0
    ranks_per_machine: int | None = None
    backend: str | None = None  # None: nccl when every rank has its own GPU, else gloo

    def threads_per_rank(self) -> int:
        """``num_threads``, or this machine's cores shared by the ranks it runs."""
        return self.num_threads or default_threads(self.ranks_per_machine or self.num_nodes)

    @property
    def accumulation_steps(self) -> int:
        """Minibatches per optimizer step."""
        return self.batch_size // self.minibatch_size

    def config(self) -> dict[str, Any]:
        """Plain settings of the run, for logs and the saved run config."""
        plain = {
            k: getattr(self, k)
            for k in (
                "num_nodes", "num_epochs", "max_steps", "batch_size", "minibatch_size",
                "shuffle", "val_size", "val_interval", "autocast", "device_type", "devices",
                "seed", "num_threads", "checkpoint_interval", "correlation_interval",
                "run_name",
            )
        }
        plain["strategy"] = self.strategy.__config__()
        plain["model"] = type(self.model).__name__
        plain["trainable_parameters"] = sum(
            p.numel() for p in self.model.parameters() if p.requires_grad
        )
        return plain


def _int_at_least(name: str, value: Any, low: int, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = f"an integer >= {low}" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value


def _check_dataset(name: str, dataset: Any) -> None:
    if dataset is None:
        raise ValueError(f"{name} is None; pass a Dataset or a factory f(rank, num_nodes, is_train)")
    if is_factory(dataset):
        return
    if not hasattr(dataset, "__getitem__") and not hasattr(dataset, "__iter__"):
        raise TypeError(f"{name} must be a torch Dataset or a factory f(rank, num_nodes, "
                        f"is_train), got {type(dataset).__name__}")
    if hasattr(dataset, "__len__") and len(dataset) == 0:
        raise ValueError(f"{name} is empty")


def resolve_minibatch(batch_size: int, minibatch_size: int | str | None,
                      gradient_accumulation: int | None) -> int | str:
    """Minibatch size from ``minibatch_size`` or ``gradient_accumulation`` (checked)."""
    if minibatch_size is not None and gradient_accumulation is not None:
        if minibatch_size == "auto":
            raise ValueError("give minibatch_size='auto' or gradient_accumulation=, not both")
        if batch_size != minibatch_size * gradient_accumulation:
            raise ValueError(
                f"minibatch_size={minibatch_size} and gradient_accumulation="
                f"{gradient_accumulation} disagree with batch_size={batch_size}; give one of them"
            )
    if gradient_accumulation is not None:
        _int_at_least("gradient_accumulation", gradient_accumulation, 1)
        if batch_size % gradient_accumulation:
            raise ValueError(f"gradient_accumulation={gradient_accumulation} must divide "
                             f"batch_size={batch_size}")
        return batch_size // gradient_accumulation
    if minibatch_size is None:
        return batch_size
    if minibatch_size == "auto":
        return "auto"
    _int_at_least("minibatch_size", minibatch_size, 1)
    if minibatch_size > batch_size or batch_size % minibatch_size:
        raise ValueError(
            f"minibatch_size={minibatch_size} must divide batch_size={batch_size} "
            "(each step accumulates batch_size/minibatch_size minibatches); "
            f"divisors of {batch_size}: {divisors(batch_size)}"
        )
    return minibatch_size


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order."""
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def make_run_spec(
    model: torch.nn.Module,
    train_dataset: Any,
    val_dataset: Any,
    *,
    strategy: Strategy,
    num_nodes: int,
    num_epochs: int,
    max_steps: int | None,
    batch_size: int,
    minibatch_size: int | str | None,
    gradient_accumulation: int | None,
    shuffle: bool,
    val_size: int,
    val_interval: int,
    autocast: bool,
    device: Any,
    devices: Any,
    seed: int,
    num_threads: int | None,
    dataloader_kwargs: dict[str, Any] | None,
    save_dir: str,
    checkpoint_interval: int | None,
    keep_checkpoints: int,
    resume_from: str | None,
    correlation_interval: int | None,
    run_name: str | None,
    log_interval: int,
    timeout_s: float,
) -> RunSpec:
    """Validate ``fit``'s arguments and return the spec (``minibatch_size`` may stay 'auto')."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (none has requires_grad=True)")
    if not isinstance(strategy, Strategy):
        raise TypeError(
            "strategy must be a Strategy instance such as DiLoCoStrategy(H=100) or "
            f"SimpleReduceStrategy(), got {strategy!r}"
        )
    _check_dataset("train_dataset", train_dataset)
    if val_size:
        _check_dataset("val_dataset", val_dataset)
    _int_at_least("num_nodes", num_nodes, 1)
    _int_at_least("num_epochs", num_epochs, 1)
    _int_at_least("max_steps", max_steps, 1, allow_none=True)
    _int_at_least("batch_size", batch_size, 1)
    minibatch = resolve_minibatch(batch_size, minibatch_size, gradient_accumulation)
    _int_at_least("val_size", val_size, 0)
    _int_at_least("val_interval", val_interval, 1)
    _int_at_least("seed", seed, 0)
    _int_at_least("num_threads", num_threads, 1, allow_none=True)
    _int_at_least("checkpoint_interval", checkpoint_interval, 1, allow_none=True)
    _int_at_least("keep_checkpoints", keep_checkpoints, 1)
    _int_at_least("correlation_interval", correlation_interval, 1, allow_none=True)
    _int_at_least("log_interval", log_interval, 1)
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if dataloader_kwargs is not None and not isinstance(dataloader_kwargs, dict):
        raise TypeError(f"dataloader_kwargs must be a dict, got {type(dataloader_kwargs).__name__}")
    reserved = {"batch_size", "sampler", "batch_sampler", "shuffle"} & set(dataloader_kwargs or {})
    if reserved:
        raise ValueError(f"dataloader_kwargs may not set {sorted(reserved)}: the trainer sets "
                         "them from batch_size/minibatch_size and shuffle")
    if resume_from is not None and not isinstance(resume_from, str):
        raise TypeError(f"resume_from must be a path or 'auto', got {resume_from!r}")
    device_type, device_ids = resolve_devices(device, devices)
    if autocast and device_type == "mps" and not hasattr(torch, "mps"):
        raise ValueError("autocast on MPS needs a newer torch; set autocast=False")
    return RunSpec(
        model=model,
        train_dataset=train_dataset,
        val_dataset=val_dataset,
        strategy=strategy,
        num_nodes=num_nodes,
        num_epochs=num_epochs,
        max_steps=max_steps,
        batch_size=batch_size,
        minibatch_size=minibatch,  # type: ignore[arg-type]
        shuffle=bool(shuffle),
        val_size=val_size,
        val_interval=val_interval,
        autocast=bool(autocast),
        device_type=device_type,
        devices=device_ids,
        seed=seed,
        num_threads=num_threads,
        dataloader_kwargs=dict(dataloader_kwargs or {}),
        save_dir=str(save_dir),
        checkpoint_interval=checkpoint_interval,
        keep_checkpoints=keep_checkpoints,
        resume_from=resume_from,
        correlation_interval=correlation_interval,
        run_name=run_name,
        log_interval=log_interval,
        timeout_s=float(timeout_s),
    )
