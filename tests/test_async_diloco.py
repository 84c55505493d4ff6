"""Asynchronous DiLoCo: merges on a quorum, fast ranks that do not wait, nothing lost."""

from __future__ import annotations

import json

import pytest
import torch
from toys import tiny_model, toy_dataset

from distributed.profiles.profile import load_profile
from distributed.worker.run_profile import run_profile
from exogym import Trainer
from exogym.data.digits import DigitsMLP, digits_datasets
from exogym.strategy import AsyncDiLoCoStrategy, DiLoCoStrategy

SLOW = [1.0, 1.0, 1.0, 0.25]


def fit(strategy, num_nodes=4, max_steps=16, dataset=None, model=None, **kwargs):
    ds = dataset if dataset is not None else toy_dataset(512)
    torch.manual_seed(0)
    trainer = Trainer(model if model is not None else tiny_model(), ds, ds)
    options = dict(batch_size=16, val_size=64, val_interval=max_steps, logger=None,
                   progress=False, compute_time_s=0.01, speed_mode="clock")
    options.update(kwargs)
    final = trainer.fit(strategy=strategy, num_nodes=num_nodes, max_steps=max_steps, **options)
    return trainer, final


def step_rows(trainer, rank=None):
    return [r for r in trainer.history if r.get("event", "step") == "step" and "samples" in r
            and (rank is None or r["rank"] == rank)]


@pytest.mark.parametrize("kwargs, words", [
    ({"quorum": 0}, "quorum must be a count of workers >= 1"),
    ({"quorum": 1.5}, r"quorum=1.5: a fraction of the workers must be in \(0, 1\]"),
    ({"quorum": "half"}, "quorum must be a count of workers"),
    ({"max_staleness": -1}, r"max_staleness must be an integer >= 0 \(versions\), got -1"),
    ({"weighting": "loss"}, "weighting must be one of 'tokens', 'equal', got 'loss'"),
    ({"grace_s": -0.5}, r"grace_s must be a number of seconds >= 0, got -0.5"),
    ({"H": 0}, "H must be an integer >= 1"),
    ({"H": 4, "merge_delay": 4}, r"merge_delay must be an integer with 0 <= merge_delay < H=4"),
])
def test_bad_settings_are_refused_naming_the_value_and_the_range(kwargs, words):
    with pytest.raises(ValueError, match=words):
        AsyncDiLoCoStrategy(**kwargs)


def test_a_quorum_larger_than_the_workers_is_refused_before_any_rank_starts():
    ds = toy_dataset(64)
    trainer = Trainer(tiny_model(), ds, ds)
    with pytest.raises(ValueError, match="quorum=5 is more than the 4 workers of this run: "
                                         "give at most 4"):
        trainer.fit(strategy=AsyncDiLoCoStrategy(quorum=5, H=2), num_nodes=4, max_steps=4,
                    batch_size=8, logger=None, progress=False)
    assert trainer.history == []
    with pytest.raises(ValueError, match="paces its ranks itself|balance"):
        trainer.fit(strategy=AsyncDiLoCoStrategy(H=2), num_nodes=2, max_steps=4,
                    batch_size=8, balance="steps", logger=None, progress=False)


def test_equal_speeds_a_full_quorum_and_no_grace_give_diloco_exactly():
    diloco, expected = fit(DiLoCoStrategy(lr=0.01, H=4))
    ours, final = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=4, grace_s=0.0))
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(final.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert ours.summary["final_val_global_loss"] == pytest.approx(
        diloco.summary["final_val_global_loss"], rel=1e-6)
    merges = ours.summary["merges"]
    assert [m["step"] for m in merges["rounds"]] == [4, 8, 12, 16]
    assert all(m["contributors"] == [0, 1, 2, 3] and m["staleness"] == [0, 0, 0, 0]
               for m in merges["rounds"])
    # one all-reduce of the model per merge, as a DiLoCo round
    assert {r["comm_bytes"] for r in step_rows(ours) if r["step"] == 16} == \
        {r["comm_bytes"] for r in step_rows(diloco) if r["step"] == 16}


def test_fast_ranks_do_not_wait_for_a_slow_one():
    sync, _ = fit(DiLoCoStrategy(lr=0.01, H=4), max_steps=16, rank_speeds=SLOW)
    ours, _ = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=3), max_steps=16, rank_speeds=SLOW)
    # every rank trains the first 3 steps (the ranks then agree on their measured speeds);
    # after that the slow rank trains one step in four, the others every step
    trained = {rank: sum(not r.get("idle") for r in step_rows(ours, rank)) for rank in range(4)}
    assert trained == {0: 16, 1: 16, 2: 16, 3: 3 + 3}
    wait = {r["step"]: r["sim_comm_s"] for r in step_rows(ours, 0)}
    # the first merge waits for the slow rank's 3 probe steps (3 x 0.04 s, against 0.03 s);
    # after that, without a network, a merge costs only the wait for the last to arrive: none
    assert wait[4] == pytest.approx(0.08)
    assert sum(wait[step] for step in range(5, 17)) < 1e-9
    sync_wait = sum(r["sim_comm_s"] for r in step_rows(sync, 0))
    assert sync_wait == pytest.approx(16 * 0.03)  # each step waits for the slow one
    assert ours.summary["sim_time_s"] < 0.4 * sync.summary["sim_time_s"]
    merges = ours.summary["merges"]
    # the fast ranks merge every 4 steps; the slow rank's rounds end at steps 7 and 16
    # (the end), each merged one version late
    assert [m["contributors"] for m in merges["rounds"]] == \
        [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 3]]
    assert [m["staleness"] for m in merges["rounds"]][1::2] == [[0, 0, 0, 1]] * 2
    speeds = {r["rank"]: r["measured_speed"] for r in step_rows(ours) if r["step"] == 16}
    assert speeds == {0: 1.0, 1: 1.0, 2: 1.0, 3: pytest.approx(0.25)}
    # each step event says which version its rank trains from
    assert {r["rank"]: r["version"] for r in step_rows(ours) if r["step"] == 12} == \
        {0: 3, 1: 3, 2: 3, 3: 2}


def test_keep_training_fills_the_wait_for_a_quorum_with_steps_that_are_merged():
    """A full quorum waits for the slow rank: the fast ranks idle through it, or with
    ``keep_training`` train on, their rounds longer than H, every step merged, in the
    same simulated time."""
    runs = {}
    for keep in (False, True):
        trainer, _ = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=4, keep_training=keep),
                         max_steps=16, rank_speeds=SLOW)
        runs[keep] = trainer
    trained = {keep: {rank: sum(not r.get("idle") for r in step_rows(t, rank))
                      for rank in range(4)} for keep, t in runs.items()}
    assert trained[False] == {0: 8, 1: 8, 2: 8, 3: 6}
    assert trained[True] == {0: 16, 1: 16, 2: 16, 3: 6}
    for keep, trainer in runs.items():
        merges = trainer.summary["merges"]
        assert [m["step"] for m in merges["rounds"]] == [7, 16]
        assert merges["steps"] == sum(trained[keep].values()) and merges["dropped_steps"] == 0
    assert runs[True].summary["sim_time_s"] < 1.1 * runs[False].summary["sim_time_s"]
    assert runs[True].summary["final_val_global_loss"] < \
        runs[False].summary["final_val_global_loss"]


@pytest.mark.slow
def test_grace_waits_for_a_round_about_to_end_and_staleness_drops_old_ones():
    speeds = [1.0, 1.0, 1.0, 0.5]
    # grace 0: the quorum of the three fast ranks merges at once
    no_grace, _ = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=3), max_steps=12,
                      rank_speeds=speeds)
    first = no_grace.summary["merges"]["rounds"][0]
    assert (first["step"], first["contributors"]) == (4, [0, 1, 2])
    # grace of 5 steps' time: the slow rank's round, 2 steps of its own from its end, joins
    grace, _ = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=3, grace_s=0.05), max_steps=12,
                   rank_speeds=speeds)
    first = grace.summary["merges"]["rounds"][0]
    assert first["contributors"] == [0, 1, 2, 3] and first["step"] > 4
    # max_staleness=0: the slow rank's contributions, one version late, are dropped and counted
    strict, _ = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=3, max_staleness=0),
                    max_steps=12, rank_speeds=speeds)
    merges = strict.summary["merges"]
    assert merges["dropped"] >= 1 and merges["dropped_steps"] >= 4
    assert all(3 not in m["contributors"] for m in merges["rounds"][:-1])


def test_a_rank_away_mid_round_loses_only_what_is_counted_as_dropped():
    trainer, _ = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=2), max_steps=24,
                     rank_speeds=SLOW, rank_failures=[(1, 7, 15)])
    merges = trainer.summary["merges"]
    trained = sum(not r.get("idle") for r in step_rows(trainer))
    # every step any rank trained was merged or counted as dropped
    assert merges["steps"] + merges["dropped_steps"] == trained
    left = [gone for m in merges["rounds"] for gone in m.get("left", [])]
    assert left == [{"rank": 1, "step": 7, "steps": 2, "tokens": 32}]
    # back at step 16 (a round boundary) with the newest model: it merges again
    assert any(1 in m["contributors"] for m in merges["rounds"] if m["step"] > 16)
    assert trainer.summary["membership"][-1]["ranks"] == [0, 1, 2, 3]


def test_a_worker_lost_on_its_host_mid_round_is_dropped_and_the_rest_merged(monkeypatch):
    # Across hosts (min_nodes) the members are decided once a round: rank 2, killed
    # mid-round, is still a member when the round's merge comes, and the all-reduce
    # completes among ranks 0 and 1 only. Rank 0 here, rank 1's change added by the
    # stand-in all-reduce, weighted as rank 0 weighted its own (1/3: 2 steps of 6).
    from exogym.strategy import async_diloco

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    strategy = AsyncDiLoCoStrategy(lr=0.1, H=2, quorum=3, outer_lr=1.0, outer_momentum=0.0,
                                   nesterov=False)
    strategy.max_steps = 8
    strategy._init_node(model, 0, 3)
    start = model.weight.detach().clone()
    theirs = torch.tensor([[0.3, -0.6, 0.9]])
    sent = {}

    def all_reduce(tensors, dtype=None, **options):
        sent["mine"] = tensors[0].clone()
        tensors[0].add_(theirs / 3)

    monkeypatch.setattr(async_diloco.comm, "all_reduce_tensors", all_reduce)
    monkeypatch.setattr(async_diloco.comm, "present_ranks", lambda group=None: [0, 1])
    monkeypatch.setattr(async_diloco.comm, "side_all_reduce", lambda tensor, op=None: None)
    for step in (1, 2):
        assert strategy.begin_step(step, [0, 1, 2])
        model.weight.grad = torch.ones_like(model.weight)
        strategy.step()
    # the mean of the two changes that arrived, not two thirds of it
    mine = 3 * sent["mine"]
    torch.testing.assert_close(strategy.master[0], start - (mine + theirs) / 2)
    merge = strategy.step_fields()["merge"]
    assert merge["contributors"] == [0, 1] and merge["steps"] == 4
    assert merge["left"] == [{"rank": 2, "step": 2, "steps": 2, "tokens": 2}]
    # the next round's members leave rank 2 out: its round is not counted twice
    assert strategy.begin_step(3, [0, 1])
    assert sorted(strategy.workers) == [0, 1] and strategy.dropped_contributions == 1


def test_the_run_ends_with_one_global_model_every_evaluation_scores():
    trainer, final = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=2), max_steps=14,
                         rank_speeds=SLOW)
    # the last step merges what every rank has, so all ranks end with the global model
    assert trainer.summary["merges"]["rounds"][-1].get("final") is True
    state = final.state_dict()
    assert all(torch.isfinite(t).all() for t in state.values())
    evals = [r for r in trainer.history if "val_global_loss" in r and r["step"] == 14]
    assert len({round(r["val_global_loss"], 9) for r in evals}) == 1


def test_checkpoint_and_resume_continue_the_same_run(tmp_path):
    options = dict(rank_speeds=SLOW, checkpoint_interval=6, save_dir=str(tmp_path),
                   run_name="a", keep_checkpoints=3)
    whole, expected = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=3), max_steps=16, **options)
    # as if the run had stopped after its checkpoint at step 6, mid-way through rounds
    for later in tmp_path.glob("a/rank*/step00000012.ckpt"):
        later.unlink()
    resumed, final = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=3), max_steps=16,
                         resume_from=str(tmp_path / "a"), **options)
    assert min(r["step"] for r in step_rows(resumed)) == 7
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(final.state_dict()[key], value)
    assert whole.summary["merges"]["rounds"][-2:] == resumed.summary["merges"]["rounds"][-2:]


def test_the_digits_async_profile_writes_its_merges_into_summary_json(tmp_path):
    resolved = load_profile("digits-async").resolved
    assert resolved.strategy_cls is AsyncDiLoCoStrategy
    assert resolved.strategy_kwargs["quorum"] == 0.5
    trainer = run_profile("digits-async", progress=False, local=True, overrides={
        "num_nodes": 3, "max_steps": 20, "H": 5, "val_size": 64, "val_interval": 10,
        "rank_speeds": [1.0, 1.0, 0.5], "speed_mode": "clock", "compute_time_s": 0.01,
        "checkpoint_interval": None, "output_dir": str(tmp_path)})
    saved = json.loads((tmp_path / "summary.json").read_text())
    merges = saved["merges"]
    assert merges == json.loads(json.dumps(trainer.summary["merges"]))
    assert merges["versions"] >= 4 and {r["rank"] for r in merges["ranks"]} == {0, 1, 2}
    assert all({"version", "contributors", "tokens", "staleness", "dropped"} <= set(m)
               for m in merges["rounds"])


@pytest.mark.slow
def test_unequal_speeds_reach_the_loss_sooner_than_synchronous_diloco_on_digits():
    train, val = digits_datasets()
    common = dict(dataset=None, num_nodes=4, batch_size=32, val_size=len(val), val_interval=10,
                  compute_time_s=0.05, network="100mbit")

    def run(strategy, steps, speeds=None, **extra):
        torch.manual_seed(0)
        trainer = Trainer(DigitsMLP(), train, val)
        trainer.fit(strategy=strategy, max_steps=steps, rank_speeds=speeds, speed_mode="clock",
                    logger=None, progress=False,
                    **{k: v for k, v in common.items() if k != "dataset"}, **extra)
        return [(r["sim_time_s"], r["val_global_loss"]) for r in step_rows(trainer, 0)
                if "val_global_loss" in r]

    target = run(DiLoCoStrategy(lr=3e-3, H=10), 200)[-1][1]

    def reached(evals):
        return next((t for t, loss in evals if loss <= target), None)

    sync = reached(run(DiLoCoStrategy(lr=3e-3, H=10), 200, SLOW))
    ours = reached(run(AsyncDiLoCoStrategy(lr=3e-3, H=10, quorum=0.5), 400, SLOW))
    assert sync is not None and ours is not None
    assert ours <= 0.75 * sync, (ours, sync)


def test_a_merge_delay_trains_on_while_the_merge_travels_and_rebases_onto_it(tmp_path):
    options = dict(rank_speeds=SLOW, network="100kbit", checkpoint_interval=5,
                   save_dir=str(tmp_path), run_name="d", keep_checkpoints=3)
    later, expected = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=3, merge_delay=2),
                          max_steps=16, **options)
    rounds = later.summary["merges"]["rounds"]
    # called at a round's end, applied two steps later (the last merge, at the end, at once)
    assert [(m["step"], m.get("applied_step")) for m in rounds[:2]] == [(4, 6), (8, 10)]
    assert rounds[-1]["final"] and "applied_step" not in rounds[-1]
    trained = sum(not r.get("idle") for r in step_rows(later))
    assert later.summary["merges"]["steps"] + later.summary["merges"]["dropped_steps"] == trained
    # the merges travel while the ranks train: with equal speeds, the two steps (0.02 s)
    # hide part of each of the three merges before the end (0.09 s each on this link)
    waited = []
    for delay in (0, 2):
        run, _ = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=4, merge_delay=delay),
                     max_steps=16, network="100kbit")
        waited.append(sum(r["sim_comm_s"] for r in step_rows(run, 0)))
    assert waited[1] == pytest.approx(waited[0] - 3 * 0.02, abs=1e-6), waited
    # a checkpoint taken while a merge travels (step 5) resumes to the same end
    for newer in tmp_path.glob("d/rank*/step0000001[05].ckpt"):
        newer.unlink()
    resumed, final = fit(AsyncDiLoCoStrategy(lr=0.01, H=4, quorum=3, merge_delay=2),
                         max_steps=16, resume_from=str(tmp_path / "d"), **options)
    assert min(r["step"] for r in step_rows(resumed)) == 6
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(final.state_dict()[key], value)


def test_adaptive_rounds_are_as_long_as_the_speed_allows_and_give_balanced_diloco():
    # a quarter as fast: rounds of H/4 = 2 steps, fresh at every merge, weighted by steps
    ours, final = fit(AsyncDiLoCoStrategy(lr=0.01, H=8, quorum=3, adaptive_H=True),
                      max_steps=24, rank_speeds=SLOW)
    rounds = ours.summary["merges"]["rounds"]
    assert all(m["contributors"] == [0, 1, 2, 3] and m["staleness"] == [0, 0, 0, 0]
               for m in rounds)
    assert [m["step"] for m in rounds] == [8, 16, 24]
    # the same rounds as DiLoCo with balance='steps' (each rank's inner steps its speed
    # allows, averaged by samples): the same model
    _, balanced = fit(DiLoCoStrategy(lr=0.01, H=8), max_steps=24, rank_speeds=SLOW,
                      balance="steps")
    for key, value in balanced.state_dict().items():
        torch.testing.assert_close(final.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="adaptive_H must be True or False"):
        AsyncDiLoCoStrategy(adaptive_H="yes")


@pytest.mark.parametrize("weighting, share", [("tokens", 2 / 8), ("equal", 1 / 2)])
def test_a_contribution_weighs_its_steps_or_counts_alike(monkeypatch, weighting, share):
    # rank 0 offers 2 steps, rank 1 six: rank 0 sends its change times its share of the merge
    from exogym.strategy import async_diloco
    from exogym.strategy.async_diloco import _Worker

    model = torch.nn.Linear(2, 1, bias=False)
    strategy = AsyncDiLoCoStrategy(H=8, quorum=2, weighting=weighting)
    strategy.max_steps = 100
    strategy._init_node(model, 0, 2)
    with torch.no_grad():
        model.weight.sub_(1.0)  # a change of -1 from the base, in every weight
    strategy.workers = {0: _Worker(steps=2, ready=True), 1: _Worker(steps=6, ready=True)}
    sent = {}
    monkeypatch.setattr(async_diloco.comm, "all_reduce_tensors",
                        lambda tensors, **options: sent.setdefault("mine", tensors[0].clone()))
    monkeypatch.setattr(async_diloco.comm, "present_ranks", lambda group=None: [0, 1])
    monkeypatch.setattr(async_diloco.comm, "side_all_reduce", lambda tensor, op=None: None)
    strategy._merge([0, 1], final=False)
    torch.testing.assert_close(sent["mine"], torch.full((1, 2), share))


def test_the_launcher_s_merge_log_takes_each_merge_from_whichever_rank_reported_it():
    """Across hosts each merge comes in the step event of the lowest rank present at it:
    rank 0's events have some, rank 1's the others (rank 0 away). The launcher's log of
    every rank's events gives them all, in order, with each rank's last version."""
    from exogym.report.summary import MergeLog

    def merge(step, version, contributors, steps, **extra):
        return {"version": version, "step": step, "contributors": contributors,
                "steps": steps, "tokens": steps * 4, "staleness": [0] * len(contributors),
                "dropped": [], "dropped_steps": 0, "dropped_tokens": 0, **extra}

    events = [
        {"event": "step", "rank": 0, "step": 4, "version": 0, "merge": merge(4, 1, [0, 1], 8)},
        {"event": "step", "rank": 1, "step": 4, "version": 0},
        {"event": "system", "rank": 1},
        {"event": "step", "rank": 1, "step": 8, "version": 1,
         "merge": merge(8, 2, [1], 4, left=[{"rank": 0, "step": 8, "steps": 3, "tokens": 12}])},
        {"event": "step", "rank": 0, "step": 12, "version": 2,
         "merge": merge(12, 3, [0, 1], 8, final=True)},
        {"event": "step", "rank": 1, "step": 12, "version": 2},
    ]
    log = MergeLog()
    for event in events:
        log.on_event(event)
    merges = log.merges()
    assert [m["step"] for m in merges["rounds"]] == [4, 8, 12]
    assert merges["versions"] == 3 and merges["merged"] == 5 and merges["steps"] == 20
    assert merges["dropped"] == 1 and merges["dropped_steps"] == 3
    assert merges["ranks"] == [{"rank": 0, "version": 2, "contributed": 2},
                               {"rank": 1, "version": 2, "contributed": 3}]
    assert MergeLog().merges() is None
