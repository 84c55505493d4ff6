"""One rank's simulated clock: when its steps would end on a modelled cluster.

``fit(network=..., compute_time_s=..., rank_speeds=...)`` gives every rank a
clock. It advances by two kinds of time:

- **compute**: the rank's own work in a step (forward, backward, optimizer,
  the strategy's local work), as measured on this machine, or the fixed
  ``compute_time_s``; divided by the rank's speed (``rank_speeds``, 1.0 = full
  speed). Measured compute is the CPU time of the rank's thread when it trains
  on one thread (so ranks sharing this machine's cores do not count each
  other's turns), its wall time otherwise; time spent in collectives is taken
  out.
- **communication**: every training collective (through :mod:`exogym.comm`)
  starts when the last of its ranks arrives (the ranks exchange their clocks,
  uncounted) and lasts what :class:`exogym.sim.network.Network` says for its
  counted bytes, group and algorithm. So a straggler makes everyone wait at a
  collective, and only there. An asynchronous collective (Streaming DiLoCo's
  ``fragment_delay``) runs beside the compute that follows it: the clock
  waits only in its ``wait()``, and only for what is left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exogym.sim.network import Network


@dataclass
class SimClock:
    """The simulated time of one rank.

    Args:
        network: the modelled network (None: collectives take no time, only the
            wait for the slowest rank).
        speed: this rank's compute speed (1.0: as measured; 0.5: twice as long).
        compute_time_s: fixed compute time of a step at full speed (None: measured).
        schedule: each step's compute at full speed, step 1 first (``compute_schedule``:
            a replay's recorded steps); steps past it are charged its mean. Takes
            precedence over ``compute_time_s``.
    """

    network: Network | None
    speed: float = 1.0
    compute_time_s: float | None = None
    schedule: tuple[float, ...] | None = None
    now: float = 0.0
    comm_s: float = field(default=0.0)  # simulated time spent in collectives, waiting included
    compute_s: float = field(default=0.0)  # simulated time spent computing

    @property
    def fixed(self) -> bool:
        """True when a step's compute is given (``compute_time_s`` or a schedule), not measured."""
        return self.compute_time_s is not None or self.schedule is not None

    def add_compute(self, measured_s: float, work: float = 1.0, step: int | None = None
                    ) -> float:
        """Advance by one step's compute; returns the simulated seconds added.

        ``work`` scales a fixed ``compute_time_s`` (or the schedule's): the step's samples
        over ``batch_size`` (a rank whose batch ``fit(balance='batch')`` changed).
        ``step`` (from 1) picks the schedule's entry.
        """
        if self.schedule is not None and step is not None:
            given = self.schedule[step - 1] if 0 < step <= len(self.schedule) else \
                sum(self.schedule) / len(self.schedule)
            base = given * work
        elif self.compute_time_s is not None:
            base = self.compute_time_s * work
        else:
            base = measured_s
        seconds = max(0.0, base) / self.speed
        self.now += seconds
        self.compute_s += seconds
        return seconds

    def collective_s(self, kind: str, payload: float, ranks: list[int]) -> float:
        """Simulated duration of one collective (0 without a network)."""
        if self.network is None:
            return 0.0
        return self.network.seconds(kind, payload, ranks)

    def finish_at(self, done: float) -> None:
        """The rank waits until ``done`` (a collective's end), if that is later than now."""
        if done > self.now:
            self.comm_s += done - self.now
            self.now = done
