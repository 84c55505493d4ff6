"""Strategy: how one rank turns its gradients into a model update.

A strategy sees its rank's model, the rank, the number of ranks and the
collectives of :mod:`exogym.comm`; it never sees the trainer. The base class
owns what every strategy shares: the (inner) optimizer built from an
``OptimSpec`` or a name, the learning-rate schedule, gradient clipping and the
step counter. ``SimpleReduceStrategy`` (AllReduce / DDP) lives here too.

Writing a strategy takes a few lines::

    class MyStrategy(Strategy):
        def step(self):
            ...                 # look at self.model's grads, call all_reduce(...)
            self.optim.step()
            super().step()      # advances the schedule and local_step

The lifecycle, every call public and made by the trainer:

1. the constructor checks the settings; :meth:`Strategy.validate` checks what
   depends on the model or the ranks, once, before any rank starts;
2. :meth:`Strategy.setup` attaches the strategy to one rank, once, with a
   :class:`~exogym.strategy.context.RankContext` (model, rank, ranks, steps, seed,
   samples a step, collectives, membership, clock);
3. each step: :meth:`Strategy.zero_grad`, forward and backward, :meth:`Strategy.step`
   (or :meth:`Strategy.idle_step`); a strategy that :attr:`~Strategy.paces_steps` is
   asked :meth:`~Strategy.begin_step` first and told :meth:`~Strategy.record_step` after;
4. :meth:`Strategy.state_dict` / :meth:`Strategy.load_state_dict` for checkpoints and
   hand-overs.

A strategy written for exo gym overrides ``_init_node(model, rank, num_nodes)``
instead of :meth:`Strategy.setup`; :meth:`Strategy.setup` calls it, so it keeps
working, and so does its ``torch.distributed.get_rank()``
(:func:`exogym.comm.torch_identity` answers for a packed rank while such a
strategy runs).
"""

from __future__ import annotations

import inspect
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from exogym.base.arg_errors import init_arg_names, unknown_args_error
from exogym.comm.wire import ModelFacts, Traffic

from .context import RankContext
from .optim import OptimSpec, ensure_optim_spec
from .settings import EVERY

SCHEDULERS = ("lambda_cosine", "cosine", "constant")
_SCHEDULE_KEYS = ("warmup_steps", "cosine_anneal", "min_lr_factor", "max_steps")


def lr_factor(
    step: int,
    total_steps: int,
    warmup_steps: int = EVERY.warmup_steps.default,
    cosine: bool = EVERY.cosine_anneal.default,
    min_lr_factor: float = EVERY.min_lr_factor.default,
) -> float:
    """Multiplier of the base learning rate for the optimizer step numbered ``step`` (0-based).

    Linear warmup over ``warmup_steps`` starts at ``1/warmup_steps`` (never at 0),
    then the factor stays 1, or follows a half cosine down to ``min_lr_factor``
    at ``total_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if not cosine:
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_factor + (1.0 - min_lr_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _check_scheduler_class(cls: type, kwargs: dict[str, Any]) -> None:
    """Raise ``TypeError`` unless ``cls`` is a torch scheduler that takes ``kwargs`` (the
    optimizer is its first argument)."""
    if not issubclass(cls, LRScheduler):
        raise TypeError(f"lr_scheduler class must be a torch LRScheduler, got {cls!r}")
    try:
        inspect.signature(cls).bind(None, **kwargs)
    except TypeError as exc:
        takes = [p for p in inspect.signature(cls).parameters if p != "optimizer"]
        raise TypeError(f"lr_scheduler={cls.__name__} cannot be built with "
                        f"lr_scheduler_kwargs={kwargs!r}: {exc}; it takes "
                        f"{', '.join(takes)}") from None


class Strategy(ABC):
    """Base class of every training strategy.

    Args:
        optim_spec: the (inner) optimizer: an ``OptimSpec``, a name (``'adamw'``,
            ``'adam'``, ``'sgd'``, ...) or an optimizer class. Default AdamW.
        inner_optim: the same, under the name DiLoCo users know; give one of the two.
        lr: learning rate; overrides the one in ``optim_spec``.
        lr_scheduler: ``'lambda_cosine'`` (warmup, then cosine if ``cosine_anneal``),
            ``'cosine'`` (warmup then cosine), ``'constant'`` (warmup then flat), or a
            ``torch.optim.lr_scheduler`` class built with ``lr_scheduler_kwargs``.
        lr_scheduler_kwargs: arguments of the schedule (the keys below, or those of
            a scheduler class).
        warmup_steps: linear warmup length in steps (the first step runs at lr/warmup).
        cosine_anneal: anneal with a cosine after warmup (``'lambda_cosine'``).
        min_lr_factor: the cosine ends at ``lr * min_lr_factor``.
        max_steps: steps the schedule spans (default: the run's ``max_steps``).
        max_norm: clip the gradient norm to this value before the optimizer step.
    """

    #: True when every rank provably holds the same model after every step, so
    #: evaluating "the average model" needs no communication (AllReduce).
    keeps_ranks_identical: bool = False

    #: The ``local_step`` at which this strategy last made every rank hold the same model
    #: (set by a strategy whose step ends with a full average, e.g. a DiLoCo round), so
    #: that an evaluation right then needs no average model; None: not known.
    synced_at: int | None = None

    #: The ``fit(balance=...)`` modes this strategy implements (:mod:`exogym.run.balance`): it
    #: multiplies what it averages across ranks by :attr:`average_weight`.
    balance_modes: tuple[str, ...] = ()

    #: This rank's factor in an average across ranks, given before each step under
    #: ``balance`` (:meth:`set_average_weight`): the mean over ranks of
    #: ``average_weight * value`` is the average weighted by the samples each rank
    #: trained. 1.0: a plain mean.
    average_weight: float = 1.0

    #: True for a strategy that decides step by step which ranks train (AsyncDiLoCo
    #: paces each rank at its own speed): the trainer then asks :meth:`begin_step`
    #: before each step and tells :meth:`record_step` after it, the protocol
    #: ``fit(balance=...)`` follows too (:class:`exogym.run.balance.Pacer`).
    paces_steps: bool = False

    #: True for a strategy whose ranks may be computed as one batched model
    #: (``fit(stack=True)``, :mod:`exogym.run.stack`): its step changes the model's
    #: parameters only in place (``p.copy_``, ``p.add_``, an optimizer's step), never
    #: gives a parameter new storage (``p.data = ...``), and every rank trains every
    #: step. Built-in strategies declare it; one written elsewhere runs packed until
    #: it does.
    stackable: bool = False

    #: True for a strategy whose ranks meet only at a round's end and whose state a rank
    #: coming back can take while the others train (DiLoCo): across hosts such a rank
    #: joins the round under way at the next step boundary, from :meth:`synced_model`,
    #: instead of waiting for the next round (:mod:`exogym.membership.attendance`).
    joins_mid_round: bool = False

    #: True for a strategy that :attr:`joins_mid_round` and whose ranks also meet within a
    #: round (AsyncDiLoCo merges at any step): a rank that joined under way then trains
    #: alone (:attr:`training_alone`) until the round's last step, and there, once the
    #: members and it have formed one group, takes the state every rank holds alike
    #: (:meth:`entry_state`) from the lowest member still live.
    catches_up_at_entry: bool = False

    #: True while this rank, joined a round under way, trains before meeting the members
    #: (:meth:`train_alone`): a strategy that :attr:`catches_up_at_entry` must then call
    #: no collective.
    training_alone: bool = False

    def __init__(
        self,
        optim_spec: OptimSpec | str | type | None = None,
        inner_optim: OptimSpec | str | type | None = None,
        lr: float | None = None,
        lr_scheduler: str | type | None = None,
        lr_scheduler_kwargs: dict[str, Any] | None = None,
        warmup_steps: int | None = None,
        cosine_anneal: bool | None = None,
        min_lr_factor: float | None = None,
        max_steps: int | None = None,
        max_norm: float | None = None,
        **kwargs: Any,
    ):
        if kwargs:
            raise unknown_args_error(type(self).__name__, kwargs, init_arg_names(type(self)))
        if optim_spec is not None and inner_optim is not None:
            raise TypeError(
                f"{type(self).__name__}: give the inner optimizer as optim_spec= or "
                "inner_optim=, not both"
            )
        spec = optim_spec if optim_spec is not None else inner_optim
        if spec is not None or not hasattr(self, "optim_spec"):
            # A subclass may have set self.optim_spec before calling us.
            self.optim_spec = ensure_optim_spec(spec)
        EVERY.check(self, lr=lr, max_norm=max_norm)
        self.lr = lr
        self.max_norm = max_norm
        self.lr_scheduler = lr_scheduler
        self.lr_scheduler_kwargs = dict(lr_scheduler_kwargs or {})
        self._schedule = self._schedule_settings(
            warmup_steps=warmup_steps,
            cosine_anneal=cosine_anneal,
            min_lr_factor=min_lr_factor,
            max_steps=max_steps,
        )
        self.scheduler = None
        self.lr_callbacks: list[Callable[[float], None]] = []
        self.max_steps: int = max_steps or 1  # the run's length; set by the trainer
        self.seed: int = 0  # shared by all ranks; set by the trainer
        self.local_step = 0

    # -- configuration -------------------------------------------------------------

    def _schedule_settings(self, **direct: Any) -> dict[str, Any]:
        name = self.lr_scheduler
        if name is not None and not isinstance(name, type) and name not in SCHEDULERS:
            raise ValueError(
                f"lr_scheduler must be one of {', '.join(SCHEDULERS)}, a torch scheduler "
                f"class, or None; got {name!r}"
            )
        settings = {k: v for k, v in direct.items() if v is not None}
        if isinstance(name, type):
            _check_scheduler_class(name, self.lr_scheduler_kwargs)
        else:
            extra = set(self.lr_scheduler_kwargs) - set(_SCHEDULE_KEYS)
            if extra:
                raise unknown_args_error("lr_scheduler_kwargs", extra, _SCHEDULE_KEYS)
            settings = {**self.lr_scheduler_kwargs, **settings}
        EVERY.check(self, **{k: v for k, v in settings.items()
                             if k in ("warmup_steps", "min_lr_factor")})
        return settings

    # -- checks before any rank starts --------------------------------------------

    def validate(self, model: torch.nn.Module, num_nodes: int) -> None:
        """Raise, before any rank starts, for a setting that this model or this number of
        ranks cannot run: what the constructor cannot know yet.

        ``fit`` calls it once, in the process that starts the ranks (on a host, before its
        rank joins the others), with the model every rank starts from; nothing is set up
        and the model is not changed. A strategy that depends on the model's shape or on
        the ranks checks it here rather than in :meth:`_init_node`, which runs in every
        rank: an error there would surface only after every rank had started. Override it
        and call ``super().validate(model, num_nodes)``.

        Args:
            model: the model every rank starts from.
            num_nodes: the ranks the run starts.

        Raises:
            ValueError: naming the setting, its value, what the model or run has, and
                what to change.
        """

    # -- what it sends ---------------------------------------------------------------

    #: Settings the planner cannot guess for this strategy (``('H',)``): a prediction
    #: by name without them is refused rather than made with a default.
    traffic_needs: tuple[str, ...] = ()

    def traffic(self, model: ModelFacts, num_nodes: int) -> list[Traffic]:
        """The collectives this strategy runs, per step on average, as it states them.

        The planner (``distributed.planning``, ``recommend``) and anyone estimating
        a run turn this statement into bytes and seconds with the network model
        (:func:`exogym.sim.network.traffic_cost`); the simulated clock charges the
        same model for the collectives the strategy actually calls, and tests hold
        both to the comm counters. A strategy of your own states its traffic here
        and gets a planner estimate without touching the planner.

        Args:
            model: the model's sizes (:class:`exogym.comm.wire.ModelFacts`).
            num_nodes: the ranks of the run.

        Returns:
            One :class:`exogym.comm.wire.Traffic` per collective: its kind, the
            bytes each rank hands to it, and every how many steps it runs.

        Raises:
            NotImplementedError: the strategy does not state its traffic.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not state its traffic: define "
            "traffic(self, model, num_nodes) returning a list of exogym.comm.wire.Traffic "
            "(see Strategy.traffic) to get a planner estimate")

    # -- set-up on a rank ----------------------------------------------------------

    def setup(self, context: RankContext) -> None:
        """Attach the strategy to one rank, once, before its first step.

        Sets ``self.context``, ``self.model``, ``self.rank``, ``self.num_nodes``,
        ``self.max_steps``, ``self.seed`` and ``self.collectives``, and builds the
        optimizer and the learning-rate schedule. A strategy with state of its own
        overrides it, calls ``super().setup(context)`` first, and reads what it needs
        from ``context`` (:class:`~exogym.strategy.context.RankContext`): the ranks
        present from ``context.membership``, state every rank of a process holds the
        same from ``context.held_once``.

        Args:
            context: this rank's model, identity, run and collectives.
        """
        self.context = context
        self.collectives = context.collectives
        self.max_steps = context.max_steps
        self.seed = context.seed
        self._init_node(context.model, context.rank, context.num_nodes)

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        """exo gym's set-up hook: attach to this rank's model, build optimizer and schedule.

        :meth:`setup` calls it, so a strategy written for exo gym that overrides it (and
        calls ``super()._init_node(...)``) keeps working; new strategies override
        :meth:`setup`. Called directly, outside a run, it sets the strategy up for a
        rank alone.
        """
        context = self.__dict__.get("context")
        if context is None or not context.describes(model, rank, num_nodes):
            context = RankContext.alone(model, rank, num_nodes,
                                        max_steps=max(1, int(self.max_steps or 1)),
                                        seed=self.seed)
            if type(self).setup is not Strategy.setup:
                self.setup(context)  # a strategy with a set-up of its own, outside a run
                return
            self.context = context
            self.collectives = context.collectives
        self.model = model
        self.rank = rank
        self.num_nodes = num_nodes
        self.local_step = 0
        self.optim = self._build_optimizer()
        self._setup_scheduler()

    def set_max_steps(self, max_steps: int) -> None:
        """The run's length changed (a rank that rejoins learns it from the hand-over):
        the schedule spans ``max_steps`` from now on."""
        self.max_steps = max_steps
        context = self.__dict__.get("context")
        if context is not None:
            self.context = context.with_max_steps(max_steps)

    def set_average_weight(self, weight: float) -> None:
        """This rank's factor in the next step's averages (``fit(balance=...)``, see
        :attr:`average_weight`)."""
        self.average_weight = weight

    def set_step(self, step: int) -> None:
        """Move the step counter to ``step`` (counting the state a round's end creates,
        :func:`exogym.run.memory.account_state`, without training the round)."""
        self.local_step = step

    def skip_steps(self, steps: int) -> None:
        """Advance the schedule and ``local_step`` over ``steps`` steps this rank did not
        train (it joined a round under way later than the step its state was taken at)."""
        with warnings.catch_warnings():  # the schedule moves on without an optimizer step
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
            for _ in range(steps):
                Strategy.step(self)

    def synced_model(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model as every rank held it when the round began, given this rank's model
        state now (its ``state_dict``): what a rank joining the round under way starts
        from. Asked only of a strategy that :attr:`joins_mid_round`, which must say it."""
        raise NotImplementedError(f"{type(self).__name__} does not join ranks mid-round: it "
                                  "must set joins_mid_round and say its synced_model")

    def keep_round_updates(self, keep: bool) -> None:
        """Keep (True), from now on, the update every rank applies at each round's end, or
        stop keeping them and forget those kept (False): a rank that joins mid-round takes
        a copy of the state that may be rounds old by the time it has arrived, and brings
        it up to date with them (:meth:`round_updates`, :meth:`apply_round_update`). Asked
        of a strategy that :attr:`joins_mid_round`, which must do it."""
        raise NotImplementedError(f"{type(self).__name__} keeps no round updates")

    def round_updates(self, through_step: int) -> list[dict[str, Any]]:
        """The updates kept (:meth:`keep_round_updates`) of the rounds that ended at
        ``through_step`` or before, oldest first: plain values and tensors only."""
        raise NotImplementedError(f"{type(self).__name__} keeps no round updates")

    def apply_round_update(self, update: dict[str, Any]) -> None:
        """Apply one update of :meth:`round_updates` as every rank did at that round's end."""
        raise NotImplementedError(f"{type(self).__name__} keeps no round updates")

    def entry_state(self) -> dict[str, Any]:
        """What every rank of the round holds alike, at a round's last step before its
        collectives: what a rank that trained alone since it joined the round under way
        takes from a member when it meets them (:meth:`take_entry_state`); its own round
        stays its own. Asked of a strategy that :attr:`catches_up_at_entry`."""
        raise NotImplementedError(f"{type(self).__name__} does not catch up at entry")

    def take_entry_state(self, state: dict[str, Any]) -> None:
        """Take a member's :meth:`entry_state` (a rank that trained alone, meeting the
        members), before :meth:`admit_late`."""
        raise NotImplementedError(f"{type(self).__name__} does not catch up at entry")

    def train_alone(self, alone: bool) -> None:
        """Told before each step whether this rank, joined a round under way, trains it
        before meeting the members (:attr:`training_alone`)."""
        self.training_alone = alone

    def start_late(self) -> None:
        """Called on a rank that joined a round under way, once its state is up to date
        (:meth:`apply_round_update`), before its first step. Default: nothing."""

    def late_join_note(self, state: dict[str, Any],
                       updates: list[dict[str, Any]]) -> dict[str, Any]:
        """What the members learn of this rank when it meets them, having joined a round
        under way from the strategy ``state`` a member handed over and the ``updates`` since
        (plain values; :meth:`admit_late`). Default: nothing."""
        return {}

    def admit_late(self, joins: dict[int, dict[str, Any]], step: int) -> None:
        """Before step ``step``, the last of a round, on every rank of the round: ``joins``
        gives each rank that joined it under way its first step (``at``) and its
        :meth:`late_join_note` (``note``). Default: nothing."""

    def mark_synced(self, step: int) -> None:
        """Every rank holds the same model at ``local_step == step`` (a round that
        averaged the whole model): an evaluation then needs no average (:attr:`synced_at`)."""
        self.synced_at = step

    # -- optional hooks, with their defaults ---------------------------------------------

    def begin_step(self, step: int, present: Collection[int]) -> bool:
        """Asked before step ``step`` (1-based) of a strategy that :attr:`paces_steps`,
        with the ranks ``present`` at it: whether this rank trains the step (False: the
        trainer calls :meth:`idle_step` instead). Default: it trains every step."""
        return True

    def step_samples(self) -> int:
        """Samples this rank trains in the step :meth:`begin_step` began (a strategy that
        :attr:`paces_steps`). Default: the run's samples a step."""
        return self.context.samples_per_step

    def record_step(self, samples: int, seconds: float,
                    given_speed: float | None = None) -> None:
        """Told after a trained step of a strategy that :attr:`paces_steps`: its
        ``samples`` took ``seconds`` of compute; ``given_speed``: the rank's speed a
        simulation gives it (``rank_speeds``), None where it is measured. Default: nothing."""

    def step_fields(self) -> dict[str, Any]:
        """Fields this strategy adds to a step's metric event (a strategy that
        :attr:`paces_steps`: its rounds, merges). Default: none."""
        return {}

    def global_model_tensors(self) -> list[torch.Tensor] | None:
        """The global model, when the strategy holds one every rank shares (AsyncDiLoCo):
        its trainable tensors in parameter order, which an evaluation of the global model
        scores. None (default): the global model is the average of the ranks' models."""
        return None

    def _inner_spec(self) -> OptimSpec:
        spec = ensure_optim_spec(self.optim_spec, OptimSpec(torch.optim.AdamW))
        if self.lr is not None:
            spec = spec.with_overrides(lr=self.lr)
        return spec

    def _build_optimizer(self) -> torch.optim.Optimizer:
        return self._inner_spec().build(self.model)

    def _setup_scheduler(self) -> None:
        name = self.lr_scheduler
        if name is None and not self._schedule.get("warmup_steps"):
            self.scheduler = None
            return
        if isinstance(name, type):  # checked with its arguments when the strategy was made
            self.scheduler = name(self.optim, **self.lr_scheduler_kwargs)
            return
        settings = self._schedule
        cosine = name == "cosine" or (
            name == "lambda_cosine" and bool(settings.get("cosine_anneal", False))
        )

        def factor(step: int) -> float:
            total = settings.get("max_steps") or self.max_steps
            total = min(total, self.max_steps) if self.max_steps else total
            return lr_factor(
                step,
                total,
                warmup_steps=settings.get("warmup_steps", EVERY.warmup_steps.default),
                cosine=cosine,
                min_lr_factor=settings.get("min_lr_factor", EVERY.min_lr_factor.default),
            )

        self.scheduler = LambdaLR(self.optim, factor)

    # -- the step ------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Clear every parameter's gradient before the next forward/backward."""
        # What model.zero_grad(set_to_none=True) does, without walking the module tree each step.
        params = self.__dict__.get("_grad_params")
        if params is None:
            params = self._grad_params = list(self.model.parameters())
        for p in params:
            p.grad = None

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters that require grad: the only ones a strategy communicates."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def clip_grads(self) -> None:
        """Clip the gradient norm to ``max_norm`` when it is set."""
        if self.max_norm:
            torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), self.max_norm)

    @property
    def round_steps(self) -> int:
        """Steps per round: how often the ranks meet to agree (DiLoCo's ``H``; 1 for
        per-step strategies). A rank coming back after an absence joins when a round
        begins (:mod:`exogym.membership.simulated`)."""
        h = getattr(self, "H", None)
        return h if isinstance(h, int) and h >= 1 else 1

    @property
    def current_lr(self) -> float:
        """Learning rate the next optimizer step uses (first parameter group)."""
        return float(self.optim.param_groups[0]["lr"])

    @abstractmethod
    def step(self) -> None:
        """Update the model from the current gradients; subclasses call ``super().step()``."""
        if self.scheduler is not None:
            self.scheduler.step()
            if self.lr_callbacks:
                lr = self.scheduler.get_last_lr()[0]
                for callback in self.lr_callbacks:
                    callback(lr)
        self.local_step += 1

    @property
    def ranks_identical(self) -> bool:
        """Whether every rank holds the same model now: always for a strategy that
        :attr:`keeps_ranks_identical`, or right after a step that averaged the whole model."""
        return self.keeps_ranks_identical or self.synced_at == self.local_step

    def idle_step(self) -> None:
        """A step in which this rank trains nothing (``balance='steps'``): it still takes
        part in the step's collectives, so ranks that train it meet it there.

        Only a strategy whose ``balance_modes`` include ``'steps'`` is asked to idle.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot idle through a step: "
                                  "balance='steps' needs a strategy that supports it")

    def _advance_schedule(self) -> None:
        """Advance the schedule and ``local_step`` as a step does (an idle one too)."""
        Strategy.step(self)

    # -- checkpoints ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this rank's strategy after a restart.

        Like torch's own ``state_dict``, its tensors are the live ones, not copies: save
        or send it before the next step changes them.
        """
        return {
            "local_step": self.local_step,
            "optim": self.optim.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (after ``_init_node``)."""
        self.local_step = state["local_step"]
        self.optim.load_state_dict(state["optim"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def __config__(self) -> dict[str, Any]:
        """Plain settings for logs and run configs."""
        config: dict[str, Any] = {"strategy": type(self).__name__}
        spec = ensure_optim_spec(self.optim_spec, OptimSpec(torch.optim.AdamW))
        config["optim"] = spec.__config__()
        for key in ("lr", "max_norm", "H", "island_size", "client_sampling", "comm_dtype"):
            value = getattr(self, key, None)
            if value is not None:
                config[key] = value if isinstance(value, (int, float, str, bool)) else repr(value)
        if self.lr_scheduler is not None:
            sched = self.lr_scheduler
            config["lr_scheduler"] = sched if isinstance(sched, str) else sched.__name__
            config.update({k: v for k, v in self._schedule.items()})
        return config


class SimpleReduceStrategy(Strategy):
    """AllReduce (DDP): average gradients every step, clip, then step the optimizer.

    All gradients travel in one bucketed all-reduce per step, ``4 * P`` bytes per
    rank for ``P`` float32 trainable parameters.

    Args:
        optim_spec: the optimizer (default AdamW); see :class:`Strategy` for the rest.
        max_norm: gradient clipping, applied to the averaged gradient.
    """

    stackable = True

    keeps_ranks_identical = True
    balance_modes = ("batch",)

    def __init__(self, optim_spec: OptimSpec | str | None = None, max_norm: float | None = None,
                 **kwargs: Any):
        super().__init__(optim_spec=optim_spec, max_norm=max_norm, **kwargs)

    def traffic(self, model: ModelFacts, num_nodes: int) -> list[Traffic]:
        """Every gradient, in the model's own dtype, all-reduced every step."""
        return [Traffic("all_reduce", model.value_bytes * model.num_params)]

    def step(self) -> None:
        params = self.trainable_parameters()
        if self.num_nodes > 1:
            for p in params:
                if p.grad is None:  # unused this step here, maybe not elsewhere
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
            if self.average_weight != 1.0:  # balance='batch': weighted by samples
                torch._foreach_mul_(grads, self.average_weight)
            self.collectives.all_reduce_tensors(grads, average=True)
        self.clip_grads()
        self.optim.step()
        super().step()
