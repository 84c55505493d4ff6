"""TrainNode: one rank's training loop.

The same loop runs in a local simulation and on a real host: it takes a batch,
runs forward and backward (accumulating gradients over minibatches), lets the
strategy step (which is where ranks talk), and reports a metric event. It also
evaluates, measures how correlated the ranks' models are, and writes and
resumes checkpoints. Evaluation, averaging and agreement between ranks travel
over the comm module's side channel, never over the training collectives, so
byte counts stay exact.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from exogym import comm
from exogym.base.plural import plural
from exogym.comm import RankDropped
from exogym.comm.averaging import average_across_ranks, averaged_tensors
from exogym.data.loading import (
    MinibatchStream,
    batch_size_of,
    build_dataset,
    eval_loader,
    is_factory,
    to_device,
    validation_subset,
)
from exogym.membership.attendance import Attendance
from exogym.membership.simulated import MembershipStop, RunMembership
from exogym.run.balance import Balancer, Pacer
from exogym.run.checkpoint import (
    CheckpointError,
    checkpoint_path,
    list_steps,
    load_checkpoint,
    save_checkpoint,
)
from exogym.run.model_loss import model_loss
from exogym.run.stack import RankStack
from exogym.run.timing import StepTimer
from exogym.sim.clock import SimClock
from exogym.strategy.context import RankContext

if TYPE_CHECKING:
    from exogym.run.spec import Placement, RunSpec

Emit = Callable[[dict[str, Any]], None]


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (2**32))


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _own_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose tensors hold only their own elements: a stacked
    rank's buffer is a view of its process's stack, which ``deepcopy`` would copy whole."""
    memo: dict[int, Any] = {id(t): t.detach().clone() for t in model.buffers()}
    return copy.deepcopy(model, memo)


class TrainNode:
    """One rank of a run: its model copy, data shard, strategy and loop.

    Args:
        spec: the run (validated; ``minibatch_size`` already an int).
        rank: this rank.
        device: the device it trains on.
        emit: where metric events go (the parent's pipe in simulation, stdout lines on a host).
        placement: where this machine runs its ranks (default: every rank here, no
            broadcast of rank 0's initial weights).
        membership: which ranks train each step, when ranks come and go (default:
            the run's ``rank_failures``, or every rank always).
    """

    def __init__(self, spec: RunSpec, rank: int, device: torch.device, emit: Emit,
                 placement: Placement | None = None, membership: RunMembership | None = None):
        self.spec = spec
        self.rank = rank
        self.num_nodes = spec.num_nodes
        self.device = device
        self.emit = emit
        self.placement = placement or spec.placement_here()
        self.checkpoint_root = Path(spec.save_dir) / (spec.run_name or "run")
        _seed_everything(spec.seed + rank)

        self.model = copy.deepcopy(spec.model).to(device)
        self.model.train()
        # Stacked ranks: this rank's parameters become its views of its process's stack.
        self.stack: RankStack | None = None
        if self.placement.stacked:
            world = comm.backend()
            self.stack = world.held_once(RankStack, lambda: RankStack(world.meet_here,
                                                                       world.here))
            self.stack.join(rank, self.model)
        # Which ranks train each step: fixed by rank_failures (a simulation), or agreed as
        # the run goes (exogym.membership.hosts). A rank that rejoins a running round takes no part
        # in the start's agreements: a peer hands it the state when it is admitted.
        self.membership = membership if membership is not None else spec.membership()

        train_data = build_dataset(spec.train_dataset, rank, self.num_nodes, True)
        self.train_stream = MinibatchStream(
            train_data, spec.minibatch_size, rank, self.num_nodes,
            shard=not is_factory(spec.train_dataset), shuffle=spec.shuffle, seed=spec.seed,
            dataloader_kwargs=spec.dataloader_kwargs, partition=spec.partition,
        )
        self.max_steps = self._max_steps_here()  # agreed with the others in start()

        self.val_loader = self.val_shard_loader = None
        if spec.val_size > 0:
            val_data = build_dataset(spec.val_dataset, rank, self.num_nodes, False)
            subset = validation_subset(val_data, spec.val_size, spec.seed)
            self.val_loader = eval_loader(val_data, subset, spec.minibatch_size,
                                          spec.dataloader_kwargs)
            self.val_shard_loader = eval_loader(val_data, subset[rank::self.num_nodes],
                                                spec.minibatch_size, spec.dataloader_kwargs)
        self._avg_model: torch.nn.Module | None = None

        self.strategy = copy.deepcopy(spec.strategy)

        self.step = 0
        self.samples = 0
        self.departed = False  # away at the end of the run (rank_failures)
        self.clock: SimClock | None = None
        if spec.has_clock:
            speed = spec.rank_speeds[rank] if spec.rank_speeds is not None else 1.0
            schedule = spec.compute_schedule[rank] if spec.compute_schedule is not None else None
            self.clock = SimClock(spec.network, speed, spec.compute_time_s,
                                  tuple(schedule) if schedule is not None else None)
            comm.use_clock(self.clock)
        self._foreign_code = ExitStack()
        self.started = False
        self.timer = StepTimer(self.clock, one_thread=self.placement.threads_per_rank(spec) == 1,
                               speed_mode=spec.speed_mode,
                               alone_on_machine=self.placement.ranks_per_machine == 1,
                               throttle=self.placement.throttle)
        self.attendance = Attendance(self.membership, rank, emit)
        if spec.balance != "none" and self.membership is not None:
            raise ValueError(f"balance={spec.balance!r} cannot run with ranks that come and go: "
                             "every rank takes part in agreeing on the shares; for unequal "
                             "hosts that come and go use AsyncDiLoCoStrategy (it paces each "
                             "rank at its own speed), or leave one of the two out")
        self.balance: Balancer | None = None
        self.pacer: Pacer | None = None
        self._last_loss = float("nan")  # reported by an idle step
        self._comm_wall_seen = comm.collective_time()[0]
        # The store round trips of this thread at the last step event (None: not counted).
        self._trips_seen = comm.store_round_trips() if (
            self.membership is not None and self.membership.decided_in_store) else None
        self._clock_seen = (0.0, 0.0)  # the clock's compute and communication at the last event
        self._step_started = self.timer.wall()
        self._samples_before = 0
        self.autocast = (
            torch.autocast(device_type=device.type, dtype=torch.bfloat16)
            if spec.autocast else nullcontext()
        )

    def start(self) -> None:
        """Meet the other ranks and set the strategy up: the initial weights from rank 0
        (where each machine built its own), the run's length agreed, then the strategy's
        :meth:`~exogym.strategy.strategy.Strategy.setup` with this rank's context, and the
        pacer of the steps. Once, before the first step (:meth:`train` calls it); the
        constructor communicates nothing.

        A rank that rejoins a running round takes no part in the start's agreements: a
        peer hands it the state when it is admitted.
        """
        if self.started:
            return
        self.started = True
        spec = self.spec
        joining = self.membership is not None and self.membership.joining
        if self.placement.broadcast_init and self.num_nodes > 1 and not joining:
            self._broadcast_initial_state()
        if not joining:
            self.max_steps = self._agree_on_max_steps(self.max_steps)
        # A strategy not built into exogym may ask torch.distributed its rank (one written
        # for exo gym): torch then answers for this rank while the run lasts.
        if not type(self.strategy).__module__.startswith("exogym."):
            self._foreign_code.enter_context(comm.torch_identity())
        self.strategy.setup(RankContext(
            model=self.model, rank=self.rank, num_nodes=self.num_nodes,
            max_steps=self.max_steps, seed=spec.seed, samples_per_step=spec.batch_size,
            clock=self.clock))
        if self.strategy.joins_mid_round and self.strategy.round_steps > 1:
            self.attendance.allow_mid_round(self.strategy.catches_up_at_entry)
        self.balance = Balancer.for_run(spec, self.rank, self.max_steps)  # fit(balance=...)
        # Who trains each step, on how many samples: the balancer of fit(balance=...), or
        # a strategy that paces its ranks itself (AsyncDiLoCo); None: every rank, always.
        self.pacer = self.balance if self.balance is not None else (
            self.strategy if self.strategy.paces_steps else None)
        if self.pacer is not None:
            self.train_stream.set_step_samples(self.pacer.step_samples())
        self._comm_wall_seen = comm.collective_time()[0]

    # -- agreement between ranks (side channel, uncounted) ----------------------------

    def _side_reduce(self, values: list[float], op) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        comm.side_all_reduce(t, op=op)
        return t.tolist()

    def _broadcast_initial_state(self) -> None:
        for t in [p.data for p in self.model.parameters()] + list(self.model.buffers()):
            comm.side_broadcast(t, src=0)

    def _max_steps_here(self) -> int:
        """The run's steps as this rank counts them (a rejoining rank: until the hand-over
        brings the run's number)."""
        if self.spec.max_steps is not None:
            return self.spec.max_steps
        per_epoch = self.train_stream.batches_per_epoch()
        if per_epoch is None:
            raise ValueError("max_steps is required when the training dataset is iterable "
                             "(it has no length to count epochs by)")
        return max(1, self.spec.num_epochs * per_epoch // self.spec.accumulation_steps)

    def _agree_on_max_steps(self, steps: int) -> int:
        if self.spec.max_steps is not None:
            return steps
        # Ranks with different factory-built datasets must still stop together.
        return int(self._side_reduce([steps], comm.ReduceOp.MIN)[0])

    # -- one step -------------------------------------------------------------------

    def _loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        with self.autocast, comm.torch_identity():  # a model may ask torch its rank
            return model_loss(model, batch, f" at rank {self.rank}")

    def train_step(self) -> dict[str, Any]:
        """Run one optimizer step (with accumulation) and return its metric event.

        The one step path: under a pacer (:class:`exogym.run.balance.Pacer`: the balancer
        of ``fit(balance=...)``, or a strategy that paces its ranks) the rank may idle
        through the step, and trains the pacer's samples; otherwise it trains
        ``batch_size`` samples in ``minibatch_size`` minibatches.
        """
        self._step_started = self.timer.wall()
        self._samples_before = self.samples
        pacer = self.pacer
        # Joined a round under way: until its last step the rank meets no member.
        self.strategy.train_alone(not self.attendance.in_group(self.step + 1))
        if pacer is not None:
            trains = pacer.begin_step(self.step + 1, self._present())
            if pacer is self.balance:
                self.strategy.set_average_weight(self.balance.weight)
            if not trains:
                return self._idle_step(pacer.step_fields)
        timer = self.timer
        timed = pacer is not None or self.clock is not None
        mark = timer.mark() if timed else None
        clock_before = timer.clock_reading() if pacer is not None else None
        self.strategy.zero_grad()
        if pacer is None:
            loss, work = self._accumulated_backward(), 1.0
        else:
            samples = pacer.step_samples()
            self.train_stream.set_step_samples(samples)
            loss = self._mean_loss_backward(samples)
            work = samples / self.spec.batch_size
        self._last_loss = loss
        lr = self.strategy.current_lr
        if mark is not None:
            timer.forward_backward(mark, work, self.step + 1)
            strategy_mark = timer.mark()
        self.strategy.step()
        self.strategy.zero_grad()  # nothing reads them any more: ranks in turn hold one set
        if mark is not None:
            timer.strategy_work(strategy_mark)
        if pacer is not None:
            assert mark is not None
            # A host paces by its measured speed; ranks sharing this machine's cores run at
            # the speeds the simulation gives them (their measured times differ by the noise).
            speeds = self.spec.rank_speeds
            given = None if timer.alone_on_machine else (
                speeds[self.rank] if speeds is not None else 1.0)
            pacer.record_step(samples, timer.balanced_seconds(mark, clock_before), given)
        self.step += 1
        event = self._step_event(loss, lr)
        if pacer is not None:
            event.update(pacer.step_fields())
        return event

    def _accumulated_backward(self) -> float:
        """Forward and backward over ``batch_size`` samples in the stream's minibatches,
        the gradient that of their mean loss; returns that mean loss."""
        accumulation = self.spec.accumulation_steps
        losses = []
        for _ in range(accumulation):
            batch = to_device(next(self.train_stream), self.device)
            if self.stack is not None:
                loss = self._stacked_backward(batch, 1.0 / accumulation)
            else:
                loss = self._loss(self.model, batch)
                (loss / accumulation if accumulation > 1 else loss).backward()
            losses.append(loss.detach())
            self.samples += batch_size_of(batch)
        total = losses[0] if accumulation == 1 else torch.stack(losses).float().sum()
        return float(total) / accumulation

    def _stacked_backward(self, batch: Any, scale: float) -> torch.Tensor:
        """The loss on ``batch``, its gradient times ``scale`` added, computed with the
        process's other present ranks at once; the rank is charged its share of the time."""
        assert self.stack is not None
        wall, cpu = time.perf_counter(), time.thread_time()
        loss, share_wall, share_cpu = self.stack.backward(self.rank, batch, scale, self.autocast)
        self.timer.credit(share_wall - (time.perf_counter() - wall),
                          share_cpu - (time.thread_time() - cpu))
        return loss

    def _present(self) -> range | frozenset[int]:
        """The ranks that train the next step."""
        if self.membership is None:
            return range(self.num_nodes)
        return self.membership.present(self.step + 1)

    def _idle_step(self, fields: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """A step this rank does not train: it meets the strategy's collectives only."""
        lr = self.strategy.current_lr
        self.strategy.idle_step()
        self.step += 1
        event = self._step_event(self._last_loss, lr)
        event["idle"] = True
        event.update(fields())
        return event

    def _step_event(self, train_loss: float, lr: float) -> dict[str, Any]:
        comm_wall = comm.collective_time()[0]
        event = {
            "event": "step",
            "rank": self.rank,
            "step": self.step,
            "train_loss": train_loss,
            "lr": lr,
            "comm_bytes": comm.comm_bytes(),
            "samples": self.samples,
            "step_samples": self.samples - self._samples_before,  # this step's own
            # seconds this step spent inside counted collectives (waiting for peers included)
            "comm_s": comm_wall - self._comm_wall_seen,
        }
        self._comm_wall_seen = comm_wall
        clock = self.clock
        if clock is None:
            # measured: the step's wall time less its time in collectives
            event["compute_s"] = max(0.0, self.timer.wall() - self._step_started
                                     - event["comm_s"])
        else:
            # what the clock charged this step: its compute, and its collectives' time
            event["compute_s"] = clock.compute_s - self._clock_seen[0]
            event["sim_comm_s"] = clock.comm_s - self._clock_seen[1]
            self._clock_seen = (clock.compute_s, clock.comm_s)
            event["sim_time_s"] = clock.now
        return event

    def _mean_loss_backward(self, samples: int) -> float:
        """Forward and backward over the stream's next ``samples`` samples, in minibatches;
        the gradient is that of the mean loss over them. Returns that mean loss."""
        total = 0.0
        taken = 0
        while taken < samples:
            batch = to_device(next(self.train_stream), self.device)
            size = self.train_stream.last_size
            loss = self._loss(self.model, batch)
            (loss * (size / samples) if size != samples else loss).backward()
            total += float(loss.detach()) * size
            taken += size
        self.samples += samples
        return total / samples

    # -- evaluation -----------------------------------------------------------------

    @torch.no_grad()
    def _eval_loss(self, model: torch.nn.Module, loader,
                   sums: dict[str, list[float]] | None = None) -> tuple[float, int]:
        """Summed loss and sample count over ``loader``.

        A model with a ``metric_sums(batch) -> {name: (numerator, denominator)}``
        method (e.g. word errors and reference words for a word error rate) gets
        those summed into ``sums`` too.
        """
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        extra = getattr(model, "metric_sums", None) if sums is not None else None
        try:
            for batch in loader:
                batch = to_device(batch, self.device)
                n = batch_size_of(batch)
                total += float(self._loss(model, batch)) * n
                count += n
                if extra is not None:
                    for name, (num, den) in extra(batch).items():
                        acc = sums.setdefault(name, [0.0, 0.0])
                        acc[0] += float(num)
                        acc[1] += float(den)
        finally:
            model.train(was_training)
        return total, count

    def _evaluation_model(self) -> torch.nn.Module:
        """The model the global model is scored in: one per process, which the ranks packed
        there share. A rank fills it and scores it holding its process's baton, with no
        collective between, and every rank of a process fills an average with the same
        bytes, so a thousand ranks hold one copy, not a thousand."""
        if self._avg_model is None:
            self._avg_model = comm.held_once(("evaluation-model",),
                                             lambda: _own_copy(self.model))
        return self._avg_model

    def _average_model(self) -> torch.nn.Module:
        model = self._evaluation_model()
        average_across_ranks(averaged_tensors(self.model), into=averaged_tensors(model))
        return model

    @torch.no_grad()
    def _global_model(self) -> torch.nn.Module:
        shared = self.strategy.global_model_tensors()
        if shared is None:
            return self._average_model()
        model = self._evaluation_model()
        model.load_state_dict(self.model.state_dict())
        trainable = [p for p in model.parameters() if p.requires_grad]
        for target, value in zip(trainable, shared):
            target.copy_(value)
        return model

    def evaluate(self) -> dict[str, float]:
        """Validation loss of this rank's model and of the average of all ranks' models."""
        sums: dict[str, list[float]] = {}
        total, count = self._eval_loss(self.model, self.val_loader, sums)
        local = total / max(count, 1)
        extra = {f"val_{name}": num / den for name, (num, den) in sums.items() if den}
        if self.num_nodes == 1 or self.strategy.ranks_identical:
            return {"val_loss": local, "val_global_loss": local, **extra}
        # Every rank scores the global model (the average of the ranks' models, unless the
        # strategy holds one all ranks share) on its slice of the validation set.
        total, count = self._eval_loss(self._global_model(), self.val_shard_loader)
        total, count = self._side_reduce([total, count], comm.ReduceOp.SUM)
        return {"val_loss": local, "val_global_loss": total / max(count, 1), **extra}

    def correlation(self) -> float:
        """Mean pairwise Pearson correlation of the ranks' trainable parameters."""
        if self.num_nodes == 1:
            return 1.0
        ranks = comm.side_group_size()  # those present, when ranks come and go
        if ranks == 1:
            return 1.0
        flat = torch.cat([p.detach().reshape(-1).float().cpu()
                          for p in self.model.parameters() if p.requires_grad])
        gathered = [torch.empty_like(flat) for _ in range(ranks)]
        comm.side_all_gather(gathered, flat)
        corr = torch.corrcoef(torch.stack(gathered))
        mask = ~torch.eye(ranks, dtype=torch.bool)
        return float(corr[mask].mean())

    # -- checkpoints ----------------------------------------------------------------

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The model's state, each tensor its own: a stacked rank's are views of its
        process's stack, which ``torch.save`` would write whole."""
        state = self.model.state_dict()
        if self.stack is None:
            return state
        return {name: value.clone() for name, value in state.items()}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this rank exactly where it is."""
        return {
            "step": self.step,
            "samples": self.samples,
            "comm_bytes": comm.comm_bytes(),
            "comm_calls": comm.comm_calls(),
            "model": self._model_state(),
            "strategy": self.strategy.state_dict(),
            "data": self.train_stream.state(),
            "rng": _rng_state(self.device),
            "num_nodes": self.num_nodes,
            "sim_time_s": self.timer.now,
            "balance": None if self.balance is None else self.balance.state_dict(),
            "run": self.spec.run_identity,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s result."""
        if state.get("num_nodes", self.num_nodes) != self.num_nodes:
            raise ValueError(f"checkpoint was written by a run of "
                             f"{plural(state['num_nodes'], 'rank')}; "
                             f"this run has {self.num_nodes}")
        theirs = (state.get("run") or {}).get("fingerprint")
        ours = (self.spec.run_identity or {}).get("fingerprint")
        if theirs is not None and ours is not None and theirs != ours:
            raise ValueError(f"rank {self.rank}: the checkpoint at step {state['step']} in "
                             f"{self.checkpoint_root} was written by another run (settings "
                             f"fingerprint {theirs[:12]}, this run's is {ours[:12]}): it is "
                             "not resumed; resume the run it belongs to with its own settings")
        self.model.load_state_dict(state["model"])
        self.strategy.load_state_dict(state["strategy"])
        self.train_stream.restore(state["data"])
        if self.balance is not None and state.get("balance") is not None:
            self.balance.load_state_dict(state["balance"])
        _set_rng_state(state["rng"], self.device)
        self.step = state["step"]
        self.samples = state["samples"]
        self.timer.restore(state.get("sim_time_s"))
        comm.restore_counters(state["comm_bytes"], state.get("comm_calls", 0))

    def _newest_valid(self, root: Path, below: int) -> tuple[int, dict | None]:
        for step in reversed(list_steps(root, self.rank)):
            if step > below:
                continue
            try:
                return step, load_checkpoint(checkpoint_path(root, self.rank, step))
            except CheckpointError as exc:
                print(f"rank {self.rank}: skipping checkpoint: {exc}", flush=True)
        return 0, None

    def resume(self, source: str) -> int:
        """Load the newest checkpoint every rank has whole; return its step (0: none)."""
        root = self.checkpoint_root if source == "auto" else Path(source)
        if source != "auto" and not root.is_dir():
            raise FileNotFoundError(f"resume_from={source!r} is not a checkpoint folder")
        bound = 1 << 60
        while True:
            step, state = self._newest_valid(root, bound)
            low, high = self._side_reduce([step, -step], comm.ReduceOp.MIN)
            agreed, highest = int(low), int(-high)
            if agreed == highest:
                break
            bound = agreed
        if agreed == 0 or state is None:
            return 0
        self.load_state_dict(state)
        return agreed

    # -- ranks that leave and rejoin: what a hand-over gives and takes (Attendance) ------

    def handed_state(self) -> dict[str, Any]:
        """What a rank that rejoins takes from a member that stayed."""
        return {"model": self._model_state(), "strategy": self.strategy.state_dict(),
                "step": self.step, "max_steps": self.max_steps,
                "data": self.train_stream.state(), "sim_time_s": self.timer.now}

    def join_state(self, copy: bool = True) -> dict[str, Any]:
        """What a rank that joins a round under way takes: the model as every rank held it
        when the round began (:meth:`~exogym.strategy.strategy.Strategy.synced_model`), the
        strategy's state, step and data position as now; all copied, so that it can stream
        while this rank trains on (``copy=False``: the live tensors, to copy a part of)."""
        state = {"model": self.strategy.synced_model(self._model_state()),
                 "strategy": self.strategy.state_dict(), "step": self.step,
                 "max_steps": self.max_steps, "data": self.train_stream.state(),
                 "sim_time_s": self.timer.now}
        return _copied(state) if copy else state

    def adopt_state(self, state: dict[str, Any], reshard: bool,
                    at_step: int | None = None) -> None:
        """Continue from the state a member handed over (``reshard``: at its data position;
        ``at_step``: the next step this rank trains, later than the state's, the schedule
        moved on over the steps between)."""
        self.model.load_state_dict(state["model"])
        self.strategy.load_state_dict(state["strategy"])
        self.step = state["step"]
        self.max_steps = state["max_steps"]
        self.strategy.set_max_steps(self.max_steps)
        if reshard:  # the epoch goes on where the run is
            self.train_stream.restore(state["data"])
        self.timer.restore(state["sim_time_s"], not_before=True)
        if at_step is not None and at_step - 1 > self.step:
            self.strategy.skip_steps(at_step - 1 - self.step)
            self.step = at_step - 1

    def steps_done(self) -> int:
        """Steps this rank has trained (its step counter)."""
        return self.step

    def keep_round_updates(self, keep: bool) -> None:
        """Keep (or stop keeping) each round's shared update, for a rank joining mid-round."""
        self.strategy.keep_round_updates(keep)

    def round_updates(self, through_step: int) -> list[dict[str, Any]]:
        """The rounds' shared updates kept, of rounds that ended by ``through_step``."""
        return self.strategy.round_updates(through_step)

    def catch_up(self, updates: list[dict[str, Any]], start: bool = True) -> None:
        """Apply the updates of rounds that ended after this rank's state was copied
        (``start``: then start training from it, joined under way)."""
        for update in updates:
            self.strategy.apply_round_update(update)
        if start:
            self.strategy.start_late()

    def entry_state(self) -> dict[str, Any]:
        """What every rank holds alike, for a rank meeting the members after training alone."""
        return self.strategy.entry_state()

    def take_entry_state(self, state: dict[str, Any]) -> None:
        """Take a member's :meth:`entry_state`, meeting the members after training alone."""
        self.strategy.take_entry_state(state)

    def late_join_note(self, state: dict[str, Any],
                       updates: list[dict[str, Any]]) -> dict[str, Any]:
        """What the members learn of this rank, joining under way from ``state`` and
        ``updates``, when it meets them."""
        return self.strategy.late_join_note(state["strategy"], updates)

    def admit_late(self, joins: dict[int, dict[str, Any]], step: int) -> None:
        """At the last step of a round that ``joins`` joined under way: take them in."""
        self.strategy.admit_late(joins, step)

    def reshard(self, index: int, count: int) -> None:
        """Read shard ``index`` of ``count`` from now on (the run's present ranks changed)."""
        self.train_stream.reshard(index, count)

    def _take_part(self) -> bool:
        """Before each step: join the step's members, after an absence if need be.

        Returns False when this rank is away for the rest of the run.
        """
        if self.attendance.take_part(self.step + 1, self.max_steps, self) is None:
            self.departed = True
            return False
        return True

    # -- the loop -------------------------------------------------------------------

    def _one_step(self, start: float) -> None:
        """Train one step and emit its event (with evaluation and checkpoint when due)."""
        spec = self.spec
        mark = self.timer.mark() if self.clock is not None else None
        throttle_mark = self.timer.mark() if self.timer.throttle is not None else None
        event = self.train_step()
        if throttle_mark is not None:
            self.timer.throttle_step(throttle_mark, event)
        if self.balance is not None:  # new shares from the next step, in the checkpoint too
            self.balance.end_step(self.step)
        # A rank that joined a round under way meets the members only at its end.
        in_group = self.attendance.in_group(self.step)
        if self.val_loader is not None and in_group and (
            self.step % spec.val_interval == 0 or self.step == self.max_steps
        ):
            with comm.timed("evaluation"):
                event.update(self.evaluate())
        if spec.correlation_interval and in_group and \
                self.step % spec.correlation_interval == 0:
            event["correlation"] = self.correlation()
        if self._trips_seen is not None:
            # what the control plane cost this step: its attendance before it, the step,
            # its evaluation
            trips = comm.store_round_trips()
            event["store_trips"] = trips - self._trips_seen
            self._trips_seen = trips
        if spec.checkpoint_interval and self.step % spec.checkpoint_interval == 0:

            def announce() -> None:
                event["checkpoint"] = True  # sent at once: see _EventBatches
                event["wall_s"] = time.perf_counter() - start
                self.emit(event)

            # The event goes with the checkpoint's rename, in one block that an
            # interruption does not cut: a resumed run starts after the steps a checkpoint
            # holds, so the trace must have them (a SIGTERM between the two lost the step).
            save_checkpoint(self.state_dict(), self.checkpoint_root, self.rank, self.step,
                            keep=spec.keep_checkpoints, announce=announce)
        else:
            event["wall_s"] = time.perf_counter() - start
            self.emit(event)
        self.timer.lag(mark)

    def close(self) -> None:
        """Give back what the node holds in the process (torch's answers for a strategy
        not built into exogym, the threads of hand-overs still under way); the strategy is
        not called after."""
        self._foreign_code.close()
        self.attendance.close()

    def train(self) -> dict[str, torch.Tensor]:
        """Train to ``max_steps`` and return this rank's final model state (on the CPU)."""
        try:
            return self._train()
        finally:
            self.close()

    def _train(self) -> dict[str, torch.Tensor]:
        with comm.timed("start-up"):
            self.start()
        spec = self.spec
        if spec.resume_from and not (self.membership is not None and self.membership.joining):
            resumed = self.resume(spec.resume_from)
            if resumed:
                print(f"rank {self.rank}: resumed from step {resumed}", flush=True)
        opening = {"event": "start", "rank": self.rank, "max_steps": self.max_steps,
                   "step": self.step, "round_steps": self.strategy.round_steps}
        if self.membership is not None and self.membership.joining:
            opening["joining"] = True  # its step comes with the state a member hands it
        if self.train_stream.labels_held is not None:
            opening["labels"] = self.train_stream.labels_held
            if self.rank == 0:  # every rank's, for a host that sees only its own events
                opening["labels_by_rank"] = self.train_stream.labels_by_rank
        self.emit(opening)
        start = time.perf_counter()
        while self.step < self.max_steps:
            try:
                if not self._take_part():
                    break
                self._one_step(start)
            except RankDropped:
                # Declared lost while it ran (frozen, or cut off): what it did since is
                # dropped; a round admits it again with the run's state. The loss is told
                # once, by the membership change the ranks decide (not here as well).
                continue
            except MembershipStop:
                if self.step:  # a round boundary: every survivor holds the same state
                    save_checkpoint(self.state_dict(), self.checkpoint_root, self.rank,
                                    self.step, keep=spec.keep_checkpoints)
                raise
        if self.membership is not None and not self.departed:
            # What follows the loop (the final average) meets among the ranks still here.
            comm.enter_step(self.max_steps + 1, self.membership.present(self.max_steps),
                            self.membership.epoch(self.max_steps))
        # On the CPU the model's own tensors: nothing trains them any more.
        return {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it cloned (dicts, lists and tuples walked)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value
