"""Loggers: where a run's metric events are written, in the parent process.

Every logger receives the same events (see :mod:`exogym.report.metrics`) in the
process that started the run, never inside a rank, so a remote host needs no
access to the log folder (across hosts, rank 0's process is that process).
``CSVLogger`` writes a fresh folder per run (a rerun never appends to an old
one); ``WandbLogger`` streams to Weights & Biases (offline with
``WANDB_MODE=offline``); ``TensorBoardLogger`` writes TensorBoard event files,
a fresh folder per run too. The trackers are optional extras: a missing one
is an ``ImportError`` naming the extra when the logger is made, before any
rank starts.
"""

from __future__ import annotations

import csv
import io
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from exogym.base.install_mode import install_extra
from exogym.base.io import atomic_write_json, atomic_write_text


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


#: The loggers ``fit(logger=...)`` (and a profile's ``logger`` key) may name.
LOGGER_NAMES = ("csv", "wandb", "tensorboard")

#: The step event's keys the trackers log, where an event has them.
TRACKED_KEYS = ("train_loss", "val_loss", "val_global_loss", "lr", "comm_bytes", "sim_time_s",
                "correlation")


class WandbLogger(Logger):
    """Streams rank 0's metrics (and the global validation loss) to Weights & Biases.

    With ``WANDB_MODE=offline`` nothing goes over the network: the run is kept
    in ``dir/wandb/offline-run-*`` for ``wandb sync`` later.

    Args:
        project: W&B project name.
        run_name: the run's display name.
        x_axis: ``'step'`` or ``'examples'`` (samples seen by all ranks).
        log_dir: the folder W&B keeps its run files in (``log_dir/wandb``; created);
            default: W&B's own (``./wandb``).
        **init_kwargs: passed to ``wandb.init`` (``entity``, ``tags``, ...).
    """

    def __init__(self, project: str | None = None, run_name: str | None = None,
                 x_axis: str = "step", log_dir: str | Path | None = None, **init_kwargs: Any):
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "WandbLogger needs the wandb package, which is an optional extra: "
                f"{install_extra('wandb')} (or pip install wandb)"
            ) from None
        if x_axis not in ("step", "examples"):
            raise ValueError(f"x_axis must be 'step' or 'examples', got {x_axis!r}")
        self.wandb = wandb
        self.project = project
        self.run_name = run_name
        self.x_axis = x_axis
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.init_kwargs = init_kwargs
        self.num_nodes = 1

    def start(self, config: dict[str, Any]) -> None:
        self.num_nodes = int(config.get("num_nodes", 1))
        kwargs = dict(self.init_kwargs)
        if self.log_dir is not None and "dir" not in kwargs:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(self.log_dir)
        self.wandb.init(project=self.project, name=self.run_name or config.get("run_name"),
                        config=config, **kwargs)

    def log_event(self, event: dict[str, Any]) -> None:
        if event.get("event") != "step" or event.get("rank") != 0:
            return
        data = {k: event[k] for k in TRACKED_KEYS if k in event}
        x = event["step"] if self.x_axis == "step" else event["samples"] * self.num_nodes
        self.wandb.log(data, step=x)

    def finish(self, summary: dict[str, Any], failed: bool = False) -> None:
        if self.wandb.run is not None:
            self.wandb.run.summary.update(summary)
            self.wandb.finish(exit_code=1 if failed else 0)


class TensorBoardLogger(Logger):
    """Writes a run's scalars as TensorBoard event files in a new folder ``log_dir/run_name``.

    Scalars, against the step:

    - per rank, ``rank{r}/train_loss``, ``rank{r}/val_loss``, ``rank{r}/lr``,
      ``rank{r}/comm_bytes`` (cumulative bytes sent) and ``rank{r}/sim_time_s``
      (simulated time, when the events carry it);
    - global, ``global/val_loss`` (the ranks' average model), and at the steps
      every rank reported here: ``global/train_loss`` (mean over ranks),
      ``global/comm_bytes`` (sum) and ``global/sim_time_s`` (the slowest rank).

    Across hosts only rank 0 logs, and it sees its own events only: its folder
    holds ``rank0/*`` and ``global/val_loss``. The run's settings are in
    ``config.json`` beside the event files and as the text ``config``.
    ``tensorboard --logdir LOG_DIR`` shows every run of a folder.

    Args:
        log_dir: parent folder of the run folders (default ``logs``).
        run_name: the run's folder name (default: date and time); a taken name
            gets a ``-2``, ``-3`` suffix instead of being appended to.
    """

    def __init__(self, log_dir: str | Path = "logs", run_name: str | None = None):
        try:
            import tensorboard  # noqa: F401  (torch's writer needs it, and says so less clearly)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "TensorBoardLogger needs the tensorboard package, which is an optional extra: "
                f"{install_extra('tensorboard')} (or pip install tensorboard)"
            ) from None
        self._writer_class = SummaryWriter
        self.log_dir = Path(log_dir)
        self.run_name = run_name
        self.run_dir: Path | None = None
        self.writer: Any = None
        self._config_text = ""
        self.num_nodes = 1
        self._pending: dict[int, dict[int, dict[str, Any]]] = {}
        self._global_val_steps: set[int] = set()

    def start(self, config: dict[str, Any]) -> None:
        self.num_nodes = int(config.get("num_nodes", 1))
        name = self.run_name or config.get("run_name") or datetime.now().strftime("%Y%m%d_%H%M%S")
        self.run_dir = unique_run_dir(self.log_dir, str(name))
        atomic_write_json(self.run_dir / "config.json", config)
        self._config_text = json.dumps(config, indent=2, sort_keys=True, default=repr)

    def _open(self) -> Any:
        # Opened at the first event, once the ranks run: the writer's thread would
        # otherwise keep them from being forked from this process.
        if self.writer is None:
            self.writer = self._writer_class(log_dir=str(self.run_dir))
            self.writer.add_text("config", "```\n" + self._config_text + "\n```", global_step=0)
        return self.writer

    def log_event(self, event: dict[str, Any]) -> None:
        if event.get("event") != "step" or self.run_dir is None:
            return
        self._open()
        rank, step = int(event["rank"]), int(event["step"])
        for key in ("train_loss", "val_loss", "lr", "comm_bytes", "sim_time_s"):
            if _scalar(event.get(key)):
                self.writer.add_scalar(f"rank{rank}/{key}", float(event[key]), step)
        if _scalar(event.get("val_global_loss")) and step not in self._global_val_steps:
            self._global_val_steps.add(step)  # every rank reports the same average model's loss
            self.writer.add_scalar("global/val_loss", float(event["val_global_loss"]), step)
        reported = self._pending.setdefault(step, {})
        reported[rank] = event
        if len(reported) == self.num_nodes:
            self._write_global(step, list(self._pending.pop(step).values()))

    def _write_global(self, step: int, events: list[dict[str, Any]]) -> None:
        losses = [float(e["train_loss"]) for e in events if _scalar(e.get("train_loss"))]
        if len(losses) == len(events):
            self.writer.add_scalar("global/train_loss", sum(losses) / len(losses), step)
        if all(_scalar(e.get("comm_bytes")) for e in events):
            self.writer.add_scalar("global/comm_bytes",
                                   float(sum(e["comm_bytes"] for e in events)), step)
        if all(_scalar(e.get("sim_time_s")) for e in events):
            self.writer.add_scalar("global/sim_time_s",
                                   float(max(e["sim_time_s"] for e in events)), step)

    def finish(self, summary: dict[str, Any], failed: bool = False) -> None:
        if self.run_dir is None:
            return
        writer = self._open()
        writer.flush()
        writer.close()
        atomic_write_json(self.run_dir / "summary.json", {**summary, "failed": failed})


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)



def make_logger(logger: Any, log_dir: str, run_name: str | None,
                wandb_project: str | None) -> Logger | None:
    """Resolve ``fit(logger=...)``: None, ``'csv'``, ``'wandb'``, ``'tensorboard'`` or a Logger.

    ``wandb_project`` alone means W&B (in that project), unless ``logger`` names
    TensorBoard or is a Logger.
    """
    if wandb_project is not None and logger in (None, "csv", "wandb"):
        return WandbLogger(project=wandb_project, run_name=run_name, log_dir=log_dir)
    if logger is None or logger is False:
        return None
    if logger == "csv":
        return CSVLogger(log_dir=log_dir, run_name=run_name)
    if logger == "wandb":
        return WandbLogger(run_name=run_name, log_dir=log_dir)
    if logger == "tensorboard":
        return TensorBoardLogger(log_dir=log_dir, run_name=run_name)
    if isinstance(logger, Logger):
        return logger
    names = ", ".join(repr(n) for n in LOGGER_NAMES)
    raise ValueError(f"logger must be None, {names} or a Logger instance, got {logger!r}")
