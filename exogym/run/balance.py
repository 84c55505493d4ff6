"""Load balancing across ranks of unequal speed: ``fit(balance='none' | 'batch' | 'steps')``.

A rank that computes half as fast makes every other rank wait for it at each
collective. With ``balance`` each rank's share of the work follows its
measured speed, so the ranks reach their collectives together.

``'batch'`` (per-step strategies, e.g. AllReduce)
    Rank ``i`` trains on ``b_i`` samples per step: ``b_i`` proportional to its
    measured throughput (samples per second), ``sum(b_i) = K * batch_size``
    (the global batch is unchanged), every ``b_i >= 1`` (rounded by largest
    remainders). Its gradient is that of its mean loss over its ``b_i``
    samples (in minibatches of at most ``minibatch_size``), and the strategy
    averages the ranks' gradients with weights ``b_i / sum(b_j)``: the update
    is the one AllReduce (DDP) makes on the union of the ranks' batches, equal
    up to float rounding.

``'steps'`` (round-based strategies, e.g. DiLoCo; Dynamic Local Updates as in
Async Local-SGD, arXiv:2401.09135)
    A round is ``H`` steps on every rank: the step counter, ``max_steps``,
    evaluations, checkpoints and the learning-rate schedule count them alike on
    all ranks. Rank ``i`` trains the first ``H_i`` steps of each round, ``H * s_i``
    (``s_i``: its speed relative to the fastest rank) rounded down or up to a whole
    step, whichever gives more samples per unit of round time (:func:`round_shares`;
    at least 1), and idles
    through the rest: an idle step computes nothing and takes no time, it only
    takes part in the strategy's collectives, so a slow rank arrives at the
    round's average when the fast ones do. The average weights each rank's
    change by the samples it trained in the round (``H_i * batch_size``).

**Measuring.** Each rank times the steps it trains: its compute (forward,
backward, the strategy's local work), without the time spent in collectives,
waiting for peers included. A rank with its machine to itself (a real host)
reads the wall clock, so a host held back by a CPU quota, a throttled chip or
other work shows as slower; ranks sharing a machine's cores with one thread
each (a simulation) read their thread's CPU time, so that they do not count
each other's turns. In a simulation with ``rank_speeds`` and
``speed_mode='wall'`` a slow rank's time includes the time it is made to sleep;
with ``speed_mode='clock'`` the simulated compute time is used instead, which
is exact and repeatable with ``compute_time_s`` (it then scales with a step's
samples). The first step after a start or resume is a warm-up and not counted.

**When shares change.** The ranks first agree after :data:`PROBE_STEPS`
steps, then again every :data:`BATCH_INTERVAL` steps (``'batch'``) or at the
end of every round (``'steps'``), each time from every rank's throughput
over its steps since the last agreement: with ``'steps'`` their samples over
their seconds (a round lasts the sum of its steps, so a few slow steps count
as they do there, which a median of steps would hide); with ``'batch'`` the
median step's (every step meets, so a fast rank waits out a slow rank's
occasional slow step whatever the shares, and the typical step sets the
pace); averaged with the previous
estimate (weight :data:`SMOOTHING` on the new one: timing noise averages out,
a lasting change shows within two agreements), so a rank slowed by other work
gets less. New shares take effect from the next step (``'batch'``) or the next
round (``'steps'``; in the first round, from the step after the probe, a rank
that has already trained its ``H_i`` steps idling through the rest). A
measurement that moves no rank's relative speed by more than
:data:`TOLERANCE` keeps the batch shares (``'batch'``). Inner steps (``'steps'``)
follow every estimate: they are whole steps, so they move only when an
estimate crosses a rounding boundary, and a speed that drifted a little from
the one first agreed on is not left to make a rank late at every round.

**Agreement.** Each rank writes its throughput into its own slot of a vector
of ``K`` zeros and the ranks sum the vector over the side channel (uncounted),
so every rank holds the same numbers and computes the same shares. Training
traffic is unchanged: the same collectives with the same bytes.

**Data and epochs.** A rank reads its own shard at its own pace. With
``'batch'`` the run's length in steps is what ``num_epochs`` gives with equal
shares (all ranks together see the data ``num_epochs`` times), but a fast
rank goes round its shard more often than a slow one, and a step's batch may
span the end of an epoch. With ``'steps'`` a slow rank trains fewer steps, so
it reads fewer samples.

The model ``fit`` returns is the plain average of the ranks' final models, as
without ``balance`` (with DiLoCo the ranks agree at each round's end; a last
round cut short by ``max_steps`` is averaged plainly).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Protocol

import torch

from exogym import comm
from exogym.base.plural import plural

if TYPE_CHECKING:
    from exogym.run.spec import RunSpec

__all__ = ["Balancer", "batch_shares", "round_shares", "PROBE_STEPS", "BATCH_INTERVAL",
           "TOLERANCE", "SMOOTHING", "ROUND_UP_GAIN"]

#: Steps every rank trains before the first agreement (the first one is a warm-up).
PROBE_STEPS = 3
#: Steps between two agreements with ``balance='batch'`` (``'steps'``: every round).
BATCH_INTERVAL = 10
#: Largest change of any rank's relative speed that keeps the batch shares as they are.
TOLERANCE = 0.05
#: Weight of a new measurement in a rank's throughput estimate (the rest: the previous one).
SMOOTHING = 0.5
#: Least relative gain in modelled samples per second for which ``'steps'`` rounds a
#: rank's inner steps up rather than down (see :func:`round_shares`).
ROUND_UP_GAIN = 0.02


def batch_shares(throughputs: list[float], total: int, minimum: int = 1) -> list[int]:
    """Integers proportional to ``throughputs`` that sum to ``total``, each ``>= minimum``.

    Each rank gets the floor of its quota ``total * t_i / sum(t)`` (at least
    ``minimum``); what is left goes one by one to the largest remainders, and
    an excess (from raising a share to ``minimum``) is taken from the shares
    furthest above their quota. Ties go to the lower rank.

    Raises:
        ValueError: ``total`` cannot give every rank ``minimum``, or a throughput is not
            positive.
    """
    count = len(throughputs)
    if total < count * minimum:
        raise ValueError(f"{plural(total, 'sample')} cannot give each of {plural(count, 'rank')} "
                         f"{minimum}")
    if any(not t > 0 for t in throughputs):
        raise ValueError(f"throughputs must be positive, got {throughputs}")
    whole = sum(throughputs)
    quotas = [total * t / whole for t in throughputs]
    shares = [max(minimum, math.floor(q)) for q in quotas]
    while sum(shares) < total:
        i = max(range(count), key=lambda r: (quotas[r] - shares[r], -r))
        shares[i] += 1
    while sum(shares) > total:
        i = max((r for r in range(count) if shares[r] > minimum),
                key=lambda r: (shares[r] - quotas[r], -r))
        shares[i] -= 1
    return shares


def round_shares(speeds: list[float], round_steps: int) -> list[int]:
    """Inner steps per round for relative speeds ``s_i``: ``H * s_i`` rounded down or up,
    at least 1 and at most ``H``, whichever gives the most samples per unit of round time.

    A round lasts ``max(H, max_i(H_i / s_i))`` fast-rank steps. Rounding a rank's share up
    adds its one step of samples but may make it the last to arrive, so the round
    (and every rank's wait) grows to ``H_i / s_i``; rounding down keeps the round at
    ``H``. Ranks whose rounding up would be cheapest are rounded up first, and a
    rounding up is taken only when it raises the modelled samples per unit of time by
    more than :data:`ROUND_UP_GAIN` (the rank that arrives last also holds up the
    collective, on a measured speed that is itself only an estimate).
    """
    down = [max(1, min(round_steps, math.floor(round_steps * s))) for s in speeds]
    up = [max(1, min(round_steps, math.ceil(round_steps * s))) for s in speeds]

    def throughput(shares: list[int]) -> float:
        span = max([round_steps] + [n / s for n, s in zip(shares, speeds) if s > 0])
        return sum(shares) / span

    best, shares = down, list(down)
    best_rate = throughput(down)
    candidates = sorted((r for r in range(len(speeds)) if up[r] > down[r] and speeds[r] > 0),
                        key=lambda r: (up[r] / speeds[r], r))
    for rank in candidates:
        shares[rank] = up[rank]
        rate = throughput(shares)
        if rate > best_rate * (1.0 + ROUND_UP_GAIN):
            best, best_rate = list(shares), rate
    return best


class Pacer(Protocol):
    """Who trains each step, and on how many samples: the protocol the trainer follows
    with ``fit(balance=...)``'s :class:`Balancer` and with a strategy that
    :attr:`~exogym.strategy.strategy.Strategy.paces_steps` (AsyncDiLoCo).

    Each step the trainer asks :meth:`begin_step`; a rank that trains it takes
    :meth:`step_samples` samples, then is told :meth:`record_step`; a rank that does
    not idles through the step (its collectives only). :meth:`step_fields` go into
    the step's metric event either way.
    """

    def begin_step(self, step: int, present: Collection[int]) -> bool:
        """Before ``step`` (1-based), with the ranks ``present`` at it: whether this rank
        trains it."""
        ...

    def step_samples(self) -> int:
        """Samples this rank trains in the step :meth:`begin_step` began."""
        ...

    def record_step(self, samples: int, seconds: float,
                    given_speed: float | None = None) -> None:
        """A trained step: ``samples`` in ``seconds`` of compute; ``given_speed``: the
        rank's speed a simulation gives it (None where it is measured)."""
        ...

    def step_fields(self) -> dict[str, Any]:
        """What the step's metric event carries besides the trainer's own fields."""
        ...


class Balancer:
    """This rank's copy of every rank's share of the work, agreed with the other ranks.

    Every rank holds one and calls it at the same steps; the agreements run over
    the side channel, so all copies hold the same shares. The semantics are in
    this module's docstring.

    Args:
        mode: ``'batch'`` or ``'steps'``.
        rank: this rank.
        num_nodes: how many ranks there are.
        batch_size: samples per rank per step with equal shares.
        round_steps: steps per round of the strategy (``H``; 1 for per-step strategies).
        max_steps: the run's steps (no agreement after the last).
    """

    def __init__(self, mode: str, rank: int, num_nodes: int, batch_size: int,
                 round_steps: int, max_steps: int):
        if mode not in ("batch", "steps"):
            raise ValueError(f"a Balancer's mode is 'batch' or 'steps', got {mode!r}")
        self.mode = mode
        self.rank = rank
        self.num_nodes = num_nodes
        self.base_batch = batch_size
        self.round_steps = round_steps
        self.max_steps = max_steps
        self.shares = [batch_size if mode == "batch" else round_steps] * num_nodes
        self.speeds: list[float] | None = None  # relative to the fastest; None until agreed
        self.throughputs: list[float] | None = None  # every rank's estimate, samples/s
        self.counts = [0] * num_nodes  # 'steps': steps each rank trained in this round
        self._window: list[tuple[int, float]] = []  # (samples, seconds) since the last agreement
        self._warm = False

    @classmethod
    def for_run(cls, spec: RunSpec, rank: int, max_steps: int) -> Balancer | None:
        """The balancer of a run spec's ``balance`` (None for ``'none'``)."""
        mode = spec.balance
        if mode == "none":
            return None
        return cls(mode, rank, spec.num_nodes, spec.batch_size, spec.strategy.round_steps,
                   max_steps)

    # -- the plan of a step ------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Samples this rank trains on in a step."""
        return self.shares[self.rank] if self.mode == "batch" else self.base_batch

    def trains(self, rank: int, step: int) -> bool:
        """Whether ``rank`` trains at ``step`` (1-based) rather than idles."""
        if self.mode == "batch" or self.speeds is None:
            return True
        return (step - 1) % self.round_steps < self.shares[rank]

    def begin_step(self, step: int, present: Collection[int] | None = None) -> bool:
        """Start ``step`` (1-based); returns whether this rank trains in it. Every rank
        takes part under ``balance`` (``present`` is every rank)."""
        if self.mode == "steps":
            if (step - 1) % self.round_steps == 0:
                self.counts = [0] * self.num_nodes
            for rank in range(self.num_nodes):
                self.counts[rank] += self.trains(rank, step)
        return self.trains(self.rank, step)

    def step_samples(self) -> int:
        """Samples this rank trains in the step begun: its share under ``'batch'``."""
        return self.batch_size

    @property
    def weight(self) -> float:
        """This rank's factor in an average across ranks: the mean over ranks of
        ``weight * value`` is the average weighted by the samples trained (in this
        step for ``'batch'``, in this round so far for ``'steps'``)."""
        counts = self.shares if self.mode == "batch" else self.counts
        total = sum(counts)
        return counts[self.rank] * self.num_nodes / total if total else 1.0

    # -- measuring and agreeing --------------------------------------------------------

    def record_step(self, samples: int, seconds: float,
                    given_speed: float | None = None) -> None:
        """One trained step of this rank: ``samples`` in ``seconds`` of compute (a
        simulation's ``given_speed`` is already in them: the balancer measures time on
        the simulated clock or sleeps a slow rank's steps out)."""
        if not self._warm:
            self._warm = True
            return
        if seconds > 0:
            self._window.append((samples, seconds))

    def due(self, step: int) -> bool:
        """Whether the ranks agree on new shares after ``step``."""
        if step >= self.max_steps:
            return False
        if self.mode == "batch":
            return step >= PROBE_STEPS and (step - PROBE_STEPS) % BATCH_INTERVAL == 0
        return step % self.round_steps == 0 or (self.speeds is None and step == PROBE_STEPS)

    def end_step(self, step: int) -> bool:
        """After ``step``: agree on new shares when due; returns whether they changed."""
        return self.agree() if self.due(step) else False

    def agree(self) -> bool:
        """Exchange throughputs (side channel) and set the shares; True when they changed.

        A rank with no timed step since the last agreement sends 0, and then every
        rank keeps its shares.
        """
        if not self._window:
            mine = 0.0
        elif self.mode == "steps":  # a round lasts the sum of its steps
            mine = sum(n for n, _ in self._window) / sum(t for _, t in self._window)
        else:  # every step meets: the typical step, not a few slow ones, sets the pace
            mine = statistics.median(n / t for n, t in self._window)
        self._window = []
        vector = torch.zeros(self.num_nodes, dtype=torch.float64)
        vector[self.rank] = mine
        comm.side_all_reduce(vector)
        measured = vector.tolist()
        if not all(t > 0 for t in measured):
            return False
        if self.throughputs is None:
            throughputs = measured
        else:
            throughputs = [SMOOTHING * new + (1.0 - SMOOTHING) * old
                           for new, old in zip(measured, self.throughputs)]
        self.throughputs = throughputs
        fastest = max(throughputs)
        speeds = [t / fastest for t in throughputs]
        if self.mode == "batch" and self.speeds is not None and max(
                abs(new - old) for new, old in zip(speeds, self.speeds)) <= TOLERANCE:
            return False  # a sample more or less per rank: not worth chasing the noise
        self.speeds = speeds
        if self.mode == "batch":
            shares = batch_shares(throughputs, self.base_batch * self.num_nodes)
        else:
            shares = round_shares(speeds, self.round_steps)
        changed = shares != self.shares
        self.shares = shares
        return changed

    # -- reporting and checkpoints -----------------------------------------------------

    def step_fields(self) -> dict[str, Any]:
        """What a step event carries: this rank's share (``batch_size`` or ``inner_steps``
        per round) and, once measured, its ``measured_speed`` relative to the fastest."""
        fields: dict[str, Any] = {
            "batch_size" if self.mode == "batch" else "inner_steps": self.shares[self.rank]}
        if self.speeds is not None:
            fields["measured_speed"] = self.speeds[self.rank]
        return fields

    def state_dict(self) -> dict[str, Any]:
        """The agreed shares and this round's counts (the same on every rank)."""
        return {"shares": list(self.shares), "speeds": self.speeds, "counts": list(self.counts),
                "throughputs": self.throughputs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s result; the next step is a warm-up again."""
        self.shares = list(state["shares"])
        self.speeds = None if state["speeds"] is None else list(state["speeds"])
        self.counts = list(state["counts"])
        self.throughputs = state.get("throughputs")
        self._window = []
        self._warm = False

