"""The arguments of ``Trainer.fit``, defined once.

Every argument is a field of a frozen dataclass: its default, the check of its
value, a one-line help and whether a profile (a ``config.ini`` section) may set
it. Everything else is derived from these fields: the names ``fit`` accepts
(an unknown one is a ``TypeError`` with "did you mean"), ``fit``'s signature
and docstring, the run spec every rank receives (:class:`exogym.run.spec.RunSpec`
extends :class:`RunArgs`), the keys of ``RunSpec.config()`` and the run keys
of a profile (:func:`profile_keys`).

- :class:`RunArgs`: what every rank needs; it travels in the run spec.
- :class:`FitArgs`: ``RunArgs`` plus what only the process that starts the run
  uses (logger, progress display).

Checking them needs no model, no device and no torch, so a driver that only
launches hosts (and the CLI, and profiles) can check a run's arguments before
anything starts.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from exogym.base import limits
from exogym.base.arg_errors import unknown_args_error
from exogym.base.plural import plural
from exogym.config.parsers import (
    divisors,
    parse_device,
    parse_partition,
)
from exogym.report.loggers import LOGGER_NAMES

if TYPE_CHECKING:
    from exogym.report.loggers import Logger
    from exogym.report.summary import ProgressSink
    from exogym.strategy.strategy import Strategy

Check = Callable[[str, Any], None]



def _arg(default: Any, help: str, check: Check | None = None, profile: bool = False,
         convert: Callable[[Any], Any] | None = None) -> Any:
    """A field of ``fit``: its default, help line, value check, profile flag and conversion
    (applied after the check, e.g. ``bool`` or ``float``)."""
    return field(default=default, metadata={"help": help, "check": check, "profile": profile,
                                            "convert": convert})


# -- checks ----------------------------------------------------------------------------


#: The most ranks a run may have (exogym.base.limits): a simulation runs them on one
#: machine, a run across hosts one per slot; beyond it a run is a typo, refused first.
MAX_NUM_NODES = limits.MAX_NUM_NODES
#: The most steps a run may train: a billion steps of a millisecond each take 11 days.
MAX_STEPS = 10**9
#: The largest whole number any other argument takes (counts, intervals, sizes).
MAX_COUNT = 10**12
#: The most samples a rank takes in a step (``batch_size``) or an evaluation (``val_size``):
#: 16M samples, far past any batch a rank's memory holds.
MAX_BATCH_SIZE = limits.MAX_BATCH_SIZE
#: The most compute threads a rank may ask for: past any machine's cores.
MAX_NUM_THREADS = limits.MAX_NUM_THREADS


def check_int_at_least(name: str, value: Any, low: int, allow_none: bool = False,
                       high: int = MAX_COUNT) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer ``>= low`` and ``<= high`` (or
    None when allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = f"an integer >= {low}" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {kind}, got {_brief(value)}")
    if value > high:
        raise ValueError(f"{name}={_brief(value)} is over the limit of {high:,} "
                         f"({LIMIT_WHY.get(name, 'beyond any real run')}): give at most {high:,} "
                         f"(an integer from {low:,} to {high:,})")


#: Why an argument's limit is what it is, by name.
LIMIT_WHY = {"num_nodes": "the most ranks a run may have",
             "max_steps": "a billion steps of a millisecond each take 11 days",
             "batch_size": "samples per rank per step, past any rank's memory",
             "minibatch_size": "samples per forward pass, past any rank's memory",
             "val_size": "samples per evaluation, past any validation set used here",
             "num_threads": "threads per rank, past any machine's cores"}


def _brief(value: Any) -> str:
    """``value``'s repr, shortened when long (a number of a thousand digits)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def _at_least(low: int, allow_none: bool = False, high: int = MAX_COUNT) -> Check:
    def check(name: str, value: Any) -> None:
        check_int_at_least(name, value, low, allow_none, high)
    return check


def _strategy_given(name: str, value: Any) -> None:
    if value is None:
        raise TypeError("fit() needs strategy=, e.g. SimpleReduceStrategy() or "
                        "DiLoCoStrategy(H=100)")


def _device(name: str, value: Any) -> None:
    parse_device(value)


def _device_indices(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or any(
            isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0 for d in value):
        raise ValueError(f"devices must be a list of GPU indices such as [0, 1], got {value!r}")


def _minibatch(name: str, value: Any) -> None:
    if value != "auto":
        check_int_at_least(name, value, 1, allow_none=True, high=MAX_BATCH_SIZE)


def _fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def _path_or_auto(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a path or 'auto', got {value!r}")


def _trace(name: str, value: Any) -> None:
    if value is None or isinstance(value, bool) or isinstance(value, (str, os.PathLike)) \
            and os.fspath(value):
        return
    raise TypeError(f"{name} must be a folder, a .jsonl path, True (the logger's run folder) "
                    f"or None/False (no trace), got {value!r}")


def _to_trace(value: Any) -> str | bool | None:
    if value is None or value is False:
        return None
    return True if value is True else os.fspath(value)


def _run_identity(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{name} must be a dict with string keys (JSON values), got {value!r}")
    fingerprint = value.get("fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise TypeError(f"{name}['fingerprint'] must be a string, got {fingerprint!r}")


def _dataloader_kwargs(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    reserved = {"batch_size", "sampler", "batch_sampler", "shuffle"} & set(value)
    if reserved:
        raise ValueError(f"{name} may not set {sorted(reserved)}: the trainer sets "
                         "them from batch_size/minibatch_size and shuffle")


def _positive_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _logger(name: str, value: Any) -> None:
    if isinstance(value, str) and value not in LOGGER_NAMES:
        names = ", ".join(repr(n) for n in LOGGER_NAMES)
        raise ValueError(f"logger must be None, {names} or a Logger instance, got {value!r}")


def _progress(name: str, value: Any) -> None:
    if isinstance(value, bool):
        return
    if not all(callable(getattr(value, m, None)) for m in ("on_event", "close", "finish")):
        raise TypeError("fit(progress=...) must be True, False or an object with on_event(), "
                        f"close() and finish() methods, got {type(value).__name__}")


def _dict_or_empty(value: Any) -> Any:
    return {} if value is None else value


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
        check_int_at_least("gradient_accumulation", gradient_accumulation, 1)
        if batch_size % gradient_accumulation:
            raise ValueError(f"gradient_accumulation={gradient_accumulation} must divide "
                             f"batch_size={batch_size}")
        return batch_size // gradient_accumulation
    if minibatch_size is None:
        return batch_size
    if minibatch_size == "auto":
        return "auto"
    check_int_at_least("minibatch_size", minibatch_size, 1)
    if minibatch_size > batch_size or batch_size % minibatch_size:
        raise ValueError(
            f"minibatch_size={minibatch_size} must divide batch_size={batch_size} "
            "(each step accumulates batch_size/minibatch_size minibatches); "
            f"divisors of {batch_size}: {divisors(batch_size)}"
        )
    return minibatch_size


def _partition(name: str, value: Any) -> None:
    parse_partition(value)


SPEED_MODES = ("wall", "clock")


def _network(name: str, value: Any) -> None:
    if value is None:
        return
    from exogym.sim.network import Network  # torch-free

    if not isinstance(value, (Network, str, Mapping)):
        raise TypeError(f"network must be a rate such as '100mbit' or '1gbit', an "
                        f"exogym.Network, or a mapping of its arguments, got {value!r}")
    try:
        Network.coerce(value)
    except ValueError as exc:
        raise ValueError(f"network: {exc}") from None


def _to_network(value: Any) -> Any:
    from exogym.sim.network import Network

    return None if value is None else Network.coerce(value)


def _rank_speeds(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1e6
            for v in value):
        raise ValueError(f"rank_speeds must be a list of positive numbers, one per rank "
                         f"(1.0: full speed, 0.5: half), got {value!r}")


def _rank_failures(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, (str, bytes)) or not isinstance(value, Sequence)):
        raise ValueError(f"rank_failures must be a list of (rank, at_step, back_at_step or "
                         f"None) tuples, got {value!r}")


def _compute_schedule(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value or any(
            isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or not row or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e6
                for v in row) for row in value):
        raise ValueError(f"compute_schedule must be a list of lists of seconds >= 0, one list "
                         f"per rank (its steps' compute, step 1 first), got "
                         f"{_short(value)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _stack(name: str, value: Any) -> None:
    if not (isinstance(value, bool) or value == "auto"):
        raise ValueError(f"stack must be True, False or 'auto', got {_brief(value)}")


def _speed_mode(name: str, value: Any) -> None:
    if value not in SPEED_MODES:
        raise ValueError(f"speed_mode must be 'wall' (a slow rank really takes longer) or "
                         f"'clock' (only its simulated time does), got {value!r}")


BALANCE_MODES = ("none", "batch", "steps")

#: Strategies that weight their average by samples, for each ``balance`` mode.
BALANCED_STRATEGIES = {"batch": "SimpleReduceStrategy", "steps": "DiLoCoStrategy"}


def _balance(name: str, value: Any) -> None:
    if value is not None and value not in BALANCE_MODES:
        raise ValueError(f"balance must be 'none', 'batch' (per-step strategies: each rank's "
                         f"batch follows its speed) or 'steps' (round-based strategies: each "
                         f"rank's inner steps per round follow its speed), got {value!r}")


def balance_problem(mode: str, strategy: Any) -> str | None:
    """Why ``strategy`` cannot run with ``balance=mode``, or None when it can.

    ``'batch'`` needs a strategy that meets every step (``round_steps == 1``),
    ``'steps'`` one that meets once per round of several steps; both need a
    strategy that weights its average across ranks by samples (its
    ``balance_modes`` name the mode).
    """
    if mode == "none" or strategy is None:
        return None
    name = type(strategy).__name__
    rounds = getattr(strategy, "round_steps", 1)
    if mode == "batch" and rounds > 1:
        return (f"balance='batch' changes each rank's batch at every step, but {name} meets "
                f"once per round of H={rounds} steps: use balance='steps' (inner steps per "
                f"round follow each rank's speed), or a per-step strategy such as "
                f"SimpleReduceStrategy")
    if mode == "steps" and rounds == 1:
        return (f"balance='steps' changes each rank's inner steps per round, but {name} meets "
                f"at every step: use balance='batch' (batch sizes follow each rank's speed), "
                f"or a round-based strategy such as DiLoCoStrategy(H=20)")
    if mode not in getattr(strategy, "balance_modes", ()):
        return (f"balance={mode!r} needs a strategy that weights its average across ranks by "
                f"the samples each trained; {name} does not: use {BALANCED_STRATEGIES[mode]}, "
                f"or balance='none' with {name}")
    return None


# -- the arguments ---------------------------------------------------------------------


@dataclass(frozen=True)
class RunArgs:
    """The arguments of ``fit`` that every rank needs, checked on construction.

    The fields are ``fit``'s arguments (their help: :func:`fit_args_doc`). Each
    field's metadata holds its one-line ``help``, its ``check``, whether a
    ``profile`` may set it and an optional ``convert`` (applied after the check).

    Raises:
        ValueError, TypeError: a value is wrong; the message names it and what to give.
    """

    num_epochs: int = _arg(1, "epochs over each rank's shard, when ``max_steps`` is not given.",
                           _at_least(1), profile=True)
    strategy: Strategy | None = _arg(
        None, "how ranks train and communicate (e.g. ``DiLoCoStrategy(H=100)``).",
        _strategy_given)
    num_nodes: int = _arg(1, f"number of ranks K (at most {MAX_NUM_NODES}).",
                          _at_least(1, high=MAX_NUM_NODES), profile=True)
    max_steps: int | None = _arg(None, "optimizer steps per rank (overrides ``num_epochs``; at "
                                 "most a billion).",
                                 _at_least(1, allow_none=True, high=MAX_STEPS), profile=True)
    device: str | None = _arg(
        None, "``'cpu'``, ``'cuda'``, ``'cuda:N'``, ``'mps'``; None: the best available.",
        _device, profile=True)
    devices: list[int] | None = _arg(None, "CUDA indices to spread ranks over; rank r uses "
                                     "``devices[r % len(devices)]``.", _device_indices)
    batch_size: int = _arg(16, f"samples per rank per optimizer step (at most "
                           f"{MAX_BATCH_SIZE:,}).", _at_least(1, high=MAX_BATCH_SIZE),
                           profile=True)
    minibatch_size: int | str | None = _arg(
        None, "samples per forward pass (gradients accumulate up to ``batch_size``); "
        "``'auto'``: the largest that fits in ``max_memory_usage``.", _minibatch, profile=True)
    gradient_accumulation: int | None = _arg(
        None, "minibatches per step, instead of ``minibatch_size``.",
        _at_least(1, allow_none=True), profile=True)
    max_memory_usage: float = _arg(0.8, "share of the device's memory (or RAM) "
                                   "``minibatch_size='auto'`` may fill.", _fraction, profile=True)
    shuffle: bool = _arg(True, "reshuffle the training shards every epoch.", profile=True,
                         convert=bool)
    partition: str = _arg(
        "iid", "how the training set is split across ranks, by label: ``'iid'`` (even, "
        "random), ``'dirichlet:ALPHA'`` (each label's samples spread by a Dirichlet(ALPHA) "
        "draw: small ALPHA, few labels per rank), ``'shards:N'`` (label-sorted data cut into "
        "N shards per rank). Seeded by ``seed``: the same split in a simulation and on hosts.",
        _partition, profile=True, convert=lambda v: v.strip())
    shared_samples: bool = _arg(
        False, "let ranks share training samples when there are fewer samples than ranks "
        "(the even split then wraps around, so a rank trains on copies of another's); "
        "otherwise ``fit`` refuses such a run.", profile=True, convert=bool)
    val_size: int = _arg(64, "validation samples per evaluation (0: no evaluation).",
                         _at_least(0, high=MAX_BATCH_SIZE), profile=True)
    val_interval: int = _arg(100, "evaluate every this many steps (and after the last).",
                             _at_least(1), profile=True)
    autocast: bool = _arg(False, "run forward passes in bfloat16 autocast.", profile=True,
                          convert=bool)
    checkpoint_interval: int | None = _arg(None, "write a checkpoint every this many steps.",
                                           _at_least(1, allow_none=True), profile=True)
    keep_checkpoints: int = _arg(3, "newest checkpoints kept per rank.", _at_least(1),
                                 profile=True)
    resume_from: str | None = _arg(None, "``'auto'`` (the newest complete checkpoint of this "
                                   "run) or a folder.", _path_or_auto)
    correlation_interval: int | None = _arg(
        None, "log the ranks' mean pairwise parameter correlation every this many steps.",
        _at_least(1, allow_none=True), profile=True)
    save_dir: str = _arg("./checkpoints", "checkpoint folder (``save_dir/run_name``).",
                         convert=str)
    dataloader_kwargs: dict[str, Any] | None = _arg(
        None, "extra DataLoader arguments (``collate_fn``, ``num_workers``).",
        _dataloader_kwargs, convert=_dict_or_empty)
    seed: int = _arg(42, "seed shared by all ranks (data order, strategy randomness).",
                     _at_least(0), profile=True)
    run_name: str | None = _arg(None, "name of the run (log and checkpoint folders).")
    log_interval: int = _arg(10, "steps between plain progress lines when not on a terminal.",
                             _at_least(1), profile=True)
    num_threads: int | None = _arg(None, "compute threads per rank (default: cores shared by "
                                   f"the ranks of a machine; at most {MAX_NUM_THREADS:,}).",
                                   _at_least(1, allow_none=True, high=MAX_NUM_THREADS),
                                   profile=True)
    timeout_s: float = _arg(1800.0, "how long a collective may wait for a peer.",
                            _positive_seconds, profile=True, convert=float)
    network: Any = _arg(
        None, "a modelled network for the simulated clock: a rate per host such as "
        "``'100mbit'`` or ``'1gbit'`` (tc's units), ``exogym.Network(bandwidth, "
        "latency_s, rank_bandwidth)`` or a dict of those; every history row then gets "
        "``sim_time_s``.",
        _network, profile=True, convert=_to_network)
    compute_time_s: float | None = _arg(
        None, "fixed compute time of a step on the simulated clock (None: each step's "
        "measured time), so simulated times are deterministic.",
        lambda n, v: v is None or _positive_seconds(n, v), profile=True,
        convert=lambda v: None if v is None else float(v))
    rank_speeds: list[float] | None = _arg(
        None, "per rank, its compute speed (1.0: full, 0.5: half: its steps take twice as "
        "long); see ``speed_mode``.", _rank_speeds, profile=True,
        convert=lambda v: None if v is None else [float(x) for x in v])
    speed_mode: str = _arg(
        "wall", "how ``rank_speeds`` slow a rank: ``'wall'`` (default: it really takes "
        "longer, sleeping after each forward and backward, and its simulated clock "
        "shows it) or ``'clock'`` (only its simulated time is scaled: fast to run).",
        _speed_mode, profile=True)
    balance: str = _arg(
        "none", "share the work by each rank's measured speed, so fast ranks do not wait "
        "for slow ones: ``'none'``; ``'batch'`` (per-step strategies: each rank's batch "
        "follows its throughput, the global batch stays ``num_nodes * batch_size`` and "
        "gradients are averaged weighted by samples); ``'steps'`` (round-based strategies: "
        "each rank's inner steps per round follow its speed, the round's average weighted "
        "by samples). Speeds are measured in the first steps and again as the run goes; "
        "the summary lists each rank's share as ``balance`` (:mod:`exogym.run.balance`). "
        "None (what ``balance = none`` in a profile reads as) is ``'none'``.",
        _balance, profile=True, convert=lambda v: "none" if v is None else v)
    rank_failures: list[tuple[int, int, int | None]] | None = _arg(
        None, "ranks that leave and rejoin: ``[(rank, at_step, back_at_step or None), ...]``; "
        "an away rank runs no step and collectives meet among the present ranks; it rejoins "
        "at the first round boundary from ``back_at_step`` on, with the state of a rank that "
        "stayed (the rules: :mod:`exogym.membership.simulated`). The summary lists every change as "
        "``membership``.", _rank_failures,
        convert=lambda v: None if v is None else [tuple(entry) for entry in v])
    compute_schedule: list[list[float]] | None = _arg(
        None, "per rank, the simulated compute seconds of each of its steps (step 1 first; "
        "steps past the list are charged its mean), instead of ``compute_time_s`` and the "
        "measured compute; still divided by ``rank_speeds``: how a replay gives the clock "
        "what a recorded run's ranks took, step by step (:mod:`distributed.app.replay`).",
        _compute_schedule,
        convert=lambda v: None if v is None else [[float(x) for x in row] for row in v])
    run_identity: dict[str, Any] | None = _arg(
        None, "who this run is (a dict of JSON values, e.g. its profile, the fingerprint of "
        "its settings and its start time): written into every checkpoint as ``'run'``; "
        "resuming refuses a checkpoint whose ``'fingerprint'`` differs from this one's "
        "(another run's, or the same run with other settings).", _run_identity,
        convert=lambda v: None if v is None else dict(v))

    @property
    def has_clock(self) -> bool:
        """True when ranks keep a simulated clock (a network, compute time or speeds given)."""
        return (self.network is not None or self.compute_time_s is not None
                or self.rank_speeds is not None or self.compute_schedule is not None)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            check = f.metadata.get("check")
            if check is not None:
                check(f.name, value)
            convert = f.metadata.get("convert")
            if convert is not None:
                object.__setattr__(self, f.name, convert(value))
        self.minibatch()  # checks batch_size, minibatch_size and gradient_accumulation together
        if self.rank_speeds is not None and len(self.rank_speeds) != self.num_nodes:
            raise ValueError(f"rank_speeds has {plural(len(self.rank_speeds), 'value')} for "
                             f"num_nodes={self.num_nodes}: give one per rank")
        if self.network is not None:
            self.network.check_ranks(self.num_nodes)
        if self.compute_schedule is not None and len(self.compute_schedule) != self.num_nodes:
            raise ValueError(f"compute_schedule has {plural(len(self.compute_schedule), 'list')} "
                             f"for num_nodes={self.num_nodes}: give one per rank")
        problem = balance_problem(self.balance, self.strategy)
        if problem is not None:
            raise ValueError(problem)
        if self.balance != "none" and self.rank_failures is not None:
            raise ValueError(f"balance={self.balance!r} and rank_failures cannot be combined: "
                             "every rank takes part in agreeing on the shares, an away rank "
                             "cannot; leave one of them out")
        if self.rank_failures is not None:
            if self.resume_from is not None:
                raise ValueError("rank_failures and resume_from cannot be combined: an away "
                                 "rank's checkpoints lag the others'; resume without "
                                 "rank_failures, or start afresh")
            self.membership()  # checks each entry, and refuses a schedule that leaves no rank
            # or no rank to hand a returning one the state

    def membership(self):
        """The :class:`exogym.membership.simulated.Membership` of ``rank_failures`` (None without)."""
        if self.rank_failures is None:
            return None
        from exogym.membership.simulated import Membership

        round_steps = getattr(self.strategy, "round_steps", 1) if self.strategy is not None else 1
        return Membership(self.rank_failures, self.num_nodes, round_steps)

    def minibatch(self) -> int | str:
        """Samples per forward pass: an integer, or ``'auto'`` until measured."""
        return resolve_minibatch(self.batch_size, self.minibatch_size, self.gradient_accumulation)

    def run_values(self) -> dict[str, Any]:
        """The run's arguments by name (those of :class:`RunArgs` only)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(RunArgs)}


@dataclass(frozen=True)
class FitArgs(RunArgs):
    """Every argument of ``fit``: :class:`RunArgs` and what only the starting process uses."""

    logger: Logger | str | None = _arg(
        "csv", "``'csv'`` (default), ``'wandb'``, ``'tensorboard'``, None, or a Logger.",
        _logger, profile=True)
    log_dir: str = _arg("logs", "folder of the logs (CSV, TensorBoard, W&B's run files).")
    wandb_project: str | None = _arg(None, "log to this W&B project.", profile=True)
    processes: int | None = _arg(
        None, "operating-system processes a simulation runs its ranks in. None: one per rank "
        "while the ranks fit this machine's cores, else one per core, each running its ranks "
        "in turn (:mod:`exogym.comm.packed`); fewer than ``num_nodes`` packs the ranks that way.",
        _at_least(1, allow_none=True))
    stack: bool | str = _arg(
        False, "compute the ranks each process runs as one batched model "
        "(``torch.func.vmap``; :mod:`exogym.run.stack`): True stacks them (the ranks are "
        "packed, and a strategy or model that cannot be stacked is refused, saying why), "
        "``'auto'`` stacks where that is supported and known to be faster, else packs or "
        "runs a process per rank as without it; False never stacks.", _stack)
    trace: str | bool | None = _arg(
        None, "write the run's trace (``trace.jsonl``: each rank's compute and communication "
        "seconds, bytes and samples per step, evaluations, membership changes; "
        ":mod:`exogym.report.trace`) when it ends, also when it fails: a folder (the file "
        "goes in it), a path ending in ``.jsonl``, or True (the logger's run folder, beside "
        "its ``summary.json``). None: no trace.", _trace, convert=_to_trace)
    progress: bool | ProgressSink = _arg(
        True, "show the progress bar and summary table; or an object with "
        "``on_event``/``close``/``finish`` (``exogym.report.summary.ProgressSink``) that shows the "
        "run its own way, e.g. a live dashboard.", _progress)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.processes is not None and self.processes > self.num_nodes:
            raise ValueError(f"processes={self.processes} is more than num_nodes="
                             f"{self.num_nodes}: a process runs one rank at least")

    @classmethod
    def from_call(cls, owner: str, args: Sequence[Any] = (),
                  kwargs: Mapping[str, Any] | None = None) -> FitArgs:
        """Bind a call's arguments as ``fit``'s signature does, and check them.

        Args:
            owner: the call's name in error messages (``'fit()'``).
            args, kwargs: the call's positional and keyword arguments.

        Raises:
            TypeError: an unknown name (naming the closest accepted one), too many
                positional arguments, or one given twice.
        """
        kwargs = dict(kwargs or {})
        names = fit_arg_names()
        unknown = set(kwargs) - set(names)
        if unknown:
            raise unknown_args_error(owner, unknown, names)
        if len(args) > len(names):
            raise TypeError(f"{owner} takes at most {len(names)} positional arguments, "
                            f"{len(args)} were given")
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"{owner} got multiple values for argument {name!r}")
            kwargs[name] = value
        return cls(**kwargs)


#: Arguments that only a simulation on one machine has a use for.
SIMULATION_ONLY = ("processes", "stack", "rank_failures", "compute_schedule")


def refuse_simulation_only(values: Mapping[str, Any], where: str) -> None:
    """Raise when ``values`` give an argument of :data:`SIMULATION_ONLY` a value.

    Raises:
        ValueError: naming the argument, and ``where`` it cannot apply.
    """
    for name in SIMULATION_ONLY:
        if values.get(name) not in (None, fit_default(name)):
            raise ValueError(f"{name} is for a simulation on one machine (exogym.Trainer); "
                             f"{where} has real ranks, one per process: leave {name} out")


def fit_arg_names() -> tuple[str, ...]:
    """Every argument ``fit`` accepts, in its signature's order."""
    return tuple(f.name for f in dataclasses.fields(FitArgs))


def fit_default(name: str) -> Any:
    """The default of ``fit``'s argument ``name`` (``fit_default("num_nodes") == 1``): the
    one place each default is written is its field.

    Raises:
        KeyError: ``name`` is no argument of ``fit``.
    """
    for f in dataclasses.fields(FitArgs):
        if f.name == name:
            return f.default if f.default is not dataclasses.MISSING else f.default_factory()
    raise KeyError(f"fit() has no argument {name!r}")


def profile_keys() -> set[str]:
    """The arguments of ``fit`` a profile may set (``num_nodes``, ``batch_size``, ...)."""
    return {f.name for f in dataclasses.fields(FitArgs) if f.metadata["profile"]}


def value_problems(values: Mapping[str, Any]) -> dict[str, str]:
    """Each of ``values`` (``fit`` arguments by name) that its field's check refuses, with
    why; names that are not arguments of ``fit`` are left to the caller. Needs no torch."""
    fields = {f.name: f for f in dataclasses.fields(FitArgs)}
    problems: dict[str, str] = {}
    for name, value in values.items():
        check = fields[name].metadata.get("check") if name in fields else None
        if check is None:
            continue
        try:
            check(name, value)
        except (ValueError, TypeError) as exc:
            problems[name] = str(exc)
    return problems


def fit_signature(types: Mapping[str, Any], returns: Any) -> inspect.Signature:
    """``fit(self, ...)``'s signature: every argument with its default and type.

    Args:
        types: the classes the annotations name beyond builtins (``Strategy``,
            ``Logger``, ``ProgressSink``), which this torch-free module does not import.
        returns: the return annotation.
    """
    hints = typing.get_type_hints(FitArgs, localns=dict(types))
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(FitArgs):
        params.append(inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        default=f.default, annotation=hints[f.name]))
    return inspect.Signature(params, return_annotation=returns)


def fit_args_doc(indent: str = "    ") -> str:
    """The ``Args:`` block of ``fit``'s docstring, one line per argument."""
    lines = ["Args:"]
    for f in dataclasses.fields(FitArgs):
        lines.append(f"{indent}{f.name}: {f.metadata['help']}")
    return "\n".join(lines)


FIT_KWARGS_MODULE = "exogym/config/fit_kwargs.py"


def fit_kwargs_source() -> str:
    """The source of :mod:`exogym.config.fit_kwargs`, generated from :class:`FitArgs`.

    ``Trainer.fit``'s keyword arguments, as a ``TypedDict`` editors and type
    checkers read (``**kwargs: Unpack[FitKwargs]``). A test checks that the
    file equals this; ``python -m exogym.config.fit_args`` rewrites it.
    """
    lines = [
        '"""``fit``\'s keyword arguments for editors and type checkers (generated: do not edit).',
        "",
        "Generated from :class:`exogym.config.fit_args.FitArgs` by",
        "``python -m exogym.config.fit_args``; a test fails when the two disagree.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import TYPE_CHECKING, Any, TypedDict",
        "",
        "if TYPE_CHECKING:",
        "    from exogym.report.loggers import Logger",
        "    from exogym.report.summary import ProgressSink",
        "    from exogym.strategy.strategy import Strategy",
        "",
        '__all__ = ["FitKwargs"]',
        "",
        "",
        "class FitKwargs(TypedDict, total=False):",
        '    """Every keyword ``Trainer.fit`` accepts, with its type; see ``fit``\'s docstring."""',
        "",
    ]
    for f in dataclasses.fields(FitArgs):
        lines.append(f"    {f.name}: {f.type}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from pathlib import Path

    target = Path(__file__).resolve().parents[2] / FIT_KWARGS_MODULE
    target.write_text(fit_kwargs_source(), encoding="utf-8")
    print(f"wrote {target}")
