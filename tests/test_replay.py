"""``replay``: a recorded run re-simulated here, side by side with the real one; what if.

A local simulation recorded through the command line (on a clocked cluster, which a
replay must reproduce closely), a run across the test sshd's hosts (its links probed
before it starts), what-if ranking, every refusal before anything starts, the page of
``--web`` fetched, and the membership timeline turned into ``rank_failures``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import warm

from distributed.app.replay import Recording, detection_waits, timeline
from exogym.report.trace import TRACE_FILE, read_trace

#: One worker runs this module: its tests share one recorded run (a module fixture).
pytestmark = pytest.mark.xdist_group("replay")

RECORDED = ["--set", "num_nodes=3", "--set", "max_steps=40", "--set", "H=10",
            "--set", "val_interval=10", "--set", "val_size=64", "--set", "num_threads=1",
            "--set", "network=10mbit", "--set", "rank_speeds=[1,1,0.5]",
            "--set", "speed_mode=clock", "--set", "compute_time_s=0.01", "--logger", "none"]


def cli(*args, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*warm.cli_command(), *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, "COLUMNS": "400"})


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A clocked local simulation of digits-diloco, recorded by distributed-train."""
    base = tmp_path_factory.mktemp("recorded")
    out = base / "run"
    done = cli("distributed-train", "digits-diloco", *RECORDED, "--set", f"output_dir={out}",
               cwd=base)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def replay_json(run: Path, *extra: str, cwd: Path) -> dict:
    done = cli("replay", run, "--json", *extra, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_a_clocked_simulation_is_reproduced_closely(recorded, tmp_path):
    report = replay_json(recorded, "--out", tmp_path / "replays", cwd=tmp_path)
    real, rep = report["real"], report["replay"]
    for figures in (real, rep):
        assert {"wall_s", "round_s_median", "evaluations"} <= set(figures)
        assert figures["clock"] == "simulated" and figures["round_steps"] == 10
    assert [s for s, _ in real["evaluations"]] == [10, 20, 30, 40] == \
        [s for s, _ in rep["evaluations"]]
    # the same settings, seed and data order: the same losses; the same cluster: its time
    for (_, a), (_, b) in zip(real["evaluations"], rep["evaluations"]):
        assert b == pytest.approx(a, rel=1e-6)
    assert rep["wall_s"] == pytest.approx(real["wall_s"], rel=0.01)
    assert rep["round_s_median"] == pytest.approx(real["round_s_median"], rel=0.01)
    cluster = report["cluster"]
    assert cluster["rank_speeds"] == pytest.approx([1, 1, 0.5], rel=1e-3)
    assert cluster["compute_time_s"] == pytest.approx(0.01)
    assert cluster["network"] == {"bandwidth": 1e7, "latency_s": 0.0}
    assert report["ratios"]["wall_s"] == pytest.approx(1, rel=0.01)
    written = json.loads((tmp_path / "replays" / "replay.json").read_text())
    assert written["real"] == real
    assert read_trace(tmp_path / "replays" / "as-recorded" / TRACE_FILE)[-1]["status"] == "ok"


@pytest.mark.slow
def test_what_if_ranks_strategies_by_time_to_the_recorded_loss(recorded, tmp_path):
    report = replay_json(recorded, "--strategy", "ddp", "--strategy", "diloco", "--set",
                         "H=5", "--out", tmp_path / "w", cwd=tmp_path)
    rows = report["what_if"]
    assert [r["place"] for r in rows] == [1, 2, 3]
    labels = {r["label"] for r in rows}
    assert labels == {"as recorded", "ddp", "diloco H=5"}
    target = report["target_val_loss"]
    recorded_row = next(r for r in rows if r["recorded"])
    assert recorded_row["reaches_target"] and \
        recorded_row["time_to_target_s"] == pytest.approx(report["replay"]["wall_s"], rel=1e-3)
    reaching = [r for r in rows if r["reaches_target"]]
    assert [r["time_to_target_s"] for r in reaching] == \
        sorted(r["time_to_target_s"] for r in reaching)
    for r in rows:
        if not r["reaches_target"]:
            assert min(v for _, v in r["evaluations"]) > target
            assert r["place"] > len(reaching)
    ddp = next(r for r in rows if r["label"] == "ddp")
    # DDP all-reduces every step over the same 10 Mbit/s: its rounds are single steps
    assert ddp["round_s_median"] < report["replay"]["round_s_median"]


def refused(run: Path, *extra: str, cwd: Path) -> str:
    done = cli("replay", run, *extra, cwd=cwd, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    return " ".join((done.stdout + done.stderr).split())


@pytest.mark.slow
def test_bad_input_is_refused_before_anything_starts(recorded, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"is not a run's folder and holds none with a {TRACE_FILE}" in \
        refused(empty, cwd=tmp_path)
    (empty / "run.json").write_text("{}")  # a run's folder, of a version that wrote no trace
    assert f"holds no {TRACE_FILE}" in refused(empty, cwd=tmp_path)
    assert "is not a folder" in refused(tmp_path / "nowhere", cwd=tmp_path)

    old = tmp_path / "old"
    shutil.copytree(recorded, old)
    lines = (old / TRACE_FILE).read_text().splitlines()
    header = json.loads(lines[0])
    header["version"] = 1
    (old / TRACE_FILE).write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    assert "format version 1" in refused(old, cwd=tmp_path)

    other = tmp_path / "other"
    shutil.copytree(recorded, other)
    identity = json.loads((other / "run.json").read_text())
    identity["fingerprint"] = "0" * 64
    identity["settings"]["H"] = 7
    (other / "run.json").write_text(json.dumps(identity))
    said = refused(other, cwd=tmp_path)
    assert "does not match the run" in said and "H (10 in the trace, 7 in the folder)" in said

    assert "--strategy 'dilocco' is not a strategy (did you mean 'diloco'?)" in \
        refused(recorded, "--strategy", "dilocco", cwd=tmp_path)
    assert "unknown key 'HH' (did you mean 'H'?)" in \
        refused(recorded, "--set", "HH=5", cwd=tmp_path)
    assert "--set network" in refused(recorded, "--set", "network=1gbit", cwd=tmp_path)
    said = refused(recorded, "--set", "lr=fast", cwd=tmp_path)
    assert "--set lr='fast': lr is a number (the run had 0.003)" in said
    assert not (recorded / "replay").exists()  # nothing ran


@pytest.mark.slow
def test_a_folder_of_runs_names_the_run_folders_that_can_be_replayed(tmp_path):
    from distributed.app.replay import ReplayError, load_recording
    from distributed.hosts.onhost import runfolders

    runs = tmp_path / "runs"
    folders = []
    for started in ("2026-11-01T10:00:00", "2026-11-02T10:00:00", "2026-11-03T10:00:00"):
        identity = {"profile": "digits-diloco", "fingerprint": "f", "started": started,
                    "settings": {"strategy": "diloco"}, "may_change": {}}
        folders.append(Path(runfolders.claim_new(str(runs / "digits-diloco"),
                                                 identity)["folder"]))
    for folder in folders[:2]:  # the third was refused before it wrote a trace
        (folder / TRACE_FILE).write_text("")
    with pytest.raises(ReplayError) as refused:
        load_recording(runs)
    message = str(refused.value)
    assert "is a folder of runs, not a run's folder" in message, message
    assert f"replay {folders[1]}" in message, message  # the newest replayable, as a command
    assert f"newest first: {folders[1]}, {folders[0]} (" in message, message
    assert str(folders[2]) not in message and "run it again" not in message, message
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReplayError, match="holds none with a trace.jsonl"):
        load_recording(tmp_path / "empty")  # no run under it can be replayed


def test_the_web_page_shows_both_curves(recorded, tmp_path):
    process = subprocess.Popen(
        [*warm.cli_command(), "replay", str(recorded), "--web",
         "--web-seconds", "60", "--out", str(tmp_path / "web")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "COLUMNS": "400"})
    try:
        url, seen, deadline = None, [], time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            seen.append(line)
            found = re.search(r"page: (http://127\.0\.0\.1:\d+/)", line)
            url = found.group(1) if found else None
        assert url, "".join(seen)
        with urllib.request.urlopen(url, timeout=10) as answer:
            page = answer.read().decode()
        assert answer.status == 200
        assert "validation loss against time" in page
        assert 'data-name="real"' in page and 'data-name="replay"' in page
        assert page == (tmp_path / "web" / "replay.html").read_text()
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_the_membership_timeline_becomes_rank_failures_and_its_cost():
    lines = [{"kind": "run", "version": 2, "source": "hosts", "num_nodes": 3},
             {"kind": "membership", "step": 1, "ranks": [0, 1, 2], "reason": "start"},
             {"kind": "membership", "step": 21, "ranks": [0, 1], "reason": "b lost"},
             {"kind": "membership", "step": 41, "ranks": [0, 1, 2], "reason": "b rejoined"}]
    # rank 0's clock: rounds of 10 steps, 1 s each, but 6 s for the round the host was lost in;
    # rank 1 lost mid-round at step 55 and back at 58, announced by no membership change
    wall = 0.0
    for step in range(1, 61):
        wall += 0.6 if step in range(11, 21) else 0.1
        for rank in range(3):
            if (rank == 2 and 21 <= step <= 40) or (rank == 1 and 55 <= step <= 57):
                continue
            lines.append({"kind": "step", "rank": rank, "step": step, "compute_s": 0.1,
                          "comm_s": 0.0, "wall_s": wall})
    recording = Recording(Path("."), lines, lines[0], None, None, 3, 10)  # type: ignore[arg-type]
    assert recording.rank_failures() == [[1, 55, 58], [2, 21, 41]]
    figures = timeline(lines, 10, 3)
    assert figures.rank == 0 and figures.round_s_median == pytest.approx(1.0)
    lost = {m["step"]: m.get("lost_s") for m in figures.membership}
    assert lost[21] == pytest.approx(5.0) and lost[41] == pytest.approx(0.0)
    assert lost[55] == pytest.approx(0.0) and 58 in lost
    assert figures.wall_s == pytest.approx(11.0)
    # a replay's timeline pays each recorded hand-over at its readmission of the same order
    paid = timeline(lines, 10, 3, add_hand_overs=[0.5, 2.0])
    assert paid.times[57] == pytest.approx(figures.times[57] + 0.5)
    assert paid.wall_s == pytest.approx(11.0 + 2.5)


def test_a_rank_lost_within_a_step_is_one_change_in_the_replay_at_its_announced_step():
    """Rank 2 is lost during step 160: it records no step from 160, the survivors complete
    160 without it, and the membership change that tells it takes effect at 161. The
    replay lists one change for it, at 161, matched to the replay's own (which takes the
    rank away from 160); its return, announced at the step it trains again, is one too."""
    from distributed.app.replay.report import replay_tables

    lines = [{"kind": "run", "version": 2, "source": "hosts", "num_nodes": 3},
             {"kind": "membership", "step": 1, "ranks": [0, 1, 2], "reason": "start"},
             {"kind": "membership", "step": 161, "ranks": [0, 1], "reason": "c lost"},
             {"kind": "membership", "step": 270, "ranks": [0, 1, 2],
              "reason": "c rejoined during a round"}]
    for step in range(1, 301):
        for rank in range(3):
            if rank == 2 and 160 <= step < 270:
                continue
            lines.append({"kind": "step", "rank": rank, "step": step, "compute_s": 0.1,
                          "comm_s": 0.0, "wall_s": step * 0.1})
    figures = timeline(lines, 10, 3)
    assert [(m["step"], m["reason"]) for m in figures.membership] == [
        (1, "start"), (161, "c lost"), (270, "c rejoined during a round")]
    assert figures.membership[1]["away_from"] == 160
    recording = Recording(Path("."), lines, lines[0], None, None, 3, 10)  # type: ignore[arg-type]
    assert recording.rank_failures() == [[2, 160, 270]]  # what the replay simulates
    real = figures.to_dict()
    replayed = {**real, "membership": [{"step": 160, "lost_s": 0.25},
                                       {"step": 270, "lost_s": 0.0}]}
    report = {"profile": "p", "real": {**real, "clock": "wall", "round_steps": 10},
              "replay": replayed, "ratios": {"wall_s": 1.0, "round_s_median": 1.0,
                                             "val_loss": []},
              "what_if": [], "cluster": {"links_from": "the trace: none", "compute_time_s": 0.1,
                                          "rank_failures": [[2, 160, 270]]}}
    from rich.console import Console

    console = Console(file=__import__("io").StringIO(), width=300)
    console.print(replay_tables(report).comparison)
    rows = [line for line in console.file.getvalue().splitlines() if "lost to step" in line]
    assert len(rows) == 2 and "lost to step 161: c lost" in rows[0] and "0.25" in rows[0], rows


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    from sshd_fixture import serve_sshd

    yield from serve_sshd(tmp_path_factory)


def test_the_wait_for_a_hung_rank_to_be_declared_lost_is_replayed():
    # rank 2 hangs after step 10: ranks 0 and 1 wait 5 s in step 10's collective before the
    # launcher declares it lost; a kill (rank 1, step 20) costs them next to nothing
    lines = [{"kind": "membership", "step": 1, "ranks": [0, 1, 2], "reason": "start"},
             {"kind": "membership", "step": 11, "ranks": [0, 1], "reason": "rank 2 lost"},
             {"kind": "membership", "step": 16, "ranks": [0, 1, 2], "reason": "rejoined"},
             {"kind": "membership", "step": 21, "ranks": [0, 2], "reason": "rank 1 lost"}]
    for rank in range(3):
        for step in range(1, 25):
            comm = 0.1 + (5.0 if step == 10 and rank < 2 else 0.0) \
                + (0.05 if step == 20 and rank != 1 else 0.0)
            lines.append({"kind": "step", "rank": rank, "step": step, "comm_s": comm})
    waits = detection_waits(lines, 3)
    assert [(rank, step) for rank, step, _ in waits] == [(0, 10), (1, 10), (0, 20), (2, 20)]
    assert [round(seconds, 6) for _, _, seconds in waits] == [5.0, 5.0, 0.05, 0.05]


@pytest.mark.slow
def test_a_run_across_hosts_records_its_links_and_replays(sshd, tmp_path, monkeypatch):
    from faces_support import sshd_hosts

    monkeypatch.setenv("EXOGYM_LINK_PROBE_S", "0.5")  # the default (tests/conftest.py: 0)

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(sshd_hosts(sshd, workers=2)))
    out = tmp_path / "net"
    done = cli("distributed-train", "digits-diloco", "--hosts", hosts,
               "--known-hosts", sshd.known_hosts, "--ssh-config", sshd.ssh_config,
               "--run-dir", tmp_path / "launch", "--set", "max_steps=20", "--set", "H=5",
               "--set", "val_interval=10", "--set", "val_size=32", "--set", "num_threads=1",
               "--logger", "none", "--set", f"output_dir={out}", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "links (pre-flight probe" in done.stdout
    header = read_trace(out / TRACE_FILE)[0]
    assert header["version"] == 2
    for host in header["hosts"]:
        assert host["link_rate_bps"] > 0 and 0 < host["latency_s"] < 0.1
    links = [line for line in read_trace(out / TRACE_FILE) if line["kind"] == "link"]
    assert all(link["link_rate_bps"] > 0 for link in links)
    report = replay_json(out, cwd=tmp_path)
    assert report["source"] == "hosts" and report["real"]["clock"] == "wall"
    assert report["replay"]["clock"] == "simulated"
    assert report["cluster"]["links_from"].startswith("each host's pre-flight probe")
    assert [s for s, _ in report["real"]["evaluations"]] == [10, 20] == \
        [s for s, _ in report["replay"]["evaluations"]]
    for (_, a), (_, b) in zip(report["real"]["evaluations"], report["replay"]["evaluations"]):
        assert b == pytest.approx(a, rel=0.02)
    assert report["replay"]["wall_s"] > 0 and report["real"]["wall_s"] > 0


def test_the_page_off_this_machine_needs_its_token():
    import urllib.error

    from distributed.app.web.replay_page import PageServer

    server = PageServer("<p>figures</p>", "0.0.0.0", 0)
    try:
        token = server.url.split("?token=")[1]
        port = server.url.split(":")[2].split("/")[0]
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/?token={token}",
                                    timeout=10) as answer:
            assert answer.read() == b"<p>figures</p>"
    finally:
        server.stop()
