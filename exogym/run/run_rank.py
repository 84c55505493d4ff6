"""run_rank: the one function every rank runs, simulated or on a real host.

Simulation and a real multi-host run differ only in how the process group is
joined (``Rendezvous``), how the ``RunSpec`` arrived and where the machine
runs its ranks (``Placement``). Everything after that — threads, device,
seeding, the training loop, the final state — is this function, so a strategy
that runs in simulation runs unchanged across hosts. The process group itself
is the comm module's (:func:`exogym.comm.init_process_group`).

A rank's monitor thread (:mod:`exogym.run.monitor`) reports its link and its host's
health about once a second, through the same ``emit`` as its steps.

On real hosts a rank also watches its peers: every rank bumps a heartbeat
counter in the rendezvous store, so when training fails (a peer's connection
dropped) the survivors can say which rank was lost, and a peer that goes
silent ends the run even if a collective would otherwise wait for it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from exogym import comm
from exogym.comm.averaging import average_state_across_ranks, state_digest
from exogym.comm.elastic_groups import ElasticGroups
from exogym.comm.mirror import Mirror
from exogym.comm.shared_memory import SharedMemoryBackend, SharedMemoryCollectives
from exogym.comm.store import describe_ignored
from exogym.comm.torch_group import TorchGroup
from exogym.membership.hosts import ElasticMembership, MembershipStop, PeerLost
from exogym.run.devices import backend_for
from exogym.run.monitor import start_monitor
from exogym.run.spec import Placement, RunSpec
from exogym.run.train_node import TrainNode


@dataclass(frozen=True)
class Rendezvous:
    """How ranks find each other: a TCP store at ``addr:port``.

    Args:
        addr: address of the store (the master).
        port: its port.
        store_on_rank0: rank 0 hosts the store (multi-host); otherwise the store
            already exists (hosted by a local simulation's parent, or torchrun's agent).
        watch_peers: run the heartbeat watch (multi-host runs).
        min_nodes: ranks that come and go (:mod:`exogym.membership.hosts`): the store is the
            launcher's, the ranks meet on groups formed for each membership, and the run
            goes on while at least this many ranks remain. None: every rank is needed
            (a process group).
        lost_after: with ``min_nodes``, the seconds of silence after which the launcher
            declares a rank lost; a group that does not form within it plus
            :data:`FORM_MARGIN_S` is given up.
        key: the run's store key, which every store value is signed with
            (:class:`exogym.comm.store.SignedStore`); None: values go unsigned.
    """

    addr: str
    port: int
    store_on_rank0: bool = True
    watch_peers: bool = False
    min_nodes: int | None = None
    lost_after: float = 10.0
    key: bytes | None = field(default=None, repr=False, compare=False)

    def open_store(self, *, is_master: bool = False, world_size: int | None = None,
                   timeout_s: float = 300.0) -> comm.ControlStore:
        """The store at this address, hosted here with ``is_master``, signed with the run's key."""
        return comm.open_store(self.addr, self.port, is_master=is_master,
                               world_size=world_size, timeout_s=timeout_s, key=self.key)


#: Seconds a group of hosts that come and go may take to form beyond ``lost_after``.
FORM_MARGIN_S = 30.0


class LostRankError(RuntimeError):
    """Training stopped because another rank failed or disappeared."""

    def __init__(self, lost: list[int], message: str):
        super().__init__(message)
        self.lost = lost


#: Seconds a watch waits to reconnect to a store whose process was found gone.
RECONNECT_S = 2.0
#: Seconds a rank waits in one collective before it says what it waits for.
WAIT_REPORT_S = 20.0


class PeerWatch:
    """Heartbeats through the rendezvous store, to name a lost rank.

    Args:
        rendezvous: the store's address.
        rank, world_size: this rank and the number of ranks.
        interval_s: seconds between heartbeats.
        silent_after_s: a peer whose heartbeat has not moved for this long is lost.
        on_lost: called from the watch thread with the lost ranks (e.g. to exit).
        judge_peers: judge the peers' silence; False where the launcher judges it
            (:mod:`exogym.membership.hosts`): then only the store's own loss is reported,
            once it has not answered for ``silent_after_s`` (a link that drops
            for a while is not a dead master).
        on_wait: called from the watch thread with a ``waiting`` event when this
            rank has waited in one collective for :data:`WAIT_REPORT_S` seconds
            (and again every as many seconds while it still waits there), so that
            the launcher can say what a run that makes no progress waits for.
        on_beat: called from the watch thread with a ``beat`` event at every heartbeat,
            where the launcher judges the ranks: the event reaches it on the rank's own
            channel (stdout over SSH), which no one without a login on the hosts can
            touch, so deleting the heartbeat's key in the store cannot make the rank
            look silent.
    """

    def __init__(self, rendezvous: Rendezvous, rank: int, world_size: int,
                 interval_s: float = 0.5, silent_after_s: float = 20.0,
                 on_lost: Callable[[list[int], str], None] | None = None,
                 judge_peers: bool = True,
                 on_wait: Callable[[dict[str, Any]], None] | None = None,
                 on_beat: Callable[[dict[str, Any]], None] | None = None):
        self.store = rendezvous.open_store(timeout_s=10)
        self.on_beat = on_beat
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.silent_after_s = silent_after_s
        self.on_lost = on_lost
        self.judge_peers = judge_peers
        self.on_wait = on_wait
        self._reported_wait_at = 0.0
        self.rendezvous = rendezvous
        self.beats = 0
        self.seen: dict[int, tuple[int, float]] = {}
        self.store_lost = False
        self._failing_since: float | None = None
        self._gone = False  # in this spell of failures, the store's process was found gone
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="exogym-peer-watch", daemon=True)
        self._thread.start()

    def _key(self, kind: str, rank: int) -> str:
        return f"exogym/{kind}/{rank}"

    def _poll(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self.store is None:  # a call failed: its late answer must not be misread
                # Once the store's process was found gone, a reconnection is a quick check.
                self.store = self.rendezvous.open_store(
                    timeout_s=RECONNECT_S if self._gone else 10)
            self.beats = comm.next_beat(self.beats)
            self.store.set(self._key("beat", self.rank), str(self.beats))
            for peer in range(self.world_size if self.judge_peers else 0):
                if peer == self.rank:
                    continue
                last = self.seen.get(peer)
                beat = comm.beat_news(self.store, self._key("beat", peer),
                                      last[0] if last else 0)
                if beat is None:
                    # Deleted or overwritten by something without the run's key (counted):
                    # no news of the peer, so its silence does not run on meanwhile. The last
                    # beat seen goes back (unless the peer wrote again): once the stranger
                    # ceases, a peer that does not beat above it is silent again.
                    assert last is not None
                    self.seen[peer] = (last[0], now)
                    self.store.compare_set(self._key("beat", peer), "", str(last[0]))
                elif last is None or beat > last[0]:
                    self.seen[peer] = (beat, now)

    def _report_wait(self) -> None:
        wait = comm.waiting()
        if wait is None or self.on_wait is None:
            return
        what, seconds = wait
        now = time.monotonic()
        if seconds >= WAIT_REPORT_S and now - self._reported_wait_at >= WAIT_REPORT_S:
            self._reported_wait_at = now
            self.on_wait({"event": "waiting", "rank": self.rank, "what": what,
                          "since_s": round(seconds, 1)})

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._report_wait()
            if self.on_beat is not None:
                self.on_beat({"event": "beat", "rank": self.rank})
            try:
                self._poll()
                self._failing_since = None
                self._gone = False
            except Exception as exc:  # noqa: BLE001 - the store itself is gone, or out of reach
                self.store = None
                now = time.monotonic()
                if self._failing_since is None:
                    self._failing_since = now
                # A refused or reset connection: the store's process is gone (its host
                # answers); a timeout may be a link that comes back, so it gets longer.
                # Reconnecting to a closed port then times out (the client retries a
                # refused connection): the spell is still the store's loss.
                self._gone = self._gone or any(
                    m in str(exc) for m in ("refused", "reset", "Broken pipe"))
                patience = min(3.0, self.silent_after_s) if self._gone else self.silent_after_s
                if self.judge_peers or now - self._failing_since > patience:
                    self.store_lost = True
            lost = self.silent()
            if lost and self.on_lost is not None and not self._stop.is_set():
                self.on_lost(lost, self.describe(lost))
                return

    def silent(self, after_s: float | None = None) -> list[int]:
        """Peers whose heartbeat has not moved for ``after_s`` seconds (rank 0 if the store died)."""
        after_s = self.silent_after_s if after_s is None else after_s
        if self.store_lost and not self.judge_peers:
            return [-1]  # the launcher's store: the master host
        if self.store_lost and self.rank != 0:
            return [0]
        now = time.monotonic()
        with self._lock:
            return sorted(p for p, (_, t) in self.seen.items() if now - t > after_s)

    def failed(self) -> dict[int, str]:
        """Peers that reported their own failure, with their one-line reason."""
        out = {}
        for peer in range(self.world_size):
            key = self._key("failed", peer)
            try:
                if peer != self.rank and self.store.check([key]):
                    out[peer] = self.store.get(key).decode()
            except Exception:  # noqa: BLE001
                break
        return out

    def report_failure(self, reason: str) -> None:
        """Tell the peers this rank failed, and why (best effort)."""
        try:
            self.store.set(self._key("failed", self.rank), reason[:500])
        except Exception:  # noqa: BLE001
            pass

    def report_stopping(self) -> None:
        """Tell the peers this rank stops because of another's loss, so none blames it."""
        try:
            self.store.set(self._key("stopping", self.rank), "1")
        except Exception:  # noqa: BLE001
            pass

    def _stopping(self) -> set[int]:
        found = set()
        for peer in range(self.world_size):
            try:
                if peer != self.rank and self.store.check([self._key("stopping", peer)]):
                    found.add(peer)
            except Exception:  # noqa: BLE001
                break
        return found

    def diagnose(self, wait_s: float = 6.0) -> tuple[list[int], str]:
        """After a collective failed: which ranks were lost, waiting briefly to see."""
        deadline = time.monotonic() + wait_s
        while True:
            failed = self.failed()
            if failed:
                ranks = sorted(failed)
                return ranks, "; ".join(f"rank {r} failed: {failed[r]}" for r in ranks)
            stopping = self._stopping()
            lost = [r for r in self.silent(after_s=min(self.silent_after_s, 2.5))
                    if r not in stopping]
            if lost or time.monotonic() > deadline:
                return lost, self.describe(lost)
            time.sleep(self.interval_s)

    def describe(self, lost: list[int]) -> str:
        """A sentence naming the lost ranks (and the store values it ignored as unsigned)."""
        said = self._describe(lost)
        ignored = describe_ignored()
        return f"{said}; this rank {ignored}" if ignored else said

    def _describe(self, lost: list[int]) -> str:
        if lost == [-1]:
            where = f"{self.rendezvous.addr}:{self.rendezvous.port}"
            return (f"lost the master: the launcher's store at {where} stopped answering (the "
                    "master host died, or the launcher was stopped); continue the run with "
                    "--resume from the newest checkpoint every rank has")
        if not lost:
            return "a peer connection failed, but every rank still answers"
        if self.store_lost and lost == [0]:
            return "lost rank 0: the rendezvous store it hosts stopped answering"
        return "lost rank " + ", ".join(map(str, lost)) + ": it stopped sending heartbeats"

    def stop(self) -> None:
        """Stop the heartbeat thread."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 1)


def peak_rss_bytes() -> int:
    """This process's peak resident memory in bytes (0 where the OS does not say)."""
    try:
        import resource
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _exit_lost(lost: list[int], message: str) -> None:
    print(f"exogym: {message}; stopping this rank", file=sys.stderr, flush=True)
    os._exit(3)


def _join(spec: RunSpec, placement: Placement, rank: int, rendezvous: Rendezvous,
          device: torch.device, shared_memory: SharedMemoryCollectives | None
          ) -> tuple[comm.Collectives, ElasticMembership | None]:
    """The transport this rank's collectives travel on, chosen once (and the membership
    of a run whose hosts come and go)."""
    if rendezvous.min_nodes is not None:
        def client(timeout_s: float) -> comm.ControlStore:
            return rendezvous.open_store(timeout_s=timeout_s)

        groups = ElasticGroups(spec.num_nodes, rank, client, spec.timeout_s,
                               form_timeout_s=rendezvous.lost_after + FORM_MARGIN_S)
        membership = ElasticMembership(groups, rank, spec.num_nodes, spec.strategy.round_steps,
                                       rendezvous.min_nodes)
        membership.watch(client)  # liveness read off the step (run_rank stops it)
        return groups, membership
    store = rendezvous.open_store(is_master=rendezvous.store_on_rank0 and rank == 0,
                                  world_size=spec.num_nodes, timeout_s=spec.timeout_s)
    backend = placement.backend or backend_for(spec.device_type, placement.devices,
                                               spec.num_nodes)
    group = TorchGroup(store, rank, spec.num_nodes, backend, spec.timeout_s, device)
    if shared_memory is not None:
        return SharedMemoryBackend(shared_memory.bind(rank), group), None
    return group, None


def _one_at_a_time(emit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """``emit`` for several threads (the rank's, its monitor's, its peer watch's): one
    event at a time, so that no two are interleaved in a pipe or on stdout."""
    lock = threading.Lock()

    def emit_one(event: dict[str, Any]) -> None:
        with lock:
            emit(event)

    return emit_one


def _digest(state: dict[str, torch.Tensor]) -> str:
    """:func:`state_digest` of a rank's final state, computed once for the ranks of a
    process that end with the same bytes (packed DiLoCo ranks after their last round):
    comparing a state with the one before takes a twentieth of hashing it."""
    last = comm.held_once(_digest, dict)  # this process's last state and its digest
    before = last.get("state")
    if before is not None and list(before) == list(state) and all(
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and a.device == b.device and torch.equal(a, b)
            for a, b in zip(before.values(), state.values())):
        return last["digest"]
    digest = state_digest(state)
    last.update(state=state, digest=digest)
    return digest


def run_rank(spec: RunSpec, placement: Placement, rank: int, rendezvous: Rendezvous | None,
             emit: Callable[[dict[str, Any]], None], average_final: bool = False,
             shared_memory: SharedMemoryCollectives | None = None
             ) -> dict[str, torch.Tensor] | None:
    """Train rank ``rank`` of ``spec`` to the end; returns its final model state (CPU).

    Args:
        spec: the run; ``spec.minibatch_size`` must be resolved (not 'auto').
        placement: where this machine runs its ranks.
        rank: this rank, ``0 <= rank < spec.num_nodes``.
        rendezvous: where the ranks meet; None for a rank packed with others in
            this process, whose world (:mod:`exogym.comm.packed`) is joined already.
        emit: receives every metric event of this rank.
        average_final: return the average of all ranks' final states instead of
            this rank's own (multi-host runs, where no parent sees every state).
        shared_memory: buffers the rank processes of this machine share; the world's
            CPU collectives then travel through them (a local simulation).

    Returns:
        The state; None for a rank that was away at the end (``rank_failures``).

    Raises:
        LostRankError: another rank failed or disappeared (multi-host runs).
    """
    emit = _one_at_a_time(emit)
    threads = placement.threads_per_rank(spec)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    device = placement.device_of(spec, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mirror = comm.collectives_mode() == "mirror"  # refuses a bad value
    elastic = rendezvous is not None and rendezvous.min_nodes is not None
    membership = None
    if rendezvous is not None:
        chosen, membership = _join(spec, placement, rank, rendezvous, device, shared_memory)
        comm.use_backend(Mirror(chosen) if mirror else chosen)
    watch = None
    if rendezvous is not None and rendezvous.watch_peers and spec.num_nodes > 1:
        # Where ranks come and go, the launcher judges them; a rank only gives up on the
        # launcher's store itself, after a minute without an answer.
        watch = PeerWatch(rendezvous, rank, spec.num_nodes, on_lost=_exit_lost,
                          silent_after_s=60.0 if elastic else 20.0, judge_peers=not elastic,
                          on_wait=emit, on_beat=emit if elastic else None)
    monitor = None
    try:
        comm.reset_counters()
        with comm.timed("start-up"):
            monitor = start_monitor(rank, emit, device)
            node = TrainNode(spec, rank, device, emit, placement, membership)
        try:
            state = node.train()
            with comm.timed("end"):
                if monitor is not None:
                    monitor.stop()  # its last figures come before the rank's end
                digest = None
                if node.departed:
                    state = None
                else:
                    digest = _digest(state)
                    synced = node.strategy.synced_at == node.strategy.local_step
                    if average_final and not synced:
                        # (a run that ends with a round that averaged the whole model, buffers
                        # too, as DiLoCo's does, needs no average: every rank holds it already)
                        state = average_state_across_ranks(state)
                    comm.side_barrier()  # nobody leaves while a peer still needs it
                if membership is not None:
                    # The ranks that met this one at the last collective hold the final model;
                    # one of them writes the outputs (ElasticMembership.finish). The round's
                    # decided members may include a rank killed in its last steps, or one
                    # that came back too late to train: neither holds it.
                    finished = membership.finish(None if node.departed else comm.present_ranks())
                    if finished is not None:
                        present, writer = finished
                    else:
                        present = sorted(membership.present(node.max_steps))
                        writer = present[0] if present else None
                    emit({"event": "final_membership", "rank": rank, "present": present,
                          "writer": writer, "changes": membership.changes(node.max_steps)})
        except MembershipStop as exc:
            raise LostRankError(exc.lost, f"rank {rank}: {exc}") from exc
        except PeerLost as exc:
            assert membership is not None
            why = f"{exc}: {type(spec.strategy).__name__} cannot go on without it"
            membership.stop(why)
            raise LostRankError([], f"rank {rank}: {why}") from exc
        except Exception as exc:
            if watch is None:
                raise
            if elastic and comm.is_connection_error(exc):
                raise LostRankError([], f"rank {rank}: {watch.describe([-1])}") from exc
            if not comm.is_connection_error(exc):
                # Our own failure: tell the peers what happened, keep our traceback.
                watch.report_failure(f"{type(exc).__name__}: {exc}".splitlines()[0])
                raise
            lost, message = watch.diagnose()
            lost = [r for r in lost if r != rank]
            watch.report_stopping()
            if not lost:
                raise
            raise LostRankError(lost, f"rank {rank}: {message}") from exc
        emit({"event": "done", "rank": rank, "step": node.step,
              "comm_bytes": comm.comm_bytes(), "comm_calls": comm.comm_calls(),
              "peak_rss_bytes": peak_rss_bytes(), "model_digest": digest})
        return state
    finally:
        if monitor is not None:
            monitor.stop(last=False)
        if watch is not None:
            watch.stop()
        if membership is not None:
            membership.close()
        comm.use_clock(None)
        if rendezvous is not None:
            comm.destroy_process_group()
