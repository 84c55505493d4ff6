"""Faults injected into runs across hosts: the spec, its refusals, the plan, what records them,
and one real run on network-namespace hosts that a kill, a freeze, a slow-down and a cut hit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from io import StringIO
from pathlib import Path

import pytest
from ranks import ROOT, free_port
from rich.console import Console
from typer.testing import CliRunner

from cli_typer import app
from distributed.app.dashboard import Dashboard
from distributed.app.web.state import WebState
from distributed.hosts.hostsfile import load_hosts
from distributed.hosts.onhost import inject as onhost
from distributed.launch.faults import (
    KILL_AWAY_S,
    FaultSpecError,
    describe_fault_event,
    parse_every,
    parse_fault,
    parse_faults,
    plan_faults,
)
from distributed.worker.throttle import FileThrottle
from exogym.report.trace import TraceWriter, read_trace
from exogym.run.timing import THROTTLE_SLICE_S, StepTimer

HOSTS = {"master": "127.0.0.1", "workers": ["127.0.0.2", "127.0.0.3"], "ssh_user": "u",
         "python_env": sys.executable, "project_path": str(ROOT), "master_port": free_port()}


@pytest.fixture
def config():
    return load_hosts(HOSTS)


def plan(inject, config, *, max_steps=1000, min_nodes=2, **kw):
    return plan_faults(inject, config, max_steps=max_steps, min_nodes=min_nodes, **kw)


# --------------------------------------------------------------------------- the spec


def test_each_kind_parses_with_its_time_duration_and_factor():
    kill = parse_fault("kill:127.0.0.3@step=300")
    assert (kill.kind, kill.target, kill.at_step, kill.at_s, kill.duration_s) == \
        ("kill", "127.0.0.3", 300, None, None)
    freeze = parse_fault("freeze:2@60s+20s")
    assert (freeze.kind, freeze.target, freeze.at_s, freeze.duration_s) == ("freeze", "2", 60, 20)
    slow = parse_fault("slow:1@step=100x0.5")
    assert (slow.factor, slow.duration_s, slow.at_step) == (0.5, None, 100)
    assert parse_fault("slow:1@30s+20sx0.25").duration_s == 20
    assert parse_fault("slow:1@30sx0.25+20s").factor == 0.25
    cut = parse_fault("cut:2@step=500+15s")
    assert (cut.kind, cut.at_step, cut.duration_s) == ("cut", 500, 15)
    assert parse_fault("freeze:2@1.5s+.5s").at_s == 1.5
    reboot = parse_fault("kill:2@90s+30s")  # a host that reboots: down 30 s, then restarted
    assert (reboot.kind, reboot.at_s, reboot.duration_s) == ("kill", 90, 30)


def test_a_kill_that_keeps_its_host_down_is_told_as_one():
    who = {"what": "kill", "host": "127.0.0.3", "ranks": [2], "step": 40, "at_s": 12.0}
    assert describe_fault_event({**who, "phase": "start", "duration_s": 30}) == \
        "injected kill on 127.0.0.3 (rank 2), its host down 30 s at step 40, 12.0 s into training"
    assert describe_fault_event({**who, "phase": "end"}) == \
        "injected kill on 127.0.0.3 (rank 2): its host is up again at step 40, 12.0 s into training"


def test_repeated_options_and_comma_lists_both_give_every_spec():
    specs = parse_faults(["kill:1@step=10,freeze:2@5s+3s", "slow:1@step=20x0.5"])
    assert [s.kind for s in specs] == ["kill", "freeze", "slow"]


@pytest.mark.parametrize("text, words", [
    ("explode:1@step=3", ["unknown kind 'explode'", "kill, freeze, slow, cut"]),
    ("kill1@step=3", ["no KIND:"]),
    ("kill:1", ["no @WHEN"]),
    ("kill:@step=3", ["no target"]),
    ("kill:1@step=x", ["'step=x' is neither step=N nor a number of seconds"]),
    ("kill:1@10", ["'10' is neither"]),
    ("kill:1@step=0", ["step=0: the step must be 1 or more"]),
    ("freeze:1@10s", ["freeze needs a duration +Ds"]),
    ("cut:1@10s", ["cut needs a duration"]),
    ("freeze:1@10s+0s", ["a duration must be more than 0 s"]),
    ("freeze:1@10s+5", ["'+5' after the time"]),
    ("slow:1@10s", ["slow needs its speed factor"]),
    ("slow:1@10sx1.5", ["x1.5: the speed factor must be between 0 and 1"]),
    ("slow:1@10sx0", ["x0: the speed factor must be between 0 and 1"]),
    ("kill:1@10sx0.5", ["only slow takes a speed factor"]),
    ("freeze:1@10s+5s+6s", ["two durations"]),
])
def test_a_malformed_spec_is_refused_naming_it_and_what_is_accepted(text, words):
    with pytest.raises(FaultSpecError) as caught:
        parse_fault(text)
    message = str(caught.value)
    assert repr(text) in message and "Accepted: KIND:TARGET@WHEN" in message
    for word in words:
        assert word in message, message


def test_an_empty_item_of_a_comma_list_is_refused():
    with pytest.raises(FaultSpecError, match="an empty spec"):
        parse_faults(["kill:1@step=3,,freeze:2@5s+3s"])


def test_every_takes_seconds_or_minutes_and_refuses_the_rest():
    assert parse_every("30s") == 30 and parse_every("2m") == 120 and parse_every("45") == 45
    assert parse_every(None) == 30
    for bad, word in (("soon", "give seconds such as 30s"), ("3s", "at least 6 s")):
        with pytest.raises(FaultSpecError, match=word):
            parse_every(bad)


# --------------------------------------------------------------------------- the plan


def test_targets_resolve_to_a_hosts_ranks_or_a_rank(config):
    p = plan(["kill:127.0.0.3@step=300", "freeze:1@60s+5s"], config)
    assert [(f.host, f.ranks) for f in p.faults] == [("127.0.0.3", (2,)), ("127.0.0.2", (1,))]
    assert p.has_slow is False and p.cut_hosts == ()
    assert "kill 127.0.0.3 (rank 2) at step 300" in p.describe()[0]


@pytest.mark.parametrize("inject, kw, words", [
    (["kill:127.0.0.9@step=3"], {}, ["'127.0.0.9' is not a host of the hosts file",
                                     "127.0.0.1, 127.0.0.2, 127.0.0.3", "0..2"]),
    (["kill:7@step=3"], {}, ["there is no rank 7", "ranks 0..2"]),
    (["kill:1@step=1000"], {}, ["step 1000 is not before max_steps=1000", "from 1 to 999"]),
    (["kill:1@step=5000"], {}, ["step 5000 is not before max_steps=1000"]),
    (["cut:127.0.0.1@5s+5s"], {}, ["127.0.0.1 is the master host"]),
    (["cut:0@5s+5s"], {}, ["is the master host"]),
    (["kill:1@step=3"], {"min_nodes": None}, ["the kill would end the run",
                                              "--min-nodes N", "--max-restarts N"]),
    (["freeze:1@10s+20s", "freeze:2@15s+5s"], {}, ["away at once at 15 s",
                                                    "fewer than min_nodes=2 of 3"]),
    (["kill:1@10s", "cut:2@40s+5s"], {}, ["away at once at 40 s",
                                          f"a kill counts {KILL_AWAY_S:g} s away"]),
    (["kill:1@step=50", "freeze:2@step=50+5s"], {}, ["away at step 50 at once"]),
    # a kill whose host stays down 30 s is away its restart's 60 s and those 30 s
    (["kill:1@10s+30s", "cut:2@85s+5s"], {}, ["away at once at 85 s", "more its +Ds"]),
    (["kill:1@step=3+30s"], {"min_nodes": None, "max_restarts": 1},
     ["a kill with a duration keeps its host down 30 s", "needs --min-nodes N"]),
    (["freeze:1@10s+5s"], {"min_nodes": 3}, ["leaving fewer than min_nodes=3 of 3"]),
    ([], {"every": "30s"}, ["--every '30s' without --inject-random"]),
    ([], {"random_seed": 4, "min_nodes": None}, ["--inject-random 4", "needs --min-nodes",
                                                 "unset"]),
    ([], {"random_seed": 4, "min_nodes": 3}, ["below its 3 ranks"]),
    ([], {"random_seed": 4, "every": "2s"}, ["at least 6 s"]),
])
def test_faults_that_cannot_run_are_refused_before_anything_starts(config, inject, kw, words):
    with pytest.raises(FaultSpecError) as caught:
        plan(inject, config, **kw)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def test_faults_apart_in_time_or_leaving_enough_ranks_are_accepted(config):
    p = plan(["freeze:1@10s+5s", "freeze:2@15s+5s", "kill:1@step=50", "cut:2@step=60+5s",
              "slow:1@step=50x0.5", "slow:2@step=50x0.5"], config)
    assert len(p.faults) == 6
    # Without min_nodes every rank is needed, yet a freeze or a cut only holds the run up.
    assert plan(["freeze:1@10s+5s", "freeze:2@10s+5s"], config, min_nodes=None)
    assert plan(["kill:1@step=3"], config, min_nodes=None, max_restarts=1)
    assert plan(["kill:1@10s+30s", "cut:2@101s+5s"], config)  # after its 60 + 30 s
    assert "kill 127.0.0.2 (rank 1) 10 s after training started, its host down 30 s" in \
        plan(["kill:1@10s+30s"], config).describe()[0]


def test_random_faults_are_a_fixed_sequence_for_a_seed_in_their_documented_ranges(config):
    p = plan([], config, random_seed=7, every="30s")
    r = p.random
    assert r.kinds == ("kill", "freeze", "slow", "cut")
    assert r.targets == ("127.0.0.1", "127.0.0.2", "127.0.0.3")
    assert r.cut_targets == ("127.0.0.2", "127.0.0.3")  # never the master

    def first(n, plan_):
        draws = plan_.random.draws()
        return [next(draws) for _ in range(n)]

    drawn = first(400, p)
    assert [(i, s.text) for i, s in drawn[:20]] == \
        [(i, s.text) for i, s in first(20, plan([], config, random_seed=7, every="30s"))]
    assert [s.text for _, s in drawn[:20]] != \
        [s.text for _, s in first(20, plan([], config, random_seed=8, every="30s"))]
    assert all(20 <= interval <= 40 for interval, _ in drawn)
    assert {s.kind for _, s in drawn} == {"kill", "freeze", "slow", "cut"}
    for _, s in drawn:
        assert s.random and s.ranks and s.host in r.targets
        if s.kind in ("freeze", "cut"):
            assert 5 <= s.duration_s <= 15
        if s.kind == "cut":
            assert s.host != "127.0.0.1"
        if s.kind == "slow":
            assert 10 <= s.duration_s <= 30 and 0.25 <= s.factor <= 0.75
    # A host that refuses cuts is left out of them; none left, no cut is drawn.
    assert p.without_random_cuts(["127.0.0.2"]).random.cut_targets == ("127.0.0.3",)
    none = p.without_random_cuts(["127.0.0.2", "127.0.0.3"])
    assert none.random.kinds == ("kill", "freeze", "slow")
    assert "cut" not in {s.kind for _, s in first(100, none)}


# --------------------------------------------------------------------------- the command line


def test_the_command_line_refuses_bad_faults_before_connecting_to_anything(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({**HOSTS, "master": "203.0.113.6",
                                 "workers": ["203.0.113.7", "203.0.113.8"]}))
    runner = CliRunner()
    cases = [
        (["--inject", "boom:1@step=3", "--min-nodes", "2"], "unknown kind 'boom'"),
        (["--inject", "kill:203.0.113.9@step=3", "--min-nodes", "2"],
         "'203.0.113.9' is not a host"),
        (["--inject", "kill:1@step=99999", "--min-nodes", "2"], "not before max_steps"),
        (["--inject", "freeze:1@5s+30s,freeze:2@10s+3s", "--min-nodes", "2"], "at once"),
        (["--every", "30s"], "without --inject-random"),
        (["--inject-random", "3"], "needs --min-nodes"),
        (["--inject", "cut:203.0.113.6@5s+5s", "--min-nodes", "2"], "is the master host"),
        (["--inject-random", "3", "--min-nodes", "2", "--failures", "kill"],
         "--failures 'kill' without --mtbf"),
        (["--inject-random", "3", "--min-nodes", "2", "--mtbf", "2m", "--failures", "boom"],
         "give a comma list of kill, freeze, cut"),
    ]
    for args, words in cases:
        started = time.monotonic()
        result = runner.invoke(app, ["distributed-train", "digits-diloco", "--hosts",
                                     str(hosts), "--ssh-timeout", "1", *args])
        assert result.exit_code == 2, (args, result.output)
        assert words in result.output, (args, result.output)
        assert "Traceback" not in result.output
        assert time.monotonic() - started < 10  # refused at once: no host was tried
    local = runner.invoke(app, ["distributed-train", "digits-diloco", "--inject",
                                "kill:1@step=3"])
    assert local.exit_code == 2 and "give --hosts" in local.output, local.output
    local = runner.invoke(app, ["distributed-train", "digits-diloco", "--failures", "kill"])
    assert local.exit_code == 2 and "--failures" in local.output, local.output


def test_the_command_of_a_run_with_failures_keeps_them(tmp_path):
    from distributed.app.run import TrainRequest, train_command

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(HOSTS))
    request = TrainRequest("digits-diloco", hosts=str(hosts), inject_random=4,
                           inject_mtbf="2m", inject_down="30s", inject_failures="kill,freeze")
    words = train_command(request).split()
    assert words[words.index("--failures") + 1] == "kill,freeze"
    assert words[words.index("--mtbf") + 1] == "2m" and request.injects


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    from sshd_fixture import serve_sshd

    yield from serve_sshd(tmp_path_factory)


@pytest.mark.slow
def test_a_cut_of_a_host_that_shares_this_machines_network_is_refused_before_start(
        sshd, tmp_path):
    """127.0.0.2 is this machine under another address: a firewall cut there would cut
    every host off. It is asked after pre-flight and refused before any rank starts."""
    from faces_support import sshd_hosts

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(sshd_hosts(sshd)))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "distributed-train", "digits-diloco", "--hosts", str(hosts), "--min-nodes", "2",
        "--known-hosts", str(sshd.known_hosts), "--ssh-config", str(sshd.ssh_config),
        "--set", f"output_dir={out}", "--run-dir", str(tmp_path / "launch"),
        "--inject", f"cut:{sshd.addresses[0]}@5s+5s"])
    assert result.exit_code == 2, result.output
    assert f"the launcher may not cut {sshd.addresses[0]}" in result.output
    assert "shares this machine's network stack" in result.output
    assert not (tmp_path / "launch").exists() and not out.exists()  # nothing started


# --------------------------------------------------------------------------- what records them


def fault_events():
    common = {"event": "fault", "injected": True, "what": "freeze", "target": "2",
              "host": "127.0.0.3", "ranks": [2], "spec": "freeze:2@5s+3s", "duration_s": 3.0,
              "id": 0}
    return [{**common, "phase": "start", "step": 40, "at_s": 5.1, "delayed_s": 0.0},
            {**common, "phase": "end", "step": 90, "at_s": 8.2},
            {"event": "fault", "injected": True, "what": "kill", "target": "1",
             "host": "127.0.0.2", "ranks": [1], "spec": "kill:1@step=500", "id": 1,
             "phase": "not_fired", "step": 120, "at_s": 9.0,
             "reason": "the run ended before its step"}]


def test_the_trace_records_injected_faults_with_their_time_step_and_target(tmp_path):
    tracer = TraceWriter()
    tracer.start(tmp_path / "trace.jsonl", source="hosts", num_nodes=3, config={})
    for event in fault_events():
        tracer.on_event(event)
    lines = [line for line in read_trace(tracer.end()) if line["kind"] == "fault"]
    assert [(x["what"], x["phase"], x["step"], x["injected"]) for x in lines] == \
        [("freeze", "start", 40, True), ("freeze", "end", 90, True),
         ("kill", "not_fired", 120, True)]
    assert all(isinstance(x["t"], float) and x["host"] for x in lines)


def test_both_dashboards_and_the_summary_show_injected_faults():
    out = StringIO()
    board = Dashboard(3, ["127.0.0.1", "127.0.0.2", "127.0.0.3"], live=False,
                      console=Console(file=out, width=200))
    board.on_event(fault_events()[0])
    assert [f["state"] for f in board.faults.active()] == ["active"]
    assert "under way: freeze on 127.0.0.3" in str(board.render().caption)
    for event in fault_events()[1:]:
        board.on_event(event)
    summary = board.summary(1.0)
    assert [(f["what"], f["state"]) for f in summary["faults"]] == \
        [("freeze", "done"), ("kill", "not fired")]
    board.finish(summary)
    text = out.getvalue()
    assert "injected freeze on 127.0.0.3 (rank 2) for 3 s at step 40, 5.1 s into training" in text
    assert "injected faults" in text and "not fired: the run ended before its step" in text
    web = WebState()
    web.begin_run("digits-diloco", {}, 3, ["127.0.0.1", "127.0.0.2", "127.0.0.3"])
    for event in fault_events():
        web.on_event(event)
    run = web.view()["runs"][0]
    assert [f["what"] for f in run["faults"]] == ["freeze", "kill"]
    assert run["fault_lines"][1].startswith("injected freeze on 127.0.0.3 (rank 2) ended")
    page = (ROOT / "distributed/app/web/static/app.js").read_text()
    assert "fault_lines" in page and 'getElementById("faults")' in page


# --------------------------------------------------------------------------- the rank's throttle


def test_a_throttle_file_slows_a_rank_by_its_factor_and_lets_it_go(tmp_path):
    path = tmp_path / "inject" / "rank1.json"
    throttle = FileThrottle(path, 1)
    assert throttle.factor() == 1.0  # no file: full speed
    onhost.throttle(str(path), 0.25, 3)
    throttle._checked = float("-inf")
    assert throttle.factor() == 0.25
    # One thread: the step's compute is its CPU time, which a busy machine does not stretch
    # as it stretches the wall clock.
    timer = StepTimer(None, one_thread=True, speed_mode="wall", alone_on_machine=True,
                      throttle=throttle)
    mark = timer.mark()
    busy = time.thread_time() + 0.02
    while time.thread_time() < busy:
        pass
    event = {"compute_s": 0.02}
    started = time.perf_counter()
    slept = timer.throttle_step(mark, event)
    assert 0.055 <= slept <= 0.2, slept  # three times the ~20 ms of work
    assert time.perf_counter() - started >= slept * 0.9
    assert event["throttle"] == 0.25 and event["compute_s"] == pytest.approx(0.02 + slept)
    time.sleep(0.01)  # a new mtime
    onhost.throttle(str(path), 1.0, 3)
    throttle._checked = float("-inf")
    assert throttle.factor() == 1.0
    assert timer.throttle_step(timer.mark(), {}) == 0.0


def test_a_slow_down_that_ends_mid_sleep_cuts_the_sleep_short():
    """A rank slowed to a hundredth owes some 2 s of sleep for 20 ms of work; when its
    factor comes back to 1 a quarter of a second in, it sleeps no more than a slice
    beyond that, and when it eases to a half it owes only what a half owes."""

    class Changing:
        def __init__(self, factors: list[tuple[float, float]]) -> None:
            self.started: float | None = None  # the first look, as the step's sleep starts
            self.factors = factors  # (from this many seconds in, the factor)

        def factor(self) -> float:
            if self.started is None:
                self.started = time.perf_counter()
            now = time.perf_counter() - self.started
            return [f for at, f in self.factors if now >= at][-1]

    def work(timer: StepTimer):
        mark = timer.mark()
        busy = time.thread_time() + 0.02
        while time.thread_time() < busy:
            pass
        return mark

    ends = Changing([(0.0, 0.01), (0.25, 1.0)])
    timer = StepTimer(None, one_thread=True, speed_mode="wall", alone_on_machine=True,
                      throttle=ends)
    event = {"compute_s": 0.02}
    slept = timer.throttle_step(work(timer), event)
    # A slice sleeps at least its length, so the factor was last read as 0.01 less than
    # 0.25 s in: one slice more at most, however busy the machine (not the 2 s first owed).
    assert THROTTLE_SLICE_S <= slept < 0.25 + THROTTLE_SLICE_S + 1e-9, slept
    assert event["throttle"] == 0.01 and event["compute_s"] == pytest.approx(0.02 + slept)
    eases = Changing([(0.0, 0.01), (0.15, 0.5)])
    timer = StepTimer(None, one_thread=True, speed_mode="wall", alone_on_machine=True,
                      throttle=eases)
    slept = timer.throttle_step(work(timer), {})
    # a half owes as much sleep as the work took (~20 ms): more has been slept already
    assert THROTTLE_SLICE_S <= slept < 0.15 + THROTTLE_SLICE_S + 1e-9, slept


def test_the_on_host_script_signals_freezes_and_thaws_a_process_group():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    try:
        assert onhost.freeze(child.pid, 0.5) == {"ok": True}
        state = lambda: Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]  # noqa: E731
        assert state() == "T"
        deadline = time.monotonic() + 10
        while state() == "T":
            assert time.monotonic() < deadline, "not thawed by the host's own timer"
            time.sleep(0.05)
        assert onhost.send(child.pid, "KILL", False) == {"ok": True}
        assert child.wait(timeout=10) == -9
        assert "no process" in onhost.send(child.pid, "KILL", False)["error"]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# --------------------------------------------------------------------------- a real run


@pytest.mark.slow(
    reason="four faults fired in turn on hosts in network namespaces, each held 4 s, each "
           "waited out")
def test_a_run_on_namespace_hosts_survives_an_injected_kill_freeze_slow_and_cut(tmp_path):
    """Three hosts (this machine as master, two namespaces), min_nodes=2, through the
    command line: every fault fires, the run exits 0, and the trace and summary.json
    record the faults; the cut is made by nftables or iptables in the host's namespace."""
    from netbed import Testbed, check_requirements
    from netns import netns_available

    missing = netns_available() or "; ".join(check_requirements(pin=False))
    if missing:
        pytest.skip(missing)
    can_cut = onhost.cut_tool() is not None
    out = tmp_path / "run"
    with Testbed(2, subnet="10.213.95", pin=False) as bed:
        config = bed.hosts_config(free_port(), launcher_is_master=True)
        hosts = tmp_path / "hosts.json"
        hosts.write_text(json.dumps(config))
        second, third = (h.address for h in bed.hosts)  # ranks 1 and 2
        # The slow lasts 8 s: some 110 steps at a quarter of the speed, so that its span
        # holds a whole 50-step block of the trace wherever it fires.
        inject = ["slow:1@step=300x0.25+8s", f"kill:{third}@step=500+4s",
                  "freeze:1@step=501+5s"]
        if can_cut:
            inject.append(f"cut:{third}@step=502+5s")
        command = [sys.executable, "cli_typer.py", "distributed-train", "digits-diloco",
                   "--hosts", str(hosts), "--min-nodes", "2", "--lost-after", "3",
                   "--known-hosts", str(bed.known_hosts), "--ssh-config", str(bed.ssh_config),
                   "--run-dir", str(tmp_path / "launch"), "--inject", ",".join(inject)]
        for pair in ("max_steps=2500", "val_interval=1000", "val_size=256", "num_threads=1",
                     "checkpoint_interval=None", "num_nodes=3", f"output_dir={out}"):
            command += ["--set", pair]
        # Each fault waits for the last one's host to be back, some 10 s for a kill: the
        # ranks train at a fiftieth of their speed (their throttle files) from the kill
        # until the last fault is over and its host trains again, then at full speed to the
        # end, so that 2,500 steps outlast the faults however busy the machine.
        run = _LiveRun(command, tmp_path / "stderr.txt")
        try:
            last = "cut" if can_cut else "freeze"
            run.wait_for("injected kill on", 240)
            # the slow's file is written by the time its start is told (a busy launcher
            # may fire the kill first: each waits for its own rank's step)
            run.wait_for("injected slow on", 240)
            throttles = _throttle_files(tmp_path / "launch", ranks=3)
            for path in throttles:
                _set_factor(path, 0.02)
            run.wait_for(f"injected {last} on", 240)  # its start
            started = run.last_index
            run.wait_for(f"injected {last} on", 240, after=started + 1, word="ended at")
            # Its host lost, then back: the launcher's line of the return may come before
            # the injector's line of the end, which waits for the host to confirm it.
            run.wait_for("lost", 120, after=started + 1,
                         word=f"{third if can_cut else second} (rank")
            run.wait_for("training on", 120, after=run.last_index + 1,
                         word=f"{second}, {third}")
            for path in throttles:
                _set_factor(path, 1.0)
            returncode = run.finish(240)
        finally:
            run.stop()
        stdout, stderr = run.text(), (tmp_path / "stderr.txt").read_text()
        assert returncode == 0, stdout[-4000:] + stderr[-3000:]
        left = [pid for host in bed.hosts for pid in bed.pids(host)
                if host.sshd is None or pid != host.sshd.pid]
    assert not left, f"processes left in the hosts' namespaces: {left}"
    summary = json.loads((out / "summary.json").read_text())
    faults = {f["what"]: f for f in summary["faults"]}
    assert set(faults) == {"slow", "kill", "freeze", *(("cut",) if can_cut else ())}
    for f in faults.values():
        assert f["outcome"] == "done", f
        assert f["fired_step"] >= f["at_step"] and f["fired_at_s"] is not None
    assert faults["kill"]["host"] == third and faults["freeze"]["ranks"] == [1]
    assert faults["freeze"]["ended_at_s"] - faults["freeze"]["fired_at_s"] >= 4.5
    trace = read_trace(out / "trace.jsonl")
    lines = [x for x in trace if x["kind"] == "fault" and x.get("injected")]
    assert {(x["what"], x["phase"]) for x in lines} >= {
        ("kill", "start"), ("freeze", "start"), ("freeze", "end"), ("slow", "start"),
        ("slow", "end")}
    lost = [x["reason"] for x in trace if x["kind"] == "membership" and "lost" in x["reason"]]
    assert any("killed by SIGKILL" in r and third in r for r in lost), lost
    assert any("no heartbeat" in r and second in r for r in lost), lost  # the frozen rank
    if can_cut:
        assert faults["cut"]["restored"] is True and faults["cut"]["cut_s"] >= 4.5
        assert any("no heartbeat" in r and third in r for r in lost), lost
    # The slow-down showed in rank 1's compute while it lasted. A busy launcher reads the
    # ranks' steps seconds late, so it may fire past the trace's first 1000 steps of a
    # line each: from there the trace has a line for each 50 steps, with their median.
    slowed, back = faults["slow"]["fired_step"], faults["slow"]["ended_step"]
    assert back > slowed, (slowed, back)
    before = _compute_times(trace, 1, 100, 290)
    # the steps while the slow-down held: from its first look at its throttle file (every
    # 0.1 s) until it ended; a busy machine trains fewer steps in those 8 s
    during = _compute_times(trace, 1, slowed + 5, back)
    assert len(during) >= 10, (slowed, back)
    assert during[len(during) // 2] > 1.5 * before[len(before) // 2], (before[::50],
                                                                         during[::50])
    assert "injected faults" in stdout
    assert f"[{third}:2] its host is down for" in stdout  # the kill's +4s held it
    # goodput, measured by the launcher on the wall clock: rank 1 down while frozen, rank 2
    # from its kill until its process started again, 4 s later at least (and while cut
    # off); rank 0 never
    goodput = summary["goodput"]
    assert goodput["time"] == "wall" and 0 < goodput["goodput"] < 1, goodput
    down = {r["rank"]: r["down_s"] for r in goodput["ranks"]}
    assert down[0] == 0 and down[1] >= 4.5 and down[2] >= (8.5 if can_cut else 4), down
    assert goodput["useful_samples"] + goodput["dropped_samples"] == goodput["trained_samples"]
    assert any(c["left"] for c in goodput["changes"]), goodput["changes"]
    assert "goodput" in stdout and "goodput per host" in stdout
    assert shutil.which("nft") is None or "exogym_cut" not in subprocess.run(
        ["nft", "list", "tables"], capture_output=True, text=True).stdout


class _LiveRun:
    """The command line's run as a person watches it: its output, line by line, as it comes.

    Args:
        command: the command.
        stderr: the file its standard error goes to.
    """

    def __init__(self, command: list[str], stderr: Path) -> None:
        self._err = open(stderr, "w")
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=self._err, text=True,
                                        env={**os.environ, "CI": "true"})
        self.lines: list[str] = []
        self.last_index = -1
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, text: str, timeout: float, *, after: int = 0, word: str = "") -> str:
        """The first line from index ``after`` holding ``text`` and ``word``; its index is
        kept in ``last_index``. Fails naming what it waited for and the last lines."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for index in range(after, len(self.lines)):
                    line = self.lines[index]
                    if text in line and word in line:
                        self.last_index = index
                        return line
                after = max(after, len(self.lines))
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line with {text!r} and {word!r} within "
                                         f"{timeout:.0f} s; the last:\n{self.text()[-3000:]}")
                self._cond.wait(min(left, 1.0))

    def finish(self, timeout: float) -> int:
        """The exit status, waiting at most ``timeout`` seconds."""
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def text(self) -> str:
        with self._cond:
            return "".join(self.lines)

    def stop(self) -> None:
        """Kill the run if it is still going; close its files."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self._err.close()


def _compute_times(trace: list[dict], rank: int, first: int, end: int) -> list[float]:
    """``rank``'s compute seconds of each step from ``first`` up to ``end`` (not included),
    sorted: a step line's own, and a block line's median for each step of a block that
    lies whole in the span."""
    times = []
    for x in trace:
        if x.get("rank") != rank:
            continue
        if x["kind"] == "step" and first <= x["step"] < end:
            times.append(x["compute_s"])
        elif x["kind"] == "steps" and first <= x["first"] and x["last"] < end:
            times += [x["compute_s_median"]] * x["count"]
    return sorted(times)


def _throttle_files(run_dir: Path, ranks: int) -> list[Path]:
    """Every rank's throttle file, named as the injector named rank 1's when it slowed it."""
    found = sorted(run_dir.rglob("inject/*-rank1.json"))
    assert len(found) == 1, f"rank 1's throttle file under {run_dir}: {found}"
    stem = found[0].name[:-len("-rank1.json")]
    return [found[0].with_name(f"{stem}-rank{rank}.json") for rank in range(ranks)]


def _set_factor(path: Path, factor: float) -> None:
    """A rank's speed, written as the injector writes it (whole, by a rename)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"factor": factor, "fault": "test"}))
    tmp.replace(path)


# --------------------------------------------------------------------------- the injector's guard


class _Run:
    running = True


def test_a_fault_that_would_leave_fewer_than_min_nodes_waits_for_ranks_to_come_back(config):
    from distributed.launch.injector import AttemptView, FaultInjector

    said = []
    plan_ = plan(["freeze:2@step=50+5s", "slow:2@step=50x0.5"], config)
    injector = FaultInjector(plan_, config, session=None, rank_run_dir="runs/x",
                             emit=lambda event: None, say=lambda text, style: said.append(text))
    away: set[int] = set()
    injector.view = AttemptView(run_of=lambda rank: _Run(), away=lambda: set(away))
    freeze, slow = plan_.faults
    assert injector._blocked(freeze) is None
    away.add(1)  # rank 1 lost (e.g. killed and not yet readmitted): one may be away
    assert "2 ranks would be away at once, fewer than min_nodes=2 left" in \
        injector._blocked(freeze)
    assert injector._blocked(slow) is None  # a slow-down takes no rank away
    away.clear()
    away.add(2)
    assert "rank 2 not running" in injector._blocked(freeze)
    assert injector.throttle_path(2).startswith("runs/x/inject/")
    assert injector.throttle_path(2).endswith("-rank2.json")


def test_a_killed_rank_counts_away_until_the_launcher_has_started_it_again(config):
    """However late a busy launcher notices a killed process end (until then it still
    counts it running), the guard counts the rank away: a freeze fired meanwhile would
    leave fewer than min_nodes ranks."""
    from distributed.launch.injector import AttemptView, FaultInjector

    plan_ = plan(["kill:2@step=50", "freeze:1@step=60+5s"], config)
    injector = FaultInjector(plan_, config, session=None, rank_run_dir="runs/x",
                             emit=lambda event: None, say=lambda text, style: None)
    runs = {rank: _Run() for rank in range(3)}
    injector.view = AttemptView(run_of=runs.get, away=set)
    injector._start_worker = lambda target, active: None  # no host to send the kill to
    kill, freeze = plan_.faults
    injector._fire(0, kill, now=0.0)
    injector.active.clear()  # the kill's few seconds are over; its process still "runs"
    assert "2 ranks would be away at once, fewer than min_nodes=2 left" in \
        injector._blocked(freeze)
    runs[2] = _Run()  # the launcher saw it end and started it again
    assert injector._blocked(freeze) is None


def test_a_kill_whose_start_is_answered_late_is_still_recorded_started_then_ended(config):
    """A kill's end is due a few seconds after it fires; on a busy host the kill's own
    start (the signal over SSH) may be answered later than that. The end waits for the
    start, so the record says done, with its end after its start."""
    import threading

    from distributed.launch.injector import AttemptView, FaultInjector

    plan_ = plan(["kill:2@step=50+4s"], config)
    injector = FaultInjector(plan_, config, session=None, rank_run_dir="runs/x",
                             emit=lambda event: None, say=lambda text, style: None)
    injector.t0 = time.monotonic()
    injector.view = AttemptView(run_of={r: _Run() for r in range(3)}.get, away=set,
                                hold=lambda rank, until: None)
    answered = threading.Event()
    injector._pid = lambda rank: 4321

    def slow_signal(rank, message):  # the host answers the kill late
        assert answered.wait(10)
        return {}

    injector._rank_action = slow_signal
    [kill] = plan_.faults
    injector._fire(0, kill, now=time.monotonic())
    active = injector.active.pop(0)
    injector._start_worker(injector._end, active)  # its end is due before the answer
    time.sleep(0.2)
    answered.set()
    for worker in injector._workers:
        worker.join(timeout=30)
    record = injector.records[0]
    assert record["outcome"] == "done", record
    assert record["ended_at_s"] >= record["fired_at_s"], record


def test_failures_that_can_only_be_cuts_are_refused_where_no_host_may_be_cut(config):
    from types import SimpleNamespace

    from distributed.launch.injector import FaultInjector

    # 127.0.0.x hosts share this machine's network stack: none may be cut
    session = SimpleNamespace(connect=lambda retry_failed: None, is_local=lambda rank: True)

    def injector(failures):
        plan_ = plan([], config, random_seed=3, mtbf="2m", failures=failures)
        return FaultInjector(plan_, config, session=session, rank_run_dir="runs/x",
                             emit=lambda event: None, say=lambda text, style: None)

    with pytest.raises(FaultSpecError, match="--failures cut: the launcher may cut none"):
        injector("cut").check()
    assert injector("cut,freeze").check().random.kinds == ("freeze",)


def test_slow_downs_of_one_rank_that_overlap_multiply_and_end_one_by_one(config):
    from distributed.launch.injector import FaultInjector

    plan_ = plan(["slow:1@step=5x0.5+10s", "slow:1@step=6x0.5"], config)
    injector = FaultInjector(plan_, config, session=None, rank_run_dir="runs/x",
                             emit=lambda event: None, say=lambda text, style: None)
    written = []
    injector._rank_action = lambda rank, message: written.append(message["factor"]) or {}
    first, second = plan_.faults
    injector._slowing[0] = first
    injector._set_throttle(1, 0)
    injector._slowing[1] = second
    injector._set_throttle(1, 1)
    del injector._slowing[0]  # the first ends: the second still holds
    injector._set_throttle(1, 0)
    assert written == [0.5, 0.25, 0.5]
