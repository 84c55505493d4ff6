"""A state that several members send a joiner at once, a share each
(:mod:`exogym.membership.handover`): three ranks in threads over one store, two members
and a joiner, with a state of 21M values whose largest tensor is 16 MiB."""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

import pytest
import torch
from ranks import free_port

from exogym import comm
from exogym.comm.elastic_groups import ElasticGroups
from exogym.comm.protocol import PeerTimeoutError
from exogym.membership.attendance import Attendance, _left_to_helpers
from exogym.membership.handover import STRIPE_MIN_BYTES, CopyAhead, share_tag, stripes
from exogym.membership.hosts import ElasticMembership, declare_lost, key

SHAPES = {"emb": (8192, 512), **{f"l{i}": (2048, 2048) for i in range(4)}}


def test_stripes_give_every_tensor_to_one_sender_and_share_the_bytes():
    sizes = [100, 64 << 20, 64 << 20, 300, 16 << 20, 16 << 20, 64 << 20, 32 << 20, 50]
    for count in (1, 2, 3, 4):
        parts = stripes(sizes, count)
        assert len(parts) == count
        assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
        assert all(i in parts[0] for i, s in enumerate(sizes) if s < STRIPE_MIN_BYTES)
        loads = [sum(sizes[i] for i in p) for p in parts]
        # No sender is further from an equal share than the largest tensor.
        assert max(loads) - sum(sizes) / count <= max(sizes), (count, loads)
    assert stripes(sizes, 2) == stripes(list(sizes), 2)  # the same on every rank
    with pytest.raises(ValueError):
        stripes(sizes, 0)


class _Gated:
    """A live tensor whose copy waits for ``gate``: the copying stands still there."""

    def __init__(self, gate: threading.Event):
        self.gate = gate

    def detach(self) -> _Gated:
        return self

    def clone(self) -> torch.Tensor:
        assert self.gate.wait(30), "the copy was never let go on"
        return torch.ones(3)


def test_a_copy_is_sent_as_soon_as_it_is_made_not_once_the_whole_state_is_copied():
    first = torch.arange(1 << 22, dtype=torch.float32)  # 16 MiB
    gate = threading.Event()
    copies = CopyAhead([first, _Gated(gate)], [0, 1], wait_s=30)
    got: dict[int, torch.Tensor] = {}

    def send():
        got[0] = copies[0]  # while the copying waits at tensor 1
        gate.set()
        got[1] = copies[1]

    sender = threading.Thread(target=send)
    sender.start()
    copies.make()
    sender.join(30)
    assert torch.equal(got[1], torch.ones(3))
    first.add_(1)  # the state moves on: what was copied does not
    assert torch.equal(got[0], torch.arange(1 << 22, dtype=torch.float32))
    with pytest.raises(RuntimeError, match=r"tensor 0 .*\(handed out already\)"):
        copies[0]  # each copy goes once it is sent


def test_copying_stops_once_nothing_more_is_sent_and_a_copy_never_made_is_a_clear_error():
    live = [torch.zeros(4), torch.zeros(4)]
    copies = CopyAhead(live, [0, 1], wait_s=0.2)
    with pytest.raises(PeerTimeoutError, match="copy of tensor 1 of the state was not made "
                                               "within 0 s"):
        copies[1]  # make() never ran
    copies.stop()
    copies.make()
    with pytest.raises(RuntimeError, match="tensor 0 of the state was not copied"):
        copies[0]


def test_the_source_leaves_uncopied_a_part_whose_helper_share_the_joiner_took():
    class Link:  # the source's link with the joiner: the joiner took part 1 from its helper
        def __init__(self):
            self.asked: list[str] = []

        def marked(self, tag: str) -> bool:
            self.asked.append(tag)
            return tag == share_tag(1)

    parts = [[0, 3], [1, 4], [2]]
    live = [torch.full((1 << 20,), float(i)) for i in range(5)]
    link = Link()
    copies = CopyAhead(live, [i for part in parts for i in part], 5.0,
                       _left_to_helpers(parts, link))
    copies.make()
    assert copies.skipped == {1, 4}
    assert link.asked == [share_tag(1), share_tag(2)]  # once a part, as the copying reached it
    assert copies.copied_bytes == 3 * (4 << 20)
    for i in (0, 3, 2):
        assert torch.equal(copies[i], live[i])
    with pytest.raises(RuntimeError, match=r"tensor 4 .*\(another member was sending it\)"):
        copies[4]


class FakeMember:
    """A member's state as a hand-over sees it: a model every member holds alike, the outer
    state alike, and optimizer moments of its own."""

    def __init__(self, rank: int, step: int, copied_at: int, shared: dict[str, torch.Tensor],
                 updates: list[dict]):
        self.rank = rank
        self.step = step
        self.copied_at = copied_at
        self.model = {k: v.clone() for k, v in shared.items()}
        self.momentum = [v.clone() * 0.5 for v in shared.values()]
        self.moments = {i: {"step": torch.tensor(float(step)),
                            "exp_avg": torch.full(SHAPES[k], float(10 * rank + i)),
                            "exp_avg_sq": torch.full(SHAPES[k], float(10 * rank + i + 100))}
                        for i, k in enumerate(SHAPES)}
        self.updates = updates
        self.kept: list[dict] | None = None
        self.adopted = None
        self.caught_up: list[dict] = []
        self.on_round_updates: Any = None  # called as its updates are read

    def join_state(self, copy: bool = True) -> dict:
        state = {"model": self.model,
                 "strategy": {"optim": {"state": self.moments, "param_groups": [{"lr": 0.1}]},
                              "master": list(self.model.values()), "momentum": self.momentum},
                 "step": self.copied_at, "max_steps": 100, "data": {"position": self.step},
                 "sim_time_s": 0.0}
        if not copy:
            return state
        return {"model": {k: v.clone() for k, v in self.model.items()},
                "strategy": {"optim": {"state": {i: {k: v.clone() for k, v in m.items()}
                                                 for i, m in self.moments.items()},
                                       "param_groups": [{"lr": 0.1}]},
                             "master": [v.clone() for v in self.model.values()],
                             "momentum": [v.clone() for v in self.momentum]},
                "step": self.copied_at, "max_steps": 100, "data": {"position": self.step},
                "sim_time_s": 0.0}

    def handed_state(self) -> dict:
        return self.join_state(copy=False)

    def steps_done(self) -> int:
        return self.step

    def keep_round_updates(self, keep: bool) -> None:
        self.kept = list(self.updates) if keep else None

    def round_updates(self, through_step: int) -> list[dict]:
        if self.on_round_updates is not None:
            self.on_round_updates()
        return [u for u in self.kept or [] if u["step"] <= through_step]

    def late_join_note(self, state, updates) -> dict:
        return {}

    def adopt_state(self, state, reshard, at_step=None) -> None:
        self.adopted = state

    def catch_up(self, updates, start=True) -> None:
        self.caught_up = list(updates)


def _world() -> tuple[Any, list[ElasticMembership], dict[str, torch.Tensor]]:
    """Ranks 0 and 1 members at step 7 of a round of steps 6-10, rank 2 lost: the store
    (kept by the caller while the ranks run), their memberships and the model every member
    holds alike."""
    server = comm.open_store("127.0.0.1", free_port(), is_master=True, timeout_s=60)
    port = server.port
    ws = [ElasticGroups(3, r, lambda t: comm.open_store("127.0.0.1", port, timeout_s=t), 60.0,
                        form_timeout_s=30.0) for r in range(3)]
    ms = [ElasticMembership(w, r, 3, 5, 2) for r, w in enumerate(ws)]
    for r, m in enumerate(ms):
        server.set(key("host", r), "h")
        m.admits_mid_round = True
        m.max_steps = 100
        m.present(1)
    declare_lost(server, 2, "killed")
    assert ms[0].present(6) == {0, 1} and ms[1].present(6) == {0, 1}
    torch.manual_seed(0)
    shared = {k: torch.randn(s) for k, s in SHAPES.items()}
    return server, ms, shared


class Run(NamedTuple):
    taken: dict  # the joiner's hand-over event
    joiner: FakeMember
    events: list[dict]
    atts: list[Attendance]
    server: Any  # the store, kept while the ranks' threads may use it


def _run(copied_at: dict[int, int], while_waiting: bool = False, serving: tuple = (0, 1),
         close_during_updates: bool = False) -> Run:
    """Ranks 0 and 1 members at step 7 of a round of steps 6-10 (copies of the state taken
    after ``copied_at`` steps), rank 2 back during it: it takes the state.
    ``while_waiting``: the members serve only as they do while they wait for a collective,
    on the thread that trains. ``serving``: the members that look for requests."""
    server, ms, shared = _world()
    # The rounds' updates every member applied alike since the copies (steps 6 and 7 here).
    updates = [{"step": s, "deltas": [torch.full((1 << 20,), float(s))]} for s in (6, 7)]
    members = [FakeMember(r, 7, copied_at[r], shared, updates) for r in (0, 1)]
    joiner = FakeMember(2, 0, 0, {k: torch.zeros(s) for k, s in SHAPES.items()}, [])
    if close_during_updates:  # a member reaches the round's last step as the updates travel
        members[1].on_round_updates = lambda: ms[1].close_round(10)
    events: list[dict] = []
    lock = threading.Lock()

    def emit(event):
        with lock:
            events.append(event)

    atts = [Attendance(m, r, emit) for r, m in enumerate(ms)]
    for a in atts:
        a.mid_round = True
    done = threading.Event()

    def serve(r):
        att = atts[r]
        if while_waiting:
            att._trainer = threading.get_ident()
            att._serving = members[r]
        while not done.is_set():
            att._next_poll = 0.0
            if while_waiting:
                att._serve_while_waiting()
            else:
                att._serve(members[r])
            time.sleep(0.02)
        for thread, _ in atts[r]._senders.values():
            thread.join(60)

    servers = [threading.Thread(target=serve, args=(r,)) for r in serving]
    for t in servers:
        t.start()
    generation = ms[2].acknowledge()
    try:
        step = atts[2]._join_late(generation, joiner)
    finally:
        done.set()
        for t in servers:
            t.join(90)
    assert step == 8
    taken = [e for e in events if e["rank"] == 2]
    assert len(taken) == 1
    return Run(taken[0], joiner, events, atts, server)


@pytest.mark.slow
def test_a_joiner_takes_a_share_of_the_state_and_of_each_update_from_each_member():
    taken, joiner, events, atts, _ = _run({0: 5, 1: 5})
    state = joiner.adopted
    got_from = taken["from"]
    assert set(got_from) == {"0", "1"} and min(got_from.values()) > 40 << 20, got_from
    assert taken["bytes"] == sum(got_from.values())
    torch.manual_seed(0)
    shared = {k: torch.randn(s) for k, s in SHAPES.items()}
    # What every member holds alike arrives whole, from whichever member sent it.
    for k, v in shared.items():
        assert torch.equal(state["model"][k], v)
    for got, want in zip(state["strategy"]["master"], shared.values()):
        assert torch.equal(got, want)
    for got, want in zip(state["strategy"]["momentum"], shared.values()):
        assert torch.equal(got, want * 0.5)
    # Each moment is one member's own, and both members gave some.
    sources = set()
    for i, moments in state["strategy"]["optim"]["state"].items():
        for name, base in (("exp_avg", i), ("exp_avg_sq", i + 100)):
            value = float(moments[name].view(-1)[0])
            assert value in (base, base + 10), (i, name, value)
            assert torch.all(moments[name] == value)
            sources.add(value >= base + 10)
    assert sources == {True, False}
    assert state["step"] == 5 and state["strategy"]["optim"]["param_groups"] == [{"lr": 0.1}]
    # The rounds' updates came in order, each in parts from both members.
    assert [u["step"] for u in joiner.caught_up] == [6, 7]
    assert [float(u["deltas"][0][0]) for u in joiner.caught_up] == [6.0, 7.0]
    given = [e for e in events if e["rank"] == 0]
    assert given and given[0]["during_round"] and given[0]["rounds_caught_up"] == 2
    # The joiner told the source it took rank 1's share, on their link.
    assert atts[2]._intake.links[0].marked(share_tag(1))


@pytest.mark.slow
def test_a_share_copied_after_another_round_ended_comes_from_the_source_instead():
    """Rank 1 copied its share after the round that ends at step 10: what every member holds
    alike was no longer the source's, so the source sends every tensor."""
    taken, joiner, _, _, _ = _run({0: 5, 1: 10})
    assert set(taken["from"]) == {"0"}, taken["from"]
    state = joiner.adopted
    for i, moments in state["strategy"]["optim"]["state"].items():
        assert torch.all(moments["exp_avg"] == float(i))  # rank 0's own
    assert [u["step"] for u in joiner.caught_up] == [6, 7]


@pytest.mark.slow
def test_a_round_that_closes_while_the_updates_travel_still_takes_the_joiner_in():
    """The joiner enters the round under way before its updates arrive: a member that
    closes the round's record meanwhile (it reached the round's last step) reads the joiner
    in it, instead of the joiner finding it closed and chasing the next round."""
    taken, joiner, _, _, _ = _run({0: 5, 1: 5}, close_during_updates=True)
    assert taken["step"] == 8
    assert [u["step"] for u in joiner.caught_up] == [6, 7]
    assert [r["entered"] for r in taken["timing"]["rounds"]] == [True]


@pytest.mark.slow
def test_members_serve_a_request_while_they_wait_for_a_collective_on_the_thread_that_trains():
    taken, joiner, _, _, _ = _run({0: 5, 1: 5}, while_waiting=True)
    assert set(taken["from"]) == {"0", "1"}
    assert [u["step"] for u in joiner.caught_up] == [6, 7]


def test_a_wait_serves_nothing_off_the_training_thread_or_outside_a_members_step():
    served = []
    att = Attendance(None, 0, lambda event: None)
    att._serve = served.append  # what a served request would call
    att._serve_while_waiting()  # no step under way
    att._serving = "member"
    other = threading.Thread(target=att._serve_while_waiting)
    other.start()
    other.join()
    assert served == []
    att._serve_while_waiting()
    assert served == ["member"]


def test_a_members_collective_calls_its_hook_while_it_waits(monkeypatch):
    """The hook runs between the wait's slices, on the waiting rank's thread, while a slow
    member has not yet come to the collective."""
    server = comm.open_store("127.0.0.1", free_port(), is_master=True, timeout_s=30)
    port = server.port
    ws = [ElasticGroups(2, r, lambda t: comm.open_store("127.0.0.1", port, timeout_s=t), 30.0)
          for r in range(2)]
    calls: list[int] = []
    ws[0].while_waiting = lambda: calls.append(threading.get_ident())
    out = {}

    def rank(r):
        ws[r].enter_step(1, [0, 1])
        if r == 1:
            time.sleep(1.5)
        t = torch.full((4,), float(r + 1))
        ws[r].all_reduce_many([t], comm.ReduceOp.SUM)
        out[r] = (float(t[0]), threading.get_ident())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out[0][0] == out[1][0] == 3.0
    assert len(calls) >= 3 and set(calls) == {out[0][1]}


@pytest.mark.slow
def test_a_joiners_thread_for_a_helper_that_never_came_ends_once_its_share_is_given_up():
    """Rank 1 never reads its request: the source sends its share, and the joiner's thread
    waiting for rank 1's link to form ends at once, not at the form timeout (30 s)."""
    run = _run({0: 5, 1: 5}, serving=(0,))
    assert set(run.taken["from"]) == {"0"}
    helper = run.atts[2]._intake.helpers[0]
    helper.join(3)
    assert not helper.is_alive()
    assert "given up before it formed" in str(helper.error)


MEMBER_DONE_MID_TRANSFER = """
import threading, time
from test_stripes import FakeMember, _world
from exogym.membership.attendance import Attendance, _left_to_helpers
from exogym.membership.handover import send_description

server, ms, shared = _world()
member = FakeMember(0, 7, 5, shared, [])
att = Attendance(ms[0], 0, lambda event: None)
att.mid_round = True
generation = ms[2].acknowledge()
name = ms[2].ask_state(0, generation, {"helpers": []})
_, decided = ms[2].current_round()
link = ms[2].world.pair_link(name, 0, 2, {0: int(decided["gens"]["0"]), 2: generation})
described = threading.Event()

def joiner():  # takes the description, then nothing more
    send_description(link.broadcast, 0, [0, 2], 2, None)
    described.set()

threading.Thread(target=joiner, daemon=True).start()
att._serve(member)
assert described.wait(60)
time.sleep(1.0)  # the member's thread now waits for a joiner that takes no tensor
thread = att._senders["state"][0]
assert thread.is_alive()
started = time.monotonic()
att.close()
print(f"closed in {time.monotonic() - started:.2f} s, thread alive: {thread.is_alive()}")
ms[0].world.close()
"""


@pytest.mark.slow
def test_a_rank_done_while_its_thread_hands_the_state_over_stops_it_and_exits_cleanly(
        tmp_path):
    """A thread left waiting in a collective when the process exits ends the process with
    an abort (SIGABRT) after the run is done: closing the rank gives the transfer up, and
    the thread ends within a loss check's slices."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    script = tmp_path / "member_done.py"
    script.write_text(MEMBER_DONE_MID_TRANSFER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    line = [x for x in done.stdout.splitlines() if x.startswith("closed in")]
    assert line and line[0].endswith("thread alive: False"), done.stdout
    assert float(line[0].split()[2]) < 3.0, line
    assert "terminate called" not in done.stderr
