"""``fit``'s keyword arguments for editors and type checkers (generated: do not edit).

Generated from :class:`exogym.config.fit_args.FitArgs` by
``python -m exogym.config.fit_args``; a test fails when the two disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from exogym.report.loggers import Logger
    from exogym.report.summary import ProgressSink
    from exogym.strategy.strategy import Strategy

__all__ = ["FitKwargs"]


class FitKwargs(TypedDict, total=False):
    """Every keyword ``Trainer.fit`` accepts, with its type; see ``fit``'s docstring."""

    num_epochs: int
    strategy: Strategy | None
    num_nodes: int
    max_steps: int | None
    device: str | None
    devices: list[int] | None
    batch_size: int
    minibatch_size: int | str | None
    gradient_accumulation: int | None
    max_memory_usage: float
    shuffle: bool
    partition: str
    shared_samples: bool
    val_size: int
    val_interval: int
    autocast: bool
    checkpoint_interval: int | None
    keep_checkpoints: int
    resume_from: str | None
    correlation_interval: int | None
    save_dir: str
    dataloader_kwargs: dict[str, Any] | None
    seed: int
    run_name: str | None
    log_interval: int
    num_threads: int | None
    timeout_s: float
    network: Any
    compute_time_s: float | None
    rank_speeds: list[float] | None
    speed_mode: str
    balance: str
    rank_failures: list[tuple[int, int, int | None]] | None
    compute_schedule: list[list[float]] | None
    run_identity: dict[str, Any] | None
    logger: Logger | str | None
    log_dir: str
    wandb_project: str | None
    processes: int | None
    stack: bool | str
    trace: str | bool | None
    progress: bool | ProgressSink
