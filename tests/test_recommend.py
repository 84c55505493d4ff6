"""Choosing the strategy: ``recommend`` and ``distributed-train --strategy auto``.

The pick rule runs on hand-made predictions. The rest runs for real: the
profile's steps timed here and on the test sshd's hosts (this machine as the
master, 127.0.0.2 over SSH), the link between them measured with a TCP
transfer, and a training run with the strategy picked.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from faces_support import sshd_hosts
from ranks import ROOT
from rich.console import Console
from safetensors import safe_open
from sshd_fixture import serve_sshd
from typer.testing import CliRunner

from cli_typer import app
from distributed.app.measurements import with_contained_steps
from distributed.app.recommend import (
    Candidate,
    Measurements,
    RecommendError,
    candidate_specs,
    pick,
    predict_candidates,
)
from distributed.profiles.profile import load_profile

runner = CliRunner()
#: A tiny digits run: the steps to time are short, and DiLoCo's H stay below max_steps.
TINY = ["max_steps=60", "val_interval=60", "val_size=32", "num_threads=1",
        "checkpoint_interval=None"]
ROW_FIELDS = {"label", "name", "settings", "step_s", "comm_s", "speedup", "wire_bytes",
              "applies", "comm_fraction"}


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    yield from serve_sshd(tmp_path_factory)


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def sets(pairs: list[str]) -> list[str]:
    return [part for pair in pairs for part in ("--set", pair)]


def ssh_files(sshd) -> list[str]:
    return ["--known-hosts", str(sshd.known_hosts), "--ssh-config", str(sshd.ssh_config)]


def two_hosts(sshd, tmp_path: Path) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(sshd_hosts(sshd, workers=1)))
    return path


# --------------------------------------------------------------------------- the pick rule


def row(label: str, speedup: float, wire: float, applies: bool = True) -> Candidate:
    return Candidate(label, label.split()[0].lower(), {}, 1.0 / speedup, 0.0, speedup, wire,
                     applies, None if applies else "its keys do not fit")


def test_pick_takes_the_highest_predicted_speedup():
    rows = [row("ddp", 1.2, 1e7), row("diloco H=10", 1.8, 1e6), row("sparta", 1.5, 1e4)]
    assert pick(rows).label == "diloco H=10"


def test_pick_breaks_a_tie_toward_fewer_bytes():
    rows = [row("diloco H=100", 1.950, 1e5), row("diloco H=500", 1.945, 2e4),
            row("ddp", 1.5, 1e7)]
    assert pick(rows).label == "diloco H=500"  # within 1% of the best: fewer bytes wins
    assert pick(rows, tie=0.0).label == "diloco H=100"


def test_pick_skips_strategies_the_profile_cannot_switch_to():
    rows = [row("ddp", 1.9, 1e7, applies=False), row("diloco H=10", 1.7, 1e6)]
    assert pick(rows).label == "diloco H=10"
    with pytest.raises(RecommendError, match="no candidate strategy fits"):
        pick([row("ddp", 1.9, 1e7, applies=False)])


def test_predictions_follow_the_link_ddp_wins_on_a_fast_one():
    profile = load_profile("chargpt-bench")
    specs = candidate_specs(profile)
    assert [s.label for s in specs][:5] == ["DDP", "DiLoCo H=10", "DiLoCo H=50",
                                            "DiLoCo H=100", "SPARTA p=0.005"]

    def at(mbit: float) -> list[Candidate]:
        m = Measurements(hosts=2, num_params=3_257_856, shapes=((3_257_856,),),
                         compute_s={"ddp": 0.30, "sparta": 0.33, "demo": 0.40},
                         compute_sd_s=0.0, minibatch_s=0.30,
                         throughput_bytes_per_s=mbit * 1e6 / 8, link="modelled")
        return predict_candidates(m, specs)

    slow, fast = at(100), at(100_000)
    assert pick(slow).name == "diloco" and pick(slow).settings["H"] >= 50
    ddp_fast = next(c for c in fast if c.name == "ddp")
    assert ddp_fast.speedup > 1.9 and pick(fast).speedup == pytest.approx(2.0, rel=0.02)


def test_a_changed_setting_is_predicted_by_the_model_that_made_the_rows():
    from distributed.app.recommend import Recommendation, predict_with, reason_for

    profile = load_profile("digits-diloco")
    m = Measurements(hosts=4, num_params=9_610, shapes=((128, 64), (128,), (10, 128), (10,)),
                     compute_s={"ddp": 0.001, "sparta": 0.0012, "demo": 0.004},
                     compute_sd_s=0.0, minibatch_s=0.001,
                     throughput_bytes_per_s=100e6 / 8, link="modelled")
    rows = predict_candidates(m, candidate_specs(profile))
    chosen = pick(rows)
    rec = Recommendation(profile.name, chosen, reason_for(chosen, rows, m), tuple(rows), m)
    for row in rows:
        assert predict_with(rec, row.name, row.settings) == row  # the same figures again
    fewer = predict_with(rec, "diloco", {"H": 30})
    assert fewer.label == "DiLoCo H=30"
    h10, h50 = (next(r for r in rows if r.label == f"DiLoCo H={h}") for h in (10, 50))
    assert h10.wire_bytes > fewer.wire_bytes > h50.wire_bytes
    assert h10.speedup < fewer.speedup < h50.speedup


def digits_measurements(mbit: float, **extra) -> Measurements:
    values = {"compute_sd_s": 0.0, "minibatch_s": 0.002, **extra}
    return Measurements(hosts=2, num_params=9_610,
                        shapes=((128, 64), (128,), (10, 128), (10,)),
                        compute_s={"ddp": 0.002, "sparta": 0.0022, "demo": 0.005},
                        throughput_bytes_per_s=mbit * 1e6 / 8, link="measured", **values)


def reason_at(m: Measurements) -> tuple[str, Candidate]:
    from distributed.app.recommend import reason_for

    rows = predict_candidates(m, candidate_specs(load_profile("digits-diloco")))
    chosen = pick(rows)
    return reason_for(chosen, rows, m), next(r for r in rows if r.name == "ddp")


def test_ddp_time_is_named_by_what_it_is_spent_on_not_always_the_link():
    # A fast link and steps that vary: DDP's time beyond compute is waiting for the slowest.
    text, ddp = reason_at(digits_measurements(18_300, compute_sd_s=0.004))
    assert ddp.parts.main_cost() == "wait" and ddp.comm_fraction > 0.3
    assert "waiting for the slowest host (steps vary by 4 ms), not on the link" in text
    assert "waiting on the" not in text
    # A fast link with a long latency: DDP's ring pays it in every round.
    text, ddp = reason_at(digits_measurements(18_300, latency_s=0.005))
    assert ddp.parts.main_cost() == "latency"
    assert "on the link's 5 ms latency, not its bandwidth" in text
    # A slow link: the bytes themselves.
    text, ddp = reason_at(digits_measurements(0.5))
    assert ddp.parts.main_cost() == "transfer"
    assert "sending 37.5 KiB a step on the 0.5 Mbit/s link" in text


@pytest.mark.slow
def test_a_noisy_measurement_is_said_and_the_pick_is_made_again_at_its_ends():
    from distributed.app.recommend import HostTiming, noise_report

    specs = candidate_specs(load_profile("digits-diloco"))
    # A profile that can switch only to DDP and SPARTA: a fast link favours DDP, a slow one
    # SPARTA (DiLoCo with the largest H wins everywhere for so small a model).
    only = {s.label: None if s.name in ("ddp", "sparta") else "its keys do not fit"
            for s in specs}

    def noise(m: Measurements) -> str | None:
        chosen = pick(predict_candidates(m, specs, only))
        return noise_report(m, specs, only, chosen)

    assert noise(digits_measurements(100)) is None  # measured once, nothing to doubt
    # The link swung between a tenth and ten times the figure used: the pick changes.
    swing = digits_measurements(1000, throughput_range=(100e6 / 8, 10e9 / 8))
    said = noise(swing)
    assert said.startswith("the measurement was noisy (the link measured 100 Mbit/s to "
                           "10 Gbit/s): within it ")
    assert said.endswith("within it DDP would be picked instead of SPARTA p=0.005; measure "
                         "again, on quieter hosts, before trusting the pick")
    # Steps that vary a lot on one host, but no pick changes within the spread.
    steady_pick = digits_measurements(
        1, host_steps=(HostTiming("a", 0.002, 0.0002), HostTiming("b", 0.002, 0.0009)))
    said = noise(steady_pick)
    assert said == ("the measurement was noisy (steps on b varied by 45% from step to step "
                    "(median 2 ms)), but the pick is SPARTA p=0.005 anywhere within it")


def test_a_busy_machines_figures_give_predictions_that_agree_with_themselves():
    # Each kind timed at its own moment of a busy machine: SPARTA's step measured shorter
    # than the AdamW step it contains, the reference (two minibatches, one optimizer step)
    # shorter than one AdamW step. On a fast link DDP sends almost nothing.
    specs = candidate_specs(load_profile("digits-diloco"))
    busy = dataclasses.replace(digits_measurements(100_000), minibatch_s=0.0014,
                               compute_s={"ddp": 0.010, "sparta": 0.004, "demo": 0.012})
    rows = predict_candidates(busy, specs)
    ddp = next(r for r in rows if r.name == "ddp")
    for row in rows:
        if row.name == "sparta":  # never shorter than the AdamW step inside it
            assert row.step_s >= busy.compute_s["ddp"], row
        # one host doing both hosts' minibatches takes at least one AdamW step, so the
        # speedup is at least what the communication share (and any local work beyond an
        # AdamW step) leaves of one host's pace: 1x for DDP with nothing to send
        assert row.speedup >= (1 - row.comm_fraction) * busy.compute_s["ddp"] \
            / row.parts.compute_s - 1e-9, row
    assert ddp.comm_fraction < 0.01 and ddp.speedup >= 0.99
    # figures that already agree are left as measured
    steady = digits_measurements(1000)
    assert with_contained_steps(steady) is steady


@pytest.mark.slow
def test_the_noise_sentence_counts_what_was_timed_and_a_wild_spread_holds_no_pick():
    from distributed.app.recommend import noise_report

    specs = candidate_specs(load_profile("digits-diloco"))
    only = {s.label: None if s.name in ("ddp", "sparta") else "its keys do not fit"
            for s in specs}

    def noise(m: Measurements) -> str:
        said = noise_report(m, specs, only, pick(predict_candidates(m, specs, only)))
        assert said is not None
        return said

    # this machine's step stood in for the hosts', timed in two passes: not "1 timing run"
    here = noise(digits_measurements(1, compute_range=(1.0, 1.3), compute_range_from="here"))
    assert "step times differed by 30% between the 2 passes timed on this machine" in here
    assert "timing run" not in here and "anywhere within it" in here
    hosts = noise(digits_measurements(1, compute_range=(0.9, 1.2), timing_runs=2))
    assert "step times differed by 33% between the 2 timing runs on the hosts" in hosts
    # steps 124 times apart: the pick is not said to hold
    wild = noise(digits_measurements(1, compute_range=(1.0, 124.89),
                                     compute_range_from="here"))
    assert "step times differed by 12389% between the 2 passes" in wild
    assert wild.startswith("the measurement was too noisy to tell")
    assert "anywhere within it" not in wild and "before trusting it" in wild


def test_the_spread_from_step_to_step_is_not_set_by_one_slow_step():
    from distributed.app.measurements import robust_sd

    steps = [0.010, 0.011, 0.010, 0.009, 0.010, 0.011, 0.009, 0.010, 0.500, 0.010]
    assert robust_sd(steps) < 0.002  # a stdev would be 0.15: 15x the step
    assert robust_sd([0.01]) == 0.0


def test_links_are_measured_until_two_transfers_agree():
    from distributed.app.measurements import LINK_TRIES, _median_link, _steady_link
    from distributed.hosts.linkspeed import LinkMeasurement

    def measured(rates: list[float]):
        made = []

        def once(i: int) -> LinkMeasurement:
            made.append(i)
            return LinkMeasurement("a -> b", int(rates[i]), 1.0, 0.001 if i == 0 else None)
        return _steady_link(once), made

    found, made = measured([100e6, 101e6, 50e6, 50e6])
    assert made == [0, 1] and _median_link(found).bytes == 100e6
    found, made = measured([100e6, 50e6, 90e6, 20e6, 99e6])
    assert len(made) == LINK_TRIES  # never steady: stops at the bound, median kept
    assert _median_link(found).bytes == 50e6 and _median_link(found).latency_s == 0.001


def test_measuring_tells_each_stage_as_it_starts_and_ends_at_the_total(tmp_path, monkeypatch):
    from distributed.app import measurements as planner
    from distributed.app.run import TrainRequest
    from distributed.planning.estimate import ModelFacts

    timed = []

    def measure_model(profile, ranks_here=1, steps=10, warmup=3, num_nodes=None, task=None):
        timed.append(profile.strategy)
        return ModelFacts(num_params=9_610, compute_s_per_step=0.001, batch_size=32, threads=1,
                          shapes=((128, 64), (128,), (10, 128), (10,)))

    monkeypatch.setattr(planner, "measure_model", measure_model)
    told: list[tuple[str, int, int]] = []
    request = TrainRequest(profile="digits-diloco", overrides={"num_nodes": 3})
    planner.measure(request, Console(file=io.StringIO()), link_mbit=100,
                    progress=lambda *stage: told.append(stage))
    total = told[0][2]
    assert [done for _, done, _ in told] == list(range(total + 1))  # each once, then the end
    assert all(t == total for _, _, t in told) and told[-1][0] == "done"
    # the warm-up, then two passes over the own step, each compute kind and the reference
    assert len(timed) == total
    assert [what for what, _, _ in told[1:total]].count("timing SPARTA's step here") == 2
    assert "timing one machine doing every node's work here" in [w for w, _, _ in told]


def test_stages_show_as_a_progress_display_in_a_terminal_and_as_lines_elsewhere():
    from distributed.app.console import stage_progress

    terminal = io.StringIO()
    with stage_progress(Console(file=terminal, force_terminal=True, width=120),
                        "Timing", log_prefix="[recommend]") as report:
        report("timing SPARTA's step here", 3, 11)
    assert "Timing: timing SPARTA's step here" in terminal.getvalue()
    assert "3/11" in terminal.getvalue() and "[recommend]" not in terminal.getvalue()

    log = io.StringIO()
    with stage_progress(Console(file=log, width=120), "Timing",
                        log_prefix="[recommend]") as report:
        report("timing SPARTA's step here", 3, 11)
        report("done", 11, 11)
    assert log.getvalue() == "[recommend] timing SPARTA's step here (4 of 11)\n"
    quiet = io.StringIO()
    with stage_progress(Console(file=quiet), "Timing") as report:
        report("timing SPARTA's step here", 3, 11)
    assert quiet.getvalue() == ""


# --------------------------------------------------------------------------- bad input


def test_a_bad_profile_fails_before_any_measurement(tmp_path):
    result = invoke("recommend", "digits-dilcoo", "--link-mbit", "100")
    assert result.exit_code == 2, result.output
    assert "digits-dilcoo" in result.output and "timing" not in result.output


def test_a_bad_hosts_file_fails_before_any_measurement(tmp_path):
    bad = tmp_path / "hosts.json"
    bad.write_text('{"master": "127.0.0.1", "workers": [{"hots": "x"}]}')
    result = invoke("recommend", "digits-ddp", "--hosts", bad)
    assert result.exit_code == 2, result.output
    assert "hots" in result.output and "timing" not in result.output


def test_without_hosts_or_a_modelled_link_it_says_what_to_give():
    for args in (["recommend", "digits-ddp"], ["distributed-train", "digits-ddp",
                                                "--strategy", "auto"]):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert "--link-mbit" in result.output and "timing" not in result.output


# --------------------------------------------------------------------------- real hosts


@pytest.mark.slow(reason="measures every strategy across two hosts over SSH")
def test_recommend_json_on_two_hosts_gives_a_pick_and_rows(sshd, tmp_path):
    hosts = two_hosts(sshd, tmp_path)
    result = invoke("recommend", "digits-ddp", "--hosts", hosts, "--json", *sets(TINY),
                    *ssh_files(sshd))
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["strategy"]["name"] in {"ddp", "diloco", "sparta", "demo", "fedavg"}
    assert answer["reason"].startswith(answer["label"])
    labels = [c["label"] for c in answer["candidates"]]
    assert labels[:4] == ["DDP", "DiLoCo H=10", "DiLoCo H=50", "SPARTA p=0.005"]
    for c in answer["candidates"]:
        assert ROW_FIELDS <= set(c), c
        assert c["step_s"] > 0 and c["speedup"] > 0 and c["wire_bytes"] >= 0
    m = answer["measurements"]
    assert m["hosts"] == 2 and m["link"] == "measured"
    assert [t["host"] for t in m["host_steps"]] == ["127.0.0.1", "127.0.0.2"]
    assert all(t["step_s"] > 0 for t in m["host_steps"])
    assert m["links"][0]["link"] == "127.0.0.1 -> 127.0.0.2" and m["mbit_per_s"] > 10
    # Measured until steady: two transfers at least, a latency, a spread and runs kept.
    low, high = m["throughput_range"]
    assert low <= m["throughput_bytes_per_s"] <= high and m["latency_s"] > 0
    assert m["timing_runs"] in (1, 2) and len(m["host_steps"][0]["steps_s"]) >= 10
    assert answer["noise"] is None or answer["noise"].startswith(
        ("the measurement was noisy (", "the measurement was too noisy to tell ("))


@pytest.mark.slow(
    reason="measures each strategy on this machine, then trains with the one it picked")
def test_strategy_auto_trains_with_the_picked_strategy(sshd, tmp_path):
    hosts = two_hosts(sshd, tmp_path)
    out = tmp_path / "out"
    result = invoke("distributed-train", "digits-ddp", "--hosts", hosts, "--strategy", "auto",
                    "--link-mbit", "1", "--run-dir", str(tmp_path / "launch"),
                    *sets([*TINY, f"output_dir={out}"]), *ssh_files(sshd))
    assert result.exit_code == 0, result.output
    picked = re.search(r"strategy auto: (\w+)(?: H=(\d+))?", result.output)
    assert picked, result.output
    # 1 Mbit/s: DDP's traffic would dominate every step; the pick sends far less.
    assert picked[1] != "DDP" and "DDP would spend" in result.output
    with safe_open(str(out / "model.safetensors"), "pt") as model:
        values = json.loads(model.metadata()["profile_values"])
    assert values["strategy"] == picked[1].lower()
    if picked[2]:
        assert values["H"] == int(picked[2])


@pytest.mark.slow
def test_the_wizard_shows_the_recommendation_beside_its_estimates(tmp_path):
    config = tmp_path / "config.ini"
    config.write_text((ROOT / "config.ini").read_text())
    done = subprocess.run(
        [sys.executable, str(ROOT / "wizard.py"), "--yes", "--no-run", "--config", str(config),
         "--bandwidth-mbit", "1", *sets([*TINY, "num_nodes=2"])],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    estimates = done.stdout.index("Estimates for 2 machines at 1 Mbit/s")
    line = next(x for x in done.stdout[estimates:].splitlines() if x.startswith("Recommended:"))
    assert "communication is" in line and "predicted on 2 hosts" in line
    assert "DDP would spend" in line  # at 1 Mbit/s DDP is not the pick


def test_each_timing_run_on_the_hosts_has_a_scratch_folder_of_its_own_removed_after_it(
        monkeypatch, tmp_path):
    """Two timing runs at once (two recommends on one master) must not share a folder:
    one replaced the other's run there and failed. Each writes into its own, removed from
    the master's project folder after it, whether it trained or failed."""
    from distributed.app import measurements
    from distributed.hosts.hostsfile import load_hosts

    config = load_hosts({"master": "127.0.0.1", "workers": ["127.0.0.2"],
                         "python_env": sys.executable, "project_path": str(tmp_path)})
    folders: list[str] = []

    class Shell:
        def run(self, command: str, message=None, timeout: float = 30.0):
            subprocess.run(["sh", "-c", command], check=True, timeout=timeout)

    class Launcher:
        def __init__(self, request, config, console, dashboard):
            self.output = request.overrides["output_dir"]
            folders.append(self.output)
            self.session = self

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def preflight(self):
            return None

        def shell(self, host: int):
            return Shell()

        def run(self):
            (tmp_path / self.output).mkdir(parents=True)
            (tmp_path / self.output / "run.json").write_text("{}")
            (tmp_path / f"{self.output}.latest").symlink_to(Path(self.output).name)
            raise RuntimeError("a rank failed")

    monkeypatch.setattr(measurements, "make_launcher", Launcher)
    request = measurements.TrainRequest(profile="digits-ddp", hosts=config)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="a rank failed"):
            measurements._host_steps(request, config, Console(file=io.StringIO()), 1, 2)
    assert len(set(folders)) == 2, folders
    assert all(f.startswith("runs/recommend-probe-") for f in folders), folders
    assert list((tmp_path / "runs").iterdir()) == []  # both removed, with their pointers
