"""The simulated clock: fit(network=..., compute_time_s=..., rank_speeds=...) and sim_time_s."""

from __future__ import annotations

import math

import pytest
import torch

from distributed.planning.projection import predict_step_time, step_traffic
from exogym import Network, Trainer, comm
from exogym.comm.wire import ModelFacts, Traffic
from exogym.data.digits import DigitsMLP, digits_datasets
from exogym.sim.network import parse_rate
from exogym.strategy import (
    DiLoCoStrategy,
    SimpleReduceStrategy,
    SPARTAStrategy,
    Strategy,
    StreamingDiLoCoStrategy,
)

COMPUTE = 0.1  # seconds per step, fixed: the simulated times are exact


@pytest.fixture(scope="module")
def digits():
    return digits_datasets()


@pytest.fixture(scope="module")
def params() -> int:
    return sum(p.numel() for p in DigitsMLP().parameters())


def fit(digits, strategy, num_nodes=2, max_steps=4, **kwargs):
    train, val = digits
    trainer = Trainer(DigitsMLP(), train, val)
    trainer.fit(strategy=strategy, num_nodes=num_nodes, max_steps=max_steps, batch_size=8,
                val_size=0, progress=False, logger=None, **kwargs)
    return trainer


def clocks(trainer) -> dict[tuple[int, int], float]:
    return {(r["rank"], r["step"]): r["sim_time_s"] for r in trainer.history}


def test_rates_read_in_tc_units():
    assert parse_rate("100mbit") == 100e6
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("500kbit") == 500e3
    assert parse_rate("10mbps") == 80e6  # tc: bps is bytes per second
    assert parse_rate("1mibit") == 2**20
    assert parse_rate(2.5e6) == 2.5e6
    for bad in ("fast", "0mbit", "-1gbit", "", True):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)


def test_collective_times_follow_the_ring_model():
    net = Network("100mbit", latency_s=0.001)
    mb = 1_000_000
    # ring all-reduce among 4: each sends 2*3/4 of the buffer, in 6 rounds
    assert net.seconds("all_reduce", mb, [0, 1, 2, 3]) == pytest.approx(1.5 * mb * 8 / 1e8 + 0.006)
    # all-gather among 4: each sends its payload to 3 others, in 3 rounds
    assert net.seconds("all_gather", mb, [0, 1, 2, 3]) == pytest.approx(3 * mb * 8 / 1e8 + 0.003)
    # binomial-tree broadcast among 4: 2 rounds of the whole buffer
    assert net.seconds("broadcast", mb, [0, 1, 2, 3]) == pytest.approx(2 * (mb * 8 / 1e8 + 0.001))
    assert net.seconds("all_reduce", mb, [2]) == 0.0
    # a ring moves at the pace of its slowest link
    mixed = Network("1gbit", rank_bandwidth=["1gbit", "100mbit", "1gbit"])
    assert mixed.seconds("all_reduce", mb, [0, 2]) == pytest.approx(mb * 8 / 1e9)
    assert mixed.seconds("all_reduce", mb, [0, 1]) == pytest.approx(mb * 8 / 1e8)
    # as a profile writes it
    assert Network.coerce({"bandwidth": "1gbit", "latency_s": 0.001}) == Network("1gbit", 0.001)
    with pytest.raises(ValueError, match="needs 'bandwidth'"):
        Network.coerce({"rate": "1gbit"})
    with pytest.raises(ValueError, match="topology"):
        Network("1gbit", topology="torus")
    with pytest.raises(ValueError, match="latency_s"):
        Network("1gbit", latency_s=-1)


def test_ddp_steps_cost_compute_plus_a_ring_all_reduce(digits, params):
    net = Network("100mbit", latency_s=0.001)
    trainer = fit(digits, SimpleReduceStrategy(), max_steps=3, network=net,
                  compute_time_s=COMPUTE)
    # every step: compute, then a 2-rank ring all-reduce of the float32 gradients
    step = COMPUTE + 4 * params * 8 / 1e8 + 2 * 0.001
    for (rank, s), t in clocks(trainer).items():
        assert t == pytest.approx(s * step, rel=1e-9), (rank, s)
    assert trainer.summary["sim_time_s"] == pytest.approx(3 * step)
    assert trainer.summary["sim_time_per_step_s"] == pytest.approx(step)


def test_the_planner_predicts_what_the_clock_measures(digits, params):
    trainer = fit(digits, SimpleReduceStrategy(), max_steps=2, network="100mbit",
                  compute_time_s=COMPUTE)
    planned = predict_step_time("ddp", params, 2, COMPUTE, throughput_bytes_per_s=1e8 / 8)
    assert trainer.summary["sim_time_per_step_s"] == pytest.approx(planned, rel=1e-9)


def test_a_straggler_makes_everyone_wait_at_a_collective_not_between(digits, params):
    trainer = fit(digits, DiLoCoStrategy(H=2), max_steps=4, network="100mbit",
                  compute_time_s=COMPUTE, rank_speeds=[1.0, 0.5], speed_mode="clock")
    t = clocks(trainer)
    sync = 4 * params * 8 / 1e8  # DiLoCo's all-reduce of the model change, 2 ranks
    # between syncs each rank keeps its own pace ...
    assert t[(0, 1)] == pytest.approx(COMPUTE)
    assert t[(1, 1)] == pytest.approx(2 * COMPUTE)
    # ... at a sync the fast rank waits for the slow one
    assert t[(0, 2)] == pytest.approx(4 * COMPUTE + sync)
    assert t[(1, 2)] == pytest.approx(4 * COMPUTE + sync)
    assert t[(0, 3)] == pytest.approx(5 * COMPUTE + sync)
    assert t[(1, 3)] == pytest.approx(6 * COMPUTE + sync)
    assert t[(0, 4)] == t[(1, 4)] == pytest.approx(8 * COMPUTE + 2 * sync)


def test_a_compute_schedule_charges_each_step_its_own_seconds(digits, params):
    trainer = fit(digits, DiLoCoStrategy(H=2), max_steps=5, network="100mbit",
                  compute_schedule=[[0.1, 0.2, 0.3, 0.4], [0.1, 0.1, 0.1, 0.1]],
                  rank_speeds=[1.0, 0.5], speed_mode="clock")
    t = clocks(trainer)
    sync = 4 * params * 8 / 1e8
    assert t[(0, 1)] == pytest.approx(0.1) and t[(1, 1)] == pytest.approx(0.2)  # / speed
    assert t[(0, 2)] == t[(1, 2)] == pytest.approx(0.4 + sync)
    assert t[(0, 3)] == pytest.approx(0.7 + sync)
    assert t[(0, 4)] == t[(1, 4)] == pytest.approx(1.1 + 2 * sync)
    assert t[(0, 5)] == pytest.approx(1.1 + 2 * sync + 0.25)  # past the list: its mean


def test_sparta_pays_for_its_counted_bytes_every_step(digits):
    trainer = fit(digits, SPARTAStrategy(p_sparta=0.05), max_steps=3, network="10mbit",
                  compute_time_s=COMPUTE)
    rows = {(r["rank"], r["step"]): r for r in trainer.history}
    before = 0.0
    for s in (1, 2, 3):
        sent = rows[(0, s)]["comm_bytes"] - (rows[(0, s - 1)]["comm_bytes"] if s > 1 else 0)
        assert sent > 0
        expected = before + COMPUTE + sent * 8 / 1e7  # 2 ranks: 2*(1/2) of the payload
        assert rows[(0, s)]["sim_time_s"] == pytest.approx(expected)
        assert rows[(1, s)]["sim_time_s"] == pytest.approx(expected)
        before = expected


@pytest.mark.slow
def test_streaming_diloco_overlap_is_credited(digits):
    kwargs = dict(max_steps=8, network="1mbit", compute_time_s=COMPUTE)
    blocking = fit(digits, StreamingDiLoCoStrategy(H=4, num_fragments=2), **kwargs)
    overlapped = fit(digits, StreamingDiLoCoStrategy(H=4, num_fragments=2, fragment_delay=1),
                     **kwargs)
    # With the delay each fragment's all-reduce runs beside the next step's compute.
    saved = blocking.summary["sim_time_s"] - overlapped.summary["sim_time_s"]
    assert saved > 0
    assert saved <= 4 * COMPUTE + 1e-9  # at most one step of compute hidden per sync


#: Two fits of the slow-rank test, in a process of their own: the ranks are forked from it
#: (a test process of the suite has other threads, so its ranks come from the fork server,
#: which has not the recording stand-in for ``comm.pause``).
WALL_MODE = """
import json, os, sys
from exogym import Trainer, comm
from exogym.data.digits import DigitsMLP, digits_datasets
from exogym.strategy import DiLoCoStrategy

slept = sys.argv[1]
real_pause = comm.pause

def recorded_pause(seconds):
    with open(slept, "a") as f:  # the ranks are forked from here: each appends its own
        f.write(f"{os.getpid()} {seconds!r}\\n")
    real_pause(seconds)

comm.pause = recorded_pause
train, val = digits_datasets()
out = {}
for mode in ("wall", "clock"):
    if os.path.exists(slept):
        os.unlink(slept)
    trainer = Trainer(DigitsMLP(), train, val)
    trainer.fit(strategy=DiLoCoStrategy(H=1000), num_nodes=2, max_steps=30, batch_size=8,
                val_size=0, progress=False, logger=None, rank_speeds=[1.0, 0.25],
                compute_time_s=0.001, speed_mode=mode)
    lines = open(slept).read().split("\\n")[:-1] if os.path.exists(slept) else []
    out[mode] = {"history": trainer.history,
                 "slept": [(int(pid), float(s)) for pid, s in (l.split() for l in lines)]}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_wall_mode_really_slows_the_slow_rank(tmp_path):
    # The sleep of "wall" follows the measured compute; the clocks use the fixed one, so that
    # they are exact (a step's measured CPU time on a shared machine varies by 2x between ranks).
    # The sleeps are recorded as the ranks take them: how long the slow rank's steps took
    # beside the other's depends on what else the machine runs, what it slept does not.
    import json
    import subprocess

    import warm

    done = subprocess.run([*warm.python(), "-c", WALL_MODE, str(tmp_path / "slept")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout)
    wall, in_wall = runs["wall"]["history"], [tuple(x) for x in runs["wall"]["slept"]]
    clock, in_clock = runs["clock"]["history"], runs["clock"]["slept"]
    rows = {(r["rank"], r["step"]): r for r in wall}
    # No sync within 30 steps: in "wall" the slow rank sleeps off three times its compute
    # after each of its steps, one process alone, and its wall clock holds every sleep; the
    # other rank and every rank of "clock" never sleep (the last sleep may come after the
    # last step's time is taken).
    assert len(in_wall) == 30 and len({pid for pid, _ in in_wall}) == 1, in_wall
    assert all(seconds > 0 for _, seconds in in_wall)
    assert rows[(1, 30)]["wall_s"] >= sum(seconds for _, seconds in in_wall[:-1])
    assert in_clock == []

    def ratio(history, key):
        rows = {(r["rank"], r["step"]): r for r in history}
        return rows[(1, 30)][key] / rows[(0, 30)][key]

    # The simulated clocks say 4x either way: the compute divided by the speed.
    assert ratio(wall, "sim_time_s") == pytest.approx(4.0)
    assert ratio(clock, "sim_time_s") == pytest.approx(4.0)


def test_no_clock_no_sim_time(digits):
    trainer = fit(digits, SimpleReduceStrategy(), max_steps=1)
    assert all("sim_time_s" not in r for r in trainer.history)
    assert "sim_time_s" not in trainer.summary


@pytest.mark.parametrize("bad, match", [
    (dict(network="fast"), "network"),
    (dict(rank_speeds=[1.0]), "one per rank"),
    (dict(rank_speeds=[1.0, 0.0]), "positive"),
    (dict(speed_mode="sometimes"), "speed_mode"),
    (dict(compute_time_s=-1.0), "compute_time_s"),
    (dict(network=Network("1gbit", rank_bandwidth=["1gbit"])), "one per rank"),
    (dict(compute_schedule=[[0.1]]), "one per rank"),
    (dict(compute_schedule=[[0.1], "fast"]), "compute_schedule"),
])
def test_bad_clock_arguments_fail_before_any_rank_starts(digits, bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fit(digits, SimpleReduceStrategy(), max_steps=1, **bad)


def test_measured_compute_excludes_the_wait_in_collectives(digits):
    # DDP with a rank at a fifth of the speed: the fast rank waits at every all-reduce in
    # wall time, but its clock counts only its own compute, so after the all-reduce the
    # two clocks differ only by the optimizer's step that follows it.
    trainer = fit(digits, SimpleReduceStrategy(), max_steps=10, network="1gbit",
                  rank_speeds=[1.0, 0.2], speed_mode="wall")
    rows = {(r["rank"], r["step"]): r for r in trainer.history}
    fast, slow = rows[(0, 10)], rows[(1, 10)]
    assert 0 < slow["sim_time_s"] - fast["sim_time_s"] < 0.2 * slow["sim_time_s"]
    # in wall time the fast rank took as long as the slow one (it waited), ...
    assert fast["wall_s"] > 0.5 * slow["wall_s"]
    assert math.isfinite(fast["sim_time_s"])


@pytest.mark.slow
def test_a_resumed_run_continues_its_simulated_clock(digits, tmp_path):
    kwargs = dict(network="100mbit", compute_time_s=COMPUTE, checkpoint_interval=2,
                  save_dir=str(tmp_path), run_name="clocked")
    whole = fit(digits, SimpleReduceStrategy(), max_steps=4, **{**kwargs, "run_name": "whole"})
    fit(digits, SimpleReduceStrategy(), max_steps=2, **kwargs)
    resumed = fit(digits, SimpleReduceStrategy(), max_steps=4, resume_from="auto", **kwargs)
    assert [r["step"] for r in resumed.history if r["rank"] == 0] == [3, 4]
    assert clocks(resumed)[(0, 4)] == pytest.approx(clocks(whole)[(0, 4)])


class GatherFirstTensorEveryOtherStep(Strategy):
    """A strategy written here and nowhere else: local SGD, and every second step an
    all-gather of every rank's first parameter tensor, then its mean. No planner code
    knows it; it states its own traffic."""

    def step(self) -> None:
        if self.num_nodes > 1 and (self.local_step + 1) % 2 == 0:
            first = self.trainable_parameters()[0]
            gathered = [torch.empty_like(first.data) for _ in range(self.num_nodes)]
            comm.all_gather(gathered, first.data)
            first.data.copy_(torch.stack(gathered).mean(0))
        self.optim.step()
        super().step()

    def traffic(self, model: ModelFacts, num_nodes: int) -> list[Traffic]:
        return [Traffic("all_gather", 4 * math.prod(model.shapes[0]), every=2)]


def test_a_strategy_written_in_a_test_gets_its_simulated_time_and_planner_estimate(digits):
    model = DigitsMLP()
    facts = ModelFacts.of(model)
    net = Network("10mbit", latency_s=0.001)
    strategy = GatherFirstTensorEveryOtherStep()
    trainer = fit(digits, strategy, num_nodes=3, max_steps=4, network=net,
                  compute_time_s=COMPUTE)
    counted = max(r["comm_bytes"] for r in trainer.history if r["step"] == 4) / 4
    planned = step_traffic(strategy, facts.num_params, 3, shapes=facts.shapes)
    assert counted > 0 and planned.payload == pytest.approx(counted, rel=1e-12)
    assert planned.strategy == "GatherFirstTensorEveryOtherStep"
    step_s = predict_step_time(strategy, facts.num_params, 3, COMPUTE,
                               throughput_bytes_per_s=1e7 / 8, latency_s=0.001,
                               shapes=facts.shapes)
    # the clock charged the gathers the strategy made; the planner read its statement
    assert trainer.summary["sim_time_per_step_s"] == pytest.approx(step_s, rel=1e-9)
    assert step_s > COMPUTE
