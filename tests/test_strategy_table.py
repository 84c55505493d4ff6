"""``python -m bench.strategy_table --quick``: every strategy on a tiny chargpt, end to end.

The bench runs as a child (no test imports a bench); these tests read what it
writes: the results' structure, the plot, the bytes of each strategy against
its own statement of traffic (``Strategy.traffic``), the sweep's choice, the
Pareto front on points written by hand, resuming, and refusals of bad input.
The 1 Gbit/s column rests on the simulated clock's linearity in 1/bandwidth,
checked here on exogym itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import warm

#: One worker runs this module: its tests share one quick table (a module fixture).
pytestmark = pytest.mark.xdist_group("strategy_table")

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["ddp", "diloco", "streaming_diloco", "sparseloco", "sparta", "sparta_diloco", "fedavg",
         "demo", "muloco", "desloc", "async_diloco"]


def bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the bench to its end; on a timeout, stop it and every process it started."""
    command = [*warm.python(), "-m", "bench.strategy_table", *args]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(args)} took over {timeout} s:\n{stdout[-2000:]}{stderr[-2000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("table") / "quick"
    done = bench("--quick", "--out", str(out), "--jobs", "1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def front(points: list[tuple[float, float]]) -> list[bool]:
    return [not any(b2 <= b and l2 <= loss and (b2, l2) != (b, loss) for b2, l2 in points)
            for b, loss in points]


@pytest.mark.slow(reason="trains every strategy of the table once")
def test_quick_writes_every_row_the_table_and_the_plot(quick):
    data = json.loads((quick / "results.json").read_text())
    assert data["version"] == 1 and data["scale"]["name"] == "quick"
    assert [r["strategy"] for r in data["rows"]] == NAMES
    seeds = data["scale"]["seeds"]
    for r in data["rows"]:
        if r["strategy"] == "async_diloco" and r.get("status") != "done":
            assert importlib.util.find_spec("exogym.strategy.async_diloco") is None
            assert r["status"] == "not available in this checkout" and r["reason"]
            continue
        assert r["status"] == "done", r
        assert r["seeds"] == seeds
        loss = r["val_loss"]
        assert loss["min"] <= loss["mean"] <= loss["max"] and loss["std"] >= 0
        assert r["loss_ratio"] == pytest.approx(loss["mean"] / data["rows"][0]["val_loss"]["mean"])
        assert r["wall_s"] > 0 and isinstance(r["pareto"], bool)
        slow, fast = r["sim_s"]["100mbit"], r["sim_s"]["1gbit"]
        overlapping = r["strategy"] in ("streaming_diloco", "async_diloco")
        assert r["fast_source"] == ("simulated" if overlapping else "derived")
        # Derived from the same run, 1 Gbit/s is never later; a run of its own measures its
        # own compute, which on shared cores can take longer than the 100 Mbit/s run's.
        assert 0 < fast <= slow if r["fast_source"] == "derived" else fast > 0, r
    assert data["rows"][0]["bytes_ratio"] == 1.0 and data["rows"][0]["loss_ratio"] == 1.0
    assert data["pareto"] == [r["label"] for r in data["rows"] if r.get("pareto")]
    assert (quick / "loss_vs_bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (quick / "table.md").read_text().splitlines()
    assert sum(line.startswith("| ") for line in table) == 1 + len(NAMES)


def test_bytes_relative_to_ddp_are_what_each_strategy_states(quick):
    from distributed.tasks.builtin import chargpt_task
    from exogym.comm.wire import ModelFacts
    from exogym.sim.network import traffic_cost
    from exogym.strategy.registry import class_of

    data = json.loads((quick / "results.json").read_text())
    scale = data["scale"]
    model = chargpt_task(**scale["model"])[0]
    facts, k = ModelFacts.of(model), scale["num_nodes"]

    def stated(name: str, settings: dict) -> float:
        strategy = class_of(name)(**settings)
        return traffic_cost(strategy.traffic(facts, k), k).payload

    ddp = stated("ddp", {})
    checked = 0
    for r in data["rows"]:
        if "bytes_ratio" in r:
            assert r["bytes_ratio"] == pytest.approx(stated(r["strategy"], r["settings"]) / ddp,
                                                     rel=0.01), r["label"]
            checked += 1
    assert checked == 11
    for key, run in data["runs"].items():  # DDP's network share is its all-reduce's ring time
        if key.startswith("ddp|"):
            assert run["network_s"] == pytest.approx(run["bytes"] * 2 * (k - 1) / k * 8 / 100e6)


def test_the_sweep_keeps_the_budget_rule_and_the_front_is_the_undominated(quick):
    data = json.loads((quick / "results.json").read_text())
    for name, sweep in data["sweeps"].items():
        inside = [p for p in sweep["points"] if p["bytes_ratio"] <= data["budget"]]
        best = (min(inside, key=lambda p: p["val_loss"]) if inside
                else min(sweep["points"], key=lambda p: p["bytes_ratio"]))
        assert sweep["chosen"] == best["value"], name
        row = next(r for r in data["rows"] if r["strategy"] == name)
        assert row["value"] == best["value"]
    measured = [r for r in data["rows"] if "bytes_ratio" in r]
    assert [r["pareto"] for r in measured] == front(
        [(r["bytes_ratio"], r["val_loss"]["mean"]) for r in measured])


@pytest.mark.slow
def test_resume_runs_nothing_and_the_front_of_known_points(quick, tmp_path):
    out = tmp_path / "known"
    shutil.copytree(quick, out)
    done = bench("--quick", "--out", str(out), "--resume")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "0 runs to start now" in done.stdout
    # Every run of a strategy gets the same (bytes, loss): the front is known by hand.
    known = {"ddp": (1000, 3.00), "diloco": (100, 3.10), "sparta_diloco": (50, 3.05),
             "fedavg": (100, 3.20), "streaming_diloco": (10, 3.30), "sparseloco": (20, 3.40),
             "sparta": (5, 3.50), "demo": (5, 3.60), "muloco": (1, 3.60), "desloc": (300, 3.05),
             "async_diloco": (100, 3.15)}
    data = json.loads((out / "results.json").read_text())
    for run in data["runs"].values():
        run["bytes"], run["val_loss"] = known[run["strategy"]]
    (out / "results.json").write_text(json.dumps(data))
    (out / "loss_vs_bytes.png").unlink()
    done = bench("--quick", "--out", str(out), "--report-only", "--budget", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((out / "results.json").read_text())
    assert data["pareto"] == ["DDP", "Streaming DiLoCo", "SPARTA", "SPARTA-DiLoCo", "MuLoCo"]
    assert (out / "loss_vs_bytes.png").exists()
    assert "Pareto" in done.stdout


@pytest.mark.parametrize("args, said", [
    (["--only", "diloco,nosuch"], "nosuch is not a strategy of the table; give names from ddp"),
    (["--steps", "25"], "--steps 25: the periods of DiLoCo H=2"),
    (["--jobs", "0"], "--jobs must be at least 1, got 0"),
    (["--budget", "2"], "--budget must be within (0, 1]"),
    (["--report-only"], "does not exist"),
])
def test_bad_input_is_refused_before_any_run(tmp_path, args, said):
    done = bench("--quick", "--out", str(tmp_path / "none"), *args, timeout=60)
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert not (tmp_path / "none").exists()


def test_dry_run_plans_the_full_table_and_runs_nothing(tmp_path):
    done = bench("--dry-run", "--out", str(tmp_path / "full"), timeout=60)
    assert done.returncode == 0, done.stderr
    has_async = importlib.util.find_spec("exogym.strategy.async_diloco") is not None
    # DDP's 3 seeds; 3 sweep values and 2 more seeds for each of the others; Streaming
    # DiLoCo (and AsyncDiLoCo) again at 1 Gbit/s for each seed.
    assert f"of about {59 if has_async else 51};" in done.stdout
    keys = [line.strip() for line in done.stdout.splitlines() if line.startswith("  ")]
    assert keys[0] == "ddp|-|seed=0|100mbit" and keys[1].startswith("demo|")
    assert "diloco|H=6|seed=0|100mbit" in keys and not (tmp_path / "full").exists()


def test_existing_results_need_resume(quick):
    done = bench("--quick", "--out", str(quick), timeout=60)
    assert done.returncode == 2 and "give --resume to continue it" in done.stderr


@pytest.mark.slow
def test_the_clock_is_linear_in_one_over_bandwidth():
    # What the 1 Gbit/s column rests on: for synchronous collectives without latency,
    # T(fast) = T(slow) - (1 - slow/fast) * the network's share of T(slow).
    from distributed.tasks.builtin import chargpt_task
    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy, SimpleReduceStrategy

    for strategy in (SimpleReduceStrategy, lambda: DiLoCoStrategy(H=3)):
        times, shares = {}, {}
        for net in ("100mbit", "1gbit"):
            model, train, val = chargpt_task(n_layer=1, n_embd=16, n_head=2, block_size=16)
            trainer = Trainer(model, train, val)
            trainer.fit(strategy=strategy(), num_nodes=4, max_steps=6, batch_size=4,
                        val_size=0, network=net, compute_time_s=0.01, logger=None,
                        progress=False, num_threads=1)
            times[net] = trainer.summary["sim_time_s"]
            least: dict[int, float] = {}
            for row in trainer.history:
                if "sim_comm_s" in row:
                    least[row["step"]] = min(least.get(row["step"], 1e9), row["sim_comm_s"])
            shares[net] = sum(least.values())
        assert shares["100mbit"] > 0
        assert shares["1gbit"] == pytest.approx(shares["100mbit"] / 10)
        assert times["1gbit"] == pytest.approx(times["100mbit"] - 0.9 * shares["100mbit"])
