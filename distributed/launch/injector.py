"""Carrying out a fault plan (:mod:`distributed.launch.faults`) while the launcher runs a job.

A :class:`FaultInjector` belongs to one launcher. It reads the ranks' events as they
arrive (training starts with the first step any rank reports: the clock of ``@Ts``
faults; each rank's step: the trigger of ``@step=N`` faults), fires each fault once
when it is due, and ends it after its duration, on the target's host through the
launcher's host session (:mod:`distributed.hosts.onhost.inject` runs there):

- ``kill``: SIGKILL of each target rank's process. With ``min_nodes`` the launcher
  declares the rank lost, probes its host and starts it again (with a duration, once
  that has passed: the host was down), and it is readmitted
  (:mod:`distributed.launch.elastic_attempt`); with ``max_restarts`` the job restarts
  from its checkpoints;
- ``freeze``: SIGSTOP of each target rank's process group, SIGCONT after the
  duration, sent by a process on the host itself (and again by the launcher);
- ``slow``: the rank's throttle file (:mod:`distributed.worker.throttle`) says
  ``F``; after the duration it says 1 again;
- ``cut``: every packet in and out of the host dropped by its firewall (nftables,
  else iptables) for the duration; a process on the host takes the rules away
  again, so a cut ends even though it cuts the launcher off too. Allowed only
  where :meth:`FaultInjector.check` found the launcher may change the host's firewall
  (root, the tool present, a network stack of its own), refused before start otherwise.

With ``min_nodes`` a fault that would keep more than ``world - min_nodes`` ranks away
at once (counting ranks the launcher sees away: lost, restarting) waits until enough
are back; its ``delayed_s`` says how long. A fault whose moment never came before
the run ended is reported as not fired.

Every fault is announced as an event ``{"event": "fault", "injected": true, "phase":
"start" | "end" | "failed" | "not_fired", "id", "what", "target", "host", "ranks",
"step", "at_s", ...}``, which the trace, the dashboards and the summary record.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from exogym.base.plural import plural

from ..hosts.hostsfile import HostsConfig
from ..hosts.onhost import inject as onhost
from ..hosts.remote import module_source, probe_command
from ..hosts.session import HostSession
from .faults import FaultPlan, FaultSpec, FaultSpecError

__all__ = ["AttemptView", "FaultInjector"]

INJECT_SOURCE = module_source(onhost)
#: Seconds between two looks at what is due.
TICK_S = 0.1
#: Seconds a command on a host may take (a cut host answers again after its cut).
COMMAND_TIMEOUT_S = 20.0


@dataclass
class AttemptView:
    """What the injector may see of the running attempt.

    Args:
        run_of: the current ``RankRun`` of a rank (None before it started).
        away: the ranks not taking part now (lost, restarting, exited).
        hold: keeps a rank down until a ``time.monotonic()`` (a kill with a duration);
            None where the attempt cannot bring a rank back.
    """

    run_of: Callable[[int], Any]
    away: Callable[[], set[int]]
    hold: Callable[[int, float], None] | None = None


@dataclass
class _Active:
    """A fault under way."""

    spec: FaultSpec
    index: int
    started: float
    started_at_s: float
    delayed_s: float
    tag: str = ""
    ends: float | None = None
    record: dict[str, Any] = field(default_factory=dict)
    #: Set once its start is done and recorded (or failed): its end waits for it, so that
    #: a start slow to be answered on a busy host is never recorded after the end.
    begun: threading.Event = field(default_factory=threading.Event)


class FaultInjector:
    """Fires the faults of a plan into a launcher's running job (see the module's text).

    Args:
        plan: the checked plan.
        config: the hosts file.
        session: the launcher's host session (connections, reconnects).
        rank_run_dir: the run's log folder as the ranks name it (their ``EXOGYM_RUN_DIR``).
        emit: hands one fault event to the launcher's event stream.
        say: prints one launcher message (text, style).
    """

    def __init__(self, plan: FaultPlan, config: HostsConfig, session: HostSession,
                 rank_run_dir: str, emit: Callable[[dict[str, Any]], None],
                 say: Callable[[str, str | None], None]) -> None:
        self.plan = plan
        self.config = config
        self.session = session
        self.rank_run_dir = rank_run_dir
        self.emit = emit
        self.say = say
        self.nonce = uuid.uuid4().hex[:8]
        self.checked = False
        self.cut_allowed: dict[str, str | None] = {}  # host -> None (allowed) or why not
        self.t0: float | None = None  # training started: the first step event
        self.steps: dict[int, int] = {}
        self.pending: list[tuple[int, FaultSpec]] = list(enumerate(plan.faults))
        self.active: dict[int, _Active] = {}
        self.records: dict[int, dict[str, Any]] = {}
        self.view: AttemptView | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._random: Iterator[tuple[float, FaultSpec]] | None = None
        self._next_random: tuple[float, FaultSpec] | None = None
        self._last_fired: float | None = None
        self._held: dict[int, float] = {}  # fault index -> when it first had to wait
        # rank -> the RankRun a kill was sent to: away until the launcher has replaced it
        self._killed: dict[int, Any] = {}
        self._workers: list[threading.Thread] = []
        self._slowing: dict[int, FaultSpec] = {}  # slow-downs under way, by fault id

    # ------------------------------------------------------------------ before start

    def throttle_path(self, rank: int) -> str:
        """The throttle file of ``rank``, relative to its project folder (or absolute)."""
        return f"{self.rank_run_dir}/inject/{self.nonce}-rank{rank}.json"

    def _host_run(self, host_index: int, message: dict[str, Any],
                  timeout: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        """Run one on-host action on host ``host_index``; its answer, or ``{"error"}``."""
        import json

        host = self.config.hosts[host_index]
        shell = self.session.shell(host_index)
        if shell is None:
            return {"error": f"{host.host} is not connected"}
        done = shell.run(probe_command(host.project_path, host.python_env),
                         {"code": INJECT_SOURCE, **message}, timeout=timeout)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            why = (done.stderr.strip().splitlines() or ["no answer"])[-1]
            return {"error": f"exit code {done.returncode} on {host.host}: {why}"}
        try:
            return json.loads(lines[-1])
        except ValueError:
            return {"error": f"an answer that is not JSON from {host.host}: {lines[-1]!r}"}

    def check(self) -> FaultPlan:
        """Ask every host whether the launcher may cut it (after pre-flight, before any rank
        starts). A given ``cut`` a host does not permit is refused; random cuts leave such
        hosts out.

        Returns:
            The plan as it will run.

        Raises:
            FaultSpecError: a given cut that cannot be made, naming the host and why.
        """
        self.checked = True
        wanted = self.plan.cut_hosts
        if not wanted:
            return self.plan
        self.session.connect(retry_failed=False)
        here = onhost.cut_check()
        stacks: dict[str, dict[str, Any]] = {}
        for host in self.config.hosts:
            stacks[host.host] = (here if self.session.is_local(host.rank)
                                 else self._host_run(host.rank, {"action": "cut_check"}))
        for name in wanted:
            info = stacks[name]
            why = None
            stack = (info.get("boot_id"), info.get("netns"))
            twins = [other for other, o in stacks.items() if other != name
                     and "error" not in o and (o.get("boot_id"), o.get("netns")) == stack]
            if "error" in info:
                why = f"it could not be asked ({info['error']})"
            elif stack == (here.get("boot_id"), here.get("netns")):
                why = ("it shares this machine's network stack (the launcher's): a firewall "
                       "cut there would cut the launcher and every host on it off too")
            elif twins:
                why = (f"it shares its network stack with {', '.join(twins)}: a firewall cut "
                       "would cut both")
            elif info.get("uid") != 0:
                why = (f"the launcher logs in there as uid {info.get('uid')}, not root: only "
                       "root may change its firewall")
            elif not info.get("tool"):
                why = "neither nft nor iptables is installed there (apt-get install nftables)"
            self.cut_allowed[name] = why
        refused = {h: why for h, why in self.cut_allowed.items() if why is not None}
        for spec in self.plan.faults:
            if spec.kind == "cut" and spec.host in refused:
                raise FaultSpecError(f"--inject {spec.text!r}: the launcher may not cut "
                                     f"{spec.host}: {refused[spec.host]}")
        if self.plan.random is not None and refused:
            for host, why in refused.items():
                if host in self.plan.random.cut_targets:
                    self.say(f"random faults: no cut of {host}: {why}", "yellow")
            self.plan = self.plan.without_random_cuts(refused)
            if self.plan.random.mtbf_s is not None and not self.plan.random.kinds:
                raise FaultSpecError("--failures cut: the launcher may cut none of the hosts "
                                     f"({'; '.join(f'{h}: {w}' for h, w in refused.items())});"
                                     " add kill or freeze")
        return self.plan

    # ------------------------------------------------------------------ events

    def on_event(self, event: dict[str, Any]) -> None:
        """Take one event of a rank (the launcher calls this for every event)."""
        if event.get("event") != "step" or "rank" not in event:
            return
        with self._lock:
            if self.t0 is None:
                self.t0 = time.monotonic()
            rank = int(event["rank"])
            self.steps[rank] = int(event["step"])
            if any(spec.at_step is not None and rank in spec.ranks
                   and self.steps[rank] >= spec.at_step for _, spec in self.pending):
                self._wake.set()  # a step fault is due: fire it now, not at the next tick

    def _now_s(self) -> float | None:
        return None if self.t0 is None else round(time.monotonic() - self.t0, 3)

    def _step_of(self, spec: FaultSpec) -> int | None:
        seen = [self.steps[r] for r in spec.ranks if r in self.steps]
        return max(seen) if seen else None

    def _event(self, phase: str, index: int, spec: FaultSpec, **fields: Any) -> dict[str, Any]:
        event = {"event": "fault", "injected": True, "phase": phase, "id": index,
                 **spec.as_dict(), "rank": spec.ranks[0] if spec.ranks else None,
                 "step": self._step_of(spec), "at_s": self._now_s(), **fields}
        self.emit(event)
        return event

    # ------------------------------------------------------------------ the attempt

    def begin_attempt(self, view: AttemptView) -> None:
        """Start firing faults into an attempt (one start of the job)."""
        if not self.checked:
            self.check()
        self.view = view
        self._killed.clear()
        self._stop.clear()
        if self.plan.random is not None and self._random is None:
            self._random = iter(self.plan.random.draws())
        self._thread = threading.Thread(target=self._loop, daemon=True, name="fault-injector")
        self._thread.start()

    def end_attempt(self) -> None:
        """The attempt is over: stop firing into it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(TICK_S)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - a fault that cannot be made is reported
                self.say(f"fault injection: {type(exc).__name__}: {exc}", "red")

    def _due(self, spec: FaultSpec, now: float) -> bool:
        if spec.at_step is not None:
            step = self._step_of(spec)
            return step is not None and step >= spec.at_step
        return self.t0 is not None and now - self.t0 >= (spec.at_s or 0.0)

    def _still_killed(self) -> set[int]:
        """The killed ranks whose process the launcher has not yet replaced: they are away
        however late a busy launcher notices that the process ended (until then
        ``view.away()`` does not count them)."""
        assert self.view is not None
        for rank, run in list(self._killed.items()):
            if self.view.run_of(rank) is not run:
                del self._killed[rank]  # started again: view.away() counts it until readmitted
        return set(self._killed)

    def _blocked(self, spec: FaultSpec) -> str | None:
        """Why ``spec`` cannot fire now (None: it can)."""
        assert self.view is not None
        away = set(self.view.away()) | self._still_killed()
        if spec.takes_down or spec.kind == "slow":
            missing = [r for r in spec.ranks if r in away or self.view.run_of(r) is None
                       or not getattr(self.view.run_of(r), "running", False)]
            if missing and spec.takes_down:
                return f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} " \
                       "not running"
        if spec.takes_down:
            for index, active in self.active.items():
                hit = sorted(set(active.spec.ranks) & set(spec.ranks))
                if active.spec.takes_down and hit:
                    return (f"rank{'s' if len(hit) > 1 else ''} {', '.join(map(str, hit))} "
                            f"still under fault {index} ({active.spec.kind})")
        if spec.takes_down and self.plan.min_nodes is not None:
            for active in self.active.values():
                if active.spec.takes_down:
                    away |= set(active.spec.ranks)
            after = away | set(spec.ranks)
            spare = self.plan.world_size - self.plan.min_nodes
            if len(after) > spare:
                return (f"{plural(len(after), 'rank')} would be away at once, fewer than "
                        f"min_nodes={self.plan.min_nodes} left")
        return None

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            for index, active in list(self.active.items()):
                if active.ends is not None and now >= active.ends:
                    del self.active[index]
                    self._start_worker(self._end, active)
            if self.t0 is None:
                return
            for index, spec in list(self.pending):
                if not self._due(spec, now):
                    continue
                why = self._blocked(spec)
                if why is not None:
                    if index not in self._held:
                        self._held[index] = now
                        self.say(f"fault {index} ({spec.text}) waits: {why}", "yellow")
                    continue
                self.pending.remove((index, spec))
                self._fire(index, spec, now)
            self._tick_random(now)

    def _tick_random(self, now: float) -> None:
        if self._random is None:
            return
        if self._next_random is None:
            self._next_random = next(self._random)
        interval, spec = self._next_random
        since = self._last_fired if self._last_fired is not None else self.t0
        assert since is not None
        if now - since < interval:
            return
        index = len(self.plan.faults) + sum(1 for r in self.records.values() if r["random"])
        why = self._blocked(spec)
        if why is not None:
            if index not in self._held:
                self._held[index] = now
                self.say(f"random fault {index} ({spec.kind} on {spec.host}) waits: {why}",
                         "yellow")
            return
        self._next_random = None
        due = since + interval
        self._fire(index, replace(spec, at_s=round(due - self.t0, 3)), now)

    def _fire(self, index: int, spec: FaultSpec, now: float) -> None:
        held = self._held.pop(index, None)
        delayed = round(now - held, 3) if held is not None else 0.0
        active = _Active(spec, index, now, self._now_s() or 0.0, delayed)
        # A slow-down, freeze or cut ends its duration after it took effect on its host
        # (_start sets the end once the host has answered): timed from here, a host slow to
        # answer would have it end early, and the record would say it held for less.
        self._last_fired = now
        self.records[index] = {"id": index, **spec.as_dict(), "delayed_s": delayed,
                               "fired_at_s": None, "fired_step": None, "ended_at_s": None,
                               "ended_step": None, "outcome": "firing"}
        if spec.duration_s is not None or spec.kind == "kill":
            self.active[index] = active
        if spec.kind == "kill":
            assert self.view is not None
            self._killed.update({r: self.view.run_of(r) for r in spec.ranks})
            # Counted away a few seconds, until the launcher has seen the process end (or
            # while its host is down); from then until it is readmitted, view.away() counts it.
            active.ends = now + max(5.0, spec.duration_s or 0.0)
        self._start_worker(self._start, active)

    def _start_worker(self, target: Callable[[_Active], None], active: _Active) -> None:
        def work() -> None:
            try:
                target(active)
            except Exception as exc:  # noqa: BLE001 - reported as the fault's failure
                why = f"{type(exc).__name__}: {exc}"
                self.records[active.index]["outcome"] = f"failed: {why}"
                self._event("failed", active.index, active.spec, error=why)
                self.say(f"injected fault {active.index} ({active.spec.describe()}) failed: "
                         f"{why}", "red")
            finally:
                if target == self._start:
                    active.begun.set()

        worker = threading.Thread(target=work, daemon=True, name=f"fault-{active.index}")
        self._workers = [w for w in self._workers if w.is_alive()]
        self._workers.append(worker)
        worker.start()

    # ------------------------------------------------------------------ doing it

    def _rank_action(self, rank: int, message: dict[str, Any]) -> dict[str, Any]:
        host = self.config.host_of(rank)
        return self._host_run(host.rank, message)

    def _set_throttle(self, rank: int, index: int) -> dict[str, Any]:
        """Write ``rank``'s throttle file: the product of the slow-downs under way on it
        (1 when none is), so that overlapping ones neither undo nor replace each other."""
        with self._lock:
            factor = 1.0
            for spec in self._slowing.values():
                if rank in spec.ranks:
                    factor *= float(spec.factor or 1.0)
        return self._rank_action(rank, {"action": "throttle", "fault": index,
                                        "path": self.throttle_path(rank), "factor": factor})

    def _pid(self, rank: int) -> int | None:
        assert self.view is not None
        run = self.view.run_of(rank)
        if run is None or not run.pgid_known.wait(timeout=5.0):
            return None
        return run.pgid

    def _start(self, active: _Active) -> None:
        spec, index = active.spec, active.index
        errors = []
        if spec.kind == "cut":
            host = next(h for h in self.config.hosts if h.host == spec.host)
            active.tag = f"{self.nonce}{index}"
            done = self._host_run(host.rank, {"action": "cut", "seconds": spec.duration_s,
                                              "tag": active.tag})
            if "error" in done:
                errors.append(done["error"])
        else:
            for rank in spec.ranks:
                if spec.kind == "slow":
                    with self._lock:
                        self._slowing[index] = spec
                    done = self._set_throttle(rank, index)
                else:
                    pid = self._pid(rank)
                    if pid is None:
                        errors.append(f"rank {rank}'s process is not known")
                        continue
                    if spec.kind == "kill" and spec.duration_s is not None:
                        # before the kill: the launcher must not start it again at once
                        assert self.view is not None and self.view.hold is not None
                        self.view.hold(rank, time.monotonic() + spec.duration_s)
                    message = ({"action": "signal", "pid": pid, "signal": "KILL",
                                "group": False} if spec.kind == "kill" else
                               {"action": "freeze", "pgid": pid, "seconds": spec.duration_s})
                    done = self._rank_action(rank, message)
                    active.record[rank] = pid
                if "error" in done:
                    errors.append(f"rank {rank}: {done['error']}")
        record = self.records[index]
        if errors:
            record["outcome"] = f"failed: {'; '.join(errors)}"
            with self._lock:
                self.active.pop(index, None)
            self._event("failed", index, spec, error="; ".join(errors))
            self.say(f"injected fault {index} ({spec.describe()}) failed: "
                     f"{'; '.join(errors)}", "red")
            return
        if spec.duration_s is not None and spec.kind != "kill":
            with self._lock:
                active.ends = time.monotonic() + spec.duration_s + (
                    onhost.CUT_DELAY_S if spec.kind == "cut" else 0.0)
        event = self._event("start", index, spec, delayed_s=active.delayed_s)
        record.update(fired_at_s=event["at_s"], fired_step=event["step"],
                      outcome="fired" if spec.duration_s is not None else "done")
        self.say(f"injected: {spec.describe()} (now at step {event['step']}, "
                 f"{event['at_s']:.1f} s into training)", "magenta")

    def _end(self, active: _Active) -> None:
        spec, index = active.spec, active.index
        record = self.records[index]
        if spec.kind == "kill" and spec.duration_s is None:
            return
        # A kill's end is timed from its firing: on a busy host its start (the process's
        # group known, the signal answered) may still be under way. Its record comes first.
        if not active.begun.wait(timeout=COMMAND_TIMEOUT_S + 10.0):
            self.say(f"injected fault {index} ({spec.describe()}) had not started "
                     f"{COMMAND_TIMEOUT_S + 10.0:g} s after it was due to end", "red")
        if str(record.get("outcome", "")).startswith("failed"):
            return  # its start failed, and said so
        fields: dict[str, Any] = {}
        if spec.kind == "freeze":
            for rank, pid in active.record.items():
                # the host's own timer has sent it already; once more, in case
                self._rank_action(rank, {"action": "signal", "pid": pid, "signal": "CONT",
                                         "group": True})
        elif spec.kind == "slow":
            for rank in spec.ranks:
                with self._lock:
                    self._slowing.pop(index, None)
                self._set_throttle(rank, index)
        elif spec.kind == "cut":
            fields = self._cut_outcome(spec, active.tag)
        event = self._event("end", index, spec, **fields)
        record.update(ended_at_s=event["at_s"], ended_step=event["step"],
                      outcome="done" if fields.get("restored", True) else
                      f"failed: {fields.get('error')}", **fields)

    def _cut_outcome(self, spec: FaultSpec, tag: str) -> dict[str, Any]:
        """How a cut went, from the host's status file, once the host answers again."""
        host = next(h for h in self.config.hosts if h.host == spec.host)
        deadline = time.monotonic() + 60
        status: dict[str, Any] = {"error": "not asked"}
        while time.monotonic() < deadline:
            # The host's connection may be down a while after the cut (the launcher's watch
            # reconnects it when it probes a lost rank): ask again until it answers.
            status = self._host_run(host.rank, {"action": "cut_status", "tag": tag})
            if status.get("state") in ("restored", "failed"):
                break
            time.sleep(1.0)
        if status.get("state") == "restored":
            return {"restored": True, "cut_s": round(status["restored"] - status["applied"], 3),
                    "tool": status.get("tool")}
        return {"restored": False, "error": status.get("error") or
                f"the cut's state on {spec.host} is {status.get('state')!r}"}

    # ------------------------------------------------------------------ the end

    def finish(self) -> list[dict[str, Any]]:
        """The run is over: end what is still under way (bounded), report what never fired.

        Returns:
            Every fault's record, by id (what ``summary.json`` keeps).
        """
        self.end_attempt()
        with self._lock:
            ending = list(self.active.values())
            self.active.clear()
        for active in ending:
            if active.spec.kind == "cut" and active.ends is not None:
                left = max(0.0, min(active.ends - time.monotonic(), 120.0))
                if left > 0.5:
                    self.say(f"waiting {left:.0f} s for the cut of {active.spec.host} to end "
                             "(its host takes the rules away then)", None)
                time.sleep(left)
            if active.spec.kind != "kill" or active.spec.duration_s is not None:
                self._end(active)
        for worker in self._workers:
            worker.join(timeout=COMMAND_TIMEOUT_S + 60)
        for index, spec in self.pending:
            why = "the run ended before its step" if spec.at_step is not None else \
                "the run ended before its time"
            if self.t0 is None:
                why = "training never started"
            self.records[index] = {"id": index, **spec.as_dict(), "delayed_s": 0.0,
                                   "fired_at_s": None, "fired_step": None, "ended_at_s": None,
                                   "ended_step": None, "outcome": f"not fired: {why}"}
            self._event("not_fired", index, spec, reason=why)
        self.pending = []
        return [self.records[k] for k in sorted(self.records)]
