"""How a launched job ended: each rank's output lines and result, each attempt, the whole launch.

``Launcher.run`` returns a ``LaunchResult``; ``raise_for_failure`` turns a
failure into a ``LaunchError`` that names the first failing ``host:rank``,
how it ended and its last lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exogym.base.plural import plural


@dataclass(frozen=True)
class OutputLine:
    """One line a rank printed.

    Args:
        rank: the rank.
        host: its host.
        stream: ``stdout`` or ``stderr``.
        text: the line, without its newline (secrets replaced by ``***``).
    """

    rank: int
    host: str
    stream: str
    text: str

    @property
    def prefix(self) -> str:
        """``[host:rank]``."""
        return f"[{self.host}:{self.rank}]"

    def __str__(self) -> str:
        return f"{self.prefix} {self.text}"


@dataclass(frozen=True)
class RankResult:
    """How one rank ended.

    Args:
        rank: the rank.
        host: its host.
        exit_code: its exit code (128 + N after signal N); ``None`` when it is
            unknown because the connection was lost or it never started.
        reason: the ending in words (``finished``, ``exited with code 3``,
            ``killed by SIGKILL``, ``stopped by the launcher``, ...).
        stopped: True when the launcher stopped it (another rank failed, or
            the launcher was interrupted).
        duration_s: seconds from start to end.
        log_path: its log file.
        last_lines: its last output lines.
    """

    rank: int
    host: str
    exit_code: int | None
    reason: str
    stopped: bool
    duration_s: float
    log_path: Path
    last_lines: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when it exited with code 0."""
        return self.exit_code == 0

    @property
    def label(self) -> str:
        """``host:rank``."""
        return f"{self.host}:{self.rank}"


@dataclass(frozen=True)
class AttemptResult:
    """One start of the whole job (the first, or a restart).

    Args:
        restart: 0 for the first start, k for the k-th restart.
        ranks: every rank's result, in rank order.
        first_failure: the rank whose failure stopped the job, if one did.
        interrupted: the signal name (``SIGINT``/``SIGTERM``) when the
            launcher was interrupted.
        survived: for a job whose ranks come and go (``min_nodes``): True when it
            finished among the ranks present at its end (ranks lost on the way
            are not failures); None for a job that needs every rank.
        stop_reason: why the job stopped early: too few ranks remained, every rank was
            lost, a rank refused to start, or the run made no progress.
        checkpointed: with ``stop_reason``, the ranks wrote a checkpoint as they stopped
            (they do when too few remain).
    """

    restart: int
    ranks: tuple[RankResult, ...]
    first_failure: RankResult | None
    interrupted: str | None
    survived: bool | None = None
    stop_reason: str | None = None
    checkpointed: bool = False

    @property
    def ok(self) -> bool:
        """True when every rank exited with code 0 (with ``min_nodes``: when the job
        finished among the ranks present at its end)."""
        if self.survived is not None:
            return self.interrupted is None and self.survived
        return self.interrupted is None and all(r.ok for r in self.ranks)


@dataclass(frozen=True)
class LaunchResult:
    """The outcome of ``Launcher.run``.

    Args:
        run_dir: where the logs (``rank{r}.log``) and the index (``launch.json``) are.
        attempts: the first start and every restart, in order.
    """

    run_dir: Path
    attempts: tuple[AttemptResult, ...]

    @property
    def ok(self) -> bool:
        """True when the last attempt finished with every rank at exit code 0."""
        return bool(self.attempts) and self.attempts[-1].ok

    @property
    def ranks(self) -> tuple[RankResult, ...]:
        """The ranks of the last attempt."""
        return self.attempts[-1].ranks if self.attempts else ()

    @property
    def first_failure(self) -> RankResult | None:
        """The rank whose failure ended the last attempt, if any."""
        return self.attempts[-1].first_failure if self.attempts else None

    @property
    def interrupted(self) -> str | None:
        """The signal that interrupted the launcher, if one did."""
        return self.attempts[-1].interrupted if self.attempts else None

    @property
    def restarts(self) -> int:
        """How many times the job was restarted."""
        return max(0, len(self.attempts) - 1)

    def describe(self) -> str:
        """The outcome in a few lines: who failed first, how, and its last lines."""
        last = self.attempts[-1] if self.attempts else None
        if self.ok:
            away = [r for r in self.ranks if not r.ok]
            if away:
                names = "; ".join(f"rank {r.rank} on {r.host}: {r.reason}" for r in away)
                return (f"{len(self.ranks) - len(away)} of {plural(len(self.ranks), 'rank')} finished "
                        f"({names}) (logs in {self.run_dir})")
            return f"all {plural(len(self.ranks), 'rank')} finished (logs in {self.run_dir})"
        if self.interrupted:
            return f"interrupted by {self.interrupted}; every rank was stopped"
        if last is not None and last.stop_reason:
            lost = self.first_failure
            where = f" (first lost: rank {lost.rank} on {lost.host}, {lost.reason})" if lost \
                else ""
            if last.checkpointed:
                return (f"stopped: {last.stop_reason}{where}; the ranks still training wrote "
                        "a checkpoint as they stopped, and a lost rank keeps its own newest: "
                        "--resume continues from the newest step every rank has (logs in "
                        f"{self.run_dir})")
            return f"stopped: {last.stop_reason}{where} (logs in {self.run_dir})"
        failed = self.first_failure
        if failed is None:
            bad = [r for r in self.ranks if not r.ok]
            failed = bad[0] if bad else None
        if failed is None:
            return "the job did not finish"
        lines = "\n".join(f"    {line}" for line in failed.last_lines) or "    (no output)"
        others = " the other ranks were stopped;" if len(self.ranks) > 1 else ""
        restarts = f" after {plural(self.restarts, 'restart')}" if self.restarts else ""
        return (f"rank {failed.rank} on {failed.host} ({failed.label}) failed{restarts}: "
                f"{failed.reason};{others} its last lines (log: {failed.log_path}):\n{lines}")

    def raise_for_failure(self) -> None:
        """Raise ``LaunchError`` unless every rank finished."""
        if not self.ok:
            raise LaunchError(self)


class LaunchError(RuntimeError):
    """A launched job failed or was interrupted.

    Args:
        result: the full result; ``result.first_failure`` names the rank.
    """

    def __init__(self, result: LaunchResult) -> None:
        self.result = result
        super().__init__(result.describe())
