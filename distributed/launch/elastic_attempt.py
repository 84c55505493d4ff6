"""One start of a job whose ranks come and go (``min_nodes``): the launcher's side.

The ranks meet through a rendezvous store that lives here, in the launcher's
process (:mod:`exogym.membership.hosts` says what the ranks do with it), so no rank's
death takes it away. While the job runs, this watch:

- declares a rank lost when its process exits with an error or its connection
  drops (at once), or when its heartbeat has not moved for ``lost_after``
  seconds (a frozen process, a sleeping laptop, a cut link); the other ranks
  carry on among themselves. A rank beats both in the store and on its own
  channel (a line on its stdout over SSH): either keeps it alive, so a stranger
  who deletes its key in the store cannot make it look silent (the deletions
  are counted and told at the end);
- starts without the ranks of hosts that did not answer pre-flight (``missing``),
  declared lost before any rank starts; their hosts are tried every
  ``probe_interval`` seconds, pre-flighted when they answer, and their ranks
  started then, to join as a lost rank rejoins;
- probes a lost rank's host every ``probe_interval`` seconds over a fresh SSH
  connection; once it answers, starts the rank again, and the rank rejoins at
  the next round with the state a live peer hands it. A rank whose process
  lived through its loss (thawed, reconnected) rejoins by itself;
- reports every change of membership as an event (``{"event": "membership",
  ...}``) and each host's state (``{"event": "host", "state": "lost" |
  "rejoining" | "training"}``) for the dashboards. A change is told once, as the
  ranks decided it, at the step it took effect (``step 161: ... lost (...)``): a
  loss the run goes on without is not told again when it is noticed, nor a rank's
  return when its process starts (the table shows those states);
- stops every rank when the ranks decide that fewer than ``min_nodes`` remain
  (they write a checkpoint first), naming the lost hosts.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from exogym.base.plural import plural

from ..hosts.session import HostSession
from .program import RankPlan
from .progress import ProgressWatch
from .rank_process import ExitQueue, RankRun, RankRunContext
from .results import AttemptResult, RankResult

#: Seconds a rank may take from its start to its first heartbeat (imports, data).
START_ALLOWANCE_S = 120.0
#: A rank whose process failed this many times with an error of its own (not a lost
#: host: a bug a restart would repeat) is left out for the rest of the run.
MAX_FAILED_STARTS = 3
#: The exit code of a rank that refused its settings before it started training
#: (``python -m distributed.worker`` exits with it on a bad value).
REFUSED_EXIT = 2


class ElasticAttempt:
    """Runs, watches and heals one start of a ``min_nodes`` job.

    Args:
        plans: how each rank is started, in rank order.
        session: the host session (connections, reconnects).
        context: what the ranks share with the launcher (output, events, exits).
        run_dir: where each rank's log goes.
        restart: which start of the job this is.
        min_nodes: the fewest ranks the job goes on with.
        lost_after: seconds of heartbeat silence after which a rank is lost.
        probe_interval: seconds between attempts to reach a lost rank's host.
        say: prints one launcher message (text, style).
        interrupted: the signal that interrupted the launcher, if any.
        progress: the run's progress, which stops a run that makes none
            (:mod:`distributed.launch.progress`).
        missing: hosts (by index) that did not answer pre-flight, with what failed: their
            ranks start lost, and are started once the host answers and passes its own
            pre-flight (:meth:`distributed.hosts.session.HostSession.recheck`).
    """

    def __init__(self, plans: Sequence[RankPlan], session: HostSession,
                 context: RankRunContext, run_dir: Path, restart: int, min_nodes: int,
                 lost_after: float, probe_interval: float,
                 say: Callable[[str, str | None], None],
                 interrupted: Callable[[], str | None],
                 progress: ProgressWatch | None = None,
                 missing: Mapping[int, str] | None = None) -> None:
        self.plans = list(plans)
        self.session = session
        self.context = context
        self.run_dir = run_dir
        self.restart = restart
        self.min_nodes = min_nodes
        self.lost_after = lost_after
        self.probe_interval = probe_interval
        self.say = say
        self.interrupted = interrupted
        self.exits: ExitQueue = context.exits
        self.runs: dict[int, RankRun] = {}
        self.earlier: dict[int, list[RankResult]] = {}  # results of a rank's lost processes
        self.lost: dict[int, str] = {}  # rank -> why, while it is away
        self.state: dict[int, str] = {}
        # rank -> (highest beat seen, when it was seen, whether its process has beaten yet)
        self.beats: dict[int, tuple[int, float, bool]] = {}
        self.logged = 0
        self.membership: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self.checkpointed = False  # the ranks decided to stop and wrote a checkpoint
        self.progress = progress or ProgressWatch()
        self.first_lost: int | None = None
        self._ending = threading.Event()
        self._session_lock = threading.Lock()
        self._probing: set[int] = set()
        self._held: dict[int, float] = {}  # rank -> monotonic time before which it stays down
        self._results: dict[int, RankResult] = {}
        self.missing = dict(missing or {})
        #: Ranks never started: their host has not answered since the run's pre-flight.
        self.unstarted: set[int] = {p.rank for p in self.plans if p.host.rank in self.missing}
        #: Ranks of such hosts that answered during the run, but failed their pre-flight.
        self.not_ready: dict[int, str] = {}
        # Here, not at the top: the launcher's module stays free of torch until a run needs it.
        from exogym import comm
        from exogym.membership import hosts as protocol

        self.protocol = protocol
        self.comm = comm
        self.told = protocol.ToldChanges()  # which logged changes are new
        master = self.plans[0]
        self.store = comm.open_store(master.master_addr, master.master_port, is_master=True,
                                     timeout_s=30,
                                     key=bytes.fromhex(context.bootstrap["store_key"]))

    # ------------------------------------------------------------------ events

    def _host(self, rank: int, state: str, reason: str = "") -> None:
        if self.state.get(rank) == state:
            return
        self.state[rank] = state
        plan = self.plans[rank]
        self.context.on_event({"event": "host", "rank": rank, "host": plan.host.host,
                               "state": state, "reason": reason})

    def _read_log(self) -> None:
        """New membership decisions, as events (and the host states they imply)."""
        for decided in self.protocol.membership_log(self.store, self.logged):
            self.logged += 1
            if decided.get("stop"):
                continue  # not a membership anyone trains in: the stop itself is told once
            if not self.told.is_new(decided):
                continue  # a change told already (one loss logged at two steps, say)
            entry = {k: decided[k] for k in ("step", "ranks", "hosts", "reason")}
            self.membership.append(entry)
            self.context.on_event({"event": "membership", **entry})
            if decided["reason"] != "start":
                self.say(f"step {entry['step']}: {entry['reason']}; training on "
                         f"{', '.join(entry['hosts'])}", "yellow")
            for rank in decided["ranks"]:
                if rank not in self.lost or rank in decided["joined"]:
                    if self.lost.pop(rank, None) is not None:  # judged afresh from its next beat
                        self.beats[rank] = (self._beat_floor(rank), time.monotonic(), True)
                    self._host(rank, "training")

    # ------------------------------------------------------------------ losses

    def _lose(self, rank: int, why: str) -> None:
        if rank in self.lost:
            return
        self.protocol.declare_lost(self.store, rank, why)
        self.lost[rank] = why
        if self.first_lost is None:
            self.first_lost = rank
        plan = self.plans[rank]
        self._host(rank, "lost", why)
        if len(self.lost) == len(self.plans) and not self._ending.is_set():
            # Nothing is left to hand a restarted rank the run's state: stop, naming the
            # first loss (starting every rank again would only repeat it).
            first = self.plans[self.first_lost]
            self._stop(f"every rank was lost; the first, rank {self.first_lost} on "
                       f"{first.host.host}: {self.lost[self.first_lost]}")
            return
        remaining = len(self.plans) - len(self.lost)
        if remaining < self.min_nodes:
            self.say(f"[{plan.host.host}:{rank}] lost ({why}); {remaining} of "
                     f"{plural(len(self.plans), 'rank')} remain, fewer than "
                     f"min_nodes={self.min_nodes}: the run stops at the next round", "red")
        # Otherwise the others carry on, and the ranks' membership decision tells the loss
        # once, at the step from which they train without it (_read_log).

    def _stop(self, reason: str) -> None:
        """Stop the run: no rank is brought back, every rank still running is stopped."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self.say(f"stopping: {reason}", "red")
        self._ending.set()
        self._stop_all()

    def _watch_heartbeats(self, now: float) -> None:
        for rank, run in self.runs.items():
            # A rank that reported its end beats no more while it averages and writes its
            # outputs (seconds for a large model): its exit is awaited, within the bound
            # on a run without progress, not judged by its heartbeat.
            if rank in self.lost or not run.running or rank in self.progress.finished:
                continue
            seen = self.beats.get(rank)
            beat = self.comm.read_beat(self.store, f"exogym/beat/{rank}",
                                       seen[0] if seen is not None else 0)
            if seen is None or beat > seen[0]:
                self.beats[rank] = (beat, now, seen is not None)
                continue
            # The same heartbeat also arrives on the rank's own channel, which a stranger
            # who deletes its key in the store (counted by read_beat) cannot touch.
            heard = run.beat_heard_at
            if heard > seen[1]:
                self.beats[rank] = (seen[0], heard, True)
                continue
            allowed = self.lost_after if seen[2] else self.lost_after + START_ALLOWANCE_S
            if now - seen[1] > allowed:
                self._lose(rank, f"no heartbeat for {self.lost_after:g} s: frozen, asleep or "
                                 "cut off")

    def _beat_floor(self, rank: int) -> int:
        """The highest beat seen from ``rank``: a later process must beat above it."""
        seen = self.beats.get(rank)
        return seen[0] if seen is not None else 0

    def _watch_returns(self, now: float) -> None:
        """Ranks that acknowledged their loss are back and wait for the next round."""
        if self._ending.is_set():  # the run is over: there is no round left to rejoin
            return
        for rank in list(self.lost):
            generation = self.protocol.loss_generation(self.store, rank)
            if self.protocol.ready_generation(self.store, rank) == generation:
                self._host(rank, "rejoining")
                self.beats[rank] = (self._beat_floor(rank), now, False)

    # ------------------------------------------------------------------ bringing ranks back

    def _start(self, rank: int, shell: Any) -> RankRun:
        plan = self.plans[rank]
        # A new process beats once it runs, higher than its predecessor (beats follow the
        # clock): until then the watch gives it the time to start, not the last one's silence.
        self.beats[rank] = (self._beat_floor(rank), time.monotonic(), False)
        run = RankRun(plan, shell, self.run_dir / f"rank{rank}.log", self.restart, self.context)
        self.runs[rank] = run
        run.start()
        return run

    def _probe(self, rank: int, ended: RankRun) -> None:
        """Collect the ended run of a lost rank, reach its host again, start the rank there."""
        self.earlier.setdefault(rank, []).append(self._finish(ended))
        plan = self.plans[rank]
        # An exit code of its own (not a signal, not a dropped connection) is the program
        # failing, which a restart would repeat: only so many of those.
        failed = [r for r in self.earlier[rank] if r.exit_code is not None and 0 < r.exit_code < 128]
        if len(failed) >= MAX_FAILED_STARTS:
            self.say(f"[{plan.host.host}:{rank}] failed {plural(len(failed), 'time')} with an error of its "
                     f"own ({failed[-1].reason}); it is not started again (see "
                     f"{failed[-1].log_path})", "red")
            self._probing.discard(rank)
            return
        self._wait_out_hold(rank)
        tries = 0
        while not self._ending.wait(self.probe_interval):
            with self._session_lock:
                outcome = self.session.reconnect(plan.host.rank)
            tries += 1
            if isinstance(outcome, Exception):
                if tries == 1:
                    self.say(f"[{plan.host.host}:{rank}] unreachable ({outcome}); probing every "
                             f"{self.probe_interval:g} s", None)
                continue
            if self._ending.is_set():
                break
            self.say(f"[{plan.host.host}:{rank}] reachable again: starting rank {rank} there",
                     "green")
            self._start(rank, outcome)
            break
        self._probing.discard(rank)

    def _probe_missing(self, host: int) -> None:
        """Reach a host that did not answer the run's pre-flight until it answers, every
        ``probe_interval`` seconds; pre-flight it then, and start its ranks. Its absence
        was told once, before the start: a try that fails again is not told again."""
        ranks = sorted(r for r in self.unstarted if self.plans[r].host.rank == host)
        try:
            while not self._ending.wait(self.probe_interval):
                with self._session_lock:
                    outcome = self.session.reconnect(host)
                if isinstance(outcome, Exception) or self._ending.is_set():
                    continue
                try:
                    check = self.session.recheck(host, outcome)
                except Exception as exc:  # noqa: BLE001 - a probe's odd answer: not ready
                    problems = f"its pre-flight could not be read ({exc!r})"
                else:
                    if check.down or self._ending.is_set():
                        continue
                    problems = "; ".join(check.problems)
                    if not problems and self.session.rank_files:
                        try:  # the run's profiles file from outside the project
                            self.session.put_files(self.session.rank_files, ranks=[host])
                        except RuntimeError as exc:
                            problems = str(exc)
                span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"{ranks[0]}"
                label = f"[{self.plans[ranks[0]].host.host}:{span}]"
                if problems:
                    self.say(f"{label} answers now, but is not ready: {problems}; it "
                             "is not started in this run", "red")
                    for rank in ranks:
                        self.not_ready[rank] = problems
                    return
                self.say(f"{label} answers now: starting "
                         f"{plural(len(ranks), 'rank')} there", "green")
                for rank in ranks:
                    self.unstarted.discard(rank)
                    self._start(rank, outcome)
                return
        finally:
            self._probing.difference_update(ranks)

    def hold(self, rank: int, until: float) -> None:
        """Keep ``rank`` down until ``until`` (``time.monotonic()``): once lost, it is not
        started again before then, as a host that reboots (an injected ``kill:...+Ds``)."""
        self._held[rank] = until

    def _wait_out_hold(self, rank: int) -> None:
        """Until ``rank``'s hold ends, or the run does."""
        until = self._held.pop(rank, None)
        if until is None:
            return
        left = until - time.monotonic()
        if left > 0:
            plan = self.plans[rank]
            self.say(f"[{plan.host.host}:{rank}] its host is down for {left:.0f} s more", None)
            self._ending.wait(left)

    def _bring_back(self, rank: int, ended: RankRun) -> None:
        if rank in self._probing or self._ending.is_set():
            return
        self._probing.add(rank)
        threading.Thread(target=self._probe, args=(rank, ended), daemon=True,
                         name=f"probe-rank{rank}").start()

    # ------------------------------------------------------------------ the run

    def _exited(self, rank: int, code: int | None) -> None:
        run = self.runs[rank]
        if code == 0 or run.stop_requested or self.stop_reason or self.interrupted():
            return
        if self.store.check([self.protocol.key("finished")]) and rank not in self.lost:
            return  # the run was over; its own failure to leave is in its result
        if code == REFUSED_EXIT:
            # Settings the rank refused (a model too large for its host, a bad value): a
            # start anywhere would refuse the same.
            line = run.last_lines[-1] if run.last_lines else run.describe_exit()
            self._stop(f"rank {rank} on {run.host} refused to start: {line}")
            return
        self._lose(rank, run.describe_exit())
        if not self._ending.is_set():
            self._bring_back(rank, run)

    def _finish(self, run: RankRun) -> RankResult:
        """The run's result (finishing it once)."""
        found = self._results.get(id(run))
        if found is None:
            found = self._results[id(run)] = run.finish()
        return found

    def _stop_all(self) -> None:
        for run in self.runs.values():
            if run.running and not run.stop_requested:
                run.stop_requested = True
                threading.Thread(target=run.stop, daemon=True,
                                 name=f"stop-rank{run.plan.rank}").start()

    def run(self) -> AttemptResult:
        """Start every rank and watch until the job ends; every rank's result."""
        for plan in self.plans:
            self.store.set(self.protocol.key("host", plan.rank), plan.host.host)
        # Declared lost before any rank starts, so that the start's members leave them out.
        for rank in sorted(self.unstarted):
            why = f"did not answer pre-flight: {self.missing[self.plans[rank].host.rank]}"
            self.protocol.declare_absent(self.store, rank, why)
            self.lost[rank] = why
            self._host(rank, "lost", why)
        starting = [p for p in self.plans if p.rank not in self.unstarted]
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(starting)))) as pool:
            list(pool.map(lambda p: self._start(p.rank, self.session.shell(p.host.rank)),
                          starting))
        for host in sorted({self.plans[r].host.rank for r in self.unstarted}):
            self._probing.update(r for r in self.unstarted if self.plans[r].host.rank == host)
            threading.Thread(target=self._probe_missing, args=(host,), daemon=True,
                             name=f"probe-host{host}").start()
        stopping_since: float | None = None
        forced = False
        while True:
            now = time.monotonic()
            if self.interrupted() and stopping_since is None:
                self.say(f"{self.interrupted()} received: stopping every rank", "yellow")
                stopping_since = now
                self._ending.set()
                self._stop_all()
            try:
                item = self.exits.get(timeout=0.2)
            except queue.Empty:
                item = None
            if item is not None:
                self._exited(*item)
            try:
                self._read_log()
                if stopping_since is None:
                    self._watch_heartbeats(now)
                    self._watch_returns(now)
                    stalled = self.progress.stalled()
                    if self.store.check([self.protocol.key("stop")]):
                        self.stop_reason = self.store.get(self.protocol.key("stop")).decode()
                        self.checkpointed = True
                        self.say(f"stopping: {self.stop_reason}", "red")
                        stopping_since = now
                        self._ending.set()
                    elif stalled:
                        self._stop(stalled)
                        stopping_since = now
                    elif self.store.check([self.protocol.key("finished")]):
                        # The run is over: ranks still away will not be needed.
                        self._ending.set()
                        for rank in list(self.lost):
                            run = self.runs.get(rank)
                            if run is not None and run.running and not run.stop_requested:
                                run.stop_requested = True
                                threading.Thread(target=run.stop, daemon=True).start()
            except Exception as exc:  # noqa: BLE001 - the store is ours; keep watching
                self.say(f"store error while watching: {exc}", "red")
            if self.stop_reason is not None and stopping_since is None:
                stopping_since = now  # stopped from a rank's exit (every rank lost, a refusal)
            running = [r for r in self.runs.values() if r.running]
            if not running and not self._probing and (self._ending.is_set() or not self.lost):
                break
            grace = self.context.grace_period
            if stopping_since is not None and not forced and now - stopping_since > grace + 15:
                forced = True
                for run in running:
                    run.force_close()
        self._ending.set()
        self._read_log()
        results = []
        for rank in range(len(self.plans)):
            if rank not in self.runs:  # its host never answered
                results.append(self._never_started(rank))
                continue
            result = self._finish(self.runs[rank])
            if rank in self.lost and result.exit_code != 0:
                result = _lost_result(result, self.lost[rank])
            results.append(result)
        first = None
        if self.stop_reason is not None and self.first_lost is not None:
            earlier = self.earlier.get(self.first_lost)
            first = _lost_result(earlier[0] if earlier else results[self.first_lost],
                                 self.lost.get(self.first_lost) or "lost")
        survived = self.stop_reason is None and not self.interrupted() and all(
            r.ok for r in results if r.rank not in self.lost)
        from exogym.comm.store import describe_ignored

        refused, ignored = self.store.describe_refused(), describe_ignored(fronts=False)
        if refused:  # its store's front, which only this process serves
            self.say(f"the launcher's store {refused}: something other than the run's ranks "
                     f"writes to it", "yellow")
        if ignored:
            self.say(f"the launcher {ignored}", "yellow")
        return AttemptResult(restart=self.restart, ranks=tuple(results), first_failure=first,
                             interrupted=self.interrupted(), survived=survived,
                             stop_reason=self.stop_reason, checkpointed=self.checkpointed)

    def _never_started(self, rank: int) -> RankResult:
        """The result of a rank whose host did not answer from pre-flight to the end."""
        plan = self.plans[rank]
        problems = self.not_ready.get(rank)
        reason = (f"never started: its host {self.lost[rank]}, nor later in the run"
                  if problems is None else f"never started: its host did not answer "
                  f"pre-flight, and failed it when it answered during the run: {problems}")
        return RankResult(rank=rank, host=plan.host.host, exit_code=None, reason=reason,
                          stopped=False, duration_s=0.0,
                          log_path=self.run_dir / f"rank{rank}.log", last_lines=())

    def close(self) -> None:
        """Stop probing and close the store (the ranks are gone by now)."""
        self._ending.set()
        self.store.close()  # its public address at once, not when the object is collected
        del self.store


def _lost_result(result: RankResult, why: str) -> RankResult:
    return replace(result, reason=f"lost: {why}; it did not rejoin before the end")
