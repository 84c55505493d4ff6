"""The run's trace (trace.jsonl): what each rank's steps cost, written by every run.

A simulation through ``fit(trace=...)``, the command line's local runs and runs across the
test sshd's hosts; the file appears under its name only when the run ends, also after a
failure; past a bound per rank, steps are summarised in blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import warm
from toys import CrashAt, TinyNet, toy_dataset

from exogym import Trainer
from exogym.data.digits import DigitsMLP, digits_datasets
from exogym.report import trace as trace_module
from exogym.report.trace import TRACE_FILE, TraceWriter, read_trace
from exogym.run.trainer import RankFailedError
from exogym.strategy import DiLoCoStrategy, SimpleReduceStrategy

COMPUTE = 0.05  # simulated seconds per step: the simulated times are exact
QUIET = {"progress": False, "logger": None}


@pytest.fixture(scope="module")
def digits():
    return digits_datasets()


def kinds(lines: list[dict], kind: str) -> list[dict]:
    return [line for line in lines if line["kind"] == kind]


def by_rank(lines: list[dict]) -> dict[int, list[dict]]:
    found: dict[int, list[dict]] = defaultdict(list)
    for line in lines:
        found[line["rank"]].append(line)
    return found


def test_a_clocked_run_traces_compute_and_comm_that_add_up_to_its_simulated_time(
        digits, tmp_path):
    train, val = digits
    trainer = Trainer(DigitsMLP(), train, val)
    trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=3, max_steps=6, batch_size=8,
                val_size=16, val_interval=3, network="100mbit", compute_time_s=COMPUTE,
                trace=tmp_path, **QUIET)
    lines = read_trace(tmp_path / TRACE_FILE)
    assert trainer.trace_path == tmp_path / TRACE_FILE
    header = lines[0]
    assert header["kind"] == "run" and header["version"] == trace_module.FORMAT_VERSION
    assert header["source"] == "simulation" and header["num_nodes"] == 3
    assert header["config"] == json.loads(json.dumps(trainer.run_config, default=repr))
    assert lines[-1]["kind"] == "end" and lines[-1]["status"] == "ok"
    assert lines[-1]["steps"] == 6

    history = {(r["rank"], r["step"]): r for r in trainer.history}
    steps = kinds(lines, "step")
    assert {(s["rank"], s["step"]) for s in steps} == set(history)
    for rank, mine in by_rank(steps).items():
        mine.sort(key=lambda s: s["step"])
        before, sent = 0.0, 0
        for line in mine:
            row = history[(rank, line["step"])]
            assert line["compute_s"] == pytest.approx(COMPUTE)
            assert line["sim_time_s"] == pytest.approx(row["sim_time_s"], abs=1e-6)
            # compute and collectives are all a step costs on the simulated clock
            assert line["compute_s"] + line["comm_s"] == pytest.approx(
                row["sim_time_s"] - before, abs=3e-6)
            assert line["comm_s"] > 0  # a DDP step all-reduces its gradients
            sent += line["bytes"]
            assert sent == line["comm_bytes"] == row["comm_bytes"]
            assert line["samples"] == 8
            before = row["sim_time_s"]
    evals = {(e["rank"], e["step"]): e for e in kinds(lines, "eval")}
    assert set(evals) == {key for key, row in history.items() if "val_loss" in row}
    assert {k[1] for k in evals} == {3, 6}
    for key, line in evals.items():
        assert line["val_loss"] == history[key]["val_loss"]
        assert line["val_global_loss"] == history[key]["val_global_loss"]
    links = kinds(lines, "link")
    assert [link["rank"] for link in links] == [0, 1, 2]
    assert all(link["comm_bytes"] == history[(link["rank"], 6)]["comm_bytes"] for link in links)
    assert [p.name for p in tmp_path.iterdir()] == [TRACE_FILE]  # no temporary file left


def test_a_run_with_rank_failures_traces_every_membership_change(digits, tmp_path):
    train, val = digits
    trainer = Trainer(DigitsMLP(), train, val)
    trainer.fit(strategy=DiLoCoStrategy(H=2), num_nodes=3, max_steps=8, batch_size=8,
                val_size=0, compute_time_s=COMPUTE, rank_failures=[(2, 3, 6)],
                trace=tmp_path / "run.jsonl", **QUIET)
    lines = read_trace(tmp_path / "run.jsonl")
    changes = [{k: line[k] for k in ("step", "ranks", "reason")}
               for line in kinds(lines, "membership")]
    assert changes == trainer.summary["membership"]
    assert [c["reason"] for c in changes] == ["start", "rank 2 left", "rank 2 rejoined"]
    rejoined = kinds(lines, "membership")[-1]
    # the change is timed by when the ranks finished the step before it
    assert rejoined["sim_time_s"] == pytest.approx(
        max(r["sim_time_s"] for r in trainer.history if r["step"] == rejoined["step"] - 1),
        abs=1e-6)
    fault, = kinds(lines, "fault")
    assert (fault["rank"], fault["step"], fault["what"], fault["back_at_step"]) == \
        (2, 3, "leaves", 6)
    handed = kinds(lines, "hand_over")
    assert {h["rank"] for h in handed} == {0, 2} and all(h["step"] == 7 for h in handed)
    away = {s["step"] for s in kinds(lines, "step") if s["rank"] == 2}
    assert away == {1, 2, 7, 8}


def test_the_balancers_shares_and_speed_estimates_are_in_the_step_lines(digits, tmp_path):
    train, val = digits
    trainer = Trainer(DigitsMLP(), train, val)
    trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=12, batch_size=8,
                val_size=0, rank_speeds=[1.0, 0.5], speed_mode="clock", balance="batch",
                trace=tmp_path, **QUIET)
    history = {(r["rank"], r["step"]): r for r in trainer.history}
    steps = kinds(read_trace(tmp_path / TRACE_FILE), "step")
    assert len(steps) == len(history)
    for line in steps:
        row = history[(line["rank"], line["step"])]
        assert line["batch_size"] == row["batch_size"] == line["samples"]
        assert line.get("measured_speed") == row.get("measured_speed")
    assert any("measured_speed" in line for line in steps)


def test_trace_true_writes_beside_the_loggers_summary_and_needs_a_logger_folder(tmp_path):
    data = toy_dataset()
    trainer = Trainer(TinyNet(), data, data)
    trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=3, batch_size=8,
                val_size=0, progress=False, logger="csv", log_dir=str(tmp_path), trace=True)
    assert trainer.trace_path == trainer.log_dir / TRACE_FILE
    assert (trainer.log_dir / "summary.json").is_file()
    assert read_trace(trainer.trace_path)[-1]["status"] == "ok"
    with pytest.raises(ValueError, match="logger's run folder"):
        trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=3, trace=True,
                    **QUIET)
    with pytest.raises(TypeError, match="trace must be a folder"):
        trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=3, trace=3,
                    **QUIET)


class CrashingNet(CrashAt, TinyNet):
    crash_at = 5


class Watch:
    """A progress sink that looks at the run's folder while the ranks report."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.seen: list[tuple[bool, bool]] = []

    def on_event(self, event):
        if event.get("event") == "step":
            names = [p.name for p in self.folder.iterdir()]
            self.seen.append((TRACE_FILE in names,
                              any(n.startswith(f".{TRACE_FILE}.") for n in names)))

    def close(self):
        pass

    def finish(self, summary, title="run summary"):
        pass


@pytest.mark.slow
def test_the_trace_appears_only_when_the_run_ends_and_a_failed_run_says_it_failed(tmp_path):
    data = toy_dataset()
    watch = Watch(tmp_path)
    trainer = Trainer(TinyNet(), data, data)
    trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=6, batch_size=8,
                val_size=0, trace=tmp_path, progress=watch, logger=None)
    assert watch.seen and all(seen == (False, True) for seen in watch.seen)
    assert read_trace(tmp_path / TRACE_FILE)[-1]["status"] == "ok"

    failing = tmp_path / "failing"
    trainer = Trainer(CrashingNet(), data, data)
    with pytest.raises(RankFailedError):
        trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=20, batch_size=8,
                    val_size=0, trace=failing, **QUIET)
    lines = read_trace(failing / TRACE_FILE)
    end = lines[-1]
    assert end["kind"] == "end" and end["status"] == "failed"
    assert "simulated crash" in end["error"]
    assert kinds(lines, "fault")[0]["what"] == "failed"
    assert {s["step"] for s in kinds(lines, "step")} == {1, 2, 3, 4}
    assert [p.name for p in failing.iterdir()] == [TRACE_FILE]


@pytest.mark.slow(
    reason="a run long enough to pass the trace's bound on full step lines")
def test_a_long_run_is_summarised_past_the_bound_and_stays_small(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_module, "FULL_STEPS", 100)
    monkeypatch.setattr(trace_module, "BLOCK_STEPS", 50)
    data = toy_dataset(64)
    trainer = Trainer(TinyNet(d_in=8, hidden=4), data, data)
    trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=3000, batch_size=4,
                val_size=0, trace=tmp_path, **QUIET)
    path = tmp_path / TRACE_FILE
    lines = read_trace(path)
    assert path.stat().st_size < 100_000  # a line a step would be 800 kB
    last = {r["rank"]: r for r in trainer.history if r["step"] == 3000}
    for rank, mine in by_rank(kinds(lines, "step")).items():
        assert [s["step"] for s in mine] == list(range(1, 101))
        blocks = [b for b in kinds(lines, "steps") if b["rank"] == rank]
        assert len(blocks) == 58
        assert [(b["first"], b["last"], b["count"]) for b in blocks] == \
            [(s, s + 49, 50) for s in range(101, 3000, 50)]
        assert sum(s["bytes"] for s in mine) + sum(b["bytes"] for b in blocks) == \
            blocks[-1]["comm_bytes"] == last[rank]["comm_bytes"]
        assert sum(b["samples"] for b in blocks) == 2900 * 4
        for b in blocks:
            assert b["comm_s_median"] <= b["comm_s_max"] <= b["comm_s"]
            assert b["compute_s_median"] <= b["compute_s_max"] <= b["compute_s"]


def test_ten_thousand_steps_of_eight_ranks_stay_a_few_megabytes(tmp_path):
    writer = TraceWriter()
    writer.start(tmp_path / TRACE_FILE, source="simulation", num_nodes=8, config={})
    for step in range(1, 10_001):
        for rank in range(8):
            writer.on_event({"event": "step", "rank": rank, "step": step, "comm_s": 0.0123456789,
                             "compute_s": 0.0456789123, "comm_bytes": 123_456_789 * step,
                             "samples": 64 * step, "wall_s": 0.05 * step,
                             "sim_time_s": 0.06 * step, "sim_comm_s": 0.01234567})
    writer.end()
    assert (tmp_path / TRACE_FILE).stat().st_size < 2_500_000


def test_a_block_of_steps_never_spans_an_absence(tmp_path):
    # past the steps written one by one, a rank away for steps 8-19 shows as a gap between
    # blocks (a replay reads absences from the steps each rank recorded)
    writer = TraceWriter(full_steps=2, block_steps=5)
    writer.start(tmp_path / TRACE_FILE, source="hosts", num_nodes=1, config={})
    for step in [*range(1, 8), *range(20, 26)]:
        writer.on_event({"event": "step", "rank": 0, "step": step, "comm_s": 0.01,
                         "compute_s": 0.02, "comm_bytes": step, "samples": step})
    writer.end()
    blocks = [(b["first"], b["last"], b["count"]) for b in read_trace(tmp_path / TRACE_FILE)
              if b["kind"] == "steps"]
    assert blocks == [(3, 7, 5), (20, 24, 5), (25, 25, 1)]


def test_the_launchers_membership_host_and_hand_over_events_become_timed_lines(tmp_path):
    writer = TraceWriter()
    writer.on_event({"event": "step", "rank": 0, "step": 1})  # before start: not traced
    writer.start(tmp_path / TRACE_FILE, source="hosts", num_nodes=2, config={"H": 2},
                 hosts=[{"rank": 0, "host": "a"}, {"rank": 1, "host": "b"}])
    writer.on_event({"event": "membership", "step": 1, "ranks": [0, 1], "hosts": ["a", "b"],
                     "reason": "start"})
    writer.on_event({"event": "host", "rank": 1, "host": "b", "state": "lost",
                     "reason": "no heartbeat for 5 s"})
    writer.on_event({"event": "membership", "step": 11, "ranks": [0], "hosts": ["a"],
                     "reason": "b lost"})
    writer.on_event({"event": "hand_over", "rank": 0, "step": 21, "source": 0, "joiners": [1],
                     "bytes": 4096, "seconds": 0.25, "host": "a"})
    writer.fault(t=None, rank=1, host="b", what="failed", reason="exited with code 1",
                 restart=0)
    writer.end(failed=True, error="rank 1 failed", links={1: {"host": "b"}})
    lines = read_trace(tmp_path / TRACE_FILE)
    assert [line["kind"] for line in lines] == ["run", "membership", "host", "membership",
                                                "hand_over", "fault", "link", "end"]
    assert lines[0]["hosts"][1] == {"rank": 1, "host": "b"}
    assert all(isinstance(line["t"], float) for line in lines[1:5])
    assert lines[3] == {"kind": "membership", "t": lines[3]["t"], "step": 11, "ranks": [0],
                        "hosts": ["a"], "reason": "b lost"}
    assert (lines[2]["state"], lines[4]["bytes"], lines[5]["t"]) == ("lost", 4096, None)
    assert lines[6] == {"kind": "link", "rank": 1, "host": "b", "comm_bytes": 0, "comm_s": 0.0,
                        "achieved_bytes_per_s": None}
    assert (lines[7]["status"], lines[7]["error"]) == ("failed", "rank 1 failed")


def cli(*args, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*warm.cli_command(), *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, "COLUMNS": "400"})


SMALL = ["--set", "max_steps=4", "--set", "num_nodes=2", "--set", "val_size=16",
         "--set", "val_interval=2", "--set", "num_threads=1", "--set", "H=2",
         "--logger", "none"]


@pytest.mark.slow
def test_the_command_lines_local_run_writes_its_trace_beside_its_summary(tmp_path):
    out = tmp_path / "run"
    done = cli("distributed-train", "digits-diloco", *SMALL, "--set", f"output_dir={out}",
               cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    lines = read_trace(out / TRACE_FILE)
    assert lines[0]["run"] == summary["run"]
    assert {(s["rank"], s["step"]) for s in kinds(lines, "step")} == \
        {(r, s) for r in (0, 1) for s in range(1, 5)}
    assert lines[-1]["status"] == "ok"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    from sshd_fixture import serve_sshd

    yield from serve_sshd(tmp_path_factory)


def train_on_hosts(sshd, config: dict, tmp_path):
    """Run the small digits-diloco profile on the hosts ``config`` names; its output folder."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(config))
    out = tmp_path / "net"
    done = cli("distributed-train", "digits-diloco", "--hosts", hosts,
               "--known-hosts", sshd.known_hosts, "--ssh-config", sshd.ssh_config,
               "--run-dir", tmp_path / "launch", *SMALL, "--set", f"output_dir={out}",
               cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.mark.slow(
    reason="a run across hosts over SSH, each host's rank importing torch")
def test_a_run_across_hosts_traces_every_ranks_steps_in_its_run_folder(sshd, tmp_path):
    from faces_support import sshd_hosts

    out = train_on_hosts(sshd, sshd_hosts(sshd, workers=2), tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    lines = read_trace(out / TRACE_FILE)
    header = lines[0]
    assert header["source"] == "hosts" and header["num_nodes"] == 3
    assert header["run"] == summary["run"]
    assert [h["host"] for h in header["hosts"]] == ["127.0.0.1", *sshd.addresses[:2]]
    steps = kinds(lines, "step")
    assert {(s["rank"], s["step"]) for s in steps} == \
        {(r, s) for r in range(3) for s in range(1, 5)}
    assert all(s["compute_s"] >= 0 and s["comm_s"] >= 0 for s in steps)
    assert {e["rank"] for e in kinds(lines, "eval")} == {0, 1, 2}
    links = kinds(lines, "link")
    assert [link["host"] for link in links] == ["127.0.0.1", *sshd.addresses[:2]]
    assert all(link["comm_bytes"] > 0 and link["achieved_bytes_per_s"] > 0 for link in links)
    assert lines[-1]["status"] == "ok"


@pytest.mark.slow
def test_with_the_master_on_another_host_the_trace_is_sent_to_its_run_folder(sshd, tmp_path):
    from faces_support import sshd_hosts

    config = sshd_hosts(sshd, workers=2)
    first, second = config["workers"]
    config.update(master=first, workers=[second])
    out = train_on_hosts(sshd, config, tmp_path)
    lines = read_trace(out / TRACE_FILE)
    assert lines[0]["run"] == json.loads((out / "summary.json").read_text())["run"]
    assert {(s["rank"], s["step"]) for s in kinds(lines, "step")} == \
        {(r, s) for r in range(2) for s in range(1, 5)}
    assert not (tmp_path / "launch" / TRACE_FILE).exists()  # sent, not kept twice


@pytest.mark.parametrize("line, said", [
    ("[1, 2]", "line 2 is a JSON list, not an object"),
    ('{"rank": 0}', 'line 2 has no "kind"'),
    ('{"kind": "steps", "first": 1, "last": 2}', "line 2 (a 'steps' line) has no 'rank'"),
    ('{"kind": "steps", "rank": "0", "first": 1, "last": 2}',
     "line 2 has rank='0': a whole number >= 0 was expected"),
    ('{"kind": "eval", "rank": 0, "step": -3}', "line 2 has step=-3"),
    ('{"kind": "membership", "t": "soon"}', "line 2 has t='soon': a finite number"),
])
def test_a_trace_with_lines_not_of_its_format_is_refused_naming_the_line(tmp_path, line, said):
    # A run folder may come from anyone: every line is checked before a field is read.
    from exogym.report.trace import FORMAT_VERSION, read_trace

    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"kind": "run", "version": FORMAT_VERSION}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=str(path).replace(".", r"\.") + ": " + said.replace(
            "(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        read_trace(path)
