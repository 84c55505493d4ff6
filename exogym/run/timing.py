"""What a rank's steps cost in time: measured compute, the simulated clock, a slow rank's lag.

A :class:`StepTimer` belongs to one rank. It measures the compute of a step
(leaving out the time inside collectives and asleep), charges it to the
rank's simulated clock when the run has one (``fit(network=...,
compute_time_s=..., rank_speeds=...)``), makes a rank slowed by
``speed_mode='wall'`` really take longer, and times a step the way
``balance`` measures ranks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from exogym import comm

if TYPE_CHECKING:
    from exogym.sim.clock import SimClock

__all__ = ["Mark", "StepTimer", "Throttle"]

#: A moment of a rank: wall time, this thread's CPU time, and the wall and CPU
#: seconds spent inside collectives so far.
Mark = tuple[float, float, float, float]

#: The longest slice of a throttled step's sleep before the throttle's factor is read again.
THROTTLE_SLICE_S = 0.1


class Throttle(Protocol):
    """Slows a real rank down from outside (an injected ``slow`` fault): :meth:`factor`
    is the share of its speed the rank computes at now, 1.0 for full speed."""

    def factor(self) -> float:
        """The rank's speed factor now, 0 < F <= 1."""
        ...


class StepTimer:
    """One rank's timing of its steps.

    Args:
        clock: the rank's simulated clock (None: the run has none).
        one_thread: the rank computes on one thread, sharing the machine's cores with
            other ranks: its compute is this thread's CPU time, so ranks do not count
            each other's turns. Otherwise wall time.
        speed_mode: ``'wall'`` (a slow rank sleeps off its slowness) or ``'clock'``
            (only its simulated clock runs slower).
        alone_on_machine: the rank has its machine to itself (a real host): the
            balancer times it by the wall clock, which a CPU quota or a throttled
            chip slows while the thread's CPU time stays the same.
        throttle: slows the rank down from outside (None: never), see :meth:`throttle_step`.
    """

    def __init__(self, clock: SimClock | None, one_thread: bool, speed_mode: str,
                 alone_on_machine: bool, throttle: Throttle | None = None):
        self.clock = clock
        self.one_thread = one_thread
        self.speed_mode = speed_mode
        self.alone_on_machine = alone_on_machine
        self.throttle = throttle
        # Seconds of wall and CPU time credited to the rank beyond what it measures
        # itself (stacked ranks: its share of a computation another rank's thread ran).
        self._credit_wall = 0.0
        self._credit_cpu = 0.0

    @property
    def now(self) -> float | None:
        """The simulated time of this rank (None without a clock)."""
        return None if self.clock is None else self.clock.now

    def restore(self, sim_time_s: float | None, *, not_before: bool = False) -> None:
        """Set the simulated clock to a saved or handed-over time (``not_before``: only forward)."""
        if self.clock is None or sim_time_s is None:
            return
        self.clock.now = max(self.clock.now, float(sim_time_s)) if not_before else float(sim_time_s)

    def mark(self) -> Mark:
        """Now, for :meth:`compute_since`."""
        wall_in, cpu_in = comm.collective_time()
        return (time.perf_counter() + self._credit_wall, time.thread_time() + self._credit_cpu,
                wall_in, cpu_in)

    def wall(self) -> float:
        r"""The rank's wall clock (``time.perf_counter`` with :meth:`credit`\ s added)."""
        return time.perf_counter() + self._credit_wall

    def credit(self, wall_s: float, cpu_s: float) -> None:
        """Count ``wall_s`` and ``cpu_s`` more (or fewer, negative) seconds as this rank's
        own from now on: stacked ranks compute together in one thread, and each is
        charged its share of it instead of what its own thread spent or waited."""
        self._credit_wall += wall_s
        self._credit_cpu += cpu_s

    def compute_since(self, mark: Mark) -> float:
        """Compute seconds since ``mark``, without time inside collectives or asleep."""
        wall, cpu, wall_in, cpu_in = self.mark()
        if self.one_thread:
            return max(0.0, (cpu - mark[1]) - (cpu_in - mark[3]))
        return max(0.0, (wall - mark[0]) - (wall_in - mark[2]))

    def forward_backward(self, mark: Mark, work: float = 1.0, step: int | None = None) -> None:
        """Charge the forward and backward passes to the simulated clock (before the
        strategy's step, whose collectives start when the last rank arrives); ``work``:
        the step's samples over ``batch_size``; ``step``: which step (a schedule's entry)."""
        if self.clock is not None:
            self.clock.add_compute(self.compute_since(mark), work, step)

    def strategy_work(self, mark: Mark) -> None:
        """Charge the strategy's own work in its step (the optimizer, compression)."""
        if self.clock is not None and not self.clock.fixed:
            self.clock.add_compute(self.compute_since(mark))

    def lag(self, mark: Mark | None) -> None:
        """A slow rank in ``speed_mode='wall'`` really takes longer: after each step it
        sleeps off ``1/speed - 1`` times the work it did since ``mark`` (collectives aside)."""
        clock = self.clock
        if mark is not None and clock is not None and self.speed_mode == "wall" \
                and clock.speed < 1.0:
            comm.pause(self.compute_since(mark) * (1.0 / clock.speed - 1.0))

    def throttle_step(self, mark: Mark, event: dict[str, Any]) -> float:
        """Under a throttle at factor F < 1, sleep off ``1/F - 1`` times the compute of the
        step since ``mark`` (collectives aside), as a rank at F of its speed would take;
        the step's event gets ``throttle`` (F) and, without a simulated clock, the sleep
        in its ``compute_s``. Returns the seconds slept.

        The sleep is taken in slices of at most :data:`THROTTLE_SLICE_S`, the factor read
        again after each: a slow-down that ends (or eases) mid-sleep cuts the sleep short to
        what the new factor owes, so that a rank slowed to a crawl is back at its speed at
        once, not at the end of a long sleep."""
        if self.throttle is None:
            return 0.0
        factor = self.throttle.factor()
        if not 0.0 < factor < 1.0:
            return 0.0
        event["throttle"] = factor
        compute = self.compute_since(mark)
        slept = 0.0
        while 0.0 < factor < 1.0:
            owed = compute * (1.0 / factor - 1.0) - slept
            if owed <= 0.0:
                break
            chunk = min(owed, THROTTLE_SLICE_S)
            comm.pause(chunk)
            slept += chunk
            factor = self.throttle.factor()
        if self.clock is None and "compute_s" in event:
            event["compute_s"] += slept
        return slept

    def clock_reading(self) -> tuple[float, float] | None:
        """The simulated time and the part of it spent communicating (None without a clock)."""
        return None if self.clock is None else (self.clock.now, self.clock.comm_s)

    def balanced_seconds(self, mark: Mark, before: tuple[float, float] | None) -> float:
        """The compute time of a step since ``mark``, as the balancer measures it:
        simulated with ``speed_mode='clock'`` (``before``: :meth:`clock_reading` at
        ``mark``), else measured (collectives aside) with the time a slow simulated
        rank sleeps it off (``speed_mode='wall'``)."""
        clock = self.clock
        if clock is not None and self.speed_mode == "clock" and before is not None:
            now, comm_s = before
            return (clock.now - now) - (clock.comm_s - comm_s)
        if self.alone_on_machine:
            wall, _, wall_in, _ = self.mark()
            seconds = max(0.0, (wall - mark[0]) - (wall_in - mark[2]))
        else:
            seconds = self.compute_since(mark)
        return seconds / (clock.speed if clock is not None else 1.0)
