"""Every built-in strategy's settings, each declared once: no torch here.

A :class:`Setting` is one constructor argument of a strategy: its name, type,
default, the values it accepts and a line saying what it does. That one
declaration serves

- the constructor's default (``H: int = DILOCO.H.default``);
- the constructor's check (:meth:`Setting.check`: an error that names the
  class, the setting, the values it accepts and the value given);
- the registry and the planner: :meth:`Settings.traffic_defaults`, the settings
  a strategy's traffic depends on (marked ``traffic=True``), with their defaults;
- the documentation: :func:`markdown_table` renders the table of
  ``docs/strategies.md``, and ``python -m exogym.strategy.settings`` prints it.

A :class:`Settings` holds one strategy's settings, under the short name the
registry, profiles and the planner know the strategy by. Settings several
strategies share (the outer optimizer's, ``comm_dtype``) are declared once and
listed by each; a strategy that takes the same setting with another default
declares it as a :meth:`Setting.variant` of it. Checks that tie two settings
together (``merge_delay < H``, ``topk <= chunk``, ``error_feedback`` needing a
quantized ``comm_dtype``) stay in the constructors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from exogym.comm.wire import COMM_DTYPE, FLOAT_DTYPES, QUANTIZED_BITS

__all__ = [
    "ALL",
    "ASYNC_DILOCO",
    "DDP",
    "DEMO",
    "DESLOC",
    "DILOCO",
    "FEDAVG",
    "MULOCO",
    "NONE",
    "SPARSELOCO",
    "SPARTA",
    "SPARTA_DILOCO",
    "STREAMING_DILOCO",
    "CountOrFraction",
    "Setting",
    "Settings",
    "markdown_table",
]


def _owner_name(owner: object) -> str:
    if isinstance(owner, str):
        return owner
    return (owner if isinstance(owner, type) else type(owner)).__name__


@dataclass(frozen=True)
class Setting:
    """One setting of a strategy: what it is called, what it accepts, what it does.

    Args:
        name: the constructor argument (and profile key), e.g. ``'H'``.
        kind: ``int``, ``float``, ``bool`` or ``str``.
        default: the value when it is not given.
        help: one line saying what it does.
        low, high: the range of a number (None: no bound on that side).
        low_open, high_open: whether that bound itself is left out.
        unit: what a number counts (``'steps'``, ``'seconds'``), said with its range.
        choices: the values a ``str`` setting accepts.
        spellings: other names accepted for the choices (``'bf16'``).
        any_case: choices match in any case (and a ``torch.dtype`` by its name).
        none_means: when set, None is accepted, and means this.
        also: other values the class itself accepts besides these (an instance).
        traffic: the strategy's traffic depends on it (the planner asks for it).
        why: said after a refusal, when the accepted values need a reason (DeMo's
            float-only wire).
    """

    name: str
    kind: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    unit: str = ""
    choices: tuple[str, ...] = ()
    spellings: tuple[str, ...] = ()
    any_case: bool = False
    none_means: str = ""
    also: str = ""
    traffic: bool = False
    why: str = ""

    def variant(self, **changes: Any) -> Setting:
        """The same setting with ``changes`` (another strategy's default or help)."""
        return replace(self, **changes)

    @property
    def type_name(self) -> str:
        """The type, as the table shows it."""
        return self.kind.__name__

    def _bounds(self) -> str:
        def g(x: float) -> str:
            return f"{x:g}"

        low, high = self.low, self.high
        if low is not None and high is not None:
            if self.kind is int and not self.low_open and not self.high_open:
                return f"from {g(low)} to {g(high)}"
            return (f"in {'(' if self.low_open else '['}{g(low)}, "
                    f"{g(high)}{')' if self.high_open else ']'}")
        if low is not None:
            return f"{'>' if self.low_open else '>='} {g(low)}"
        if high is not None:
            return f"{'<' if self.high_open else '<='} {g(high)}"
        return ""

    @property
    def valid(self) -> str:
        """The values it accepts, in words: ``'an integer >= 1 (steps)'``."""
        bounds = self._bounds()
        if self.kind is bool:
            text = "True or False"
        elif self.kind is int:
            text = " ".join(filter(None, ["an integer", bounds]))
            text += f" ({self.unit})" if self.unit else ""
        elif self.kind is float:
            text = " ".join(filter(None, ["a number", f"of {self.unit}" if self.unit else "",
                                          bounds]))
        else:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        if self.also:
            text += f", or {self.also}"
        if self.none_means:
            text += f", or None ({self.none_means})"
        return text

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is one this setting accepts."""
        if value is None:
            return bool(self.none_means)
        if self.kind is bool:
            return isinstance(value, bool)
        if self.kind in (int, float):
            if isinstance(value, bool) or not isinstance(value, self._number_types()):
                return False
            if not math.isfinite(value):
                return False
            if self.low is not None and not (value > self.low if self.low_open
                                             else value >= self.low):
                return False
            return self.high is None or (value < self.high if self.high_open
                                         else value <= self.high)
        if isinstance(value, str):
            key = value.lower() if self.any_case else value
        elif self.any_case and str(value).startswith("torch."):  # a torch.dtype, by its name
            key = str(value).removeprefix("torch.")
        else:
            return False
        return key in self.choices or key in self.spellings

    def _number_types(self) -> tuple[type, ...]:
        return (int,) if self.kind is int else (int, float)

    def check(self, value: Any, owner: object, name: str | None = None) -> None:
        """Refuse ``value`` unless this setting accepts it.

        Args:
            value: the value given.
            owner: the class (or its instance, or its name) the value was given to.
            name: the argument's name there, when it is not the setting's (a
                selector's ``p`` is SPARTA's ``p_sparta``).

        Raises:
            ValueError: naming ``owner``, the setting, the values it accepts and ``value``.
        """
        if not self.accepts(value):
            raise ValueError(f"{_owner_name(owner)}: {name or self.name} must be {self.valid}, "
                             f"got {value!r}" + (f" ({self.why})" if self.why else ""))


@dataclass(frozen=True)
class CountOrFraction(Setting):
    """A setting given either as a count (an integer >= 1) or as a fraction in (0, 1] of a
    whole, e.g. AsyncDiLoCo's ``quorum`` of the workers present.

    Args:
        of: what is counted (``'workers'``); the rest as for :class:`Setting`.
    """

    of: str = ""

    @property
    def type_name(self) -> str:
        return "int or float"

    @property
    def valid(self) -> str:
        return f"a count of {self.of} >= 1, or a fraction of them in (0, 1]"

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if isinstance(value, int):
            return value >= 1
        return 0 < value <= 1

    def check(self, value: Any, owner: object, name: str | None = None) -> None:
        if isinstance(value, float) and not self.accepts(value):
            raise ValueError(f"{_owner_name(owner)}: {name or self.name}={value!r}: a fraction "
                             f"of the {self.of} must be in (0, 1]; give a count of {self.of} "
                             "as an integer")
        super().check(value, owner, name)


class Settings:
    """One strategy's settings, in the order its table lists them.

    A setting is read by name (``DILOCO.H``, ``DILOCO['H']``); iterating gives
    them in order.

    Args:
        strategy: the strategy's short name (``'diloco'``), as the registry,
            profiles and the planner know it.
        *settings: its settings.
    """

    def __init__(self, strategy: str, *settings: Setting):
        self.strategy = strategy
        self._by_name: dict[str, Setting] = {}
        for setting in settings:
            if setting.name in self._by_name or hasattr(Settings, setting.name):
                raise ValueError(f"{strategy}: setting {setting.name!r} is listed twice, or "
                                 "hides an attribute of Settings")
            self._by_name[setting.name] = setting

    def __getattr__(self, name: str) -> Setting:
        by_name = self.__dict__.get("_by_name", {})
        if name in by_name:
            return by_name[name]
        raise AttributeError(f"strategy {self.__dict__.get('strategy')!r} has no setting {name!r}")

    def __getitem__(self, name: str) -> Setting:
        return self._by_name[name]

    def __iter__(self) -> Iterator[Setting]:
        return iter(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def __repr__(self) -> str:
        return f"Settings({self.strategy!r}: {', '.join(self._by_name)})"

    @property
    def names(self) -> tuple[str, ...]:
        """The settings' names, in order."""
        return tuple(self._by_name)

    def defaults(self) -> dict[str, Any]:
        """Every setting's default, by name."""
        return {s.name: s.default for s in self}

    def traffic_defaults(self) -> dict[str, Any]:
        """The settings the strategy's traffic depends on, with their defaults."""
        return {s.name: s.default for s in self if s.traffic}

    def check(self, owner: object, **values: Any) -> None:
        """Check each of ``values`` against its setting (:meth:`Setting.check`).

        Raises:
            ValueError: the first value its setting refuses, named.
        """
        for name, value in values.items():
            self[name].check(value, owner)


# --------------------------------------------------------------------------- shared

H = Setting("H", int, 100, "inner steps per round", low=1, unit="steps", traffic=True)
OUTER_LR = Setting("outer_lr", float, 0.7, "learning rate of the outer SGD", low=0,
                   low_open=True)
OUTER_MOMENTUM = Setting("outer_momentum", float, 0.9, "momentum of the outer SGD", low=0,
                         high=1, high_open=True)
NESTEROV = Setting("nesterov", bool, True, "Nesterov momentum for the outer SGD "
                   "(none at outer_momentum 0)")
COMM = Setting("comm_dtype", str, COMM_DTYPE,
               "type the values travel in: a float type, or a quantized one with a float32 "
               "scale per 64 values",
               choices=(*FLOAT_DTYPES, *QUANTIZED_BITS),
               spellings=tuple(s for names in FLOAT_DTYPES.values() for s in names),
               any_case=True, traffic=True)
ERROR_FEEDBACK = Setting("error_feedback", bool, False,
                         "carry each round's quantization residual into the next round "
                         "(a quantized comm_dtype only)")
P_SPARTA = Setting("p_sparta", float, 0.005, "fraction of each tensor's entries averaged "
                   "per round", low=0, high=1, traffic=True)
INDEX_SELECTOR = Setting("index_selector", str, "random",
                         "which entries a round averages: a fresh random subset, a window "
                         "through a fixed permutation, or one part of a random partition",
                         choices=("random", "shuffled", "partitioned"), any_case=True,
                         also="an IndexSelector instance")


def _float_comm(*names: str) -> dict[str, Any]:
    """``comm_dtype`` limited to the float types ``names`` (with their other spellings)."""
    return {"choices": names, "spellings": tuple(s for n in names for s in FLOAT_DTYPES[n])}


# --------------------------------------------------------------------------- per strategy

#: What every strategy takes (``Strategy``'s own arguments), beside its own settings.
LR = Setting("lr", float, None, "learning rate of the inner optimizer", low=0, low_open=True,
             none_means="the optimizer's own")
EVERY = Settings(
    "every strategy",
    LR,
    Setting("warmup_steps", int, 0, "linear warmup of the learning rate (the first step runs "
            "at lr / warmup_steps)", low=0, unit="steps"),
    Setting("cosine_anneal", bool, False, "anneal with a half cosine after warmup "
            "(lr_scheduler='lambda_cosine')"),
    Setting("min_lr_factor", float, 0.1, "where the cosine ends, as a share of lr", low=0,
            high=1),
    Setting("max_norm", float, None, "clip the gradient norm to this before the optimizer "
            "step", low=0, low_open=True, none_means="no clipping"),
)

DDP = Settings("ddp")

DILOCO = Settings("diloco", H, OUTER_LR, OUTER_MOMENTUM, NESTEROV, COMM, ERROR_FEEDBACK)

SPARTA = Settings("sparta", P_SPARTA, INDEX_SELECTOR, COMM)

FEDAVG = Settings(
    "fedavg",
    H.variant(default=1, help="local steps per averaging round"),
    Setting("island_size", int, None, "ranks per island, redrawn each round", low=1,
            none_means="one island of all ranks", traffic=True),
    Setting("client_sampling", float, 1.0, "fraction of each island that takes part in a "
            "round", low=0, high=1, low_open=True),
    COMM,
)

DEMO = Settings(
    "demo",
    LR.variant(default=1e-3, none_means="", help="size of each sign step (and the "
               "gradient's scale in the momentum)"),
    Setting("compression_decay", float, 0.999, "decay of each rank's momentum", low=0, high=1),
    Setting("compression_topk", int, 32, "DCT coefficients sent per chunk", low=1,
            traffic=True),
    Setting("compression_chunk", int, 64, "largest chunk side, per dimension", low=1,
            traffic=True),
    Setting("weight_decay", float, 0.0, "decoupled weight decay", low=0),
    COMM.variant(help="type the coefficients travel in (float types: they are gathered as "
                      "they are)", why="DeMo sends its top-k coefficients in a float type: "
                      "they are gathered as they are, never quantized",
                 **_float_comm("float32", "bfloat16", "float16")),
)

SPARTA_DILOCO = Settings(
    "sparta_diloco", H.variant(help="inner steps per DiLoCo round"), OUTER_LR, OUTER_MOMENTUM,
    NESTEROV, P_SPARTA,
    Setting("sparta_interval", int, 1, "local steps between SPARTA rounds", low=1,
            unit="steps", traffic=True),
    INDEX_SELECTOR, COMM,
)

STREAMING_DILOCO = Settings(
    "streaming_diloco",
    H.variant(help="inner steps between two rounds of the same fragment"),
    Setting("num_fragments", int, 4, "fragments the layers are split into, strided across "
            "depth (at most H)", low=1, traffic=True),
    Setting("fragment_delay", int, 0, "inner steps taken while a fragment's all-reduce "
            "travels (below H)", low=0, unit="steps"),
    Setting("fragment_alpha", float, 0.0, "after a round, local = global + alpha * (local - "
            "global): 0 takes the global values", low=0, high=1),
    OUTER_LR, OUTER_MOMENTUM, NESTEROV, COMM, ERROR_FEEDBACK,
)

SPARSELOCO = Settings(
    "sparseloco",
    H.variant(default=30),
    Setting("topk", int, 64, "values sent per chunk (at most chunk)", low=1, traffic=True),
    Setting("chunk", int, 4096, "values per chunk", low=1, traffic=True),
    Setting("quant_bits", int, 2, "bits per sent value", low=1, high=8,
            none_means="float32", traffic=True),
    Setting("error_decay", float, 0.95, "decay of the error-feedback buffer", low=0, high=1),
    OUTER_LR.variant(default=1.0, help="the outer step size (SGD without momentum)"),
)

# DES-LOC's periods keep the relation Iacob et al. 2025 (arXiv 2505.22549) recommend,
# K_u = 3·K_x and K_v = 6·K_x: each state is averaged about as often as it changes (the
# second moment, beta2 = 0.999, moves slowest). Total: half of Local Adam's bytes at K_x.
_H_PARAMS = Setting("H_params", int, 100, "inner steps between averages of the parameters "
                    "and float buffers", low=1, unit="steps", traffic=True)
DESLOC = Settings(
    "desloc",
    _H_PARAMS,
    _H_PARAMS.variant(name="H_m1", default=3 * _H_PARAMS.default,
                      help="inner steps between averages of Adam's first moment"),
    _H_PARAMS.variant(name="H_m2", default=6 * _H_PARAMS.default,
                      help="inner steps between averages of Adam's second moment"),
    COMM.variant(help="type the averages travel in (float32's range: the values are averaged "
                      "as they are)", **_float_comm("float32", "bfloat16")),
)

MULOCO = Settings(
    "muloco", H, OUTER_LR, OUTER_MOMENTUM, NESTEROV,
    COMM.variant(default="int4", help="type the outer deltas travel in ('int2': the paper's "
                                      "most compressed)"),
    ERROR_FEEDBACK.variant(default=None, none_means="on whenever comm_dtype is quantized"),
)

ASYNC_DILOCO = Settings(
    "async_diloco",
    H.variant(help="inner steps of a worker's round"),
    CountOrFraction("quorum", float, 0.5, "contributions that call a merge: a count, or a "
                    "fraction of the workers present (rounded up)", of="workers"),
    Setting("grace_s", float, 0.0, "how long a merge waits past its quorum for a round about "
            "to end", low=0, unit="seconds"),
    Setting("weighting", str, "tokens", "a contribution's weight: the samples it trained, "
            "or the same for each", choices=("tokens", "equal")),
    Setting("max_staleness", int, 4, "versions a contribution may be behind and still be "
            "merged", low=0, unit="versions"),
    OUTER_LR, OUTER_MOMENTUM, NESTEROV, COMM,
    Setting("merge_delay", int, 0, "steps every rank trains while a merge travels (below H)",
            low=0, unit="steps"),
    Setting("adaptive_H", bool, False, "a worker's round is H times its speed, so a slow "
            "worker sends short, fresh rounds"),
    Setting("keep_training", bool, False, "a worker whose round is done trains on until a "
            "merge takes it, instead of idling"),
)

NONE = Settings("none")

#: Every built-in strategy's settings, in the order the documentation lists them.
ALL: tuple[Settings, ...] = (DDP, DILOCO, FEDAVG, SPARTA, SPARTA_DILOCO, DEMO, STREAMING_DILOCO,
                             SPARSELOCO, DESLOC, MULOCO, ASYNC_DILOCO, NONE)


# --------------------------------------------------------------------------- the table


def markdown_table(groups: Iterable[Settings] = (EVERY, *ALL)) -> str:
    """The settings of ``groups`` as a markdown table: strategy, setting, type, default,
    the values accepted, and what it does (strategies without settings of their own are
    left out)."""
    rows = ["| strategy | setting | type | default | accepts | what it does |",
            "| --- | --- | --- | --- | --- | --- |"]
    for group in groups:
        for setting in group:
            cells = [f"`{group.strategy}`", f"`{setting.name}`", setting.type_name,
                     f"`{setting.default!r}`", setting.valid, setting.help]
            rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
