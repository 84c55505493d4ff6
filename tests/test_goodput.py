"""Goodput under churn: its definition on hand-made event streams, rank_failures drawn from a
mean time between failures (and --mtbf across hosts), and a simulation whose summary.json
reports it."""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
import sys
from io import StringIO

import pytest
import torch
from ports import free_port
from ranks import ROOT
from rich.console import Console

from distributed.hosts.hostsfile import load_hosts
from distributed.launch.faults import FaultSpecError, parse_mtbf, plan_faults
from exogym import Trainer
from exogym.data.digits import DigitsMLP, digits_datasets
from exogym.membership.mtbf import draw_rank_failures
from exogym.membership.simulated import Membership
from exogym.report.goodput import DownSpan, GoodputMeter, goodput_summary, measure_goodput
from exogym.report.summary import print_goodput
from exogym.strategy import DiLoCoStrategy

# -- the definition on hand-made event streams ---------------------------------------------


def step(rank, number, t=None, samples=10, compute=1.0, comm=0.0, **extra):
    """One step event: ``samples`` trained in ``compute`` seconds, ``comm`` in collectives;
    ``t``: the simulated clock at its end (None: no clock)."""
    event = {"rank": rank, "step": number, "step_samples": samples, "compute_s": compute,
             "comm_s": comm, **extra}
    if t is not None:
        event.update(sim_time_s=t, sim_comm_s=comm)
    return event


def test_ddp_a_step_a_host_died_in_is_not_counted_and_its_downtime_is_not_held_against_it():
    # Two hosts, 10 samples per 1-second step. Rank 1 is killed 0.5 s into step 3, which
    # rank 0 completes alone; its process is started again at t=3 and trains step 4.
    now = [0.0]
    meter = GoodputMeter(2, clock=lambda: now[0])

    def at(t, event):
        now[0] = t
        meter.on_event(event)

    at(0.0, {"event": "start", "rank": 0, "round_steps": 1})
    at(0.0, {"event": "start", "rank": 1, "round_steps": 1})
    for t in (1.0, 2.0):
        at(t, {"event": "step", **step(0, int(t))})
        at(t, {"event": "step", **step(1, int(t))})
    at(2.5, {"event": "fault", "injected": True, "phase": "start", "id": 0, "what": "kill",
             "ranks": [1]})
    at(3.0, {"event": "step", **step(0, 3)})
    at(3.0, {"event": "start", "rank": 1, "round_steps": 1})  # its process is back
    at(4.0, {"event": "step", **step(0, 4)})
    at(4.0, {"event": "step", **step(1, 4)})
    changes = [{"step": 1, "ranks": [0, 1], "reason": "start"},
               {"step": 3, "ranks": [0], "reason": "rank 1 lost"},
               {"step": 4, "ranks": [0, 1], "reason": "rank 1 rejoined"}]
    g = meter.measure(changes)
    # useful: rank 0's 4 steps and rank 1's steps 1, 2, 4 = 70 samples; rank 1 was down
    # 0.5 s of the 4: possible 4 x 10 + 3.5 x 10 = 75
    assert g["time"] == "wall"
    assert (g["useful_samples"], g["trained_samples"], g["dropped_samples"]) == (70, 70, 0)
    assert g["possible_samples"] == pytest.approx(75.0)
    assert g["goodput"] == pytest.approx(70 / 75)
    one = g["ranks"][1]
    assert (one["up_s"], one["down_s"], one["compute_s"]) == (3.5, 0.5, 3.0)
    assert one["idle_s"] == pytest.approx(0.5)  # the half step it lost when killed
    assert [(c["step"], c["left"], c["joined"], c["dropped_samples"], c["rejoin_wait_s"])
            for c in g["changes"]] == [(3, [1], [], 0, 0.0), (4, [], [1], 0, 0.0)]


def test_a_freeze_or_a_cut_is_down_for_its_duration_however_late_it_is_announced():
    now = [0.0]
    meter = GoodputMeter(3, clock=lambda: now[0])

    def at(t, event):
        now[0] = t
        meter.on_event(event)

    fault = {"event": "fault", "injected": True}
    for t in range(1, 11):
        for rank in range(3):
            if rank == 0 or t <= 3 or t >= 9:
                at(float(t), {"event": "step", **step(rank, t)})
        if t == 3:  # both fired now; the freeze's start is announced once the host answers
            at(3.0, {**fault, "phase": "start", "id": 1, "what": "cut", "ranks": [2],
                     "duration_s": 5.0})
        if t == 8:
            at(8.0, {**fault, "phase": "end", "id": 0, "what": "freeze", "ranks": [1],
                     "duration_s": 5.0})
            at(8.1, {**fault, "phase": "start", "id": 0, "what": "freeze", "ranks": [1],
                     "duration_s": 5.0})
    # the cut's end is known late (its host polled), with the time it lasted there
    at(10.5, {**fault, "phase": "end", "id": 1, "what": "cut", "ranks": [2], "cut_s": 4.0})
    assert sorted(meter.down_spans(10.0), key=lambda s: s.rank) == [DownSpan(1, 3.0, 8.0),
                                                                     DownSpan(2, 3.0, 7.0)]
    assert meter.faulted


def diloco_rows():
    """Two ranks, H=3, six steps of 1 s and 10 samples; each round ends with 0.5 s in the
    all-reduce. Rank 1 trains step 1, is away for steps 2-3 (back for step 3, admitted at
    the round boundary, step 4, with rank 0's clock: 3.5 s)."""
    rows = []
    t = 0.0
    for n in range(1, 7):
        comm = 0.5 if n % 3 == 0 else 0.0
        t += 1.0 + comm
        rows.append(step(0, n, t, comm=comm))
        if n == 1 or n >= 4:
            rows.append(step(1, n, t, comm=comm))
    return rows


def test_diloco_a_rank_that_leaves_mid_round_loses_its_inner_steps_and_waits_to_rejoin():
    changes = [{"step": 1, "ranks": [0, 1], "reason": "start"},
               {"step": 2, "ranks": [0], "reason": "rank 1 left"},
               {"step": 4, "ranks": [0, 1], "reason": "rank 1 rejoined"}]
    g = measure_goodput(diloco_rows(), 3, 2, failures=[(1, 2, 3)], changes=changes)
    # rank 1's step 1 missed its round's outer step (step 3): dropped. Down from the end of
    # step 1 (1 s) to the end of step 2 (2 s); up and waiting from 2 s to step 4's start
    # (3.5 s). Useful 60 + 30; possible 7 s x 10 + 6 s x 10.
    assert g["time"] == "simulated"
    assert (g["useful_samples"], g["trained_samples"], g["dropped_samples"]) == (90, 100, 10)
    assert g["possible_samples"] == pytest.approx(130.0)
    assert g["goodput"] == pytest.approx(90 / 130)
    zero, one = g["ranks"]
    assert (zero["up_s"], zero["wait_s"], zero["idle_s"]) == (7.0, 1.0, 0.0)
    assert (one["up_s"], one["down_s"], one["wait_s"], one["idle_s"]) == (6.0, 1.0, 0.5, 1.5)
    assert (one["trained"], one["useful"], one["dropped"]) == (40, 30, 10)
    left, back = g["changes"]
    assert (left["dropped_samples"], left["dropped_s"], left["lost_s"]) == (10, 1.0, 1.0)
    assert (back["rejoin_wait_s"], back["lost_s"]) == (1.5, 1.5)


def test_without_a_clock_a_simulation_gives_no_fraction_only_the_samples_and_says_why():
    rows = [{k: v for k, v in r.items() if k not in ("sim_time_s", "sim_comm_s")}
            for r in diloco_rows()]
    g = measure_goodput(rows, 3, 2, failures=[(1, 2, 3)],
                        changes=[{"step": 1, "ranks": [0, 1], "reason": "start"},
                                 {"step": 2, "ranks": [0], "reason": "rank 1 left"}])
    # ranks that take turns on this machine's cores have no time of their own to measure in
    assert g["time"] == "steps" and g["goodput"] is None and g["lost"] is None
    assert "shared this machine's cores" in g["note"] and "network" in g["note"]
    assert (g["useful_samples"], g["trained_samples"], g["dropped_samples"]) == (90, 100, 10)
    assert g["possible_samples"] is None and g["ranks"][1]["up_s"] is None
    assert g["ranks"][1]["dropped"] == 10
    assert g["changes"][0]["dropped_samples"] == 10 and g["changes"][0]["lost_s"] is None
    console = Console(file=StringIO(), width=300)
    print_goodput(console, g)
    text = console.file.getvalue()
    assert text.startswith("goodput not measured: the ranks shared this machine's cores")
    assert "; 90 of 100 trained samples reached the final model (10 dropped)" in text
    assert "step 2 (rank 1 left): 10 trained samples dropped" in text
    assert "per host" not in text and " s " not in text  # no seconds: it has none
    # a run where nobody came or went prints nothing at all
    plain = goodput_summary(measure_goodput(rows, 3, 2), detail=False)
    assert plain["goodput"] is None and plain["note"] == g["note"]
    print_goodput(console := Console(file=StringIO()), plain)
    assert console.file.getvalue() == ""


def test_a_fraction_above_one_is_not_given():
    # rank 1 is said to be down for steps 2-4 but trained them: more than its speed allows
    rows = [step(r, n, float(n)) for n in range(1, 5) for r in (0, 1)]
    g = measure_goodput(rows, 1, 2, failures=[(1, 2, 5)])
    assert g["goodput"] is None and "more than their speed alone allows" in g["note"]
    assert g["useful_samples"] == 80


def test_a_fault_free_run_on_a_clock_says_where_the_time_its_fraction_leaves_went():
    # two ranks, 1 s of compute and 0.25 s in the collective per step, no one away
    rows = []
    for n in range(1, 5):
        rows += [step(0, n, 1.25 * n, comm=0.25), step(1, n, 1.25 * n, comm=0.25)]
    g = measure_goodput(rows, 1, 2)
    assert g["goodput"] == pytest.approx(0.8)
    assert g["lost"] == pytest.approx({"collectives": 0.2, "idle": 0.0, "dropped": 0.0})
    plain = goodput_summary(g, detail=False)
    console = Console(file=StringIO(), width=300)
    print_goodput(console, plain)
    # nothing was lost to faults: the line says how the time went, and gives no "goodput"
    assert console.file.getvalue().strip() == (
        "the hosts' time (simulated time): 80.0% computing, 20.0% in collectives, 0.0% idle; "
        "all 80 trained samples reached the final model (no faults and no membership "
        "changes: no goodput to measure)")


def test_async_diloco_a_stale_contribution_and_a_lost_workers_round_are_not_counted():
    rows = []
    for n in range(1, 5):
        rows += [step(0, n, float(n)), step(1, n, float(n))]
        if n <= 3:
            rows.append(step(2, n, float(n)))
    rows[0]["merge"] = {"step": 2, "contributors": [0, 1, 2], "dropped": []}
    rows[-1]["merge"] = {"step": 4, "contributors": [0], "dropped": [1], "final": True,
                         "left": [{"rank": 2, "step": 4, "steps": 1, "tokens": 10}]}
    changes = [{"step": 1, "ranks": [0, 1, 2], "reason": "start"},
               {"step": 4, "ranks": [0, 1], "reason": "rank 2 left"}]
    g = measure_goodput(rows, 2, 3, failures=[(2, 4, None)], changes=changes)
    # rank 1's second round (steps 3-4) was dropped as stale, rank 2's step 3 was lost with
    # it; rank 2 was down the last second of four
    assert [(r["useful"], r["dropped"]) for r in g["ranks"]] == [(40, 0), (20, 20), (20, 10)]
    assert g["possible_samples"] == pytest.approx(40 + 40 + 30)
    assert g["goodput"] == pytest.approx(80 / 110)
    # only the lost round is the membership change's; the stale one belongs to no change
    assert [(c["step"], c["dropped_samples"]) for c in g["changes"]] == [(4, 10)]


def test_a_step_repeated_after_a_restart_supersedes_the_one_before_it():
    rows = [step(0, 1), step(0, 2), step(0, 3), step(0, 2), step(0, 3)]  # back from step 1
    g = measure_goodput(rows, 1, 1, times=[1.0, 2.0, 3.0, 5.0, 6.0])
    assert (g["useful_samples"], g["dropped_samples"]) == (30, 20)
    assert g["goodput"] == pytest.approx(30 / 60)


def test_down_spans_are_clipped_to_the_run_and_merged_where_they_overlap():
    rows = [step(0, n, float(n)) for n in range(1, 5)] + [step(1, 1, 1.0), step(1, 4, 4.0)]
    spans = [DownSpan(1, -3.0, 2.0), DownSpan(1, 1.5, 3.0), DownSpan(1, 3.5, 9.0)]
    g = measure_goodput(rows, 1, 2, down=spans)
    assert g["ranks"][1]["down_s"] == 3.5  # 0-3 and 3.5-4


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="one arrival time per event"):
        measure_goodput([step(0, 1)], 1, 1, times=[])
    with pytest.raises(ValueError, match="round_steps must be an integer >= 1"):
        measure_goodput([step(0, 1)], 0, 1)


def test_the_printed_summary_has_the_fraction_each_host_and_each_change():
    changes = [{"step": 1, "ranks": [0, 1], "reason": "start"},
               {"step": 2, "ranks": [0], "reason": "rank 1 left"},
               {"step": 4, "ranks": [0, 1], "reason": "rank 1 rejoined"}]
    g = measure_goodput(diloco_rows(), 3, 2, failures=[(1, 2, 3)], changes=changes)
    console = Console(file=StringIO(), width=200)
    print_goodput(console, g)
    text = console.file.getvalue()
    assert "goodput 69.2%: of the 130 samples the hosts could have trained while up (each at " \
           "its own speed, in simulated time), 90 reached the final model" in text
    # 2.0 s of 13 in collectives, 1.5 s idle, 1.0 s of work dropped
    assert "the rest of their time went 11.5% in collectives, 11.5% idle, 7.7% on dropped " \
           "work" in text
    assert "10 trained samples dropped" in text
    assert "step 2 (rank 1 left): lost 1.0 s of host time: 10 samples dropped" in text
    assert "1.5 s waiting to rejoin" in text
    assert "goodput per host" in text


# -- rank_failures from a mean time between failures -----------------------------------------


def test_drawn_failures_are_reproducible_and_fit_runs_them():
    drawn = draw_rank_failures(8, 500, mtbf=60, down=15, seed=3, round_steps=10)
    assert drawn == draw_rank_failures(8, 500, mtbf=60, down=15, seed=3, round_steps=10)
    assert drawn != draw_rank_failures(8, 500, mtbf=60, down=15, seed=4, round_steps=10)
    assert drawn == sorted(drawn) and drawn
    Membership(drawn, 8, 10)  # the checks fit makes: accepted
    # in seconds of the simulated clock: the same draws at 2 s a step as in steps halved
    assert draw_rank_failures(8, 500, mtbf=120, down=30, seed=3, round_steps=10,
                              step_s=2.0) == drawn


def test_drawn_failures_come_at_the_rate_asked_and_last_the_time_asked():
    drawn = draw_rank_failures(16, 20000, mtbf=100, down=20, seed=1)
    per_host = len(drawn) / 16
    assert per_host == pytest.approx(20000 / 100, rel=0.1)
    lengths = [back - at for _, at, back in drawn if back is not None]
    # a failure at t falls in step floor(t)+1 and the host is back for step ceil(t+20)+1;
    # a few fail again before they are back (an absence of two failures)
    assert statistics.median(lengths) == 21 and all(n >= 20 for n in lengths)
    assert sum(n == 21 for n in lengths) > 0.95 * len(lengths)


def test_drawn_failures_keep_the_ranks_asked_present():
    drawn = draw_rank_failures(3, 400, mtbf=8, down=4, seed=2, round_steps=4, min_present=2)
    membership = Membership(drawn, 3, 4)
    assert drawn and min(len(membership.present(s)) for s in range(1, 401)) >= 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_nodes=1), "num_nodes must be an integer >= 2, got 1"),
    (dict(max_steps=0), "max_steps must be an integer >= 1, got 0"),
    (dict(mtbf=0), "mtbf must be a positive number, got 0"),
    (dict(down=math.inf), "down must be a positive number, got inf"),
    (dict(mtbf=30, down=30), "mtbf must be longer than down .* mtbf=30 steps, down=30 steps"),
    (dict(step_s=-1.0), "step_s must be a positive number, got -1.0"),
    (dict(min_present=4), r"min_present must be an integer in 1..3, got 4"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(round_steps=0), "round_steps must be an integer >= 1, got 0"),
])
def test_bad_drawing_arguments_are_refused_naming_them(kwargs, message):
    args = {**dict(num_nodes=4, max_steps=100, mtbf=60, down=10, seed=0), **kwargs}
    with pytest.raises(ValueError, match=message):
        draw_rank_failures(args.pop("num_nodes"), args.pop("max_steps"), **args)


# -- --mtbf across hosts ----------------------------------------------------------------------

HOSTS = {"master": "127.0.0.1", "workers": ["127.0.0.2", "127.0.0.3"], "ssh_user": "u",
         "python_env": sys.executable, "project_path": str(ROOT), "master_port": free_port()}


def test_mtbf_draws_each_host_down_for_its_time_at_the_rate_asked():
    config = load_hosts(HOSTS)
    plan = plan_faults([], config, max_steps=1000, min_nodes=2, random_seed=5, mtbf="2m",
                       down="30s")
    assert (plan.random.mtbf_s, plan.random.down_s) == (120.0, 30.0)
    assert plan.random.kinds == ("freeze", "cut")
    draws = plan.random.draws()
    drawn = [next(draws) for _ in range(3000)]
    assert [s.text for _, s in drawn[:5]] == \
        [s.text for _, s in (lambda d: [next(d) for _ in range(5)])(plan.random.draws())]
    # three hosts, each failing once per 120 s: a failure every 40 s on average
    assert statistics.mean(i for i, _ in drawn) == pytest.approx(40, rel=0.06)
    for host in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
        assert sum(s.host == host for _, s in drawn) == pytest.approx(1000, rel=0.1)
    assert {s.kind for _, s in drawn} == {"freeze", "cut"}
    assert all(s.duration_s == 30 for _, s in drawn)
    assert all(s.kind == "freeze" for _, s in drawn if s.host == "127.0.0.1")  # the master
    assert "down 30 s (freeze or cut) on average once every 120 s" in plan.describe()[0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(mtbf="2m"), "--mtbf '2m' without --inject-random"),
    (dict(random_seed=1, mtbf="2m", every="30s"), "both set how often faults come"),
    (dict(random_seed=1, down="30s"), "--down '30s' without --mtbf"),
    (dict(random_seed=1, mtbf="30s", down="30s"), "--down 30s is not shorter than --mtbf 30s"),
    (dict(random_seed=1, mtbf="3s"), "--mtbf '3s': at least 6 s"),
    (dict(random_seed=1, mtbf="soon"), "--mtbf 'soon': give seconds such as 30s"),
])
def test_bad_mtbf_options_are_refused(kwargs, message):
    with pytest.raises(FaultSpecError, match=message):
        plan_faults([], load_hosts(HOSTS), max_steps=1000, min_nodes=2, **kwargs)


def test_failures_can_be_kills_that_keep_their_host_down():
    config = load_hosts(HOSTS)
    plan = plan_faults([], config, max_steps=1000, min_nodes=2, random_seed=5, mtbf="2m",
                       down="30s", failures="kill")
    assert plan.random.kinds == ("kill",)
    drawn = [s for _, s in itertools.islice(plan.random.draws(), 300)]
    assert {s.kind for s in drawn} == {"kill"} and {s.duration_s for s in drawn} == {30}
    assert {s.host for s in drawn} == {"127.0.0.1", "127.0.0.2", "127.0.0.3"}
    assert "down 30 s (kill) on average once every 120 s" in plan.describe()[0]
    mixed = plan_faults([], config, max_steps=1000, min_nodes=2, random_seed=5, mtbf="2m",
                        failures="freeze, KILL,cut")
    assert mixed.random.kinds == ("kill", "freeze", "cut")
    kinds = [s for _, s in itertools.islice(mixed.random.draws(), 3000)]
    for kind in ("kill", "freeze", "cut"):
        # the master may not be cut: a third of the failures on each other host are cuts
        assert sum(s.kind == kind for s in kinds) == pytest.approx(
            {"kill": 1167, "freeze": 1167, "cut": 667}[kind], rel=0.12)
    assert all(s.kind != "cut" for s in kinds if s.host == "127.0.0.1")
    # by default the same draws as before --failures: a freeze or a cut
    assert plan_faults([], config, max_steps=1000, min_nodes=2, random_seed=5, mtbf="2m",
                       failures="freeze,cut").random.kinds == ("freeze", "cut")


@pytest.mark.parametrize("kwargs, message", [
    (dict(failures="kill"), "--failures 'kill' without --mtbf"),
    (dict(mtbf="2m", failures="explode"), "give a comma list of kill, freeze, cut"),
    (dict(mtbf="2m", failures=""), "give a comma list of kill, freeze, cut"),
])
def test_bad_failures_are_refused(kwargs, message):
    with pytest.raises(FaultSpecError, match=message):
        plan_faults([], load_hosts(HOSTS), max_steps=1000, min_nodes=2, random_seed=1,
                    **kwargs)


def test_down_defaults_to_a_quarter_of_the_mtbf():
    assert parse_mtbf("2m", None) == (120.0, 30.0)


# -- a simulation ---------------------------------------------------------------------------

BATCH = 16


def digits_run(tmp_path, name, failures):
    train, val = digits_datasets()
    torch.manual_seed(0)
    trainer = Trainer(DigitsMLP(), train, val)
    trainer.fit(strategy=DiLoCoStrategy(H=5, lr=0.01), num_nodes=4, max_steps=20,
                batch_size=BATCH, val_size=0, compute_time_s=0.1, network="100mbit",
                rank_failures=failures, logger="csv", log_dir=str(tmp_path), run_name=name,
                progress=False)
    return trainer, json.loads((trainer.log_dir / "summary.json").read_text())


@pytest.mark.slow
def test_a_diloco_run_with_a_rank_away_for_a_round_writes_its_goodput(tmp_path):
    # H=5: rank 1 trains steps 6 and 7 of the second round, is away for 8-10 and rejoins
    # at step 11, the third round's start. Its two inner steps never reach an outer step.
    trainer, written = digits_run(tmp_path, "away", [(1, 8, 11)])
    g = written["goodput"]
    assert g == json.loads(json.dumps(trainer.summary["goodput"]))
    assert g["time"] == "simulated"
    assert g["dropped_samples"] == 2 * BATCH
    assert [r["dropped"] for r in g["ranks"]] == [0, 2 * BATCH, 0, 0]
    assert g["useful_samples"] == (3 * 20 + 17 - 2) * BATCH
    assert 0.5 < g["goodput"] < 1.0
    assert g["goodput"] == pytest.approx(g["useful_samples"] / g["possible_samples"])
    # rank 1 was down from the end of step 7 to the end of step 10, on the simulated clock
    end = {r["step"]: r["sim_time_s"] for r in trainer.history if r["rank"] == 0}
    assert g["ranks"][1]["down_s"] == pytest.approx(end[10] - end[7], abs=1e-6)
    assert g["ranks"][0]["down_s"] == 0.0
    assert g["ranks"][1]["up_s"] == pytest.approx(g["span_s"] - g["ranks"][1]["down_s"])
    assert g["span_s"] == pytest.approx(trainer.summary["sim_time_s"])
    # every rank trains 0.1 s per step of 16 samples: 160 samples/s alone
    assert all(r["samples_per_s"] == pytest.approx(BATCH / 0.1) for r in g["ranks"])
    left = next(c for c in g["changes"] if c["left"] == [1])
    assert (left["step"], left["dropped_samples"]) == (8, 2 * BATCH)
    assert left["dropped_s"] == pytest.approx(0.2)

    # the same run with no rank away: the plain fraction, higher
    whole, written = digits_run(tmp_path, "whole", None)
    plain = written["goodput"]
    assert set(plain) == {"goodput", "note", "time", "useful_samples", "possible_samples",
                          "trained_samples", "lost"}
    assert plain["note"] is None and sum(plain["lost"].values()) + plain["goodput"] == \
        pytest.approx(1.0, abs=0.02)
    assert plain["useful_samples"] == 4 * 20 * BATCH
    assert g["goodput"] < plain["goodput"] <= 1.0


@pytest.mark.slow
def test_a_healthy_fit_on_a_clock_prints_how_the_time_went_and_no_goodput(capsys):
    from toys import tiny_model, toy_dataset

    data = toy_dataset()
    trainer = Trainer(tiny_model(), data, data)
    trainer.fit(strategy=DiLoCoStrategy(H=5), num_nodes=2, max_steps=10, batch_size=8,
                val_size=0, logger=None, progress=True, network="100mbit",
                compute_time_s=0.05)
    printed = " ".join(capsys.readouterr().err.split())
    assert not re.search(r"goodput [0-9.]+%", printed)  # no fraction: nothing was lost
    lost = trainer.summary["goodput"]["lost"]
    assert (f"the hosts' time (simulated time): {1 - lost['collectives'] - lost['idle']:.1%} "
            f"computing, {lost['collectives']:.1%} in collectives, {lost['idle']:.1%} idle; "
            "all 160 trained samples reached the final model") in printed


def test_a_healthy_fit_without_a_clock_prints_no_goodput_and_its_summary_says_why(capsys):
    from toys import tiny_model, toy_dataset

    data = toy_dataset()
    trainer = Trainer(tiny_model(), data, data)
    trainer.fit(strategy=DiLoCoStrategy(H=5), num_nodes=2, max_steps=10, batch_size=8,
                val_size=0, logger=None, progress=True)
    printed = capsys.readouterr().err  # the summary is printed to standard error
    assert "run summary" in printed and "goodput" not in printed
    goodput = trainer.summary["goodput"]
    assert goodput["goodput"] is None and "no time of their own" in goodput["note"]
    assert goodput["useful_samples"] == goodput["trained_samples"] == 2 * 10 * 8
