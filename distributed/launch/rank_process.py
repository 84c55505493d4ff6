"""One rank during one start of the job: its process, its output, its exit, its stop.

A ``RankRun`` starts its plan's command on a host's shell, sends the
supervisor (``distributed.hosts.onhost.bootstrap``) its message over stdin,
reads stdout and stderr line by line (control lines from the supervisor,
metric events, plain output, each written to the rank's log), reports its exit
on the attempt's queue, and stops its whole process group when asked. What it
shares with the launcher is one ``RankRunContext``; it knows nothing else of it.
"""

from __future__ import annotations

import collections
import json
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exogym.report.metrics import decode_line

from ..hosts.onhost.bootstrap import MARK
from ..hosts.remote import Shell, Started
from .program import RankPlan
from .results import OutputLine, RankResult

#: How many of a rank's last output lines a result keeps.
LAST_LINES = 20

#: One rank's exit as ``(rank, exit code or None)``; ``None`` alone wakes the watcher.
ExitQueue = queue.SimpleQueue[tuple[int, int | None] | None]


@dataclass(frozen=True)
class RankRunContext:
    """What every rank of one attempt shares with the launcher that started it.

    Args:
        bootstrap: the message the supervisor reads on stdin: its code, the
            secrets for the rank's environment and its grace period.
        grace_period: seconds between TERM and KILL when stopping a rank.
        redact: hides secret values in a line of output.
        on_output: receives every plain ``OutputLine``.
        on_event: receives every metric event dict.
        exits: where each rank reports ``(rank, exit code)`` when it ends
            (``None`` for the code when it is unknown).
    """

    bootstrap: Mapping[str, Any]
    grace_period: float
    redact: Callable[[str], str]
    on_output: Callable[[OutputLine], None]
    on_event: Callable[[dict[str, Any]], None]
    exits: ExitQueue


class RankRun:
    """One rank during one attempt: its process, output readers and exit.

    Args:
        plan: how the rank is started.
        shell: where its command runs; ``None`` when its host could not be reached.
        log_path: its log file (appended to, so restarts share one log).
        restart: 0 for the first start, k for the k-th restart.
        context: what it shares with the launcher.
    """

    def __init__(self, plan: RankPlan, shell: Shell | None, log_path: Path, restart: int,
                 context: RankRunContext) -> None:
        self.plan = plan
        self.shell = shell
        self.log_path = log_path
        self.restart = restart
        self.context = context
        self.started: Started | None = None
        self.start_error: str | None = None
        self.pgid: int | None = None
        self.pgid_known = threading.Event()
        self.exit_report: dict[str, Any] = {}
        self.exit_code: int | None = None
        self.stop_requested = False
        self.running = False
        self.t0 = self.t1 = time.monotonic()
        #: When the rank's last heartbeat line arrived on its channel (0: none yet).
        self.beat_heard_at = 0.0
        self.last_lines: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self.threads: list[threading.Thread] = []
        self.log_lock = threading.Lock()
        self.log: Any = None

    @property
    def host(self) -> str:
        """The host, as the hosts file names it."""
        return self.plan.host.host

    def start(self) -> None:
        """Start the rank; a failure to start counts as the rank failing."""
        self.log = open(self.log_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self.log.write(f"# exogym launcher: rank {self.plan.rank} on {self.host} "
                       f"({self.plan.login}), start {self.restart}, "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self.t0 = time.monotonic()
        try:
            if self.shell is None:
                raise ConnectionError(f"no connection to {self.plan.login}")
            self.started = self.shell.start(self.plan.command, dict(self.context.bootstrap))
        except OSError as exc:
            self.start_error = f"could not start: {exc}"
            self._line("stderr", self.start_error)
            self.t1 = time.monotonic()
            self.context.exits.put((self.plan.rank, None))
            return
        self.running = True
        for name, target, args in (("out", self._read, ("stdout",)),
                                   ("err", self._read, ("stderr",)),
                                   ("wait", self._wait, ())):
            thread = threading.Thread(target=target, args=args, daemon=True,
                                      name=f"rank{self.plan.rank}-{name}")
            thread.start()
            self.threads.append(thread)

    def _read(self, stream_name: str) -> None:
        assert self.started is not None
        stream = self.started.stdout if stream_name == "stdout" else self.started.stderr
        try:
            for raw in iter(stream.readline, b""):
                self._line(stream_name, raw.decode("utf-8", "replace").rstrip("\r\n"))
        except (OSError, EOFError, ValueError):
            pass  # the stream closed under us: the exit (or its absence) tells the story

    def _line(self, stream_name: str, text: str) -> None:
        if stream_name == "stdout":
            at = text.find(MARK)
            if at >= 0:
                self._control(text[at + len(MARK):])
                text = text[:at]
                if not text:
                    return
        text = self.context.redact(text)
        event = decode_line(text)
        if event is not None and event.get("event") == "beat":
            self.beat_heard_at = time.monotonic()  # the rank's heartbeat, on its own channel
            return
        with self.log_lock:
            self.log.write(text + "\n")
        if event is not None:
            event.setdefault("rank", self.plan.rank)
            event.setdefault("host", self.host)
            self.context.on_event(event)
            return
        self.last_lines.append(text)
        self.context.on_output(OutputLine(self.plan.rank, self.host, stream_name, text))

    def _control(self, payload: str) -> None:
        try:
            report = json.loads(payload)
        except ValueError:
            return
        if "pgid" in report:
            self.pgid = int(report["pgid"])
            self.pgid_known.set()
        if "exit" in report:
            self.exit_report = report

    def _wait(self) -> None:
        assert self.started is not None
        code = self.started.wait()
        self.exit_code = code
        self.t1 = time.monotonic()
        self.running = False
        self.context.exits.put((self.plan.rank, code))

    def stop(self) -> None:
        """Stop the rank's whole process group: TERM, then KILL after the grace period."""
        if not self.running or self.started is None or self.shell is None:
            return
        if not self.pgid_known.wait(timeout=5.0):
            # The supervisor never reported: closing its stdin makes it stop the rank itself.
            self.started.close()
            return
        assert self.pgid is not None
        self.shell.kill_group(self.pgid, self.context.grace_period, self.plan.host.python_env)

    def force_close(self) -> None:
        """Last resort: KILL the group at once and drop the connection's channel."""
        if self.shell is not None and self.pgid is not None:
            self.shell.kill_group(self.pgid, 0.0, self.plan.host.python_env)
        if self.started is not None:
            self.started.close()

    def describe_exit(self) -> str:
        """How the rank ended, in words."""
        code = self.exit_code
        if self.start_error:
            return self.start_error
        if code is None:
            if self.shell is not None and not self.shell.alive():
                return f"the SSH connection to {self.plan.login} was lost"
            return "it ended without an exit status"
        if "name" in self.exit_report:
            return f"killed by {self.exit_report['name']} (exit code {code})"
        if code == 0:
            return "finished"
        return f"exited with code {code}"

    def finish(self) -> RankResult:
        """Wait for the output to drain, make sure nothing of the rank is left, close."""
        for thread in self.threads:
            thread.join(timeout=5.0)
        if self.started is not None:
            if not self.exit_report and self.pgid is not None and self.shell is not None \
                    and self.shell.alive():
                # the supervisor did not see the rank end (it was killed, or lost its
                # channel): stop the rank's group here, so nothing is left behind
                self.shell.kill_group(self.pgid, min(self.context.grace_period, 2.0),
                                      self.plan.host.python_env)
            self.started.close()
        stopped = self.stop_requested and self.exit_code != 0
        reason = "stopped by the launcher" if stopped else self.describe_exit()
        with self.log_lock:
            self.log.write(f"# exogym launcher: rank {self.plan.rank} {reason}\n")
            self.log.close()
        return RankResult(rank=self.plan.rank, host=self.host, exit_code=self.exit_code,
                          reason=reason, stopped=stopped, duration_s=self.t1 - self.t0,
                          log_path=self.log_path, last_lines=tuple(self.last_lines))
