"""A bed host lost and back: its sshd stopped and its rank killed (``kill -9``), then its
sshd started again, so that the launcher of a ``min_nodes`` job reaches the host and
starts the rank anew.

The order is a lost machine's: the sshd goes first, so the launcher's probe
finds the host silent until :meth:`HostOutage.back`; its rank is then killed by
the PID found on the bed (:func:`tests.netbed.worker_pid`).
"""

from __future__ import annotations

import os
import signal
import time

from bench.harness.jobs import BenchError
from tests.netbed import Host, Testbed, worker_pid


class HostOutage:
    """One host of a bed taken away and given back.

    Args:
        bed: the bed.
        host: the host to take away.
        rank: the rank its job runs there.
        marker: a string on that job's command line alone (its output folder).
    """

    def __init__(self, bed: Testbed, host: Host, rank: int, marker: str) -> None:
        self.bed = bed
        self.host = host
        self.rank = rank
        self.marker = marker
        self.killed: int | None = None
        self.away = False

    def hit(self) -> float:
        """Stop the host's sshd and kill its rank; returns the moment (``time.monotonic``).

        Raises BenchError (the sshd started again) when the rank's process is not found.
        """
        self.bed.stop_sshd(self.host)
        self.away = True
        pid = worker_pid(self.rank, self.marker)
        if pid is None:
            self.back()
            raise BenchError(f"rank {self.rank}'s process (command line with {self.marker}) "
                             f"was not found on host {self.host.index} to kill")
        os.kill(pid, signal.SIGKILL)
        self.killed = pid
        return time.monotonic()

    def back(self) -> float:
        """Start the host's sshd again (waiting for its greeting); returns the moment."""
        if self.away:
            self.bed.start_sshd(self.host)
            self.away = False
        return time.monotonic()
