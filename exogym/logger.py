"""Loggers: where a run's metric events are written, in the parent process.

Every logger receives the same events (see :mod:`exogym.metrics`) in the
process that started the run, never inside a rank, so a remote host needs no
access to the log folder. ``CSVLogger`` writes a fresh folder per run (a rerun
never appends to an old one); ``WandbLogger`` streams to Weights & Biases.
"""

from __future__ import annotations

import csv
import io
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from exogym.io import atomic_write_json, atomic_write_text


def _perplexity(loss: float | None) -> float | str:
    if loss is None or not isinstance(loss, (int, float)) or math.isnan(loss):
        return ""
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")


class Logger:
    """Base of the loggers: receives the run config, every event, and the summary."""

    def start(self, config: dict[str, Any]) -> None:
        """Called once before the ranks start."""

    def log_event(self, event: dict[str, Any]) -> None:
        """Called for every metric event of every rank."""

    def finish(self, summary: dict[str, Any], failed: bool = False) -> None:
        """Called once at the end, also when the run failed."""


def unique_run_dir(log_dir: str | Path, run_name: str) -> Path:
    """``log_dir/run_name``, or ``run_name-2``, ``-3``, ... if taken; created empty."""
    base = Path(log_dir)
    base.mkdir(parents=True, exist_ok=True)
    candidate = base / run_name
    n = 2
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            candidate = base / f"{run_name}-{n}"
            n += 1


class CSVLogger(Logger):
    """Writes a run's metrics as CSV files in a new folder ``log_dir/run_name``.

    Files: ``config.json`` (the run's settings), ``history.csv`` (one row per
    rank and step), ``train.csv`` and ``validation.csv`` (rank 0's view, with
    ``local_loss`` and ``global_loss``), ``summary.json``. Each is written
    atomically; the tables are written at the end of the run (or at its failure).

    Args:
        log_dir: parent folder of the run folders (default ``logs``).
        run_name: the run's folder name (default: date and time); a taken name
            gets a ``-2``, ``-3`` suffix instead of being appended to.
    """

    def __init__(self, log_dir: str | Path = "logs", run_name: str | None = None):
        self.log_dir = Path(log_dir)
        self.run_name = run_name
        self.run_dir: Path | None = None
        self.rows: list[dict[str, Any]] = []

    def start(self, config: dict[str, Any]) -> None:
        name = self.run_name or config.get("run_name") or datetime.now().strftime("%Y%m%d_%H%M%S")
        self.run_dir = unique_run_dir(self.log_dir, str(name))
        atomic_write_json(self.run_dir / "config.json", config)

    def log_event(self, event: dict[str, Any]) -> None:
        if event.get("event") == "step":
            self.rows.append({k: v for k, v in event.items() if k != "event"})

    def _table(self, rows: list[dict[str, Any]], columns: list[str]) -> str:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()

    def finish(self, summary: dict[str, Any], failed: bool = False) -> None:
        if self.run_dir is None:
            return
        columns: list[str] = []
        for row in self.rows:
            columns += [k for k in row if k not in columns]
        atomic_write_text(self.run_dir / "history.csv", self._table(self.rows, columns))
        rank0 = [r for r in self.rows if r.get("rank") == 0]
        train = [{"step": r["step"], "examples_trained": r.get("samples"),
                  "train_loss": r.get("train_loss"),
                  "train_perplexity": _perplexity(r.get("train_loss")), "lr": r.get("lr")}
                 for r in rank0]
        atomic_write_text(self.run_dir / "train.csv", self._table(
            train, ["step", "examples_trained", "train_loss", "train_perplexity", "lr"]))
        val = [{"step": r["step"], "local_loss": r["val_loss"],
                "local_perplexity": _perplexity(r["val_loss"]),
                "global_loss": r.get("val_global_loss"),
                "global_perplexity": _perplexity(r.get("val_global_loss"))}
               for r in rank0 if "val_loss" in r]
        atomic_write_text(self.run_dir / "validation.csv", self._table(
            val, ["step", "local_loss", "local_perplexity", "global_loss", "global_perplexity"]))
        atomic_write_json(self.run_dir / "summary.json", {**summary, "failed": failed})


class WandbLogger(Logger):
    """Streams rank 0's metrics (and the global validation loss) to Weights & Biases.

    Args:
        project: W&B project name.
        run_name: the run's display name.
        x_axis: ``'step'`` or ``'examples'`` (samples seen by all ranks).
        **init_kwargs: passed to ``wandb.init`` (``entity``, ``tags``, ...).
    """

    def __init__(self, project: str | None = None, run_name: str | None = None,
                 x_axis: str = "step", **init_kwargs: Any):
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "WandbLogger needs the wandb package, which is an optional extra: "
                "pip install 'exogym[wandb]' (or pip install wandb)"
            ) from None
        if x_axis not in ("step", "examples"):
            raise ValueError(f"x_axis must be 'step' or 'examples', got {x_axis!r}")
        self.wandb = wandb
        self.project = project
        self.run_name = run_name
        self.x_axis = x_axis
        self.init_kwargs = init_kwargs
        self.num_nodes = 1

    def start(self, config: dict[str, Any]) -> None:
        self.num_nodes = int(config.get("num_nodes", 1))
        self.wandb.init(project=self.project, name=self.run_name or config.get("run_name"),
                        config=config, **self.init_kwargs)

    def log_event(self, event: dict[str, Any]) -> None:
        if event.get("event") != "step" or event.get("rank") != 0:
            return
        data = {k: event[k] for k in ("train_loss", "lr", "comm_bytes", "val_loss",
                                      "val_global_loss", "correlation") if k in event}
        x = event["step"] if self.x_axis == "step" else event["samples"] * self.num_nodes
        self.wandb.log(data, step=x)

    def finish(self, summary: dict[str, Any], failed: bool = False) -> None:
        if self.wandb.run is not None:
            self.wandb.run.summary.update(summary)
            self.wandb.finish(exit_code=1 if failed else 0)


def make_logger(logger: Any, log_dir: str, run_name: str | None,
                wandb_project: str | None) -> Logger | None:
    """Resolve ``fit(logger=...)``: None, ``'csv'``, ``'wandb'`` or a Logger instance."""
    if wandb_project is not None and logger in (None, "csv", "wandb"):
        return WandbLogger(project=wandb_project, run_name=run_name)
    if logger is None or logger is False:
        return None
    if logger == "csv":
        return CSVLogger(log_dir=log_dir, run_name=run_name)
    if logger == "wandb":
        return WandbLogger(run_name=run_name)
    if isinstance(logger, Logger):
        return logger
    raise ValueError(f"logger must be None, 'csv', 'wandb' or a Logger instance, got {logger!r}")
