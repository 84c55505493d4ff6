"""fit(balance=...): each rank's share of the work follows its measured speed.

'batch' is checked exactly against AllReduce on the union of the ranks' batches,
'steps' against DiLoCo's round computed by hand with each rank's inner steps and
the average weighted by samples. The simulated clock (speed_mode='clock' with a
fixed compute_time_s) makes the measured speeds exact, so the shares are known.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from ranks import ROOT, free_port, rank_env
from rich.console import Console
from torch.utils.data import IterableDataset, TensorDataset
from toys import TinyNet, tiny_model, toy_dataset

from exogym import Trainer
from exogym.config.fit_args import FitArgs, RunArgs
from exogym.report.summary import RunReporter
from exogym.run import balance as balance_module
from exogym.run.balance import Balancer, batch_shares, round_shares
from exogym.run.checkpoint import checkpoint_path
from exogym.run.spec import Placement, make_run_spec
from exogym.run.train_node import TrainNode
from exogym.strategy import (
    DiLoCoStrategy,
    FedAvgStrategy,
    OptimSpec,
    SimpleReduceStrategy,
)

SPEEDS = [1.0, 0.5]
CLOCK = dict(rank_speeds=SPEEDS, speed_mode="clock", compute_time_s=0.1)
QUIET = dict(device="cpu", val_size=0, progress=False, logger=None, shuffle=False)
LR = 0.1


def shard(dataset: TensorDataset, rank: int, num_nodes: int) -> list[int]:
    """Rank ``rank``'s samples in order, unshuffled (the dataset's length divides evenly)."""
    assert len(dataset) % num_nodes == 0
    return list(range(rank, len(dataset), num_nodes))


class Reader:
    """Hands out a rank's samples in order, round and round its shard, as its stream does."""

    def __init__(self, dataset: TensorDataset, rank: int, num_nodes: int):
        self.dataset, self.order, self.position = dataset, shard(dataset, rank, num_nodes), 0

    def take(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        picked = [self.order[(self.position + i) % len(self.order)] for i in range(n)]
        self.position += n
        x, y = self.dataset.tensors
        return x[picked], y[picked]


def by_rank_and_step(trainer: Trainer, key: str) -> dict[tuple[int, int], object]:
    return {(row["rank"], row["step"]): row.get(key) for row in trainer.history}


def assert_same_model(a: torch.nn.Module, b: torch.nn.Module, atol: float = 1e-6) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert (x - y).abs().max().item() <= atol, (name, (x - y).abs().max().item())


# --------------------------------------------------------------------------- the shares


def test_batch_shares_follow_throughput_sum_to_the_global_batch_and_give_each_rank_one():
    assert batch_shares([1.0, 0.5], 32) == [21, 11]
    assert batch_shares([1.0, 1.0, 1.0], 30) == [10, 10, 10]
    assert batch_shares([1.0, 1.0, 1.0], 31) == [11, 10, 10]  # a tie goes to the lower rank
    assert batch_shares([1000.0, 1.0, 1.0], 8) == [6, 1, 1]  # the floor of 1 taken from the top
    shares = batch_shares([3.0, 2.0, 0.25, 1.0], 64)
    assert sum(shares) == 64 and shares == sorted(shares, reverse=True)[:2] + shares[2:]
    with pytest.raises(ValueError, match="cannot give each of 4 ranks 1"):
        batch_shares([1.0] * 4, 3)


def test_round_shares_are_inner_steps_in_proportion_to_speed_at_least_one():
    assert round_shares([1.0, 0.5], 8) == [8, 4]
    assert round_shares([1.0, 0.25, 0.01], 10) == [10, 3, 1]  # never 0; 2.5 up: the slowest sets the round
    # 9.68 -> 9: a tenth step would make the rank last by 0.66 step for 0.1% more samples/s
    assert round_shares([1.0, 0.484], 20) == [20, 9]
    assert round_shares([1.0, 0.495], 20) == [20, 10]  # 2.4% more samples/s: rounded up
    assert round_shares([1.0, 0.7], 4) == [4, 3] and round_shares([1.0, 0.62], 4) == [4, 2]


def test_a_balancer_idles_a_slow_rank_past_its_inner_steps_and_weights_the_round_by_them():
    balancer = Balancer("steps", rank=1, num_nodes=2, batch_size=8, round_steps=4, max_steps=12)
    balancer.speeds, balancer.shares = [1.0, 0.5], [4, 2]
    trained = [balancer.begin_step(step) for step in range(1, 5)]
    assert trained == [True, True, False, False]
    assert balancer.counts == [4, 2]
    assert balancer.weight == pytest.approx(2 * 2 / 6)  # its samples over the mean of the ranks'
    assert balancer.begin_step(5) and balancer.counts == [1, 1]  # a new round


def agreements(monkeypatch, balancer: Balancer, rounds: list[list[float]]) -> list[list[int]]:
    """The shares after each agreement, every rank measuring the throughputs of ``rounds``."""
    measured = iter(rounds)

    def side_all_reduce(vector, op=None):
        vector.copy_(torch.tensor(next(measured), dtype=vector.dtype))

    monkeypatch.setattr(balance_module.comm, "side_all_reduce", side_all_reduce)
    shares = []
    for _ in rounds:
        balancer._window = [(16, 1.0)]  # this rank timed a step (its value comes from ``rounds``)
        balancer.agree()
        shares.append(list(balancer.shares))
    return shares


def test_steps_throughput_is_samples_over_seconds_and_batch_s_the_median_step_s():
    balancer = Balancer("steps", rank=0, num_nodes=1, batch_size=16, round_steps=4, max_steps=40)
    balancer.record_step(16, 9.0)  # the first step after a start: a warm-up, not counted
    for seconds in (0.25, 0.25, 1.0, 0.25):  # a round lasts their sum, 1.75 s
        balancer.record_step(16, seconds)
    balancer.agree()
    assert balancer.throughputs == [pytest.approx(64 / 1.75)]  # not the median step's 64
    # with 'batch' every step meets, so the typical step is what the shares should match
    batch = Balancer("batch", rank=0, num_nodes=1, batch_size=16, round_steps=1, max_steps=40)
    for seconds in (9.0, 0.25, 0.25, 1.0, 0.25):
        batch.record_step(16, seconds)
    batch.agree()
    assert batch.throughputs == [pytest.approx(64.0)]


def test_inner_steps_follow_a_small_drift_that_batch_shares_ignore(monkeypatch):
    # rank 1 first measured at 0.51 of rank 0's speed, then at 0.47 round after round: its
    # estimate drifts to 0.49, within TOLERANCE of 0.51, but 20 of 40 steps would now make
    # it late at every round: the inner steps move to 19
    rounds = [[100.0, 51.0], [100.0, 47.0], [100.0, 47.0]]
    steps = Balancer("steps", rank=0, num_nodes=2, batch_size=16, round_steps=40, max_steps=400)
    assert agreements(monkeypatch, steps, rounds) == [[40, 20], [40, 19], [40, 19]]
    assert steps.speeds[1] == pytest.approx(0.48)
    batch = Balancer("batch", rank=0, num_nodes=2, batch_size=16, round_steps=1, max_steps=400)
    first = agreements(monkeypatch, batch, rounds)
    assert first[0] == first[1] == first[2]  # a sample more or less: kept


# --------------------------------------------------------------------------- batch


def test_balance_batch_equals_allreduce_on_the_union_of_the_ranks_batches(tmp_path):
    data = toy_dataset(n=64)  # 32 samples a rank: the fast rank wraps round its shard
    model = tiny_model()
    trainer = Trainer(model, data, data)
    strategy = SimpleReduceStrategy(optim_spec=OptimSpec(torch.optim.SGD, lr=LR))
    final = trainer.fit(strategy=strategy, num_nodes=2, max_steps=8, batch_size=8,
                        minibatch_size=4, balance="batch", **CLOCK,
                        **{**QUIET, "logger": "csv"}, log_dir=str(tmp_path), run_name="b")

    sizes = by_rank_and_step(trainer, "batch_size")
    assert [sizes[(0, s)] for s in range(1, 9)] == [8, 8, 8] + [11] * 5  # agreed after step 3
    assert [sizes[(1, s)] for s in range(1, 9)] == [8, 8, 8] + [5] * 5  # about 2:1, sum 16

    expected = copy.deepcopy(model)
    sgd = torch.optim.SGD(expected.parameters(), lr=LR)
    readers = [Reader(data, rank, 2) for rank in range(2)]
    for step in range(1, 9):
        parts = [readers[rank].take(sizes[(rank, step)]) for rank in range(2)]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        sgd.zero_grad()
        expected((x, y)).backward()  # the mean loss over the union of the two batches
        sgd.step()
    assert_same_model(final, expected)

    balance = trainer.summary["balance"]
    assert balance["mode"] == "batch"
    assert [(r["rank"], r["speed"], r["batch_size"], r["samples"]) for r in balance["ranks"]] \
        == [(0, 1.0, 11, 3 * 8 + 5 * 11), (1, 0.5, 5, 3 * 8 + 5 * 5)]
    assert [r["share"] for r in balance["ranks"]] == pytest.approx([11 / 16, 5 / 16])
    assert [c["step"] for c in balance["changes"]] == [1, 4]
    written = json.loads((trainer.log_dir / "summary.json").read_text())
    assert written["balance"] == balance
    # each rank's steps take about the same simulated time: 0.1 * 11/8 and 0.1 * 5/8 / 0.5
    assert trainer.summary["sim_time_s"] == pytest.approx(3 * 0.2 + 5 * 0.1375)


def test_balance_batch_resumes_from_a_checkpoint_with_its_shares_and_data_position(tmp_path):
    data = toy_dataset(n=64)
    common = dict(strategy=SimpleReduceStrategy(optim_spec=OptimSpec(torch.optim.SGD, lr=LR)),
                  num_nodes=2, max_steps=8, batch_size=8, balance="batch",
                  checkpoint_interval=5, save_dir=str(tmp_path), run_name="r", **CLOCK, **QUIET)
    whole = Trainer(tiny_model(), data, data).fit(**common)
    assert checkpoint_path(tmp_path / "r", 1, 5).exists()  # the newest: as if stopped there
    again = Trainer(tiny_model(), data, data)
    resumed = again.fit(resume_from="auto", **common)
    assert min(row["step"] for row in again.history) == 6
    assert {row["batch_size"] for row in again.history if row["rank"] == 0} == {11}
    assert_same_model(resumed, whole, atol=0.0)


# --------------------------------------------------------------------------- steps


def diloco_by_hand(model: torch.nn.Module, data: TensorDataset,
                   counts: list[list[int]]) -> torch.nn.Module:
    """DiLoCo with inner SGD and outer SGD (lr 0.7, no momentum) where rank r trains
    ``counts[round][r]`` inner steps of 8 samples, and the round averages the ranks'
    changes weighted by those steps."""
    readers = [Reader(data, rank, 2) for rank in range(2)]
    global_model = copy.deepcopy(model)
    for steps in counts:
        deltas = []
        for rank, n in enumerate(steps):
            local = copy.deepcopy(global_model)
            sgd = torch.optim.SGD(local.parameters(), lr=LR)
            for _ in range(n):
                sgd.zero_grad()
                local(readers[rank].take(8)).backward()
                sgd.step()
            deltas.append([g.detach() - p.detach() for g, p in
                           zip(global_model.parameters(), local.parameters())])
        with torch.no_grad():
            for i, p in enumerate(global_model.parameters()):
                p -= 0.7 * sum(n * d[i] for n, d in zip(steps, deltas)) / sum(steps)
    return global_model


def test_balance_steps_gives_the_slow_rank_half_the_inner_steps_and_weights_the_average():
    data = toy_dataset(n=64)
    model = tiny_model()
    trainer = Trainer(model, data, data)
    strategy = DiLoCoStrategy(optim_spec=OptimSpec(torch.optim.SGD, lr=LR), H=4,
                              outer_lr=0.7, outer_momentum=0.0, nesterov=False)
    final = trainer.fit(strategy=strategy, num_nodes=2, max_steps=12, batch_size=8,
                        balance="steps", **CLOCK, **QUIET)

    idle = by_rank_and_step(trainer, "idle")
    trained = [[sum(not idle[(rank, s)] for s in range(4 * r + 1, 4 * r + 5))
                for rank in range(2)] for r in range(3)]
    # round 1: all train until the speeds are agreed after step 3, then the slow rank idles;
    # rounds 2 and 3: the slow rank trains H * 0.5 = 2 of the 4 steps
    assert trained == [[4, 3], [4, 2], [4, 2]]
    assert [idle[(1, s)] for s in range(5, 9)] == [None, None, True, True]
    assert_same_model(final, diloco_by_hand(model, data, trained))

    balance = trainer.summary["balance"]
    assert balance["mode"] == "steps"
    assert [(r["speed"], r["inner_steps"]) for r in balance["ranks"]] == [(1.0, 4), (0.5, 2)]
    assert [r["samples"] for r in balance["ranks"]] == [12 * 8, 7 * 8]
    # a round takes the fast rank's 4 * 0.1 s on both ranks (the first: 3 * 0.2 s)
    assert trainer.summary["sim_time_s"] == pytest.approx(0.6 + 0.4 + 0.4)
    # the bytes are those of any DiLoCo round
    unbalanced = Trainer(tiny_model(), data, data)
    unbalanced.fit(strategy=copy.deepcopy(strategy), num_nodes=2, max_steps=12, batch_size=8,
                   **CLOCK, **QUIET)
    assert trainer.summary["bytes_per_node"] == unbalanced.summary["bytes_per_node"]
    assert unbalanced.summary["sim_time_s"] == pytest.approx(12 * 0.2)


class SlowsDown(TinyNet):
    """A TinyNet whose training forward burns extra CPU time on the rank whose samples
    carry the flag ``1``, from its ``after``-th call on: a host that other work slows."""

    after = 5  # within the second round whatever the first measurement gave

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, batch):
        x, y, flag = batch
        if torch.is_grad_enabled():
            self.calls += 1
            slow = self.calls >= self.after and bool(flag[0])
            size, rounds = (256, 30) if slow else (128, 4)  # a steady step, then 30x longer
            weight = torch.ones(size, size)
            for _ in range(rounds):
                weight = torch.tanh(weight @ weight / size)
        return F.cross_entropy(self.fc2(torch.tanh(self.fc1(x))), y)


def flagged(rank: int, num_nodes: int, is_train: bool) -> TensorDataset:
    x, y = toy_dataset(n=64, seed=rank).tensors
    return TensorDataset(x, y, torch.full((len(x),), rank, dtype=torch.long))


def test_speeds_are_measured_again_as_the_run_goes_so_a_rank_slowed_later_gets_less():
    torch.manual_seed(0)
    trainer = Trainer(SlowsDown(), flagged, flagged)
    strategy = DiLoCoStrategy(optim_spec=OptimSpec(torch.optim.SGD, lr=LR), H=4)
    # measured compute on the simulated clock: equal speeds, until rank 1 slows down
    trainer.fit(strategy=strategy, num_nodes=2, max_steps=20, batch_size=8, balance="steps",
                network="1gbit", speed_mode="clock", num_threads=1, **QUIET)
    inner = by_rank_and_step(trainer, "inner_steps")
    assert inner[(1, 4)] >= 2  # first measured about as fast as rank 0 (timing noise aside)
    # slowed many times over from round 2 on: the smoothed speed (each agreement weighs the
    # new measurement and the old estimate half and half) falls below 3/8 within two more
    # agreements, and the rank is left one inner step a round
    assert inner[(1, 8)] > inner[(1, 20)] == 1
    assert inner[(0, 20)] == 4


class HeldBack(TinyNet):
    """A TinyNet whose training forward waits 0.1 s without using the CPU: a rank on a
    host held back by a CPU quota or a throttled chip."""

    def forward(self, batch):
        if torch.is_grad_enabled():
            time.sleep(0.1)
        return super().forward(batch)


@pytest.mark.parametrize("ranks_per_machine, counted", [(1, True), (2, False)])
def test_a_rank_with_a_host_to_itself_is_timed_by_the_wall_clock(ranks_per_machine, counted):
    # On a real host (one rank per machine) a step's wall time is what keeps the others
    # waiting: time the rank's CPU thread alone and a host held to half its core by a
    # quota looks as fast as the others. Ranks sharing a machine's cores, each on one
    # thread (a simulation), count their own CPU time: the others' turns are not theirs.
    ds = toy_dataset()
    spec = make_run_spec(HeldBack(), ds, ds, RunArgs(
        strategy=SimpleReduceStrategy(optim_spec=OptimSpec(torch.optim.SGD, lr=LR)),
        num_nodes=1, max_steps=2, batch_size=8, balance="batch", num_threads=1, val_size=0,
        device="cpu"))
    node = TrainNode(spec, 0, torch.device("cpu"), emit=lambda event: None,
                     placement=Placement(ranks_per_machine=ranks_per_machine))
    node.start()
    timed: list[float] = []
    node.balance.record_step = lambda samples, seconds, given_speed=None: timed.append(seconds)
    node.train_step()
    assert (timed[0] >= 0.1) if counted else (timed[0] < 0.05), timed


@pytest.mark.slow
def test_real_ranks_time_their_own_work_so_a_held_back_host_gets_a_smaller_batch(tmp_path):
    # Two rank processes over TCP, as on two hosts: each has its machine to itself, so
    # it is timed by the wall clock, without the time inside collectives. Rank 1 waits
    # 50 ms a step without using the CPU (a CPU quota); rank 0 waits as long for it in
    # every all-reduce, and that wait is not rank 0's work.
    port = free_port()
    helpers = os.pathsep.join([str(ROOT), str(ROOT / "tests")])  # the project, tests/toys.py
    procs = [subprocess.Popen([sys.executable, "tests/scripts/balance_rank.py"], cwd=ROOT,
                              env={**rank_env(rank, 2, port), "PYTHONPATH": helpers},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    last = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert last[0]["batch_size"] >= 12 and last[1]["batch_size"] <= 4, last


# --------------------------------------------------------------------------- checks


@pytest.mark.parametrize("strategy, mode, words", [
    (DiLoCoStrategy(H=4), "batch", ["DiLoCoStrategy meets once per round of H=4",
                                    "use balance='steps'"]),
    (SimpleReduceStrategy(), "steps", ["SimpleReduceStrategy meets at every step",
                                       "use balance='batch'"]),
    (FedAvgStrategy(H=4), "steps", ["FedAvgStrategy does not", "use DiLoCoStrategy"]),
    (SimpleReduceStrategy(), "fast", ["balance must be 'none', 'batch'", "'fast'"]),
])
def test_a_balance_the_strategy_cannot_run_is_refused_before_any_rank_starts(strategy, mode,
                                                                             words):
    # refused where fit's arguments are checked: no model, no process
    with pytest.raises(ValueError) as caught:
        FitArgs.from_call("fit()", (), dict(strategy=strategy, num_nodes=2, balance=mode))
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


def test_balance_with_ranks_that_come_and_go_or_a_streamed_dataset_is_refused():
    data = toy_dataset(n=32)
    with pytest.raises(ValueError, match="balance='batch' and rank_failures cannot be combined"):
        Trainer(tiny_model(), data, data).fit(
            strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=4, balance="batch",
            rank_failures=[(1, 2, None)], **QUIET)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(data)

    with pytest.raises(ValueError, match="IterableDataset streams fixed minibatches"):
        Trainer(tiny_model(), Stream(), data).fit(
            strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=4, balance="batch", **QUIET)


def test_the_summary_table_shows_each_ranks_share():
    out = io.StringIO()
    reporter = RunReporter(2, console=Console(file=out, width=120))
    reporter.finish({"num_nodes": 2, "steps": 8, "wall_s": 1.0, "balance": {
        "mode": "steps", "changes": [{"step": 1}, {"step": 4}],
        "ranks": [{"rank": 0, "speed": 1.0, "inner_steps": 4, "share": 2 / 3, "samples": 96},
                  {"rank": 1, "speed": 0.5, "inner_steps": 2, "share": 1 / 3, "samples": 56}]}})
    text = out.getvalue()
    assert "balance=steps" in text and "inner steps per round" in text
    assert "0.50" in text and "33.3%" in text and "56" in text


def test_balance_is_a_profile_key_and_the_train_commands_take_balance(tmp_path):
    from typer.testing import CliRunner

    from cli_typer import app
    from distributed.profiles.profile import ProfileError, load_profile, parse_overrides

    profile = load_profile("digits-diloco", overrides={"balance": "steps"})
    assert profile.resolved.run_kwargs["balance"] == "steps"
    # `balance = none` (a profile, --set, --balance none on a host) reads as None: no balance
    profile = load_profile("digits-ddp", overrides=parse_overrides(["balance=none"]))
    none = RunArgs(strategy=SimpleReduceStrategy(), balance=profile.resolved.run_kwargs["balance"])
    assert none.balance == "none"
    with pytest.raises(ProfileError, match="SimpleReduceStrategy meets at every step"):
        load_profile("digits-ddp", overrides={"balance": "steps"})
    with pytest.raises(ProfileError, match="balance must be"):
        load_profile("digits-ddp", overrides={"balance": "fast"})

    runner = CliRunner()
    result = runner.invoke(app, ["distributed-train", "digits-diloco", "--dry-run",
                                 "--balance", "steps", "--set", "rank_speeds=[1,0.5,1,1]"])
    assert result.exit_code == 0, result.output
    assert "--set balance=steps" in result.output
    # a simulation of equally fast ranks has nothing to balance: the option needs hosts
    result = runner.invoke(app, ["distributed-train", "digits-diloco", "--dry-run",
                                 "--balance", "steps"])
    assert result.exit_code == 2 and "--balance only applies to a run across hosts" in \
        result.output, result.output
    result = runner.invoke(app, ["distributed-train", "digits-ddp", "--dry-run",
                                 "--balance", "steps"])
    assert result.exit_code == 2 and "use balance='batch'" in result.output, result.output
    result = runner.invoke(app, ["distributed-train", "digits-ddp", "--dry-run",
                                 "--balance", "fast"])
    assert result.exit_code == 2 and "--balance 'fast' is not a mode" in result.output
    script = tmp_path / "job.sbatch"
    result = runner.invoke(app, ["slurm", "digits-diloco", "--nodes", "2", "--out", str(script),
                                 "--balance", "steps"])
    assert result.exit_code == 0, result.output
    assert "--profile digits-diloco --set balance=steps" in script.read_text()
