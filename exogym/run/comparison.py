"""``exogym.compare``: every strategy on one model, one dataset and one seed, side by side.

What the CLI's ``compare`` does for a profile, for a person's own model and data::

    from exogym import compare

    rows = compare(model, train_ds, val_ds, ["ddp", "diloco", "sparta"], num_nodes=4,
                   max_steps=200, network="100mbit", plot="compare.png")

Each strategy trains a fresh copy of the model with the same data, seed and ``fit``
arguments; a table shows the final validation loss (and accuracy, when the task
reports it), the bytes each node sent, the wall time, the train time and, on a
named ``network``, the simulated time. The rows come back as dicts.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["compare"]

#: What ``compare`` runs when no strategies are named: the registry's comparison set.
DEFAULT = ("ddp", "diloco", "sparta", "fedavg", "demo")


@dataclass
class _Result:
    strategy: str
    curve: list[tuple[int, int, float]] = field(default_factory=list)
    sim_curve: list[tuple[float, float]] = field(default_factory=list)


def _strategies(strategies: Sequence[Any] | Mapping[str, Any] | None
                ) -> list[tuple[str, Any]]:
    """``(label, strategy name or instance)`` for each asked for, checked now."""
    from exogym.strategy import registry
    from exogym.strategy.strategy import Strategy

    if strategies is None:
        items: list[tuple[str, Any]] = [(name, name) for name in DEFAULT]
    elif isinstance(strategies, Mapping):
        items = [(str(label), value) for label, value in strategies.items()]
    elif isinstance(strategies, (str, Strategy)):
        raise TypeError("strategies must be a list (or a mapping of labels to strategies), "
                        f"got {strategies!r}; wrap it in a list")
    else:
        items = []
        for value in strategies:
            label = value if isinstance(value, str) else type(value).__name__
            items.append((label, value))
    if not items:
        raise ValueError("compare needs at least one strategy")
    checked = []
    for label, value in items:
        if isinstance(value, str):
            name = registry.canonical(value)  # ValueError naming the known ones
            if name == "none":
                raise ValueError("strategy 'none' trains nothing together: leave it out")
            checked.append((label, name))
        elif isinstance(value, Strategy):
            checked.append((label, value))
        else:
            raise TypeError(f"strategy {label!r}: give a name such as 'diloco' or a Strategy "
                            f"instance, got {type(value).__name__}")
    labels = [label for label, _ in checked]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"strategies {', '.join(repeated)} given twice: give each once (a "
                         "mapping of labels to strategies tells two settings apart)")
    return checked


def _fresh(value: Any) -> Any:
    """A strategy for one run: built from its name, or a copy of the instance given (a
    strategy holds state from the run it served)."""
    from exogym.strategy import registry

    if isinstance(value, str):
        return registry.class_of(value)()
    return copy.deepcopy(value)


def compare(model: torch.nn.Module, train_dataset: Any, val_dataset: Any = None,
            strategies: Sequence[Any] | Mapping[str, Any] | None = None, *,
            network: Any = None, plot: str | Path | None = None, show: bool = True,
            **fit_kwargs: Any) -> list[dict[str, Any]]:
    """Train ``model`` with each strategy on the same data and seed; the results as rows.

    Args:
        model: the model; each strategy trains a copy of it, so it is left as it is.
        train_dataset, val_dataset: as for :class:`exogym.Trainer`.
        strategies: names (``"diloco"``), :class:`~exogym.strategy.strategy.Strategy`
            instances (each run gets a copy), or a mapping of labels to either; default
            DDP, DiLoCo, SPARTA, FedAvg and DeMo with their defaults.
        network: a :class:`exogym.Network` or a rate (``"100mbit"``): each run keeps the
            simulated clock on it, and the rows give the simulated time.
        plot: where to write a PNG of validation loss against steps, bytes sent and (with
            ``network``) simulated time; needs matplotlib.
        show: print the table (and each run's progress, unless ``progress`` is given).
        **fit_kwargs: for every run's ``fit`` (``num_nodes``, ``max_steps``, ``seed``,
            ``batch_size``, ...); ``strategy`` is compare's to set.

    Returns:
        One dict per strategy, in the order given: ``strategy``, ``final_val_loss``,
        ``final_val_accuracy`` (None unless the task reports it), ``bytes_per_node``,
        ``wall_s``, ``train_s``, ``sim_time_s`` (None without ``network``), ``steps``.

    Raises:
        ValueError, TypeError: a strategy or an argument ``fit`` would refuse, before any
            run starts.
        ImportError: ``plot`` without matplotlib, before any run starts.
    """
    from exogym.run.trainer import Trainer

    if "strategy" in fit_kwargs:
        raise TypeError("compare sets each run's strategy: give them as strategies=[...]")
    runs = _strategies(strategies)
    if plot is not None:
        from exogym.report.comparison_plot import check_plotting

        check_plotting()
    if network is not None:
        fit_kwargs["network"] = network
    fit_kwargs.setdefault("logger", None)
    fit_kwargs.setdefault("progress", bool(show))
    fit_kwargs.setdefault("seed", 0)
    # Every argument checked before the first run: a typo costs nothing.
    Trainer(model, train_dataset, val_dataset).check(strategy=_fresh(runs[0][1]), **fit_kwargs)
    rows, results = [], []
    for label, value in runs:
        trainer = Trainer(copy.deepcopy(model), train_dataset, val_dataset)
        trainer.fit(strategy=_fresh(value), **fit_kwargs)
        summary = trainer.summary
        evaluations = [r for r in trainer.history if r["rank"] == 0 and "val_loss" in r]
        results.append(_Result(
            label,
            [(r["step"], int(r["comm_bytes"]), float(r.get("val_global_loss", r["val_loss"])))
             for r in evaluations],
            [(float(r["sim_time_s"]), float(r.get("val_global_loss", r["val_loss"])))
             for r in evaluations if "sim_time_s" in r]))
        loss = summary.get("final_val_global_loss", summary.get("final_val_loss"))
        rows.append({"strategy": label, "final_val_loss": loss,
                     "final_val_accuracy": summary.get("final_val_accuracy"),
                     "bytes_per_node": float(summary.get("bytes_per_node") or 0),
                     "wall_s": summary.get("wall_s"), "train_s": summary.get("train_s"),
                     "sim_time_s": summary.get("sim_time_s"), "steps": summary.get("steps")})
    if show:
        _print_table(rows, network)
    if plot is not None:
        from exogym.report.comparison_plot import plot_comparison

        named = None if network is None else _network_name(network)
        plot_comparison(results, plot, network=named)
    return rows


def _network_name(network: Any) -> str:
    from exogym.sim.network import Network

    return Network.coerce(network).describe()


def _print_table(rows: list[dict[str, Any]], network: Any) -> None:
    from rich.table import Table

    from exogym.base.terminal import output_console
    from exogym.report.summary import human_bytes

    accuracy = any(r["final_val_accuracy"] is not None for r in rows)
    timed = any(r["sim_time_s"] is not None for r in rows)
    table = Table(title="compare: the same model, data and seed"
                  + (f", on {_network_name(network)}" if network is not None else ""),
                  title_justify="left")
    for name in ("strategy", "val loss", *(("val acc",) if accuracy else ()),
                 "sent per node", "wall (s)", "train (s)", *(("simulated (s)",) if timed else ())):
        table.add_column(name, justify="left" if name == "strategy" else "right")

    def number(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        table.add_row(r["strategy"], number(r["final_val_loss"], ".4f"),
                      *((number(r["final_val_accuracy"], ".1%"),) if accuracy else ()),
                      human_bytes(r["bytes_per_node"]), number(r["wall_s"], ".3g"),
                      number(r["train_s"], ".3g"),
                      *((number(r["sim_time_s"], ".3g"),) if timed else ()))
    output_console().print(table)
