"""The strategies known by name: what profiles, the CLI and the planner call them. No torch here.

One entry per built-in strategy: its name (``'diloco'``), the class that
implements it (imported only when asked for), a line saying what it sends,
and the settings its traffic depends on with the class's defaults
(:mod:`exogym.strategy.facts`, where the classes take them from). What a
strategy sends is its class's own statement (``Strategy.traffic``); nothing
here computes bytes, so a strategy a researcher writes needs no entry to be
simulated or planned, only to be called by a short name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from .facts import (
    COMM_DTYPE,
    DEMO_CHUNK,
    DEMO_TOPK,
    DESLOC_H_M1,
    DESLOC_H_M2,
    DESLOC_H_PARAMS,
    DILOCO_H,
    FEDAVG_H,
    MULOCO_COMM_DTYPE,
    SPARSELOCO_CHUNK,
    SPARSELOCO_H,
    SPARSELOCO_QUANT_BITS,
    SPARSELOCO_TOPK,
    SPARTA_INTERVAL,
    SPARTA_P,
    STREAMING_FRAGMENTS,
)

__all__ = ["ALIASES", "COMPARED", "KNOWN", "Known", "canonical", "class_of", "name_of"]


@dataclass(frozen=True)
class Known:
    """A strategy known by name.

    Args:
        name: its short name (a profile's ``strategy = diloco``).
        home: ``module:Class`` of its class, relative to :mod:`exogym.strategy`;
            empty for ``none`` (no communication, no class).
        summary: one line saying what it sends.
        traffic_defaults: the settings its traffic depends on, with its class's defaults.
    """

    name: str
    home: str
    summary: str
    traffic_defaults: dict[str, Any] = field(default_factory=dict)


KNOWN: dict[str, Known] = {k.name: k for k in (
    Known("ddp", "strategy:SimpleReduceStrategy",
          "all-reduce every gradient every step: the reference, and the most traffic"),
    Known("diloco", "diloco:DiLoCoStrategy",
          "H local steps, then one all-reduce of the model change: traffic divided by H",
          {"H": DILOCO_H, "comm_dtype": COMM_DTYPE}),
    Known("sparta", "sparta:SPARTAStrategy",
          "every step, average a small random fraction p of the weights: traffic times p",
          {"p_sparta": SPARTA_P, "comm_dtype": COMM_DTYPE}),
    Known("fedavg", "federated_averaging:FedAvgStrategy",
          "H local steps, then average whole models, optionally in islands of ranks",
          {"H": FEDAVG_H, "island_size": None, "comm_dtype": COMM_DTYPE}),
    Known("demo", "demo:DeMoStrategy",
          "send only the top-k DCT components of each rank's momentum every step",
          {"compression_topk": DEMO_TOPK, "compression_chunk": DEMO_CHUNK,
           "comm_dtype": COMM_DTYPE}),
    Known("sparta_diloco", "sparta_diloco:SPARTADiLoCoStrategy",
          "SPARTA's sparse averaging between DiLoCo rounds",
          {"H": DILOCO_H, "p_sparta": SPARTA_P, "sparta_interval": SPARTA_INTERVAL,
           "comm_dtype": COMM_DTYPE}),
    Known("streaming_diloco", "streaming_diloco:StreamingDiLoCoStrategy",
          "DiLoCo's round cut into fragments synced in turn: same total, "
          "peak per sync divided by the fragments",
          {"H": DILOCO_H, "num_fragments": STREAMING_FRAGMENTS, "comm_dtype": COMM_DTYPE}),
    Known("sparseloco", "sparseloco:SparseLoCoStrategy",
          "H local steps, then all-gather the top-k of every chunk of the "
          "error-fed change, quantized: a percent of DiLoCo's bytes",
          {"H": SPARSELOCO_H, "topk": SPARSELOCO_TOPK, "chunk": SPARSELOCO_CHUNK,
           "quant_bits": SPARSELOCO_QUANT_BITS}),
    Known("desloc", "desloc:DESLOCStrategy",
          "local Adam steps; average the parameters every H_params steps and Adam's two "
          "moments on their own, longer periods: half of Local Adam's traffic",
          {"H_params": DESLOC_H_PARAMS, "H_m1": DESLOC_H_M1, "H_m2": DESLOC_H_M2,
           "comm_dtype": COMM_DTYPE}),
    Known("muloco", "muloco:MuLoCoStrategy",
          "DiLoCo with Muon inner steps; the model change sent in 4 bits with error "
          "feedback: about a seventh of DiLoCo's bytes",
          {"H": DILOCO_H, "comm_dtype": MULOCO_COMM_DTYPE}),
    Known("async_diloco", "async_diloco:AsyncDiLoCoStrategy",
          "DiLoCo without waiting: each worker's H steps at its own pace, merged as soon as "
          "a quorum of them is in; one all-reduce per merge",
          {"H": DILOCO_H, "comm_dtype": COMM_DTYPE}),
    Known("none", "", "no communication (one host, or independent training)"),
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
