"""The strategies known by name: what profiles, the CLI and the planner call them. No torch here.

One entry per built-in strategy: its settings (:mod:`exogym.strategy.settings`,
which also gives its name: ``'diloco'``), the class that implements it
(imported only when asked for) and a line saying what it sends. The settings
its traffic depends on, with their defaults, are read from those declarations
(:attr:`Known.traffic_defaults`). What a strategy sends is its class's own
statement (``Strategy.traffic``); nothing here computes bytes, so a strategy a
researcher writes needs no entry to be simulated or planned, only to be called
by a short name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from . import settings
from .settings import Settings

__all__ = ["ALIASES", "COMPARED", "KNOWN", "Known", "canonical", "class_of", "name_of"]


@dataclass(frozen=True)
class Known:
    """A strategy known by name.

    Args:
        settings: its settings (:mod:`exogym.strategy.settings`), under its short name.
        home: ``module:Class`` of its class, relative to :mod:`exogym.strategy`;
            empty for ``none`` (no communication, no class).
        summary: one line saying what it sends.
    """

    settings: Settings
    home: str
    summary: str

    @property
    def name(self) -> str:
        """Its short name (a profile's ``strategy = diloco``)."""
        return self.settings.strategy

    @property
    def traffic_defaults(self) -> dict[str, Any]:
        """The settings its traffic depends on, with its class's defaults."""
        return self.settings.traffic_defaults()


KNOWN: dict[str, Known] = {k.name: k for k in (
    Known(settings.DDP, "strategy:SimpleReduceStrategy",
          "all-reduce every gradient every step: the reference, and the most traffic"),
    Known(settings.DILOCO, "diloco:DiLoCoStrategy",
          "H local steps, then one all-reduce of the model change: traffic divided by H"),
    Known(settings.SPARTA, "sparta:SPARTAStrategy",
          "every step, average a small random fraction p of the weights: traffic times p"),
    Known(settings.FEDAVG, "federated_averaging:FedAvgStrategy",
          "H local steps, then average whole models, optionally in islands of ranks"),
    Known(settings.DEMO, "demo:DeMoStrategy",
          "send only the top-k DCT components of each rank's momentum every step"),
    Known(settings.SPARTA_DILOCO, "sparta_diloco:SPARTADiLoCoStrategy",
          "SPARTA's sparse averaging between DiLoCo rounds"),
    Known(settings.STREAMING_DILOCO, "streaming_diloco:StreamingDiLoCoStrategy",
          "DiLoCo's round cut into fragments synced in turn: same total, "
          "peak per sync divided by the fragments"),
    Known(settings.SPARSELOCO, "sparseloco:SparseLoCoStrategy",
          "H local steps, then all-gather the top-k of every chunk of the "
          "error-fed change, quantized: a percent of DiLoCo's bytes"),
    Known(settings.DESLOC, "desloc:DESLOCStrategy",
          "local Adam steps; average the parameters every H_params steps and Adam's two "
          "moments on their own, longer periods: half of Local Adam's traffic"),
    Known(settings.MULOCO, "muloco:MuLoCoStrategy",
          "DiLoCo with Muon inner steps; the model change sent in 4 bits with error "
          "feedback: about a seventh of DiLoCo's bytes"),
    Known(settings.ASYNC_DILOCO, "async_diloco:AsyncDiLoCoStrategy",
          "DiLoCo without waiting: each worker's H steps at its own pace, merged as soon as "
          "a quorum of them is in; one all-reduce per merge"),
    Known(settings.NONE, "", "no communication (one host, or independent training)"),
)}

#: Other spellings of the names above.
ALIASES = {"allreduce": "ddp", "all_reduce": "ddp", "simple_reduce": "ddp", "simplereduce": "ddp"}

#: The strategies ``compare`` simulates unless told otherwise.
COMPARED = ("ddp", "diloco", "streaming_diloco", "sparta", "fedavg", "demo", "sparseloco")


def canonical(name: str) -> str:
    """The known name for ``name`` (``'allreduce'`` -> ``'ddp'``, ``'sparta-diloco'`` too).

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: a name nobody knows; the message lists the known ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"strategy must be a name such as 'ddp', got {name!r}")
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    key = ALIASES.get(key, key)
    if key not in KNOWN:
        raise ValueError(f"unknown strategy {name!r}: the known ones are {', '.join(KNOWN)}")
    return key


def class_of(name: str) -> type:
    """The class of the strategy known as ``name`` (imports it, and torch).

    Raises:
        ValueError: an unknown name, or ``'none'`` (no class).
    """
    known = KNOWN[canonical(name)]
    if not known.home:
        raise ValueError(f"strategy {name!r} has no class: it communicates nothing")
    module, _, attr = known.home.partition(":")
    return getattr(importlib.import_module(f"exogym.strategy.{module}"), attr)


def name_of(strategy: Any) -> str | None:
    """The known name of a strategy object or class, or None for one defined elsewhere."""
    cls = strategy if isinstance(strategy, type) else type(strategy)
    for known in KNOWN.values():
        if known.home and known.home.split(":")[1] == cls.__name__ \
                and cls.__module__ == f"exogym.strategy.{known.home.split(':')[0]}":
            return known.name
    return None
