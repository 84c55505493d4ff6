"""Asynchronous DiLoCo: a merge as soon as a quorum of workers has a round to give.

Synchronous DiLoCo waits at every round for its slowest rank, and a rank that
drops mid-round throws its round away. Here each worker (rank) trains ``H``
inner steps at its own pace from the newest global model it holds, then offers
its change (the global model it started from minus its model now) with the
samples it trained on and the global version it started from. The global
model moves on as soon as ``quorum`` offers are in:

**Pace.** Steps are counted on one clock for all ranks (the run's step counter:
``max_steps``, evaluations, checkpoints and the learning-rate schedule count
them alike). The fastest rank trains at every step; a rank measured at ``s``
times its speed trains at a fraction ``s`` of the steps (the first step at
which its running credit ``s + s + ...`` reaches a whole step) and idles at
the others: an idle step computes nothing and takes no time. So each rank
takes its own time for its ``H`` steps and nobody waits between merges. Speeds
are measured on hosts as ``fit(balance=...)`` measures them
(:mod:`exogym.run.balance`: each rank's samples per second of compute,
collectives aside); in a simulation, whose ranks share this machine's cores,
they are the ``rank_speeds`` given (1.0 without), not the machine's noise.
They are agreed over the side channel after :data:`PROBE_STEPS` steps and at
every merge; a speed within :data:`SPEED_TOLERANCE` of the fastest counts as
full speed. Every rank
therefore knows, without asking, which ranks train at which step.

**Merge.** After a step at which at least ``quorum`` workers (a count, or a
fraction of the workers present, rounded up) hold a finished round, the merge
waits at most ``grace_s`` seconds more for a worker whose round would end
within them (at its measured speed), then happens at the end of a step: every
present worker takes part in one all-reduce, the contributors with their
weighted change, the others with zeros. A contribution counts with weight
``tokens`` (the samples of its round; ``weighting='equal'``: 1) times
``1 / (1 + staleness)``, where ``staleness`` is how many versions the global
model moved on since the contributor started its round; one more than
``max_staleness`` versions old is dropped (its worker starts afresh from the
newest model) and counted. The merged change is the sum of the weighted
contributions divided by the sum of their undiscounted sizes (samples, or 1
each): with no staleness, their mean weighted by samples; a stale contribution
counts for less even when it is merged alone. The outer optimizer (by default
DiLoCo's SGD with Nesterov momentum) steps the global model with it on every
rank alike, and the version goes up by one. The contributors take the new global model and start a new
round; the others train on and take the newest model when their own round
ends. A worker whose round is done waits for a merge (it idles) only until the
quorum and grace rule calls one; with ``keep_training`` it trains on meanwhile,
and its round, longer than ``H``, counts every step it trained.

**The end.** At the last step every present worker offers what it has (a round
cut short counts with its samples), so no trained step is left out, and all
ranks end with the same global model, which ``fit`` returns.

**Ranks that come and go** (``rank_failures``; ``min_nodes`` across hosts): a
worker that leaves mid-round loses that round (counted as dropped, with its
samples); one that comes back takes the state from a worker present and starts
a round from the newest global model. Across hosts the members are decided once
a round, so a worker lost mid-round is found at the next merge, which it does
not complete: the merge's mean is over the contributions that arrived, and the
lost worker is left out until the next round's members are decided. A worker that
comes back on its host during a round (``merge_delay=0``) starts a round of its own
from the global model at once and trains it alone; at the round's last step it
meets the others in one group, takes the global model, its optimizer and the
bookkeeping from the lowest member still live (:meth:`entry_state`), and merges
from then on as a worker with the steps it trained
(:mod:`exogym.membership.attendance`).

**Bytes.** One all-reduce of the parameters and float buffers per merge, as a
DiLoCo round: ``4 * P`` bytes per rank per merge in float32.

**Equal speeds, ``quorum`` = all, ``grace_s=0``** give DiLoCo exactly (up to
float rounding): every merge has every worker, with staleness 0 and equal
samples.

Every merge is reported in the step event of the lowest present rank
(``merge``: version, contributors, their steps and tokens, staleness, dropped
ones with their steps and tokens, and the workers that left since the last
merge) and in ``summary.json``; every step event carries the ``version`` its
rank trains from. Tokens are steps times ``batch_size``: the samples of full
batches (the short last batch of an epoch counts as full).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from exogym import comm
from exogym.comm.wire import ModelFacts, Traffic, wire_bytes, wire_collective

from .context import RankContext
from .optim import OptimSpec
from .outer import OuterOptimizer, OuterState
from .settings import ASYNC_DILOCO
from .strategy import Strategy

__all__ = ["AsyncDiLoCoStrategy", "PROBE_STEPS", "SPEED_TOLERANCE", "WEIGHTINGS"]

#: Steps every rank trains before the ranks first agree on their speeds.
PROBE_STEPS = 3
#: A rank measured within this fraction of the fastest rank's speed trains at every step.
SPEED_TOLERANCE = 0.1
#: Weight of a new measurement in a rank's throughput estimate.
SMOOTHING = 0.5
#: How contributions are weighted in a merge.
WEIGHTINGS = ASYNC_DILOCO.weighting.choices


@dataclass
class _Worker:
    """What every rank knows of one worker's round."""

    steps: int = 0          # steps trained in its current round
    base_version: int = 0   # the global version the round started from
    credit: float = 0.0     # its pace: a step is trained when this reaches 1
    ready: bool = False     # its round is done; its contribution waits for a merge
    trains: bool = False    # it trains at the current step


@dataclass
class _Pending:
    """A merge whose result is applied at the end of step ``apply_after``."""

    apply_after: int
    started: int                      # the step it was called at
    contributors: list[int]           # merged and dropped
    record: dict[str, Any]            # its contributions' steps, weights and staleness
    reduced: list[torch.Tensor] | None = None  # the merged change and buffers, once reduced
    handle: Any = None                # the all-reduce in flight


class AsyncDiLoCoStrategy(Strategy):
    """Asynchronous DiLoCo with a quorum: fast workers never wait for slow ones.

    Args:
        optim_spec: the inner optimizer (default AdamW); ``inner_optim=`` is the same.
        H: inner steps of a worker's round.
        quorum: contributions that trigger a merge: a count (``1 <= quorum <= workers``)
            or a fraction of the workers present, ``0 < quorum <= 1`` (rounded up).
        grace_s: once the quorum is in, how many more seconds the merge waits for a
            worker whose round would end within them.
        weighting: ``'tokens'`` (each contribution weighted by the samples it trained)
            or ``'equal'``.
        max_staleness: versions a contribution may be behind and still be merged
            (with weight divided by ``1 + staleness``); older ones are dropped and
            counted.
        outer_optim_spec: the outer optimizer as an ``OptimSpec`` or name; default
            SGD with ``outer_lr``, ``outer_momentum`` and ``nesterov``.
        outer_optim: alias of ``outer_optim_spec``.
        outer_lr: outer learning rate.
        outer_momentum: outer momentum.
        nesterov: Nesterov momentum for the outer SGD.
        comm_dtype: type the changes travel in (``'float32'``, ``'bfloat16'``,
            ``'float16'``, or quantized ``'int8'``, ``'float8_e4m3fn'``, ``'int4'``,
            ``'int2'``).
        merge_delay: steps every rank trains on while a merge's all-reduce travels
            (``0 <= merge_delay < H``; 0: the merge completes within its step).
        adaptive_H: a worker's round is ``H`` times its speed (rounded, at least 1) rather
            than ``H`` (dynamic local updates, as in Async Local-SGD): a slow worker
            offers fresh, shorter rounds at the fast ones' pace instead of late long ones.
        keep_training: a worker whose round is done trains on, at its pace, until a merge
            takes its round (which then counts every step it trained), instead of idling
            until then: no worker waits for a quorum, for a grace or for a merge in flight.
        **kwargs: inner optimizer, schedule and clipping arguments of ``Strategy``.

    The rules are in this module's docstring. It paces its ranks itself, so
    ``fit(balance=...)`` stays ``'none'``. Defaults and accepted values:
    :data:`exogym.strategy.settings.ASYNC_DILOCO` (the settings table in
    ``docs/strategies.md``).
    """

    #: The trainer asks this strategy which ranks train each step (see :meth:`begin_step`).
    paces_steps = True

    def __init__(
        self,
        optim_spec: OptimSpec | str | None = None,
        H: int = ASYNC_DILOCO.H.default,
        quorum: int | float = ASYNC_DILOCO.quorum.default,
        grace_s: float = ASYNC_DILOCO.grace_s.default,
        weighting: str = ASYNC_DILOCO.weighting.default,
        max_staleness: int = ASYNC_DILOCO.max_staleness.default,
        outer_optim_spec: OptimSpec | str | None = None,
        outer_optim: OptimSpec | str | None = None,
        outer_lr: float = ASYNC_DILOCO.outer_lr.default,
        outer_momentum: float = ASYNC_DILOCO.outer_momentum.default,
        nesterov: bool = ASYNC_DILOCO.nesterov.default,
        comm_dtype: str = ASYNC_DILOCO.comm_dtype.default,
        merge_delay: int = ASYNC_DILOCO.merge_delay.default,
        adaptive_H: bool = ASYNC_DILOCO.adaptive_H.default,
        keep_training: bool = ASYNC_DILOCO.keep_training.default,
        **kwargs: Any,
    ):
        ASYNC_DILOCO.check(self, H=H, quorum=quorum, grace_s=grace_s, weighting=weighting,
                           max_staleness=max_staleness, outer_lr=outer_lr,
                           outer_momentum=outer_momentum, nesterov=nesterov,
                           comm_dtype=comm_dtype, merge_delay=merge_delay,
                           adaptive_H=adaptive_H, keep_training=keep_training)
        if merge_delay >= H:
            raise ValueError(f"merge_delay must be an integer with 0 <= merge_delay < H={H} "
                             f"(steps trained while a merge travels), got {merge_delay!r}")
        comm.resolve_dtype(comm_dtype)
        self.H = H
        self.quorum = quorum
        self.grace_s = float(grace_s)
        self.weighting = weighting
        self.max_staleness = max_staleness
        self.comm_dtype = comm_dtype
        self.merge_delay = merge_delay
        self.adaptive_H = adaptive_H
        self.keep_training = keep_training
        self.outer_optim_spec = OuterOptimizer.from_args(
            "AsyncDiLoCoStrategy", outer_optim_spec, outer_optim, outer_lr, outer_momentum,
            nesterov,
        ).optim_spec()
        self.samples_per_step = 1  # samples a rank trains per step: the context's, once set up
        super().__init__(optim_spec=optim_spec, **kwargs)

    # -- checks and traffic ---------------------------------------------------------

    def validate(self, model: torch.nn.Module, num_nodes: int) -> None:
        super().validate(model, num_nodes)
        if isinstance(self.quorum, int) and self.quorum > num_nodes:
            raise ValueError(f"quorum={self.quorum} is more than the {num_nodes} workers of "
                             f"this run: give at most {num_nodes}, or a fraction of the "
                             "workers present in (0, 1]")

    traffic_needs = ("H",)

    def traffic(self, model: ModelFacts, num_nodes: int) -> list[Traffic]:
        """One all-reduce of the parameters and float buffers per merge: every ``H`` steps
        with equal speeds (a merge may come sooner or later when speeds differ)."""
        values = model.num_params + model.num_buffers
        return [Traffic(wire_collective(self.comm_dtype), wire_bytes(values, self.comm_dtype),
                        every=self.H)]

    def round_length(self, rank: int) -> int:
        """Inner steps of ``rank``'s rounds: ``H``, or with ``adaptive_H`` ``H`` times its
        speed, rounded (at least 1), so that a slow worker's rounds end with the others'."""
        if not self.adaptive_H:
            return self.H
        return max(1, min(self.H, round(self.H * self.speeds[rank])))

    def quorum_count(self, present: int) -> int:
        """Contributions that call a merge when ``present`` workers are here."""
        if isinstance(self.quorum, int):
            return max(1, min(self.quorum, present))
        return max(1, min(present, math.ceil(self.quorum * present - 1e-9)))

    # -- set-up ---------------------------------------------------------------------

    def setup(self, context: RankContext) -> None:
        super().setup(context)
        model, num_nodes = context.model, context.num_nodes
        self.samples_per_step = context.samples_per_step
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        # The global model and its optimizer are the same on every rank: ranks that share
        # a process share them, and the first to finish a merge's all-reduce steps them.
        self.outer = context.held_once(("async-diloco-outer",),
                                       lambda: OuterState(self.params, self.outer_optim_spec))
        self.master = self.outer.master
        self.outer_optim = self.outer.optim
        self.base = [p.detach().clone() for p in self.params]  # the model my round started from
        self._scratch: list[torch.Tensor] | None = None  # zeros sent when not contributing
        self.version = 0
        self.workers: dict[int, _Worker] = {}
        self.speeds = [1.0] * num_nodes
        self.throughputs: list[float] | None = None
        self.given_speeds: list[float] | None = None  # a simulation's rank_speeds
        self._given_speed: float | None = None
        self._window: list[tuple[int, float]] = []
        self._warm = False
        self._tick = 0
        self._grace_until: int | None = None
        self._merge_record: dict[str, Any] | None = None
        self._pending: _Pending | None = None
        self._left: list[dict[str, Any]] = []
        # Workers found lost in a merge, left out until the membership's next round
        # (hosts that come and go decide their members once a round).
        self._lost: set[int] = set()
        self.merged_contributions = 0
        self.dropped_contributions = 0
        # Each step's merge and bookkeeping, kept while a rank joins the round under way.
        self.kept: list[dict[str, Any]] | None = None
        self._applied_delta: list[torch.Tensor] | None = None

    # -- the pace -------------------------------------------------------------------

    def begin_step(self, step: int, present: Any) -> bool:
        """Before step ``step`` (1-based), with the ranks ``present`` at it: update every
        worker's round and return whether this rank trains (False: it idles)."""
        self._tick = step
        self._merge_record = None
        if self.training_alone:
            # Joined the round under way: its own round goes on, the members' merges are
            # taken when it meets them, at the round's last step (admit_late).
            worker = self.workers.setdefault(self.rank, _Worker(base_version=self.version))
            worker.steps += 1
            worker.trains = True
            return True
        if (step - 1) % self.H == 0:
            self._lost = set()  # a round of the membership begins: it was decided anew
        present = sorted(r for r in present if r not in self._lost)
        for rank in sorted(self.workers):
            if rank not in present:
                gone = self.workers.pop(rank)
                if gone.steps:
                    self.dropped_contributions += 1
                    self._left.append({"rank": rank, "step": step, "steps": gone.steps,
                                       "tokens": gone.steps * self.samples_per_step})
        for rank in present:
            if rank not in self.workers:
                self.workers[rank] = _Worker(base_version=self.version)
                if rank == self.rank and step > 1:
                    self._start_round()  # back after an absence: from the newest model
        for rank in present:
            worker = self.workers[rank]
            worker.trains = False
            if worker.ready and not self.keep_training:
                continue  # its round waits for a merge
            worker.credit += self.speeds[rank]
            if worker.credit >= 1.0 - 1e-9:
                worker.credit = max(0.0, worker.credit - 1.0)
                worker.trains = True
                worker.steps += 1
                worker.ready = worker.ready or worker.steps >= self.round_length(rank)
        return self.workers[self.rank].trains

    def record_step(self, samples: int, seconds: float,
                    given_speed: float | None = None) -> None:
        """One trained step of this rank: ``samples`` in ``seconds`` of compute;
        ``given_speed``: the speed a simulation gives it (it then paces by that, not by its
        measurement)."""
        self._given_speed = given_speed
        if not self._warm:
            self._warm = True
            return
        if seconds > 0:
            self._window.append((samples, seconds))

    def _agree_speeds(self) -> None:
        """Exchange throughputs (side channel, every present rank) and set the speeds."""
        mine = (sum(n for n, _ in self._window) / sum(t for _, t in self._window)
                if self._window else 0.0)
        self._window = []
        vector = torch.zeros(2 * self.num_nodes, dtype=torch.float64)
        vector[self.rank] = mine
        vector[self.num_nodes + self.rank] = self._given_speed or 0.0
        self.collectives.side_all_reduce(vector)
        measured = vector[:self.num_nodes].tolist()
        given = vector[self.num_nodes:].tolist()
        if all(g > 0 for g in given):  # a simulation: every rank's speed is known
            self.given_speeds = given
        old = self.throughputs
        throughputs = []
        for rank, value in enumerate(measured):
            before = old[rank] if old is not None else 0.0
            if value <= 0:
                throughputs.append(before)  # away, or nothing timed yet: keep what we had
            elif before > 0:
                throughputs.append(SMOOTHING * value + (1.0 - SMOOTHING) * before)
            else:
                throughputs.append(value)
        known = [t for t in throughputs if t > 0]
        if known:
            self.throughputs = throughputs
        paces = self.given_speeds or (throughputs if known else None)
        if paces is None:
            return
        fastest = max(paces)
        speeds = []
        for t in paces:
            s = t / fastest if t > 0 else 1.0
            speeds.append(1.0 if s >= 1.0 - SPEED_TOLERANCE else s)
        self.speeds = speeds
        for rank, worker in self.workers.items():  # adaptive_H: rounds may end sooner now
            if not worker.ready and worker.steps and worker.steps >= self.round_length(rank):
                worker.ready = True

    def _step_seconds(self) -> float | None:
        """Seconds of a step at the fastest rank's speed (None before any measurement)."""
        known = [t for t in self.throughputs or [] if t > 0]
        return self.samples_per_step / max(known) if known else None

    def _steps_to_finish(self, worker: _Worker, rank: int) -> int:
        """Steps of the run until ``worker`` finishes its round at its pace."""
        left = self.round_length(rank) - worker.steps
        speed = self.speeds[rank]
        return max(0, math.ceil((left - worker.credit) / speed - 1e-9)) if left > 0 else 0

    # -- the step -------------------------------------------------------------------

    def step(self) -> None:
        self.clip_grads()
        self.optim.step()
        self._end_of_step()
        super().step()

    def idle_step(self) -> None:
        """A step this rank does not train: it only takes part in a merge, if one is due."""
        self._end_of_step()
        self._advance_schedule()

    def _end_of_step(self) -> None:
        if self.training_alone:
            return
        self._applied_delta = None
        self._merge_if_due()
        if self.kept is not None:  # for a rank joining the round under way
            self.kept.append({"step": self._tick, "deltas": self._applied_delta,
                              "book": self._book()})

    def _merge_if_due(self) -> None:
        step = self._tick
        if step == PROBE_STEPS and step < self.max_steps and self.throughputs is None:
            self._agree_speeds()
        pending = self._pending
        if pending is not None and (step >= pending.apply_after or step >= self.max_steps):
            self._apply(pending)
        present = sorted(self.workers)
        if step >= self.max_steps:
            contributors = [r for r in present if self.workers[r].steps]
            self._merge(contributors, final=True)
            return
        if self._pending is not None:
            return  # one merge in flight at a time: rounds done meanwhile wait for the next
        ready = [r for r in present if self.workers[r].ready]
        if not ready:
            return
        if len(ready) < len(present):
            if len(ready) < self.quorum_count(len(present)):
                return
            if self._grace_until is None:
                self._grace_until = step + self._grace_steps(present)
            if step < self._grace_until:
                return
        self._merge(ready, final=False)

    def _grace_steps(self, present: list[int]) -> int:
        """Steps the merge waits for workers whose round ends within ``grace_s``."""
        seconds = self._step_seconds()
        if not self.grace_s or seconds is None:
            return 0
        wait = 0
        for rank in present:
            worker = self.workers[rank]
            if worker.ready:
                continue
            steps = self._steps_to_finish(worker, rank)
            if steps * seconds <= self.grace_s:
                wait = max(wait, steps)
        return wait

    def _weight(self, worker: _Worker) -> tuple[float, int]:
        """A contribution's weight (0: dropped) and its staleness."""
        staleness = self.version - worker.base_version
        if staleness > self.max_staleness or worker.steps == 0:
            return 0.0, staleness
        return self._size(worker) / (1.0 + staleness), staleness

    def _size(self, worker: _Worker) -> float:
        """A contribution's size: its steps (``weighting='tokens'``), or 1."""
        return float(worker.steps) if self.weighting == "tokens" else 1.0

    @torch.no_grad()
    def _merge(self, contributors: list[int], final: bool) -> None:
        """Merge the rounds of ``contributors``: at once, or, with ``merge_delay``, start
        the all-reduce and apply it ``merge_delay`` steps later (:meth:`_apply`)."""
        weights = {r: self._weight(self.workers[r]) for r in contributors}
        merged = [r for r in contributors if weights[r][0] > 0]
        # Divided by the contributions' undiscounted sizes: a stale contribution counts
        # for less even when it is merged alone.
        sizes = {r: self._size(self.workers[r]) for r in merged}
        total = sum(sizes.values())
        delay = 0 if final or total == 0 else self.merge_delay
        pending = _Pending(self._tick + delay, self._tick, contributors, {
            "merged": merged, "sizes": sizes, "total": total, "final": final,
            "steps": {r: self.workers[r].steps for r in contributors},
            "staleness": {r: weights[r][1] for r in contributors}})
        mine = self.rank in merged
        share = weights[self.rank][0] / total if mine else 0.0
        if total > 0 and delay == 0:
            if mine:
                # My change, weighted, in the parameters' own memory: they take the global
                # model's values at the end of the merge anyway.
                sent = [p.detach() for p in self.params]
                for delta, base in zip(sent, self.base):
                    delta.neg_().add_(base)
                tensors = sent + self.buffers
                torch._foreach_mul_(tensors, share)
            else:
                tensors = self._zeroed_scratch()
            self.collectives.all_reduce_tensors(tensors, dtype=self.comm_dtype)
            pending.reduced = tensors
        elif total > 0:
            # Training goes on while the all-reduce runs: the change travels in a buffer of
            # its own, and the base keeps the model it was taken from, to rebase onto.
            tensors = self._zeroed_scratch()
            if mine:
                for out, p, base in zip(tensors, self.params, self.base):
                    torch.sub(base, p.detach(), out=out)
                for out, buf in zip(tensors[len(self.params):], self.buffers):
                    out.copy_(buf)
                torch._foreach_mul_(tensors, share)
            pending.reduced = tensors
            pending.handle = self.collectives.all_reduce_tensors(tensors, dtype=self.comm_dtype,
                                                                 async_op=True)
        if delay and self.rank in contributors:
            for base, p in zip(self.base, self.params):
                base.copy_(p)  # the model its next round starts from, until the merge lands
        for rank in contributors:
            credit = self.workers[rank].credit
            self.workers[rank] = _Worker(base_version=self.version + (total > 0),
                                         credit=credit)
        self._grace_until = None
        if delay:
            self._pending = pending
        else:
            self._apply(pending, final)
        if not final:
            self._agree_speeds()

    def _zeroed_scratch(self) -> list[torch.Tensor]:
        """A buffer for the parameters and float buffers, zeros (a merge's part to send)."""
        if self._scratch is None:
            self._scratch = [torch.zeros_like(t) for t in self.params + self.buffers]
        else:
            for t in self._scratch:
                t.zero_()
        return self._scratch

    @torch.no_grad()
    def _apply(self, pending: _Pending, final: bool = False) -> None:
        """Step the global model with a merge's result; its contributors rebase onto it."""
        self._pending = None
        if pending.handle is not None:
            pending.handle.wait()
            pending.handle = None
        facts = pending.record
        reduced = pending.reduced
        contributors = pending.contributors
        # Hosts that come and go decide their members once a round: a worker lost since
        # then completed no all-reduce, so its part is not in the sum. The sum is divided
        # by the sizes of the contributions that arrived, and the lost worker's round is
        # dropped; it is left out until the next round's members are decided.
        lost = []
        if reduced is not None:
            arrived = set(self.context.membership.present())
            lost = [r for r in sorted(set(self.workers) | set(contributors))
                    if r not in arrived]
        merged = [r for r in facts["merged"] if r not in lost]
        kept = sum(facts["sizes"][r] for r in merged)
        applied = reduced is not None and kept > 0
        if applied:
            assert reduced is not None
            if lost and kept < facts["total"]:
                torch._foreach_mul_(reduced, facts["total"] / kept)
            params = len(self.params)
            if self.outer.applied != pending.started:  # the same merged change on every rank
                self.outer.step(reduced[:params])
                self.outer.applied = pending.started
                if self.kept is not None:
                    self._applied_delta = [d.clone() for d in reduced[:params]]
            self.version += 1
            if final or self.rank in contributors:
                # My buffers take the merged ones (the weighted mean of the contributors').
                for buf, mean in zip(self.buffers, reduced[params:]):
                    if buf.data_ptr() != mean.data_ptr():
                        buf.copy_(mean)
        for rank in lost:
            gone = self.workers.pop(rank, None)
            self._lost.add(rank)
            steps = facts["steps"][rank] if rank in contributors else (gone.steps if gone else 0)
            if steps:
                self.dropped_contributions += 1
                self._left.append({"rank": rank, "step": self._tick, "steps": steps,
                                   "tokens": steps * self.samples_per_step})
        if not applied:
            merged = []
        dropped = [r for r in contributors if r not in merged and r not in lost]
        self.merged_contributions += len(merged)
        self.dropped_contributions += len(dropped)
        steps = sum(facts["steps"][r] for r in merged)
        dropped_steps = sum(facts["steps"][r] for r in dropped)
        record: dict[str, Any] = {
            "version": self.version, "step": pending.started, "contributors": merged,
            "steps": steps, "tokens": steps * self.samples_per_step,
            "staleness": [facts["staleness"][r] for r in merged], "dropped": dropped,
            "dropped_steps": dropped_steps,
            "dropped_tokens": dropped_steps * self.samples_per_step}
        if pending.started != self._tick:
            record["applied_step"] = self._tick
        if final:
            record["final"] = True
        if self._left:
            record["left"] = self._left
            self._left = []
        self._merge_record = record
        delayed = pending.started != self._tick
        if final or self.rank in contributors:
            for p, master, base in zip(self.params, self.master, self.base):
                if delayed and not final:
                    # the newest global model, plus what this rank trained since it sent
                    # its change (its base kept the model it sent it from)
                    p.sub_(base).add_(master)
                else:
                    p.copy_(master)
                base.copy_(master)
            worker = self.workers.get(self.rank)
            if worker is not None:
                worker.base_version = self.version
        for rank in contributors:
            if rank in self.workers:
                self.workers[rank].base_version = self.version
        if final or len(contributors) == len(self.workers) and not delayed:
            # Every rank took the same global model (and the same buffers): identical now.
            self.synced_at = self.local_step + 1

    @torch.no_grad()
    def _start_round(self) -> None:
        """Take the newest global model and start a round from it."""
        for p, master, base in zip(self.params, self.master, self.base):
            p.copy_(master)
            base.copy_(master)
        worker = self.workers.get(self.rank)
        if worker is not None:
            worker.base_version = self.version

    # -- a rank that joins a round under way (hosts) ---------------------------------

    #: The members merge at any step: a rank joined under way trains alone until the
    #: round's last step, takes the global state there from any live member
    #: (:meth:`entry_state`) and is admitted as a worker (:meth:`admit_late`).
    catches_up_at_entry = True

    @property
    def joins_mid_round(self) -> bool:
        """A rank coming back mid-round starts a round of its own from the global model;
        not with ``merge_delay``, whose merges travel across steps: it joins at a round's
        start there."""
        return self.merge_delay == 0

    def entry_state(self) -> dict[str, Any]:
        """The global model, its optimizer's state and the bookkeeping, as every rank of the
        round holds them now; a joiner's own round (its model, base, inner optimizer) is
        not in it."""
        return {"master": [m.detach() for m in self.master],
                "outer_optim": self.outer_optim.state_dict(), "book": self._book()}

    def take_entry_state(self, state: dict[str, Any]) -> None:
        """Take a member's :meth:`entry_state`: the global model steps no further on this
        rank than on the members', and their bookkeeping is this rank's."""
        with torch.no_grad():
            for m, value in zip(self.master, state["master"]):
                m.copy_(value)
        self.outer_optim.load_state_dict(state["outer_optim"])
        self._set_book(state["book"])
        self._pending = None

    def synced_model(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` with each trainable parameter's value in the global model (a tied
        parameter under each of its names): where a joining rank's round starts."""
        global_ = {p.data_ptr(): m for p, m in zip(self.params, self.master)}
        return {name: global_.get(value.data_ptr(), value) if value.is_floating_point()
                else value for name, value in state.items()}

    def keep_round_updates(self, keep: bool) -> None:
        """Keep (or stop keeping and forget) each step's merged change and bookkeeping."""
        self.kept = [] if keep else None

    def round_updates(self, through_step: int) -> list[dict[str, Any]]:
        """The steps kept up to ``through_step``: each its merged change (None: no merge)
        and every worker's round as the step left them."""
        return [u for u in list(self.kept or []) if u["step"] <= through_step]

    @torch.no_grad()
    def apply_round_update(self, update: dict[str, Any]) -> None:
        """A step of the members': the global model stepped with its merge, if it had one,
        and their bookkeeping as it left it."""
        if update["deltas"] is not None:
            self.outer.step([d.to(m.device) for d, m in zip(update["deltas"], self.master)])
        self._set_book(update["book"])

    def start_late(self) -> None:
        """Start a round of its own from the newest global model."""
        self._pending = None
        self._grace_until = None
        self.workers[self.rank] = _Worker(base_version=self.version)
        self._start_round()
        self._window = []
        self._warm = False

    def late_join_note(self, state: dict[str, Any],
                       updates: list[dict[str, Any]]) -> dict[str, Any]:
        """The global version the joiner's round starts from."""
        version = updates[-1]["book"]["version"] if updates else state["version"]
        return {"version": int(version)}

    def admit_late(self, joins: dict[int, dict[str, Any]], step: int) -> None:
        """Every rank takes each joiner in as a worker whose round began at its first step,
        from the version it noted."""
        for rank, join in sorted(joins.items()):
            steps = step - int(join["at"])
            worker = _Worker(steps=steps, base_version=int(join["note"]["version"]))
            worker.ready = steps >= self.round_length(rank)
            self.workers[rank] = worker
            self._lost.discard(rank)

    def _book(self) -> dict[str, Any]:
        """The bookkeeping every rank holds alike, as plain values (a copy)."""
        return {"version": self.version,
                "workers": {r: asdict(w) for r, w in self.workers.items()},
                "speeds": list(self.speeds),
                "throughputs": None if self.throughputs is None else list(self.throughputs),
                "given_speeds": None if self.given_speeds is None else list(self.given_speeds),
                "grace_until": self._grace_until, "lost": sorted(self._lost),
                "merged_contributions": self.merged_contributions,
                "dropped_contributions": self.dropped_contributions,
                "left": [dict(x) for x in self._left], "applied": self.outer.applied}

    def _set_book(self, book: dict[str, Any]) -> None:
        self.version = book["version"]
        self.workers = {int(r): _Worker(**w) for r, w in book["workers"].items()}
        self.speeds = list(book["speeds"])
        self.throughputs = book["throughputs"]
        self.given_speeds = book["given_speeds"]
        self._grace_until = book["grace_until"]
        self._lost = set(book["lost"])
        self.merged_contributions = book["merged_contributions"]
        self.dropped_contributions = book["dropped_contributions"]
        self._left = [dict(x) for x in book["left"]]
        self.outer.applied = book["applied"]

    # -- what it reports ------------------------------------------------------------

    def step_fields(self) -> dict[str, Any]:
        """What this rank's step event carries: the version it trains from, and, from the
        lowest present rank, the merge made at this step."""
        worker = self.workers.get(self.rank)
        fields: dict[str, Any] = {
            "version": worker.base_version if worker is not None else self.version,
            "global_version": self.version}
        if self._merge_record is not None and self.workers and self.rank == min(self.workers):
            fields["merge"] = self._merge_record
        if self.throughputs is not None:
            fields["measured_speed"] = self.speeds[self.rank]
        return fields

    def global_model_tensors(self) -> list[torch.Tensor]:
        """The global model's trainable parameters (the same on every rank)."""
        return self.master

    # -- checkpoints and hand-overs ---------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update({
            "master": [m.detach() for m in self.master],
            "outer_optim": self.outer_optim.state_dict(),
            "base": [b.detach() for b in self.base],
            "version": self.version,
            "workers": {r: asdict(w) for r, w in self.workers.items()},
            "speeds": list(self.speeds),
            "throughputs": self.throughputs,
            "given_speeds": self.given_speeds,
            "grace_until": self._grace_until,
            "pending": self._pending_state(),
            "lost": sorted(self._lost),
            "merged_contributions": self.merged_contributions,
            "dropped_contributions": self.dropped_contributions,
        })
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
            for b, saved in zip(self.base, state["base"]):
                b.copy_(saved)
        self.outer_optim.load_state_dict(state["outer_optim"])
        self.version = state["version"]
        self.workers = {int(r): _Worker(**w) for r, w in state["workers"].items()}
        self.speeds = list(state["speeds"])
        self.throughputs = state["throughputs"]
        self.given_speeds = state.get("given_speeds")
        self._grace_until = state["grace_until"]
        self._lost = set(state.get("lost", ()))
        self._pending = None
        saved = state.get("pending")
        if saved is not None:
            tensors = self._zeroed_scratch()
            with torch.no_grad():
                for t, value in zip(tensors, saved["reduced"]):
                    t.copy_(value)
            self._pending = _Pending(saved["apply_after"], saved["started"],
                                     list(saved["contributors"]), dict(saved["record"]),
                                     tensors)
        self.merged_contributions = state["merged_contributions"]
        self.dropped_contributions = state["dropped_contributions"]
        self._window = []
        self._warm = False

    def _pending_state(self) -> dict[str, Any] | None:
        """The merge in flight, its all-reduce waited for (a checkpoint, a hand-over)."""
        pending = self._pending
        if pending is None:
            return None
        if pending.handle is not None:
            pending.handle.wait()
            pending.handle = None
        assert pending.reduced is not None
        return {"apply_after": pending.apply_after, "started": pending.started,
                "contributors": list(pending.contributors), "record": pending.record,
                "reduced": [t.detach() for t in pending.reduced]}

    def __config__(self) -> dict[str, Any]:
        config = super().__config__()
        config.update({"quorum": self.quorum, "grace_s": self.grace_s,
                       "weighting": self.weighting, "max_staleness": self.max_staleness,
                       "merge_delay": self.merge_delay, "adaptive_H": self.adaptive_H,
                       "keep_training": self.keep_training})
        return config

