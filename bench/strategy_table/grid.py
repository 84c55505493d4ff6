"""What the table runs: the two scales, every strategy with its swept setting, and the runs.

A **scale** fixes the model, the ranks, the steps, the batch and the seeds; every
strategy of a scale trains the same model from the same weights on the same
data, with the same inner steps and samples. A strategy's **entry** names the
one setting its sweep varies (``H`` for the DiLoCo family, ``p_sparta`` for
SPARTA, the top-k for DeMo and SparseLoCo), the values tried, and the settings
held fixed. A **run** is one strategy, one value of its setting, one seed and
one simulated network.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field
from typing import Any

#: The simulated network every run trains under, and the one derived (or simulated) beside it.
NETWORK = "100mbit"
FAST_NETWORK = "1gbit"
#: Bits per second of each.
RATES = {NETWORK: 100e6, FAST_NETWORK: 1e9}

#: The class the AsyncDiLoCo row needs, as ``module:Class``; the row says when it is missing.
ASYNC_HOME = "exogym.strategy.async_diloco:AsyncDiLoCoStrategy"


@dataclass(frozen=True)
class Scale:
    """One size of the benchmark.

    Args:
        name: ``quick`` or ``full``.
        model: ``chargpt_task`` arguments (layers, heads, width, context).
        num_nodes: simulated ranks K.
        steps: inner steps per rank, the same for every strategy.
        batch_size: samples per rank per step.
        val_size: validation windows of the final evaluation.
        lr: the inner learning rate (AdamW, DeMo's own, Muon's AdamW-matched).
        warmup_steps: linear warm-up of the inner learning rate.
        seeds: the seeds of the final runs (the sweep uses the first).
        sweeps: per strategy name, the values its setting is swept over.
        fixed: per strategy name, the settings held fixed.
    """

    name: str
    model: dict[str, int]
    num_nodes: int
    steps: int
    batch_size: int
    val_size: int
    lr: float
    warmup_steps: int
    seeds: tuple[int, ...]
    sweeps: dict[str, tuple[Any, ...]]
    fixed: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["seeds"] = list(self.seeds)
        out["sweeps"] = {k: list(v) for k, v in self.sweeps.items()}
        return out


@dataclass(frozen=True)
class Entry:
    """One strategy of the table.

    Args:
        name: its registry name (``diloco``), or ``async_diloco``.
        label: how the table names it.
        knob: the setting its sweep varies (None: DDP, nothing to sweep).
        home: ``module:Class`` for a class outside the registry (AsyncDiLoCo).
    """

    name: str
    label: str
    knob: str | None
    home: str | None = None

    def periods(self, settings: dict[str, Any]) -> list[int]:
        """Steps that must divide the run's length for its bytes to be whole rounds."""
        keys = ("H", "H_params", "H_m1", "H_m2")
        return [int(settings[k]) for k in keys if k in settings]

    def overlaps(self, settings: dict[str, Any]) -> bool:
        """True when its collectives overlap compute: its 1 Gbit/s time is then simulated,
        not derived (see the package docstring)."""
        if self.name == "streaming_diloco":
            return int(settings.get("fragment_delay", 0)) > 0
        return self.name == "async_diloco"


ENTRIES: tuple[Entry, ...] = (
    Entry("ddp", "DDP", None),
    Entry("diloco", "DiLoCo", "H"),
    Entry("streaming_diloco", "Streaming DiLoCo", "H"),
    Entry("sparseloco", "SparseLoCo", "topk"),
    Entry("sparta", "SPARTA", "p_sparta"),
    Entry("sparta_diloco", "SPARTA-DiLoCo", "H"),
    Entry("fedavg", "FedAvg", "H"),
    Entry("demo", "DeMo", "compression_topk"),
    Entry("muloco", "MuLoCo", "H"),
    Entry("desloc", "DES-LOC", "H_params"),
    Entry("async_diloco", "AsyncDiLoCo", "H", home=ASYNC_HOME),
)
NAMES = tuple(e.name for e in ENTRIES)
#: The strategies whose runs take longest (DeMo: about twice a DiLoCo run on the lent GPU
#: and here): their sweeps start first.
SLOWEST = ("demo", "muloco")
BY_NAME = {e.name: e for e in ENTRIES}


def _desloc(h: int) -> dict[str, int]:
    return {"H_params": h, "H_m1": 3 * h, "H_m2": 6 * h}


def sweeps_for(steps: int, fragments: int) -> tuple[dict[str, tuple[Any, ...]],
                                                     dict[str, dict[str, Any]]]:
    """The swept values and fixed settings for a run of ``steps`` steps.

    Periods are fractions of the run, so a longer run keeps the same number of
    rounds: the DiLoCo family's ``H`` at 1/12, 1/6 and 1/3 of it (12, 6 and 3 rounds),
    SparseLoCo's at 1/6, DES-LOC's ``H_params`` at 1/18, 1/12 and 1/6 (its second
    moment, at 6x, then averaged 3, 2 and once). Top-k and ``p`` do not depend on it.
    """
    H = (steps // 12, steps // 6, steps // 3)
    sweeps: dict[str, tuple[Any, ...]] = {
        "diloco": H, "streaming_diloco": H, "sparta_diloco": H, "fedavg": H, "muloco": H,
        "async_diloco": H, "desloc": (steps // 18, steps // 12, steps // 6)}
    fixed = {"streaming_diloco": {"num_fragments": fragments, "fragment_delay": 1,
                                  "comm_dtype": "int4"},
             "sparseloco": {"H": steps // 6}, "sparta_diloco": {"p_sparta": 0.005}}
    return sweeps, fixed


def make_scale(name: str, steps: int | None = None, seeds: int | None = None) -> Scale:
    """The ``quick`` or ``full`` scale, with other ``steps`` or number of ``seeds``.

    ``full``: chargpt-bench's model (4 layers, 4 heads, 256 wide, context 64:
    3.26M parameters), K=4, 72 steps of 16 windows per rank, 3 seeds. ``quick``: 2 layers,
    32 wide, context 32 (37k parameters), 24 steps of 8, 2 seeds.
    """
    if name == "full":
        base = Scale(name="full", model={"n_layer": 4, "n_head": 4, "n_embd": 256,
                                         "block_size": 64},
                     num_nodes=4, steps=72, batch_size=16, val_size=256, lr=1e-3,
                     warmup_steps=20, seeds=(0, 1, 2), sweeps={})
        topk = {"sparseloco": (16, 64, 256), "sparta": (0.002, 0.01, 0.05),
                "demo": (4, 16, 64)}
        chunk, fragments = 4096, 4
    elif name == "quick":
        base = Scale(name="quick", model={"n_layer": 2, "n_head": 2, "n_embd": 32,
                                          "block_size": 32},
                     num_nodes=4, steps=24, batch_size=8, val_size=32, lr=3e-3,
                     warmup_steps=4, seeds=(0, 1), sweeps={})
        topk = {"sparseloco": (4, 16, 64), "sparta": (0.005, 0.02, 0.05), "demo": (2, 8, 32)}
        chunk, fragments = 256, 2
    else:
        raise ValueError(f"scale must be 'quick' or 'full', got {name!r}")
    steps = base.steps if steps is None else steps
    sweeps, fixed = sweeps_for(steps, fragments)
    fixed["sparseloco"]["chunk"] = chunk
    return Scale(name=base.name, model=base.model, num_nodes=base.num_nodes, steps=steps,
                 batch_size=base.batch_size, val_size=base.val_size, lr=base.lr,
                 warmup_steps=base.warmup_steps,
                 seeds=base.seeds if seeds is None else tuple(range(seeds)),
                 sweeps={**sweeps, **topk}, fixed=fixed)


QUICK = make_scale("quick")
FULL = make_scale("full")



def settings_of(scale: Scale, entry: Entry, value: Any) -> dict[str, Any]:
    """The strategy's own settings for one value of its swept setting."""
    settings = dict(scale.fixed.get(entry.name, {}))
    if value is None:
        return settings
    if entry.name == "desloc":
        settings.update(_desloc(int(value)))
    elif entry.knob is not None:
        settings[entry.knob] = value
    return settings


def describe(entry: Entry, value: Any) -> str:
    """``H=24``, ``p_sparta=0.01``; empty for DDP."""
    return "" if entry.knob is None or value is None else f"{entry.knob}={value:g}"


def strategy_class(entry: Entry) -> type:
    """The entry's class; ImportError or AttributeError when this checkout lacks it."""
    if entry.home is None:
        from exogym.strategy.registry import class_of

        return class_of(entry.name)
    module, _, attr = entry.home.partition(":")
    return getattr(importlib.import_module(module), attr)


def availability(entry: Entry) -> str | None:
    """None when the entry's class imports here, else why not (one line)."""
    try:
        strategy_class(entry)
    except (ImportError, AttributeError) as exc:
        return f"not available in this checkout ({entry.home}: {type(exc).__name__}: {exc})"
    return None


def check_scale(scale: Scale, entries: list[Entry]) -> list[str]:
    """Problems with the scale for these entries (steps not whole rounds), one line each."""
    problems = []
    if scale.steps < 1 or scale.num_nodes < 2 or not scale.seeds:
        problems.append(f"need steps >= 1, num_nodes >= 2 and a seed; got steps={scale.steps}, "
                        f"num_nodes={scale.num_nodes}, seeds={list(scale.seeds)}")
    bad = []
    for entry in entries:
        for value in scale.sweeps.get(entry.name, (None,)):
            settings = settings_of(scale, entry, value)
            if any(p < 1 or scale.steps % p for p in entry.periods(settings)):
                bad.append(f"{entry.label} {describe(entry, value)}".strip())
    if bad:
        problems.append(f"--steps {scale.steps}: the periods of {', '.join(bad)} do not "
                        "divide it (each is a fraction of the steps); a multiple of 36 "
                        "always works")
    return problems


def run_key(entry: Entry, value: Any, seed: int, network: str) -> str:
    """A run's key in the results: ``diloco|H=24|seed=1|100mbit``."""
    return f"{entry.name}|{describe(entry, value) or '-'}|seed={seed}|{network}"


def run_spec(scale: Scale, entry: Entry, value: Any, seed: int, network: str,
             device: str) -> dict[str, Any]:
    """Everything a worker needs for one run, as plain data."""
    return {"key": run_key(entry, value, seed, network), "strategy": entry.name,
            "label": entry.label, "knob": entry.knob, "value": value,
            "settings": settings_of(scale, entry, value), "seed": seed, "network": network,
            "device": device, "home": entry.home, "model": dict(scale.model),
            "num_nodes": scale.num_nodes, "steps": scale.steps,
            "batch_size": scale.batch_size, "val_size": scale.val_size, "lr": scale.lr,
            "warmup_steps": scale.warmup_steps}


def sweep_specs(scale: Scale, entry: Entry, device: str) -> list[dict[str, Any]]:
    """The sweep: every value at the first seed (DDP: its final seeds, it has no sweep)."""
    if entry.knob is None:
        return [run_spec(scale, entry, None, s, NETWORK, device) for s in scale.seeds]
    return [run_spec(scale, entry, v, scale.seeds[0], NETWORK, device)
            for v in scale.sweeps[entry.name]]


def seed_specs(scale: Scale, entry: Entry, value: Any, device: str) -> list[dict[str, Any]]:
    """The chosen value's other seeds, and 1 Gbit/s twins where the time cannot be derived
    (none for DDP: its sweep is its seeds)."""
    if entry.knob is None:
        return []
    specs = [run_spec(scale, entry, value, s, NETWORK, device) for s in scale.seeds[1:]]
    if entry.overlaps(settings_of(scale, entry, value)):
        specs += [run_spec(scale, entry, value, s, FAST_NETWORK, device) for s in scale.seeds]
    return specs
