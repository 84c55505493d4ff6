"""The pieces of runs whose ranks come and go, each on its own: the gloo groups and votes
that survive a lost peer, the round decisions, the settings and what the dashboards show.

The whole thing over SSH is in ``test_elastic_hosts.py``.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from io import StringIO

import pytest
import torch
import warm
from ranks import free_port
from rich.console import Console

from distributed.app.dashboard import Dashboard
from distributed.app.web.state import WebState
from distributed.launch.options import LaunchOptions
from distributed.profiles.profile import launch_key_problems
from distributed.worker.environment import rank_environment
from exogym import comm
from exogym.comm.elastic_groups import ElasticGroups
from exogym.membership.hosts import (
    ElasticMembership,
    MembershipStop,
    RankDropped,
    declare_lost,
    key,
    membership_log,
)


@pytest.fixture
def store():
    server = comm.open_store("127.0.0.1", free_port(), is_master=True, timeout_s=20)
    yield server
    del server


def worlds(store, n=3, timeout_s=20.0, cls=ElasticGroups):
    port = store.port
    return [cls(n, r, lambda t: comm.open_store("127.0.0.1", port, timeout_s=t), timeout_s)
            for r in range(n)]


def run_ranks(worlds_, body):
    """``body(world, rank)`` in one thread per rank; their results (or exceptions)."""
    out: dict[int, object] = {}

    def one(world, rank):
        try:
            out[rank] = body(world, rank)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(w, r)) for r, w in enumerate(worlds_)]
    for t in threads:
        t.start()
    return threads, out


def test_an_all_reduce_completes_among_the_survivors_and_every_survivor_gets_the_same(store):
    ws = worlds(store)
    seen = threading.Event()

    def body(world, rank):
        world.enter_step(5, None)
        t = torch.full((4,), float(rank + 1))
        if rank == 2:
            seen.wait(10)  # never arrives before it is declared lost
        world.all_reduce_many([t], comm.ReduceOp.SUM, divide_by=3)
        return t

    threads, out = run_ranks(ws, body)
    time.sleep(0.5)
    declare_lost(store, 2, "killed")
    threads[0].join(10)
    threads[1].join(10)
    seen.set()
    threads[2].join(10)
    # The average is over the two that completed it: (1 + 2) / 2.
    assert torch.equal(out[0], torch.full((4,), 1.5)) and torch.equal(out[0], out[1])
    # The lost rank's late vote is refused: it learns it was dropped.
    assert isinstance(out[2], RankDropped)
    # The survivors go on in a group of their own.
    assert ws[0].group_ranks() == [0, 1] == ws[1].group_ranks()


@pytest.mark.slow
def test_a_rank_dropped_inside_a_collective_closes_without_waiting_for_the_call(store):
    """A rank declared lost while its all-reduce waits for members that do not come (it was
    frozen, and they went on without it) is dropped; ending it then returns at once. Its
    call is still blocked in gloo's threads, so the group is kept for good, not destroyed:
    gloo's destructor would wait for the call until gloo's timeout, and the rank's process
    could not end before."""
    ws = worlds(store, timeout_s=60.0)
    threads, out = run_ranks(ws, lambda world, rank: world.enter_step(1, None))
    for t in threads:
        t.join(30)
    assert out == {0: None, 1: None, 2: None}, out

    def alone(world, rank):
        try:
            world.all_reduce(torch.ones(4))  # ranks 0 and 1 never call it
        except RankDropped as exc:
            return f"dropped: {exc}"  # not the exception: its frames would hold the group
        return "completed"

    threads, out = run_ranks(ws[2:], alone)
    deadline = time.monotonic() + 20
    while not (ws[2].waiting_for or "").startswith("an all-reduce"):
        assert time.monotonic() < deadline and threads[0].is_alive(), out
        time.sleep(0.01)
    declare_lost(store, 2, "no heartbeat")
    threads[0].join(10)
    assert out[0].startswith("dropped: rank 2 was declared lost"), out
    started = time.monotonic()
    ws[2].close()
    took = time.monotonic() - started
    for world in ws[:2]:
        world.close()
    assert took < 10, f"closing the dropped rank waited {took:.0f} s for its blocked call"


class _VotesLate(ElasticGroups):
    """Votes on a collective only once the test lets it (forming its group, at once)."""

    go = threading.Event()

    def _vote(self, name, call, members, ok):
        if call != "form":
            self.go.wait(10)
        return super()._vote(name, call, members, ok)


def test_a_member_lost_after_it_voted_counts_for_every_survivor(store):
    ws = worlds(store, cls=_VotesLate)
    _VotesLate.go = threading.Event()
    ws[2].go = threading.Event()
    ws[2].go.set()  # rank 2 votes at once; the others wait

    def body(world, rank):
        world.enter_step(1, None)
        t = torch.full((2,), float(rank + 1))
        world.all_reduce_many([t], comm.ReduceOp.SUM)
        return t

    threads, out = run_ranks(ws, body)
    vote = key("v", ws[2]._wanted_name, "1", 2)  # rank 2's vote on the group's first call
    deadline = time.monotonic() + 10
    while not store.check([vote]):
        assert time.monotonic() < deadline, "rank 2 never voted"
        time.sleep(0.01)
    declare_lost(store, 2, "killed after it voted")
    _VotesLate.go.set()
    for t in threads:
        t.join(10)
    # Its vote stands (it was cast, so it is never sealed): the sum holds its part too.
    assert torch.equal(out[0], torch.full((2,), 6.0)) and torch.equal(out[1], out[0])
    assert torch.equal(out[2], out[0])
    assert ws[0].lost_since_admitted(2)


@pytest.mark.parametrize("chunk_bytes", [None, 1 << 20], ids=["one-chunk", "16-chunks"])
def test_a_16_mib_tensor_is_all_reduced_and_handed_over_point_to_point(store, monkeypatch,
                                                                         chunk_bytes):
    """Real transports carry any size: no tensor goes through the store. In 1 MiB chunks
    the hand-over keeps several in flight, each copied in at its place."""
    import exogym.comm.elastic_groups

    if chunk_bytes is not None:
        monkeypatch.setattr(exogym.comm.elastic_groups, "CHUNK_BYTES", chunk_bytes)
    ws = worlds(store)
    n = 4 << 20  # 16 MiB of float32

    def body(world, rank):
        world.enter_step(1, None)
        t = torch.full((n,), float(rank + 1))
        world.all_reduce_many([t], comm.ReduceOp.SUM, divide_by=3)
        state = torch.arange(n, dtype=torch.float32) if rank == 0 else torch.zeros(n)
        if rank != 1:  # rank 1 takes no part in the hand-over
            world.side_broadcast(state, 0, [0, 2])
        return t, state

    threads, out = run_ranks(ws, body)
    for t in threads:
        t.join(60)
    for rank in range(3):
        assert not isinstance(out[rank], BaseException), out[rank]
        assert torch.equal(out[rank][0], torch.full((n,), 2.0))
    assert torch.equal(out[2][1], torch.arange(n, dtype=torch.float32))
    assert torch.equal(out[1][1], torch.zeros(n))


def test_a_joiner_whose_source_is_lost_during_the_hand_over_tries_a_later_round(store):
    port = store.port
    ws = [ElasticGroups(3, r, lambda t: comm.open_store("127.0.0.1", port, timeout_s=t), 20.0,
                        form_timeout_s=3.0) for r in range(3)]

    def body(world, rank):
        world.enter_step(1, None)
        if rank == 0:
            declare_lost(store, 0, "killed while handing over")  # it never sends
            return "source gone"
        if rank == 2:
            state = torch.zeros(5 << 20)  # 20 MiB: more than one chunk
            started = time.monotonic()
            try:
                world.side_broadcast(state, 0, [0, 2])
            except comm.PeerLost as exc:
                return exc, time.monotonic() - started, state
        return "not in the hand-over"

    threads, out = run_ranks(ws, body)
    for t in threads:
        t.join(30)
    error, waited, state = out[2]
    assert isinstance(error, comm.PeerLost) and "rank 0" in str(error), error
    assert waited < 10
    assert torch.equal(state, torch.zeros(5 << 20))  # nothing was written half
    assert out[1] == "not in the hand-over"


def test_the_store_refuses_a_value_over_64_kib_in_the_writer(store):
    store.set("small", b"x" * comm.MAX_VALUE_BYTES)
    with pytest.raises(comm.ControlValueTooLarge, match="'big'.*65,537 bytes"):
        store.set("big", b"x" * (comm.MAX_VALUE_BYTES + 1))
    with pytest.raises(comm.ControlValueTooLarge):
        store.compare_set("big", "", b"x" * (comm.MAX_VALUE_BYTES + 1))
    assert not store.check(["big"])


def membership(store, n=3, h=5, min_nodes=2):
    ws = worlds(store, n)
    return ws, [ElasticMembership(w, r, n, h, min_nodes) for r, w in enumerate(ws)]


def test_the_first_rank_at_a_boundary_decides_and_the_others_read_the_same(store):
    for r, host in enumerate(["a", "b", "c"]):
        store.set(key("host", r), host)
    _, ms = membership(store)
    assert ms[1].present(1) == {0, 1, 2}
    assert ms[0].present(3) == {0, 1, 2}  # the same round: decided once
    declare_lost(store, 2, "exited with code -9")
    assert ms[0].present(4) == {0, 1, 2}  # inside the round nothing changes
    assert ms[0].present(6) == {0, 1}  # the next round drops it
    assert ms[1].present(6) == {0, 1} and ms[1].shard(1, 6) == (1, 2)
    change = membership_log(store)[-1]
    assert change["step"] == 6 and change["hosts"] == ["a", "b"]
    assert change["reason"] == "c (rank 2) lost (exited with code -9)"


def test_a_returning_rank_is_admitted_at_the_next_round_with_a_source(store):
    ws, ms = membership(store)
    ms[0].present(1)
    ms[1].present(1)
    declare_lost(store, 2, "frozen")
    assert ms[0].present(6) == {0, 1}
    ms[1].present(6)
    assert not ms[2].is_present(2, 6)  # it knows it was dropped
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("at", ms[2].next_join(2, 6)))
    waiter.start()
    import time
    time.sleep(0.3)  # it has said it is ready
    assert ms[0].present(11) == {0, 1, 2}
    waiter.join(10)
    assert got["at"] == 11
    assert ms[0].joiners(11) == [2] and ms[0].source(11) == 0
    assert ms[2].is_present(2, 12)


def test_too_few_ranks_stop_the_run_naming_the_host(store):
    store.set(key("host", 1), "laptop")
    _, ms = membership(store, n=2, min_nodes=2)
    ms[0].present(1)
    declare_lost(store, 1, "no heartbeat for 10 s")
    with pytest.raises(MembershipStop, match="laptop.*fewer than min_nodes=2"):
        ms[0].present(6)
    assert store.check([key("stop")])


def _until(test, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not test():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:.0f} s"
        time.sleep(0.02)


def test_a_fresh_look_spares_the_step_the_store_and_a_loss_is_still_seen(store, monkeypatch):
    """A rank's lookout reads its loss generation and the requests for its state in a thread
    of its own: a step boundary that has a fresh look asks the store nothing, yet a loss
    declared meanwhile is seen there once the next look has read it. A stale look (a
    process frozen and thawed, a starved thread) makes the step ask the store itself."""
    from exogym.membership import hosts

    _, ms = membership(store)
    member = ms[0]
    assert member.present(1) == {0, 1, 2}
    member.watch(lambda t: comm.open_store("127.0.0.1", store.port, timeout_s=t))
    try:
        _until(lambda: member.lookout.look() is not None, "rank 0's first look")
        trips = comm.store_round_trips()
        assert member.is_present(0, 2) and member.state_requests(0) == ([], 0)
        assert comm.store_round_trips() == trips
        declare_lost(store, 0, "no heartbeat for 10 s")  # as the launcher would
        trips = comm.store_round_trips()
        _until(lambda: not member.is_present(0, 3), "rank 0 seeing its own loss")
        assert comm.store_round_trips() == trips
        monkeypatch.setattr(hosts, "LOOK_FRESH_S", 0.0)  # every look is stale now
        assert not member.is_present(0, 3)
        assert comm.store_round_trips() > trips
    finally:
        member.close()
    assert member.lookout is None


def test_launch_settings_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match="min_nodes must be a whole number >= 1"):
        LaunchOptions(min_nodes=0)
    with pytest.raises(ValueError, match="do not go together"):
        LaunchOptions(min_nodes=2, max_restarts=1)
    with pytest.raises(ValueError, match="lost_after must be a number of seconds > 0"):
        LaunchOptions(min_nodes=2, lost_after=0)
    assert launch_key_problems({"min_nodes": "two"})[0].startswith("min_nodes must be")
    assert launch_key_problems({"min_nodes": 2, "lost_after": 5}) == []
    assert "do not go together" in launch_key_problems({"min_nodes": 2, "balance": "steps"})[0]
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": str(free_port())}
    assert rank_environment({**env, "EXOGYM_MIN_NODES": "2"}).min_nodes == 2
    with pytest.raises(ValueError, match="EXOGYM_MIN_NODES=4 must be in 1..WORLD_SIZE"):
        rank_environment({**env, "EXOGYM_MIN_NODES": "4"})


def test_the_dashboards_show_lost_and_rejoining_hosts_and_record_the_membership():
    console = Console(file=StringIO(), width=200)
    board = Dashboard(3, ["a", "b", "c"], console=console, live=False)
    web = WebState()
    web.begin_run("p", {}, 3, ["a", "b", "c"])
    events = [
        {"event": "membership", "step": 1, "ranks": [0, 1, 2], "hosts": ["a", "b", "c"],
         "reason": "start"},
        {"event": "host", "rank": 2, "host": "c", "state": "lost", "reason": "killed"},
        {"event": "membership", "step": 21, "ranks": [0, 1], "hosts": ["a", "b"],
         "reason": "c (rank 2) lost (killed)"},
        {"event": "host", "rank": 2, "host": "c", "state": "rejoining", "reason": ""},
    ]
    for e in events[:3]:
        board.on_event(e)
        web.on_event(e)
    assert board.ranks[2].status == "lost"
    assert web.runs[0].ranks[2].state == "lost"
    board.on_event(events[3])
    web.on_event(events[3])
    assert board.ranks[2].status == "rejoining" and web.runs[0].ranks[2].state == "rejoining"
    assert [m["ranks"] for m in board.summary()["membership"]] == [[0, 1, 2], [0, 1]]
    assert web.runs[0].as_json(0.0)["membership"][1]["reason"] == "c (rank 2) lost (killed)"
    board.finish()
    # the launcher tells each change, once (test_a_host_lost_and_back_is_told_once_...)
    assert "lost" not in console.file.getvalue()


def _reporting_attempt(store, on_event, told: list[str]):
    """An elastic attempt of three hosts a, b and c (min_nodes 2) with only its reporting
    set up, on a real store: its events go to ``on_event``, its lines to ``told``."""
    from types import SimpleNamespace

    from distributed.launch.elastic_attempt import ElasticAttempt
    from exogym.membership import hosts as protocol

    attempt = ElasticAttempt.__new__(ElasticAttempt)
    vars(attempt).update(
        protocol=protocol, store=store, lost={}, first_lost=None, state={}, logged=0,
        membership=[], beats={}, min_nodes=2, _ending=threading.Event(),
        told=protocol.ToldChanges(),
        plans=[SimpleNamespace(host=SimpleNamespace(host=h)) for h in "abc"],
        context=SimpleNamespace(on_event=on_event),
        say=lambda text, style: told.append(text))
    return attempt


def test_a_host_lost_and_back_is_told_once_each_at_its_membership_change_s_step(store):
    """The terminal of a run across hosts is the launcher's lines and the dashboard's: a
    host lost at step 160 and back during a round at step 270 is told in one line each, at
    the step the ranks' membership log gives it, never at a step a process happened to be
    at (a lost rank's last step seen, a restarted process's step 0)."""
    from exogym.membership import hosts as protocol

    console = Console(file=StringIO(), width=300)
    board = Dashboard(3, ["a", "b", "c"], console=console, live=False)
    told: list[str] = []
    attempt = _reporting_attempt(store, board.on_event, told)

    def decided(step: int, ranks: list[int], reason: str, joined=()) -> None:
        protocol.log_change(store, json.dumps({
            "step": step, "ranks": ranks, "hosts": ["abc"[r] for r in ranks],
            "reason": reason, "joined": list(joined), "left": [], "gens": {},
            "stop": None}).encode())
        attempt._read_log()

    def steps(ranks, first, last):
        for step in range(first, last + 1):
            for rank in ranks:
                board.on_event({"event": "step", "rank": rank, "host": "abc"[rank],
                                "step": step, "train_loss": 1.0, "samples": 8 * step,
                                "comm_bytes": 0, "wall_s": 0.0})

    decided(1, [0, 1, 2], "start")
    steps([0, 1, 2], 1, 159)
    attempt._lose(2, "its connection dropped")  # noticed: no line yet
    steps([0, 1], 160, 160)
    decided(161, [0, 1], "c (rank 2) lost (its connection dropped)")
    steps([0, 1], 161, 269)
    # the rank's process, started again, begins before a member hands it the state
    board.on_event({"event": "start", "rank": 2, "host": "c", "step": 0, "max_steps": 300,
                    "joining": True})
    board.on_event({"event": "host", "rank": 2, "host": "c", "state": "rejoining"})
    decided(270, [0, 1, 2], "c (rank 2) rejoined during a round", joined=[2])
    steps([0, 1, 2], 270, 300)
    board.finish()
    terminal = "\n".join(told) + "\n" + console.file.getvalue()
    assert [line for line in terminal.splitlines() if "(rank 2)" in line] == [
        "step 161: c (rank 2) lost (its connection dropped); training on a, b",
        "step 270: c (rank 2) rejoined during a round; training on a, b, c"], terminal
    assert "at step 0" not in terminal and "at step 159" not in terminal, terminal
    assert "next round" not in terminal, terminal
    assert board.ranks[2].step == 300 and attempt.lost == {}


def test_one_change_of_membership_logged_twice_is_told_once_at_one_step_everywhere(store):
    """A loss logged at two steps (160, then 161) and a join logged twice are each one
    change: one launcher line, one membership event (what the dashboards, the trace and
    so replay take), one entry of the launcher's record (summary.json, goodput) and of a
    rank's own record, all at the step of the first. A rank lost and back between two
    rounds is a change of its own, though its members are the same."""
    from exogym.membership import hosts as protocol

    told: list[str] = []
    events: list[dict] = []
    attempt = _reporting_attempt(store, events.append, told)

    def logged(step: int, ranks: list[int], reason: str, gens: dict, joined=(), left=()):
        protocol.log_change(store, json.dumps({
            "step": step, "ranks": ranks, "hosts": ["abc"[r] for r in ranks],
            "reason": reason, "joined": list(joined), "left": list(left), "gens": gens,
            "stop": None}).encode())
        attempt._read_log()

    logged(1, [0, 1, 2], "start", {0: 0, 1: 0, 2: 0})
    attempt._lose(2, "killed")
    logged(160, [0, 1], "c (rank 2) lost (killed)", {0: 0, 1: 0}, left=[2])
    logged(161, [0, 1], "c (rank 2) lost (killed)", {0: 0, 1: 0}, left=[2])
    logged(270, [0, 1, 2], "c (rank 2) rejoined during a round", {2: 1}, joined=[2])
    logged(275, [0, 1, 2], "c (rank 2) rejoined during a round", {2: 1}, joined=[2])
    declare_lost(store, 2, "frozen")  # and back before the next round: its generation moved
    logged(301, [0, 1, 2], "c (rank 2) rejoined", {0: 0, 1: 0, 2: 2}, joined=[2])

    assert told == ["step 160: c (rank 2) lost (killed); training on a, b",
                    "step 270: c (rank 2) rejoined during a round; training on a, b, c",
                    "step 301: c (rank 2) rejoined; training on a, b, c"], told
    steps = [1, 160, 270, 301]
    assert [e["step"] for e in events if e["event"] == "membership"] == steps, events
    assert [m["step"] for m in attempt.membership] == steps
    states = [e["state"] for e in events if e["event"] == "host" and e["rank"] == 2]
    assert states == ["training", "lost", "training"], states
    from types import SimpleNamespace

    rank_0 = ElasticMembership(SimpleNamespace(store=store, generations={}), 0, 3, 20, 2)
    assert [c["step"] for c in rank_0.changes()] == steps


def _events(log_path):
    from exogym.report.metrics import decode_line

    return [e for e in map(decode_line, log_path.read_text().splitlines()) if e is not None]


@contextlib.contextmanager
def _workers(store, tmp_path, profile: str, *settings: str, quiet: bool = False,
             fresh: bool = False):
    """Three local worker processes of ``profile`` meeting through ``store`` with
    ``min_nodes=2`` (the test is their launcher): their processes and output folder,
    every one still running killed when the test ends (passed or not). Each rank's
    output goes to ``tmp_path/rank{r}.log``; each is slowed through its throttle file
    (:func:`_slow`). They start warm (tests/warm.py) unless ``fresh``: a test that
    freezes one (SIGSTOP) needs the rank to be the process it has."""
    procs, out = _start_workers(store, tmp_path, profile, *settings, quiet=quiet, fresh=fresh)
    try:
        yield procs, out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a frozen one takes its kill too
                proc.kill()
                proc.wait(timeout=30)


def _start_workers(store, tmp_path, profile: str, *settings: str, quiet: bool = False,
                   fresh: bool = False):
    import subprocess
    import sys

    from ranks import ROOT, rank_env

    for r in range(3):
        store.set(key("host", r), f"host{r}")
    out = tmp_path / "run"
    args = [*([sys.executable] if fresh else warm.python()), "-m", "distributed.worker",
            "--profile", profile,
            *(["--quiet"] if quiet else [])]
    for pair in (*settings, "num_threads=1", "checkpoint_interval=None", "num_nodes=3",
                 f"output_dir={out}"):
        args += ["--set", pair]
    procs = []
    for r in range(3):
        with open(tmp_path / f"rank{r}.log", "wb") as log:
            env = rank_env(r, 3, store.port, EXOGYM_MIN_NODES="2",
                           EXOGYM_THROTTLE_FILE=str(tmp_path / f"throttle{r}.json"))
            procs.append(subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          env=env))
    return procs, out


def _slow(tmp_path, rank: int, factor: float) -> None:
    """Run ``rank`` of :func:`_workers` at ``factor`` of its speed from its next look at its
    throttle file (:mod:`distributed.worker.throttle`): a test that must act within a stretch
    of steps makes the stretch last, whatever else the machine runs."""
    path = tmp_path / f"throttle{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps({"factor": factor, "fault": "test"}))
    path.with_suffix(".tmp").replace(path)


def _wait_for_step(tmp_path, procs, rank: int, step: int) -> None:
    deadline = time.monotonic() + 120
    while not any(e.get("step", 0) >= step for e in _events(tmp_path / f"rank{rank}.log")):
        assert time.monotonic() < deadline and procs[rank].poll() is None
        time.sleep(0.1)


def _cpu_s(pid: int) -> float | None:
    """CPU seconds process ``pid`` has used (None where /proc does not say)."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads_of(pid: int) -> list[str]:
    """Each thread of ``pid`` as /proc shows it: name, state and the kernel wait it is in
    (gloo's and torch's C++ threads have no Python stack to dump)."""
    from pathlib import Path

    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            name = (task / "comm").read_text().strip()
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (task / "wchan").read_text().strip() or "-"
        except OSError:
            continue
        out.append(f"{task.name} {name} state={state} wchan={wchan}")
    return out


def _ends_or_says_why(proc, log_path, timeout_s: float, cpu_before: float | None) -> int:
    """``proc``'s exit code once it ends within ``timeout_s``; otherwise fail naming what it
    was doing: its Python stacks (the worker dumps every thread's on SIGUSR1, into its log),
    its threads as the kernel sees them, the CPU time it had since ``cpu_before`` (a rank
    starved on a loaded machine has used little of the wait but is runnable; a blocked one
    sleeps in a futex or a socket), and its log's tail."""
    import subprocess

    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    cpu = _cpu_s(proc.pid)
    threads = _threads_of(proc.pid)
    proc.send_signal(signal.SIGUSR1)  # faulthandler's dump (the default action once Python
    time.sleep(3)                      # has shut down: its end is then told by its code)
    code = proc.poll()
    used = "?" if cpu is None or cpu_before is None else f"{cpu - cpu_before:.1f}"
    tail = log_path.read_text(errors="replace")[-8000:]
    pytest.fail(f"pid {proc.pid} did not end within {timeout_s:.0f} s: it used {used} s of "
                f"CPU meanwhile; {'still running' if code is None else f'ended with {code}'} "
                "after SIGUSR1\nits threads:\n  " + "\n  ".join(threads) +
                f"\nits log's tail (Python stacks last):\n{tail}")


@pytest.mark.slow(
    reason="three worker processes train 300 steps at a twentieth of their speed so that "
           "the kill lands mid-run")
@pytest.mark.parametrize("profile, identical", [
    ("digits-ddp", True), ("digits-demo", True), ("digits-sparta", False)])
def test_per_step_survivors_go_on_from_the_step_they_all_completed(store, tmp_path, profile,
                                                                   identical):
    """A per-step strategy: a rank killed mid-run; the others' steps complete among
    themselves and they stay identical (local worker processes, the test as launcher).
    In DeMo's gather the lost rank's part reads as absent (NaN), and is skipped."""
    # Every rank steps with rank 2, slowed so that its run outlasts the test's look at it on
    # a busy machine (about 4 s in all; at full speed it ends within a second of step 100).
    _slow(tmp_path, 2, 0.05)
    with _workers(store, tmp_path, profile, "max_steps=300", "val_interval=300",
                  quiet=True) as (procs, out):
        _wait_for_step(tmp_path, procs, 2, 100)
        warm.send_signal(procs[2], signal.SIGKILL)
        procs[2].wait()
        declare_lost(store, 2, "killed")
        assert [p.wait(timeout=180) for p in procs[:2]] == [0, 0]
    ends = [[e for e in _events(tmp_path / f"rank{r}.log") if e.get("event") == "step"][-1]
            for r in range(2)]
    assert ends[0]["step"] == ends[1]["step"] == 300
    if identical:  # SPARTA averages a few parameters a step: its ranks differ
        assert ends[0]["val_loss"] == ends[1]["val_loss"]
    assert math.isfinite(ends[0]["val_loss"]) and math.isfinite(ends[1]["val_loss"])
    summary = json.loads((out / "summary.json").read_text())
    assert [m["ranks"] for m in summary["membership"]] == [[0, 1, 2], [0, 1]]
    assert summary["membership"][1]["reason"] == "host2 (rank 2) lost (killed)"


@pytest.mark.slow(reason="three worker processes train DiLoCo across 6 rounds")
def test_a_step_inside_a_diloco_round_asks_the_store_nothing_while_no_host_is_lost(
        store, tmp_path):
    """What hosts that may come and go cost on a training step, counted: the store round
    trips of each rank's training thread (the step events' ``store_trips``). A step inside
    a round makes none (liveness and requests for the state are read by a thread off the
    step); a round's edges make some (its decision, its record of joins closed, its voted
    all-reduce: how many depends on how long the votes are waited for). A step that had to
    ask (its look at the store went stale on a busy machine) is rare, never the rule."""
    h, rounds = 20, 6
    with _workers(store, tmp_path, "digits-diloco", f"H={h}", f"max_steps={h * rounds}",
                  f"val_interval={h * rounds}", quiet=True) as (procs, _):
        assert [p.wait(timeout=180) for p in procs] == [0, 0, 0]
    inside, edges = [], []
    for r in range(3):
        steps = [e for e in _events(tmp_path / f"rank{r}.log") if e.get("event") == "step"]
        assert [e["step"] for e in steps] == list(range(1, h * rounds + 1))
        # Rounds 2 to 5: the first forms the group, the last ends the run (an evaluation).
        for e in steps[h:h * (rounds - 1)]:
            (edges if e["step"] % h in (0, 1) else inside).append(e["store_trips"])
    asked = [t for t in inside if t]
    assert len(asked) <= len(inside) // 10, f"{len(asked)} of {len(inside)} steps inside " \
        f"rounds asked the store: {asked}"
    assert sum(edges) >= 3 * (rounds - 2), edges  # each rank's rounds were counted


def test_the_live_dashboard_shows_each_hosts_share_of_the_work():
    console = Console(file=StringIO(), width=200)
    board = Dashboard(2, ["fast", "slow"], console=console, live=False)
    board.on_event({"event": "step", "rank": 0, "step": 1, "train_loss": 1.0, "samples": 21,
                    "wall_s": 0.1, "comm_bytes": 0, "batch_size": 21})
    board.on_event({"event": "step", "rank": 1, "step": 1, "train_loss": 1.0, "samples": 11,
                    "wall_s": 0.1, "comm_bytes": 0, "batch_size": 11})
    out = Console(file=StringIO(), width=200)
    out.print(board.render())
    text = out.file.getvalue()
    assert "share" in text and "batch 21" in text and "batch 11" in text
    plain = Dashboard(1, ["a"], console=console, live=False)
    plain.on_event({"event": "step", "rank": 0, "step": 1, "train_loss": 1.0})
    out = Console(file=StringIO(), width=200)
    out.print(plain.render())
    assert "share" not in out.file.getvalue()


def _probe_after(tmp_path, exit_codes: list[int | None],
                 held_s: float | None = None) -> tuple[list[str], list[int]]:
    """What the launcher's probe of a lost rank 1 says and starts after earlier endings
    with ``exit_codes`` (the last one the run that just ended); ``held_s``: its host is
    held down that long (an injected kill with a duration)."""
    from types import SimpleNamespace

    from distributed.launch.elastic_attempt import ElasticAttempt
    from distributed.launch.results import RankResult

    def result(code: int | None) -> RankResult:
        return RankResult(rank=1, host="h1", exit_code=code, reason=f"ended with {code}",
                          stopped=False, duration_s=1.0, log_path=tmp_path / "rank1.log",
                          last_lines=())

    said: list[str] = []
    started: list[int] = []
    attempt = SimpleNamespace(
        earlier={1: [result(code) for code in exit_codes[:-1]]},
        plans={1: SimpleNamespace(host=SimpleNamespace(host="h1", rank=1))},
        _finish=lambda run: result(exit_codes[-1]),
        say=lambda text, style=None: said.append(text),
        _probing={1}, _ending=threading.Event(), probe_interval=0.01,
        _session_lock=threading.Lock(),
        session=SimpleNamespace(reconnect=lambda host_rank: "shell"),
        _start=lambda rank, shell: started.append((rank, time.monotonic())), _held={})
    attempt._wait_out_hold = lambda rank: ElasticAttempt._wait_out_hold(attempt, rank)
    if held_s is not None:
        ElasticAttempt.hold(attempt, 1, time.monotonic() + held_s)
    ElasticAttempt._probe(attempt, 1, object())
    assert 1 not in attempt._probing
    return said, started


def test_a_rank_whose_program_fails_three_times_is_not_started_again(tmp_path):
    said, started = _probe_after(tmp_path, [1, 137, None, 2, 1])  # three errors of its own
    assert started == [] and len(said) == 1
    assert "failed 3 times with an error of its own" in said[0] and "ended with 1" in said[0]
    # killed by a signal (128 + N) or cut off (None): not the program's fault, started again
    said, started = _probe_after(tmp_path, [1, 137, None, 137, 2])
    assert [rank for rank, _ in started] == [1]
    assert "reachable again: starting rank 1" in said[-1]


def test_a_rank_killed_with_its_host_held_down_is_started_again_only_after(tmp_path):
    begun = time.monotonic()
    said, started = _probe_after(tmp_path, [137], held_s=1.0)
    assert [rank for rank, _ in started] == [1] and started[0][1] - begun >= 1.0
    assert said[0] == "[h1:1] its host is down for 1 s more"


@pytest.mark.slow
def test_a_rank_that_loses_the_launcher_s_store_says_it_lost_the_master():
    from exogym.run.run_rank import PeerWatch, Rendezvous

    port = free_port()
    server = comm.open_store("127.0.0.1", port, is_master=True, world_size=None)
    lost = []
    done = threading.Event()

    def on_lost(ranks, message):
        lost.append((ranks, message))
        done.set()

    watch = PeerWatch(Rendezvous("127.0.0.1", port, store_on_rank0=False, min_nodes=2), rank=1,
                      world_size=3, interval_s=0.1, silent_after_s=60.0, on_lost=on_lost,
                      judge_peers=False)
    try:
        time.sleep(0.5)
        assert not lost  # peers are the launcher's to judge: nothing while the store answers
        del server  # the launcher's process is gone: connections are refused
        started = time.monotonic()
        assert done.wait(15.0)
        took = time.monotonic() - started
    finally:
        watch.stop()
    ranks, message = lost[0]
    assert ranks == [-1]
    assert message.startswith(f"lost the master: the launcher's store at 127.0.0.1:{port}")
    assert "--resume" in message
    assert took < 10.0  # a refused connection counts after 3 s, not the 60 s a silent link gets


def _waits_in_a_collective(tmp_path, procs, rank: int) -> None:
    """Until ``rank`` of :func:`_workers` says it has waited in one all-reduce for
    :data:`exogym.run.run_rank.WAIT_REPORT_S` seconds (its ``waiting`` event)."""
    deadline = time.monotonic() + 120
    while not any(e.get("event") == "waiting" and "all-reduce" in e.get("what", "")
                  for e in _events(tmp_path / f"rank{rank}.log")):
        assert time.monotonic() < deadline and procs[rank].poll() is None
        time.sleep(0.2)


@pytest.mark.parametrize("frozen", [
    "between collectives",
    "inside the round's all-reduce"])
@pytest.mark.slow(
    reason="three worker processes train 1,500 steps; one is frozen (inside the all-reduce "
           "after it waited there 20 s), declared lost and thawed once the others end")
def test_a_rank_away_when_the_run_ends_says_so_and_leaves_the_outputs_to_the_others(
        store, tmp_path, frozen):
    """A rank frozen past its loss wakes after the survivors finished: it ends cleanly,
    says the run ended while it was away, and writes neither model nor summary. Frozen
    inside the round's all-reduce (the others held until it waits there), it wakes with
    that call still under way in gloo: it ends as soon, the call left where it stands."""
    with _workers(store, tmp_path, "digits-diloco", "max_steps=1500",
                  "val_interval=500", fresh=True) as (procs, out):
        try:
            if frozen == "between collectives":
                _wait_for_step(tmp_path, procs, 2, 200)
            else:
                _wait_for_step(tmp_path, procs, 2, 100)
                for proc in procs[:2]:
                    proc.send_signal(signal.SIGSTOP)
                _waits_in_a_collective(tmp_path, procs, 2)
            procs[2].send_signal(signal.SIGSTOP)
            declare_lost(store, 2, "no heartbeat")
            for proc in procs[:2]:
                proc.send_signal(signal.SIGCONT)
            assert [p.wait(timeout=180) for p in procs[:2]] == [0, 0]
            summary = (out / "summary.json").read_bytes()
            model = (out / "model.safetensors").read_bytes()
            cpu_before = _cpu_s(procs[2].pid)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGCONT)
        assert _ends_or_says_why(procs[2], tmp_path / "rank2.log", 60, cpu_before) == 0
    log = (tmp_path / "rank2.log").read_text()
    assert "rank 2: the run ended while this rank was away" in log, log[-2000:]
    assert "ranks 0, 1 finished it, and rank 0 wrote the final model" in log
    assert "rank 2's own steps (not the run's)" in log
    final = [e for e in _events(tmp_path / "rank2.log") if e.get("event") == "final_membership"]
    assert final and final[0]["present"] == [0, 1]
    # The outputs are the survivors' alone.
    assert (out / "summary.json").read_bytes() == summary
    assert (out / "model.safetensors").read_bytes() == model
    assert json.loads(summary)["steps"] == 1500


@pytest.mark.slow(
    reason="three worker processes train 900 steps, rank 0 slowed to a hundredth in the "
           "last round until it is killed")
def test_rank_0_killed_in_the_last_round_leaves_the_outputs_to_the_lowest_rank_that_ended_it(
        store, tmp_path):
    """Rank 0 dies in the run's last round: the round's decided members still name it,
    but it does not end the run. Rank 1, the lowest rank that does, writes the final
    model and the summary."""
    # Rank 0 must not finish the last round before it is killed, however long the machine
    # holds the test back: a tenth of its speed until the round (a 300-step round then lasts
    # 2 s or more), a hundredth in it (20 s or more).
    _slow(tmp_path, 0, 0.1)
    with _workers(store, tmp_path, "digits-diloco", "max_steps=900", "H=300",
                  "val_interval=900", quiet=True) as (procs, out):
        _wait_for_step(tmp_path, procs, 0, 601)  # in the round that starts at step 601
        _slow(tmp_path, 0, 0.01)
        _wait_for_step(tmp_path, procs, 0, 610)
        warm.send_signal(procs[0], signal.SIGKILL)
        procs[0].wait()
        declare_lost(store, 0, "killed")
        assert [p.wait(timeout=180) for p in procs[1:]] == [0, 0]
    finals = {r: [e for e in _events(tmp_path / f"rank{r}.log")
                  if e.get("event") == "final_membership"] for r in (1, 2)}
    for r in (1, 2):
        assert finals[r] and finals[r][0]["present"] == [1, 2], finals[r]
        assert finals[r][0]["writer"] == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 900
    done = {r: [e for e in _events(tmp_path / f"rank{r}.log") if e.get("event") == "done"][0]
            for r in (1, 2)}
    assert done[1]["model_digest"] == done[2]["model_digest"] is not None
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(out / "model.safetensors").values())


def test_a_lost_rank_that_acknowledges_after_the_run_ended_is_not_shown_rejoining(store):
    """The launcher marks a lost rank "rejoining" once it acknowledges its loss, but not
    when the run is already over: there is no round left for it."""
    from types import SimpleNamespace

    from distributed.launch.elastic_attempt import ElasticAttempt
    from exogym.membership import hosts as elastic

    declare_lost(store, 1, "no heartbeat")
    store.set(key("ready", 1), "1")
    events: list[dict] = []

    def attempt(ending: bool) -> SimpleNamespace:
        stand_in = SimpleNamespace(
            lost={1: "no heartbeat"}, protocol=elastic, store=store, beats={}, state={},
            _ending=threading.Event(), plans={1: SimpleNamespace(host=SimpleNamespace(host="h1"))},
            context=SimpleNamespace(on_event=events.append))
        stand_in._host = lambda rank, state, reason="": ElasticAttempt._host(
            stand_in, rank, state, reason)
        stand_in._beat_floor = lambda rank: ElasticAttempt._beat_floor(stand_in, rank)
        if ending:
            stand_in._ending.set()
        return stand_in

    ElasticAttempt._watch_returns(attempt(ending=True), time.monotonic())
    assert events == []
    ElasticAttempt._watch_returns(attempt(ending=False), time.monotonic())
    assert [(e["rank"], e["state"]) for e in events] == [(1, "rejoining")]


# -- a rank that comes back during a round (a strategy that joins_mid_round) ---------------


def test_a_rank_joins_a_round_under_way_and_the_members_take_it_in_at_the_round_s_end(store):
    for r, host in enumerate(["a", "b", "c"]):
        store.set(key("host", r), host)
    ws, ms = membership(store)
    for m in ms:
        m.admits_mid_round = True
    for m in ms:
        m.present(1)
    declare_lost(store, 2, "killed")
    assert ms[0].present(6) == {0, 1} and ms[1].present(6) == {0, 1}
    joiner = ms[2]
    generation = joiner.acknowledge()
    start, decided = joiner.current_round()
    assert start == 6 and joiner.live_source(decided) == 0
    # It asks rank 0, which reads the request at its next look.
    link = joiner.ask_state(0, generation)
    requests, seen = ms[0].state_requests(0)
    assert [r["rank"] for r in requests] == [2] and requests[0]["link"] == link and seen == 1
    assert ms[0].state_requests(seen) == ([], 1)  # read once
    assert joiner.join_late(8, generation)
    assert joiner.is_present(2, 8) and not joiner.is_present(2, 7)
    assert not joiner.in_members_group(8) and joiner.in_members_group(10)
    # Before the round's last step the members train among themselves ...
    assert ms[0].present(9) == {0, 1} and ms[0].epoch(9) == 6
    # ... there the first one closes the record and every member reads the same joiners.
    for m in ms:
        assert m.round_end(9) == 10
        m.close_round(10)
    assert all(m.present(10) == {0, 1, 2} and m.epoch(10) == 10 for m in ms)
    assert ws[0].generations[2] == generation
    # A joiner too late for the record waits for the next round.
    assert not ms[1].join_late(9, generation)
    # The next round keeps it as a member: no second hand-over, no change to log.
    assert ms[0].present(11) == {0, 1, 2} and ms[0].joiners(11) == []
    assert ms[0].epoch(11) == 10
    assert ms[2].is_present(2, 11) and ms[2].in_members_group(11)
    log = membership_log(store)
    assert [(e["step"], e["ranks"]) for e in log] == [(1, [0, 1, 2]), (6, [0, 1]), (8, [0, 1, 2])]
    assert log[-1]["reason"] == "c (rank 2) rejoined during a round"


def test_a_request_from_a_rank_lost_again_is_not_served(store):
    _, ms = membership(store)
    declare_lost(store, 2, "killed")
    generation = ms[2].acknowledge()
    ms[2].ask_state(0, generation)
    declare_lost(store, 2, "killed again")
    assert ms[0].state_requests(0) == ([], 1)


def test_a_request_is_served_once_even_by_a_member_started_again_since(store):
    """A member that served a request and was started again reads every request made of its
    rank from the first: the joiner served before, still live, never comes to that link
    again, so the new process must not serve it (its sender would wait on it, and the
    next joiner's request behind it)."""
    ws, ms = membership(store)
    declare_lost(store, 2, "killed")
    generation = ms[2].acknowledge()
    ms[2].ask_state(0, generation)
    assert [r["rank"] for r in ms[0].state_requests(0)[0]] == [2]
    again = ElasticMembership(ws[0], 0, 3, 5, 2)  # rank 0's next process
    assert again.state_requests(0) == ([], 1)
    second = ms[2].ask_state(0, generation)  # a new request is served
    assert [r["link"] for r in again.state_requests(1)[0]] == [second]


def test_a_pair_link_the_other_side_gave_up_fails_before_it_forms(store):
    """A joiner that gave a transfer up marks its link: a member that reads the request
    later fails at once, not after the time a link takes to form."""
    ws = worlds(store)
    gens = {0: 0, 2: 0}
    ws[2].pair_link("late", 0, 2, gens).abandon()
    started = time.monotonic()
    with pytest.raises(comm.PeerLost, match="gave the hand-over on late up"):
        ws[0].pair_link("late", 0, 2, gens).broadcast(torch.zeros(4), 0, [0, 2])
    assert time.monotonic() - started < 2


def test_a_pair_link_streams_a_16_mib_state_while_the_members_all_reduce(store, monkeypatch):
    """The source's thread hands the state over on a link of its own while the members'
    group runs its collectives: neither waits for the other."""
    import exogym.comm.elastic_groups

    monkeypatch.setattr(exogym.comm.elastic_groups, "CHUNK_BYTES", 1 << 20)
    ws = worlds(store)
    n = 4 << 20
    gens = {0: 0, 2: 0}

    def body(world, rank):
        if rank == 2:  # the joiner: not in the members' group
            link = world.pair_link("t", 0, 2, gens)
            state = torch.zeros(n)
            link.broadcast(state, 0, [0, 2])
            link.close()
            return state
        world.enter_step(1, [0, 1])
        sent = {}
        if rank == 0:
            link = world.pair_link("t", 0, 2, gens)
            sender = threading.Thread(target=lambda: (
                link.broadcast(torch.arange(n, dtype=torch.float32), 0, [0, 2]),
                sent.setdefault("done", time.monotonic())))
            sender.start()
        sums = []
        for _ in range(5):
            t = torch.full((1024,), float(rank + 1))
            world.all_reduce_many([t], comm.ReduceOp.SUM)
            sums.append(float(t[0]))
        if rank == 0:
            sender.join(30)
            link.close()
        return sums, sent

    threads, out = run_ranks(ws, body)
    for t in threads:
        t.join(60)
    assert torch.equal(out[2], torch.arange(n, dtype=torch.float32))
    assert out[0][0] == out[1][0] == [3.0] * 5
    assert "done" in out[0][1]


def test_a_group_with_a_member_declared_lost_forms_among_the_others_without_waiting(store):
    """A membership that takes a rank lost since (killed while the round went on) forms its
    group among the others at once, not after the form timeout of a member that never
    comes; the collective then runs among them."""
    port = store.port
    ws = [ElasticGroups(3, r, lambda t: comm.open_store("127.0.0.1", port, timeout_s=t), 60.0,
                        form_timeout_s=30.0) for r in range(3)]
    declare_lost(store, 2, "killed by SIGKILL")

    def body(world, rank):
        if rank == 2:
            return "dead"
        started = time.monotonic()
        world.enter_step(1, [0, 1, 2], epoch=1)
        t = torch.full((4,), float(rank + 1))
        world.all_reduce(t)
        return time.monotonic() - started, t, world.group_ranks()

    threads, out = run_ranks(ws, body)
    for t in threads:
        t.join(60)
    for rank in (0, 1):
        assert not isinstance(out[rank], BaseException), out[rank]
        waited, t, members = out[rank]
        assert waited < 10, waited  # the form timeout is 30 s
        assert torch.equal(t, torch.full((4,), 3.0)) and members == [0, 1]


def test_a_member_lost_while_the_others_form_its_group_does_not_hold_them_the_form_timeout(
        store):
    """A member killed while the others are forming its group (after they began, before it
    came): once it is declared lost they form among themselves, within seconds, not after
    the 30 s form timeout."""
    port = store.port
    ws = [ElasticGroups(3, r, lambda t: comm.open_store("127.0.0.1", port, timeout_s=t), 60.0,
                        form_timeout_s=30.0) for r in range(3)]

    def body(world, rank):
        if rank == 2:
            return "dead"
        started = time.monotonic()
        world.enter_step(1, [0, 1, 2], epoch=1)
        t = torch.full((4,), float(rank + 1))
        world.all_reduce(t)
        return time.monotonic() - started, t, world.group_ranks()

    threads, out = run_ranks(ws, body)
    time.sleep(1.5)  # ranks 0 and 1 are forming the group by now
    assert all(t.is_alive() for t in threads[:2])
    declare_lost(store, 2, "killed by SIGKILL")
    for t in threads:
        t.join(60)
    for rank in (0, 1):
        assert not isinstance(out[rank], BaseException), out[rank]
        waited, t, members = out[rank]
        # 1.5 s before the loss, then a few seconds; the form timeout is 30 s, and a
        # starved machine (the flake hunt's busy processes) took 16 s to get here
        assert waited < 20, waited
        assert torch.equal(t, torch.full((4,), 3.0)) and members == [0, 1]


def test_a_pair_link_whose_source_is_lost_while_it_forms_fails_without_the_form_timeout(store):
    port = store.port
    ws = [ElasticGroups(3, r, lambda t: comm.open_store("127.0.0.1", port, timeout_s=t), 60.0,
                        form_timeout_s=30.0) for r in range(3)]
    link = ws[2].pair_link("late", 0, 2, {0: 0, 2: 0})
    threads, out = run_ranks([ws[2]], lambda world, rank: link.broadcast(torch.zeros(8), 0,
                                                                          [0, 2]))
    started = time.monotonic()
    time.sleep(1.0)
    declare_lost(store, 0, "killed")
    threads[0].join(40)
    assert isinstance(out[0], comm.PeerLost), out[0]
    assert time.monotonic() - started < 20  # the form timeout is 30 s


def test_a_pair_link_fails_on_the_joiner_once_its_source_is_declared_lost(store):
    port = store.port
    ws = [ElasticGroups(3, r, lambda t: comm.open_store("127.0.0.1", port, timeout_s=t), 20.0,
                        form_timeout_s=3.0) for r in range(3)]
    declare_lost(store, 0, "killed")
    link = ws[2].pair_link("gone", 0, 2, {0: 0, 2: 0})
    with pytest.raises(comm.PeerLost, match="rank 0 was lost"):
        link.broadcast(torch.zeros(8), 0, [0, 2])
    with pytest.raises(comm.PeerLost, match="failed earlier"):
        link.broadcast(torch.zeros(8), 0, [0, 2])


def test_a_diloco_copy_rounds_old_is_brought_up_to_date_exactly_by_the_rounds_kept():
    """A joiner's copy of the state may be rounds old when it has arrived: the member keeps
    each round's averaged deltas meanwhile, and the joiner's outer steps on them give the
    member's outer parameters and momentum bit for bit."""
    import copy

    from exogym.strategy import DiLoCoStrategy
    from exogym.strategy.context import RankContext

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    joiner_model = copy.deepcopy(model)
    member = DiLoCoStrategy(H=3, lr=0.01)
    member.setup(RankContext.alone(model, samples_per_step=4))
    joiner = DiLoCoStrategy(H=3, lr=0.01)
    joiner.setup(RankContext.alone(joiner_model, samples_per_step=4))
    assert member.joins_mid_round

    def train(steps):
        for _ in range(steps):
            member.zero_grad()
            x = torch.randn(4, 8)
            model(x).pow(2).mean().backward()
            member.step()

    train(4)  # into the second round
    copied = {"model": {k: v.clone() for k, v in member.synced_model(model.state_dict()).items()},
              "strategy": copy.deepcopy(member.state_dict())}
    assert torch.equal(copied["model"]["0.weight"], member.diloco.master[0])
    member.keep_round_updates(True)
    train(5)  # two rounds end: at steps 6 and 9
    updates = member.round_updates(member.local_step)
    assert [u["step"] for u in updates] == [6, 9]
    member.keep_round_updates(False)
    assert member.round_updates(member.local_step) == []

    joiner_model.load_state_dict(copied["model"])
    joiner.load_state_dict(copied["strategy"])
    for update in updates:
        joiner.apply_round_update(update)
    for a, b in zip(member.diloco.master, joiner.diloco.master):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), joiner_model.parameters()):
        assert torch.equal(a, b)  # the round just ended: every rank holds the outer model
    momentum = [member.diloco.outer_optim.state[m]["momentum_buffer"] for m in member.diloco.master]
    theirs = [joiner.diloco.outer_optim.state[m]["momentum_buffer"] for m in joiner.diloco.master]
    assert all(torch.equal(a, b) for a, b in zip(momentum, theirs))
    joiner.skip_steps(member.local_step - joiner.local_step)
    assert joiner.local_step == member.local_step == 9
    assert joiner.current_lr == member.current_lr


def test_an_async_diloco_joiner_replays_the_merges_it_missed_and_meets_the_members_alike():
    """AsyncDiLoCo merges at any step: a joiner's copy is brought up to date by each step
    kept (its merge, if any, and the workers' rounds as it left them), trains alone without
    merging, and at the round's last step every rank takes it in as the same worker."""
    import copy
    from dataclasses import asdict

    from exogym.strategy import AsyncDiLoCoStrategy
    from exogym.strategy.context import RankContext

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    joiner_model = copy.deepcopy(model)
    member = AsyncDiLoCoStrategy(H=3, lr=0.01, quorum=1)
    member.setup(RankContext.alone(model, num_nodes=2, samples_per_step=4, max_steps=100))
    joiner = AsyncDiLoCoStrategy(H=3, lr=0.01, quorum=1)
    joiner.setup(RankContext.alone(joiner_model, rank=1, num_nodes=2, samples_per_step=4,
                                   max_steps=100))
    assert member.joins_mid_round and member.catches_up_at_entry
    assert not AsyncDiLoCoStrategy(H=3, merge_delay=1).joins_mid_round

    def train(strategy, net, steps):
        for _ in range(steps):
            step = strategy.local_step + 1
            assert strategy.begin_step(step, [0] if strategy is member else [0, 1])
            strategy.zero_grad()
            net(torch.randn(4, 8)).pow(2).mean().backward()
            strategy.step()

    train(member, model, 4)  # a merge at step 3
    copied = {"model": {k: v.clone() for k, v in member.synced_model(model.state_dict()).items()},
              "strategy": copy.deepcopy(member.state_dict())}
    assert torch.equal(copied["model"]["0.weight"], member.master[0])
    member.keep_round_updates(True)
    train(member, model, 5)  # merges at steps 6 and 9
    updates = member.round_updates(member.local_step)
    assert [u["step"] for u in updates] == [5, 6, 7, 8, 9]
    assert [u["deltas"] is not None for u in updates] == [False, True, False, False, True]

    joiner_model.load_state_dict(copied["model"])
    joiner.load_state_dict(copied["strategy"])
    for update in updates:
        joiner.apply_round_update(update)
    joiner.start_late()
    assert joiner.version == member.version == 3
    for a, b in zip(member.master, joiner.master):
        assert torch.equal(a, b)
    for m_a, m_b in zip(member.master, joiner.master):
        assert torch.equal(member.outer_optim.state[m_a]["momentum_buffer"],
                           joiner.outer_optim.state[m_b]["momentum_buffer"])
    for p, m in zip(joiner_model.parameters(), joiner.master):
        assert torch.equal(p, m)  # its round starts from the newest global model
    note = joiner.late_join_note(copied["strategy"], updates)
    assert note == {"version": 3}

    # Alone it trains every step and merges nothing, however long its round.
    joiner.skip_steps(member.local_step - joiner.local_step)
    joiner.train_alone(True)
    train(joiner, joiner_model, 4)
    assert joiner.version == 3 and joiner.workers[1].steps == 4 and joiner.kept is None
    member.keep_round_updates(False)
    train(member, model, 4)  # a merge at step 12: the joiner, alone, knows nothing of it
    assert member.version == 4 and joiner.version == 3
    own = [p.detach().clone() for p in joiner_model.parameters()]
    joiner.train_alone(False)
    # At the round's last step the members admit it, and in their group it takes what
    # every rank holds alike from one of them: the global model, its optimizer and the
    # bookkeeping; its own round stays its own.
    join = {1: {"at": 10, "note": note}}
    member.admit_late(join, 14)
    joiner.take_entry_state(member.entry_state())
    joiner.admit_late(join, 14)
    assert joiner.version == member.version == 4
    for m_a, m_b in zip(member.master, joiner.master):
        assert torch.equal(m_a, m_b)
        assert torch.equal(member.outer_optim.state[m_a]["momentum_buffer"],
                           joiner.outer_optim.state[m_b]["momentum_buffer"])
    assert all(torch.equal(a, b) for a, b in zip(own, joiner_model.parameters()))
    assert {r: asdict(w) for r, w in member.workers.items()} == \
        {r: asdict(w) for r, w in joiner.workers.items()}
    assert asdict(member.workers[1]) == {"steps": 4, "base_version": 3, "credit": 0.0,
                                        "ready": True, "trains": False}
    assert member.round_updates(member.local_step) == []


def test_a_rank_joining_a_round_before_the_members_began_it_reads_their_decision(store):
    """A joiner whose transfer ends at the last step of a round joins the next one: the
    members decide that round, never the joiner (it knows none of the rounds before)."""
    ws, ms = membership(store)
    for m in ms:
        m.admits_mid_round = True
        m.present(1)
    declare_lost(store, 2, "killed")
    for m in ms[:2]:
        m.close_round(5)
    generation = ms[2].acknowledge()
    got = {}
    joiner = threading.Thread(target=lambda: got.setdefault("ok", ms[2].join_late(6, generation)))
    joiner.start()
    time.sleep(0.3)
    assert joiner.is_alive()  # it waits for the members to begin the round
    assert ms[0].present(6) == {0, 1}  # decided by a member: rank 2 was lost
    joiner.join(10)
    assert got["ok"]
    assert ms[2].present(6) == {0, 1, 2} and ms[2].epoch(6) == 6
    assert not ms[2].in_members_group(6) and ms[2].in_members_group(10)
    for m in ms:
        m.close_round(10)
    assert all(m.present(10) == {0, 1, 2} and m.epoch(10) == 10 for m in ms)


def test_a_joiner_stops_waiting_at_once_when_its_source_gives_the_transfer_up(store):
    """A send that fails on the source's side (a broken connection, no rank lost) marks the
    link failed in the store: the joiner stops waiting then, not at gloo's timeout."""
    ws = worlds(store, timeout_s=60.0)
    gens = {0: 0, 2: 0}
    links = {0: ws[0].pair_link("given-up", 0, 2, gens), 2: ws[2].pair_link("given-up", 0, 2, gens)}

    def body(world, rank):
        if rank == 1:
            return None
        first = torch.arange(4.0) if rank == 0 else torch.zeros(4)
        links[rank].broadcast(first, 0, [0, 2])  # the link forms and carries one tensor
        if rank == 0:
            time.sleep(0.5)
            store.set(links[0]._failed_key, "1")  # what a failed send leaves
            return first
        started = time.monotonic()
        with pytest.raises(comm.PeerLost, match="given-up failed"):
            links[2].broadcast(torch.zeros(1 << 20), 0, [0, 2])
        return time.monotonic() - started

    threads, out = run_ranks(ws, body)
    for t in threads:
        t.join(60)
    assert not isinstance(out[2], BaseException), out[2]
    assert out[2] < 5  # the world's timeout is 60 s
