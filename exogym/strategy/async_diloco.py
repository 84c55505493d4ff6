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
are measured as ``fit(balance=...)`` measures them (:mod:`exogym.run.balance`:
each rank's samples per second of compute, collectives aside) and agreed over
the side channel after :data:`PROBE_STEPS` steps and at every merge; a speed
within :data:`SPEED_TOLERANCE` of the fastest counts as full speed. Every rank
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
counts for less even when it is merged alone. The outer optimizer (SGD, lr 0.7, Nesterov momentum 0.9 by
default) steps the global model with it on every rank alike, and the version
goes up by one. The contributors take the new global model and start a new
round; the others train on and take the newest model when their own round
ends. A worker whose round is done waits for a merge (it idles) only until the
quorum and grace rule calls one.

**The end.** At the last step every present worker offers what it has (a round
cut short counts with its samples), so no trained step is left out, and all
ranks end with the same global model, which ``fit`` returns.

**Ranks that come and go** (``rank_failures``; ``min_nodes`` across hosts): a
worker that leaves mid-round loses that round (counted as dropped, with its
samples); one that comes back takes the state from a worker present and starts
a round from the newest global model. Across hosts the members are decided once
a round, so a worker lost mid-round is found at the next merge, which it does
not complete: the merge's mean is over the contributions that arrived, and the
lost worker is left out until the next round's members are decided.

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

from .facts import ASYNC_GRACE_S, ASYNC_MAX_STALENESS, ASYNC_QUORUM, COMM_DTYPE, DILOCO_H
from .optim import OptimSpec
from .outer import OuterOptimizer, OuterState
from .strategy import Strategy

__all__ = ["AsyncDiLoCoStrategy", "PROBE_STEPS", "SPEED_TOLERANCE", "WEIGHTINGS"]

#: Steps every rank trains before the ranks first agree on their speeds.
PROBE_STEPS = 3
#: A rank measured within this fraction of the fastest rank's speed trains at every step.
SPEED_TOLERANCE = 0.1
#: Weight of a new measurement in a rank's throughput estimate.
SMOOTHING = 0.5
#: How contributions are weighted in a merge.
WEIGHTINGS = ("tokens", "equal")


@dataclass
class _Worker:
    """What every rank knows of one worker's round."""

    steps: int = 0          # steps trained in its current round
    base_version: int = 0   # the global version the round started from
    credit: float = 0.0     # its pace: a step is trained when this reaches 1
    ready: bool = False     # its round is done; its contribution waits for a merge
    trains: bool = False    # it trains at the current step


class AsyncDiLoCoStrategy(Strategy):
    """Asynchronous DiLoCo with a quorum: fast workers never wait for slow ones.

    Args:
        optim_spec: the inner optimizer (default AdamW); ``inner_optim=`` is the same.
        H: inner steps of a worker's round (default 100).
        quorum: contributions that trigger a merge: a count (``1 <= quorum <= workers``)
            or a fraction of the workers present, ``0 < quorum <= 1`` (rounded up;
            default 0.5).
        grace_s: once the quorum is in, how many more seconds the merge waits for a
            worker whose round would end within them (default 0).
        weighting: ``'tokens'`` (each contribution weighted by the samples it trained)
            or ``'equal'``.
        max_staleness: versions a contribution may be behind and still be merged
            (with weight divided by ``1 + staleness``); older ones are dropped and
            counted (default 4).
        outer_optim_spec: the outer optimizer as an ``OptimSpec`` or name; default
            SGD with ``outer_lr``, ``outer_momentum`` and ``nesterov``.
        outer_optim: alias of ``outer_optim_spec``.
        outer_lr: outer learning rate (0.7).
        outer_momentum: outer momentum (0.9).
        nesterov: Nesterov momentum for the outer SGD (True).
        comm_dtype: type the changes travel in (``'float32'``, ``'bfloat16'``,
            ``'float16'``, or quantized ``'int8'``, ``'float8_e4m3fn'``, ``'int4'``,
            ``'int2'``).
        **kwargs: inner optimizer, schedule and clipping arguments of ``Strategy``.

    The rules are in this module's docstring. It paces its ranks itself, so
    ``fit(balance=...)`` stays ``'none'``.
    """

    #: The trainer asks this strategy which ranks train each step (see :meth:`begin_step`).
    paces_steps = True

    def __init__(
        self,
        optim_spec: OptimSpec | str | None = None,
        H: int = DILOCO_H,
        quorum: int | float = ASYNC_QUORUM,
        grace_s: float = ASYNC_GRACE_S,
        weighting: str = "tokens",
        max_staleness: int = ASYNC_MAX_STALENESS,
        outer_optim_spec: OptimSpec | str | None = None,
        outer_optim: OptimSpec | str | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        comm_dtype: str = COMM_DTYPE,
        **kwargs: Any,
    ):
        if not isinstance(H, int) or isinstance(H, bool) or H < 1:
            raise ValueError(f"H must be an integer >= 1, got {H!r}")
        _check_quorum(quorum)
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) \
                or not grace_s >= 0 or math.isinf(grace_s):
            raise ValueError(f"grace_s must be a number of seconds >= 0, got {grace_s!r}")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(map(repr, WEIGHTINGS))}, "
                             f"got {weighting!r}")
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) \
                or max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0 (versions), "
                             f"got {max_staleness!r}")
        comm.resolve_dtype(comm_dtype)
        self.H = H
        self.quorum = quorum
        self.grace_s = float(grace_s)
        self.weighting = weighting
        self.max_staleness = max_staleness
        self.comm_dtype = comm_dtype
        self.outer_optim_spec = OuterOptimizer.from_args(
            "AsyncDiLoCoStrategy", outer_optim_spec, outer_optim, outer_lr, outer_momentum,
            nesterov,
        ).optim_spec()
        self.samples_per_step = 1  # set by the trainer: samples a rank trains per step
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

    def quorum_count(self, present: int) -> int:
        """Contributions that call a merge when ``present`` workers are here."""
        if isinstance(self.quorum, int):
            return max(1, min(self.quorum, present))
        return max(1, min(present, math.ceil(self.quorum * present - 1e-9)))

    # -- set-up ---------------------------------------------------------------------

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        super()._init_node(model, rank, num_nodes)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        # The global model and its optimizer are the same on every rank: ranks that share
        # a process share them, and the first to finish a merge's all-reduce steps them.
        self.outer = comm.held_once(("async-diloco-outer",),
                                    lambda: OuterState(self.params, self.outer_optim_spec))
        self.master = self.outer.master
        self.outer_optim = self.outer.optim
        self.base = [p.detach().clone() for p in self.params]  # the model my round started from
        self._scratch: list[torch.Tensor] | None = None  # zeros sent when not contributing
        self.version = 0
        self.workers: dict[int, _Worker] = {}
        self.speeds = [1.0] * num_nodes
        self.throughputs: list[float] | None = None
        self._window: list[tuple[int, float]] = []
        self._warm = False
        self._tick = 0
        self._grace_until: int | None = None
        self._merge_record: dict[str, Any] | None = None
        self._left: list[dict[str, Any]] = []
        # Workers found lost in a merge, left out until the membership's next round
        # (hosts that come and go decide their members once a round).
        self._lost: set[int] = set()
        self.merged_contributions = 0
        self.dropped_contributions = 0

    # -- the pace -------------------------------------------------------------------

    def begin_step(self, step: int, present: Any) -> bool:
        """Before step ``step`` (1-based), with the ranks ``present`` at it: update every
        worker's round and return whether this rank trains (False: it idles)."""
        self._tick = step
        self._merge_record = None
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
            if worker.ready:
                continue
            worker.credit += self.speeds[rank]
            if worker.credit >= 1.0 - 1e-9:
                worker.credit = max(0.0, worker.credit - 1.0)
                worker.trains = True
                worker.steps += 1
                worker.ready = worker.steps >= self.H
        return self.workers[self.rank].trains

    def record_step(self, samples: int, seconds: float) -> None:
        """One trained step of this rank: ``samples`` in ``seconds`` of compute."""
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
        vector = torch.zeros(self.num_nodes, dtype=torch.float64)
        vector[self.rank] = mine
        comm.side_all_reduce(vector)
        measured = vector.tolist()
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
        if not known:
            return
        self.throughputs = throughputs
        fastest = max(known)
        speeds = []
        for t in throughputs:
            s = t / fastest if t > 0 else 1.0
            speeds.append(1.0 if s >= 1.0 - SPEED_TOLERANCE else s)
        self.speeds = speeds

    def _step_seconds(self) -> float | None:
        """Seconds of a step at the fastest rank's speed (None before any measurement)."""
        known = [t for t in self.throughputs or [] if t > 0]
        return self.samples_per_step / max(known) if known else None

    def _steps_to_finish(self, worker: _Worker, rank: int) -> int:
        """Steps of the run until ``worker`` finishes its round at its pace."""
        left = self.H - worker.steps
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
        step = self._tick
        if step == PROBE_STEPS and step < self.max_steps and self.throughputs is None:
            self._agree_speeds()
        present = sorted(self.workers)
        ready = [r for r in present if self.workers[r].ready]
        if step >= self.max_steps:
            contributors = [r for r in present if self.workers[r].steps]
            self._merge(contributors, final=True)
            return
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
        weights = {r: self._weight(self.workers[r]) for r in contributors}
        # Divided by the contributions' undiscounted sizes: a stale contribution counts
        # for less even when it is merged alone.
        total = sum(self._size(self.workers[r]) for r in contributors if weights[r][0] > 0)
        merged = [r for r in contributors if weights[r][0] > 0]
        dropped = [r for r in contributors if weights[r][0] == 0]
        mine = self.rank in merged
        if total > 0:
            share = weights[self.rank][0] / total if mine else 0.0
            if mine:
                # My change, weighted, in the parameters' own memory: they take the global
                # model's values at the end of the merge anyway.
                sent = [p.detach() for p in self.params]
                for delta, base in zip(sent, self.base):
                    delta.neg_().add_(base)
                tensors = sent + self.buffers
                torch._foreach_mul_(tensors, share)
            else:
                if self._scratch is None:
                    self._scratch = [torch.zeros_like(t) for t in self.params + self.buffers]
                else:
                    for t in self._scratch:
                        t.zero_()
                sent = self._scratch[:len(self.params)]
                tensors = self._scratch
            comm.all_reduce_tensors(tensors, dtype=self.comm_dtype)
            # Hosts that come and go: a worker lost since the membership's round began
            # completed no all-reduce, so its part is not in the sum: the sum is divided by
            # the sizes of the contributions that arrived, and the lost round is dropped.
            arrived = set(comm.present_ranks())
            lost = [r for r in sorted(self.workers) if r not in arrived]
            kept = sum(self._size(self.workers[r]) for r in merged if r not in lost)
            if lost and kept > 0:
                torch._foreach_mul_(tensors, total / kept)
            if kept > 0:
                if self.outer.applied != self._tick:  # every rank holds the same change
                    for master, delta in zip(self.master, sent):
                        master.grad = delta
                    self.outer_optim.step()
                    for master in self.master:
                        master.grad = None
                    self.outer.applied = self._tick
                self.version += 1
                if not mine and (final or self.rank in contributors):
                    # My buffers take the merged ones (the weighted mean of the
                    # contributors'), as my parameters take the global model; a
                    # contributor's hold them already.
                    for buf, mean in zip(self.buffers, self._scratch[len(self.params):]):
                        buf.copy_(mean)
        else:
            lost = []
        for rank in lost:
            gone = self.workers.pop(rank)
            self._lost.add(rank)
            if gone.steps:
                self.dropped_contributions += 1
                self._left.append({"rank": rank, "step": self._tick, "steps": gone.steps,
                                   "tokens": gone.steps * self.samples_per_step})
        merged = [r for r in merged if r not in lost]
        dropped = [r for r in dropped if r not in lost]
        contributors = [r for r in contributors if r not in lost]
        steps = sum(self.workers[r].steps for r in merged)
        dropped_steps = sum(self.workers[r].steps for r in dropped)
        self.merged_contributions += len(merged)
        self.dropped_contributions += len(dropped)
        record = {"version": self.version, "step": self._tick, "contributors": merged,
                  "steps": steps, "tokens": steps * self.samples_per_step,
                  "staleness": [weights[r][1] for r in merged], "dropped": dropped,
                  "dropped_steps": dropped_steps,
                  "dropped_tokens": dropped_steps * self.samples_per_step}
        if final:
            record["final"] = True
        if self._left:
            record["left"] = self._left
            self._left = []
        self._merge_record = record
        for rank in contributors:
            credit = self.workers[rank].credit
            self.workers[rank] = _Worker(base_version=self.version, credit=credit)
        if final or self.rank in contributors:
            self._start_round()
        self._grace_until = None
        if final or len(contributors) == len(self.workers):
            # Every rank took the same global model (and the same buffers): identical now.
            self.synced_at = self.local_step + 1
        if not final:
            self._agree_speeds()

    @torch.no_grad()
    def _start_round(self) -> None:
        """Take the newest global model and start a round from it."""
        for p, master, base in zip(self.params, self.master, self.base):
            p.copy_(master)
            base.copy_(master)
        worker = self.workers.get(self.rank)
        if worker is not None:
            worker.base_version = self.version

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
            "grace_until": self._grace_until,
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
        self._grace_until = state["grace_until"]
        self._lost = set(state.get("lost", ()))
        self.merged_contributions = state["merged_contributions"]
        self.dropped_contributions = state["dropped_contributions"]
        self._window = []
        self._warm = False

    def __config__(self) -> dict[str, Any]:
        config = super().__config__()
        config.update({"quorum": self.quorum, "grace_s": self.grace_s,
                       "weighting": self.weighting, "max_staleness": self.max_staleness})
        return config


def _check_quorum(quorum: Any) -> None:
    if isinstance(quorum, bool) or not isinstance(quorum, (int, float)):
        raise ValueError(f"quorum must be a count of workers (an integer >= 1) or a fraction "
                         f"of them in (0, 1], got {quorum!r}")
    if isinstance(quorum, int):
        if quorum < 1:
            raise ValueError(f"quorum must be a count of workers >= 1 or a fraction in (0, 1], "
                             f"got {quorum!r}")
    elif not 0 < quorum <= 1:
        raise ValueError(f"quorum={quorum!r}: a fraction of the workers must be in (0, 1]; "
                         "give a count of workers as an integer")
