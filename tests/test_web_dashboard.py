"""The dashboard in the browser (``--web``): its state, its server's ``/state`` and
``/events`` read with urllib, the LAN token, and the page in a real headless Chromium
(Debian's ``chromium`` and ``chromium-driver``, from tests/setup_system.sh) during a
real local simulation."""

from __future__ import annotations

import io
import json
import math
import os
import random
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import warm
from rich.console import Console

from distributed.app.dashboard import Dashboard
from distributed.app.fanout import FanOut
from distributed.app.web import server as web_server
from distributed.app.web.page_lifetime import keep_serving
from distributed.app.web.server import WebDashboard, plotly_js_path
from distributed.app.web.state import WebState
from exogym.base.install_mode import install_extra

ROOT = Path(__file__).resolve().parents[1]
CHROMEDRIVER = "/usr/bin/chromedriver"
#: Tiny settings for the runs that only need the command's server (not its speed).
TINY = [f"--set={kv}" for kv in ("max_steps=20", "num_nodes=2", "val_interval=10",
                                   "val_size=64", "num_threads=1", "checkpoint_interval=None")]
#: A real digits run slow enough to be read twice while it trains (a CNN, two ranks).
SLOW_RUN = ["digits-diloco", "--set", "num_nodes=2", "--set", "model=cnn", "--set", "hidden=32",
            "--set", "batch_size=64", "--set", "max_steps=400", "--set", "val_interval=100",
            "--set", "H=25", "--set", "checkpoint_interval=None", "--set", "num_threads=1"]


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def start(rank: int, max_steps: int = 10) -> dict:
    return {"event": "start", "rank": rank, "max_steps": max_steps, "step": 0}


def step(rank: int, n: int, loss: float = 1.0, **extra) -> dict:
    return {"event": "step", "rank": rank, "step": n, "train_loss": loss, "samples": 16 * n,
            "wall_s": 0.5 * n, "comm_bytes": 1000 * n, **extra}


def get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# ---------------------------------------------------------------------------- the state


def test_state_keeps_a_row_per_rank_and_a_chart_point_per_step():
    clock = Clock()
    state = WebState("t", clock=clock)
    state.begin_run("digits", {"lr": 0.1, "output_dir": Path("runs/x")}, 2, ["a", "b"])
    state.on_event(start(0))
    state.on_event(start(1))
    clock.now += 1
    state.on_event(step(0, 1, 2.0))
    state.on_event(step(1, 1, 2.2))
    clock.now += 1
    state.on_event(step(0, 2, 1.5, val_loss=1.7, val_global_loss=1.6))
    clock.now += 0.5
    view = state.view()
    assert view["runs"][0]["config"] == {"lr": 0.1, "output_dir": "runs/x"}
    assert view["runs"][0]["status"] == "running"
    rows = {r["rank"]: r for r in view["ranks"]}
    assert rows[0]["host"] == "a" and rows[1]["host"] == "b"
    assert rows[0]["step"] == 2 and rows[0]["loss"] == 1.5 and rows[0]["val_loss"] == 1.6
    assert rows[0]["samples_per_s"] == pytest.approx(32.0)
    assert rows[0]["bytes_sent"] == 2000 and rows[0]["max_steps"] == 10
    assert rows[0]["heartbeat_age_s"] == pytest.approx(0.5)
    assert rows[1]["heartbeat_age_s"] == pytest.approx(1.5)
    assert [(p["rank"], p["step"]) for p in view["points"]] == [(0, 1), (1, 1), (0, 2)]
    assert view["points"][2]["val_loss"] == 1.6 and view["points"][2]["t"] == pytest.approx(2.0)
    assert view["seq"] == 3
    newer = state.view(since=2)
    assert newer["since"] == 2 and [p["step"] for p in newer["points"]] == [2]


def test_state_keeps_about_two_thousand_points_per_rank_of_a_long_run_and_every_evaluation():
    state = WebState("t")
    state.begin_run("long", {}, 1)
    state.on_event(start(0, max_steps=10_000))
    for n in range(1, 10_001):
        state.on_event(step(0, n, **({"val_loss": 0.5} if n % 1001 == 0 else {})))
    view = state.view()
    steps = [p["step"] for p in view["points"]]
    assert 2000 <= len(steps) <= 2020 and steps[-1] == 10_000
    assert [p["step"] for p in view["points"] if "val_loss" in p] == [1001 * k for k in range(1, 10)]
    assert view["ranks"][0]["step"] == 10_000  # the row follows every step


def test_state_shows_the_final_figures_and_sends_no_nan():
    state = WebState("t")
    state.begin_run("digits", {}, 1)
    state.on_event(start(0))
    state.on_event(step(0, 1, float("nan")))
    state.on_event({"event": "done", "rank": 0, "step": 1, "comm_bytes": 5})
    state.end_run({"steps": 1, "final_train_loss": float("nan"), "wall_s": 2.0})
    view = state.view()
    text = json.dumps(view, allow_nan=False)  # the page's JSON.parse rejects NaN
    assert '"final_train_loss": null' in text
    assert view["runs"][0]["status"] == "done"
    assert view["ranks"][0]["state"] == "done" and view["ranks"][0]["bytes_sent"] == 5


def timed_step(rank: int, n: int, wall_s: float, batch: int = 64) -> dict:
    return {"event": "step", "rank": rank, "step": n, "train_loss": 1.0, "samples": batch * n,
            "wall_s": wall_s, "comm_bytes": 0}


def warm_start_steps(steps: int = 40) -> list[dict]:
    """Two ranks of one host whose first step came 1.4 ms after their start (64 samples:
    45,700 samples/s), then a step of 64 samples every 32 ms (2,000 samples/s each)."""
    return [timed_step(rank, n, 0.0014 + (n - 1) * 0.032)
            for n in range(1, steps + 1) for rank in (0, 1)]


def test_state_throughput_leaves_out_the_interval_before_the_first_step():
    state = WebState("t")
    state.begin_run("digits", {}, 2, ["a", "a"])
    for rank in (0, 1):
        state.on_event(start(rank, 40))
    for event in warm_start_steps():
        state.on_event(event)
    points = state.view()["points"]
    rates = {(p["step"], p["rank"]): p["host_samples_per_s"] for p in points}
    # a rate once a rank's steps since its first span half a second: from step 17 (0.512 s)
    assert all(rates[n, rank] is None for n in range(1, 17) for rank in (0, 1))
    assert rates[17, 0] is None  # rank 0's is known, rank 1's not yet: the host's is not
    assert all(rates[n, rank] == pytest.approx(4000.0)  # the host: both ranks
               for n in range(17, 41) for rank in (0, 1) if (n, rank) != (17, 0))
    clocks = [p["host_wall_s"] for p in points]
    assert clocks == sorted(clocks) and clocks[-1] == pytest.approx(0.0014 + 39 * 0.032)
    # rank 0 finishes first; the host's last point still counts it (no drop at the end)
    state.on_event({"event": "done", "rank": 0, "step": 40})
    state.on_event(timed_step(1, 41, 0.0014 + 40 * 0.032))
    assert state.view()["points"][-1]["host_samples_per_s"] == pytest.approx(4000.0)
    # a rank lost or stopped no longer trains: the host's rate is its other ranks'
    state.set_status(1, "lost")
    state.on_event(timed_step(0, 42, 0.0014 + 41 * 0.032))
    assert state.view()["points"][-1]["host_samples_per_s"] == pytest.approx(2000.0)


def test_state_throughput_follows_a_host_that_slows_down():
    state = WebState("t")
    state.begin_run("digits", {}, 1, ["a"])
    wall = 0.0
    for n in range(1, 201):
        wall += 0.032 if n <= 100 else 0.064  # 2,000 then 1,000 samples/s
        state.on_event(timed_step(0, n, wall))
    rates = [p["host_samples_per_s"] for p in state.view()["points"]]
    assert rates[50] == pytest.approx(2000.0) and rates[-1] == pytest.approx(1000.0)
    assert state.view()["ranks"][0]["samples_per_s"] == pytest.approx(12800 / wall)  # the table


def test_state_keeps_each_ranks_validation_accuracy():
    state = WebState("t")
    state.begin_run("digits", {}, 2)
    state.on_event(step(0, 1, val_loss=0.9, val_accuracy=0.875))
    state.on_event(step(1, 1, val_loss=1.1, val_accuracy=0.8))
    state.on_event(step(0, 2))  # a step without evaluation keeps the last accuracy
    assert [r["val_accuracy"] for r in state.view()["ranks"]] == [0.875, 0.8]


def test_state_gives_a_finished_run_its_own_duration_not_the_time_since_it_started():
    clock = Clock()
    state = WebState("t", clock=clock)
    state.begin_run("digits", {}, 1)
    state.on_event(start(0))
    clock.now += 12
    assert state.view()["runs"][0]["elapsed_s"] == pytest.approx(12.0)  # running: it counts
    state.end_run({"steps": 10, "wall_s": 20.7})
    clock.now += 130  # a page opened (or reloaded) two minutes after the run
    assert state.view()["runs"][0]["elapsed_s"] == pytest.approx(20.7)
    # a run that failed (no summary) lasted from its first event to its end
    state.begin_run("second", {}, 1)
    state.on_event(start(0))
    clock.now += 5
    state.end_run(None, failed=True)
    clock.now += 60
    assert [r["elapsed_s"] for r in state.view()["runs"]] == [pytest.approx(20.7),
                                                              pytest.approx(5.0)]


def test_state_keeps_each_compared_run_apart():
    state = WebState("t")
    for name in ("ddp", "diloco"):
        state.begin_run(name, {"strategy": name}, 2)
        state.on_event(step(0, 1))
        state.end_run({"steps": 1})
    view = state.view()
    assert [r["name"] for r in view["runs"]] == ["ddp", "diloco"]
    assert sorted((r["run"], r["rank"]) for r in view["ranks"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [p["run"] for p in view["points"]] == [0, 1]


GIB = 2**30


def system(rank: int, available_gib: float, **extra) -> dict:
    return {"event": "system", "rank": rank, "pid": 100 + rank, "cpu_percent": 12.5,
            "cores": 4, "rss_bytes": 3 * GIB // 2, "mem_available_bytes": int(available_gib * GIB),
            "mem_total_bytes": 16 * GIB, "low_memory": available_gib < 1.6, **extra}


def test_state_keeps_each_hosts_link_and_health_as_the_terminal_table_does():
    clock = Clock()
    state = WebState("t", clock=clock)
    state.begin_run("digits", {}, 2, ["a", "b"])
    state.on_event(start(0))
    state.on_event(step(0, 1, comm_s=0.125, compute_s=0.375))
    clock.now += 20  # a long collective: the rank's reports keep its heartbeat fresh
    state.on_event({"event": "link", "rank": 0, "in_flight": True, "done": 0.5,
                    "rate_bps": 2e7})
    state.on_event(system(1, 0.8, gpu="cuda:0", gpu_percent=float("nan"), gpu_bytes=GIB))
    view = state.view()
    json.dumps(view, allow_nan=False)  # what the driver could not read is null, not NaN
    hosts = {h["host"]: h for h in view["hosts"]}
    assert hosts["a"]["link_bps"] == 2e7 and hosts["a"]["sync_done"] == 0.5
    assert hosts["a"]["waiting"] == 0.25 and hosts["a"]["cpu_percent"] is None
    assert hosts["b"]["cpu_percent"] == 12.5 and hosts["b"]["rss_bytes"] == 1.5 * GIB
    assert hosts["b"]["low_memory"] is True and hosts["b"]["available_bytes"] == int(0.8 * GIB)
    assert hosts["b"]["gpu_percent"] is None and hosts["b"]["gpu_bytes"] == GIB
    assert {r["rank"]: r["heartbeat_age_s"] for r in view["ranks"]} == {0: 0.0, 1: 0.0}
    assert [r["state"] for r in view["ranks"]] == ["training", "waiting"]


def test_fan_out_feeds_the_terminal_dashboard_and_the_page():
    out = io.StringIO()
    terminal = Dashboard(2, console=Console(file=out, width=120), live=False)
    with WebDashboard() as web:
        web.begin_run("digits", {}, 2)
        sink = FanOut(terminal, web)
        for rank in (0, 1):
            sink.on_event(start(rank, 2))
            sink.on_event(step(rank, 2, 0.5))
        sink.close()
        sink.finish(sink.summary(1.0))
        view = web.state.view()
    assert [r["step"] for r in view["ranks"]] == [2, 2]
    assert view["runs"][0]["status"] == "done" and view["runs"][0]["summary"]["steps"] == 2
    assert terminal.ranks[1].step == 2 and "run summary" in out.getvalue()


# ---------------------------------------------------------------------------- the server


def test_state_endpoint_serves_the_snapshot_as_json():
    with WebDashboard() as web:
        web.begin_run("digits", {"lr": 0.1}, 2)
        web.on_event(step(1, 3, 0.25))
        status, body = get(f"http://127.0.0.1:{web.port}/state")
    assert status == 200
    view = json.loads(body)
    assert view["runs"][0]["config"] == {"lr": 0.1}
    assert [(r["rank"], r["step"]) for r in view["ranks"]] == [(0, 0), (1, 3)]
    assert view["points"][0]["loss"] == 0.25


def read_event(stream) -> dict:
    """The next ``data:`` message of a server-sent event stream (comments skipped)."""
    data = []
    while True:
        line = stream.readline().decode()
        assert line, "the event stream ended"
        if line.startswith("data: "):
            data.append(line[6:].rstrip("\n"))
        elif line == "\n" and data:
            return json.loads("".join(data))


def test_event_stream_sends_the_whole_state_then_each_change_within_a_second_then_the_end():
    with WebDashboard() as web:
        web.begin_run("digits", {}, 1)
        web.on_event(step(0, 1))
        with urllib.request.urlopen(f"http://127.0.0.1:{web.port}/events", timeout=10) as stream:
            assert stream.headers["Content-Type"] == "text/event-stream"
            first = read_event(stream)
            assert first["since"] == 0 and [p["step"] for p in first["points"]] == [1]
            for n in (2, 3):
                sent = time.monotonic()
                web.on_event(step(0, n, 0.5))
                message = read_event(stream)
                assert time.monotonic() - sent < 1.0
                assert message["since"] == n - 1
                assert [p["step"] for p in message["points"]] == [n]
                assert message["ranks"][0]["step"] == n
            # the command's end: the page gets the final state, told no more will come
            web.finish({"steps": 3})
            stopping = threading.Thread(target=web.stop)
            stopping.start()
            last = read_event(stream)
            while not last["closed"]:
                last = read_event(stream)
            stopping.join()
            assert last["runs"][0]["status"] == "done" and last["runs"][0]["summary"]["steps"] == 3


def test_page_its_files_and_plotly_js_from_the_installed_package_are_served():
    with WebDashboard() as web:
        base = f"http://127.0.0.1:{web.port}"
        status, page = get(base + "/")
        assert status == 200 and b'src="plotly.min.js"' in page and b'src="app.js"' in page
        assert b"http://" not in page and b"https://" not in page  # nothing from elsewhere
        assert get(base + "/app.js")[0] == 200 and get(base + "/app.css")[0] == 200
        status, plotly = get(base + "/plotly.min.js")
        assert status == 200 and plotly == plotly_js_path().read_bytes()
        assert get(base + "/nothing-here")[0] == 404


def test_lan_dashboard_answers_403_without_its_token():
    with WebDashboard("0.0.0.0") as web:
        assert web.token and f"?token={web.token}" in web.url
        base = f"http://127.0.0.1:{web.port}"
        for path in ("/", "/state", "/events", "/app.js", "/plotly.min.js"):
            assert get(base + path)[0] == 403, path
        assert get(base + "/state?token=wrong")[0] == 403
        assert get(base + f"/state?token={web.token}")[0] == 200
        # the page opened with the token keeps it in a cookie for its own requests
        request = urllib.request.Request(base + f"/?token={web.token}")
        with urllib.request.urlopen(request, timeout=10) as answer:
            cookie = answer.headers["Set-Cookie"].split(";")[0]
        assert get(base + "/app.js", {"Cookie": cookie})[0] == 200


def test_loopback_dashboard_needs_no_token_and_listens_on_the_port_asked():
    from ranks import free_port

    port = free_port()
    with WebDashboard("127.0.0.1", port) as web:
        assert web.token is None and web.url == f"http://127.0.0.1:{port}/"
        assert get(f"http://127.0.0.1:{port}/state")[0] == 200


def test_taken_port_and_missing_plotly_fail_before_the_run_with_what_to_do(monkeypatch):
    with WebDashboard() as web:
        with pytest.raises(ValueError, match=f"127.0.0.1:{web.port}.*--web-port"):
            WebDashboard(port=web.port)
    hide_plotly(monkeypatch)
    with pytest.raises(ImportError, match=re.escape(install_extra("web"))):
        WebDashboard()


def hide_plotly(monkeypatch) -> None:
    """Make plotly look uninstalled (the rest of the import system is left alone)."""
    find_spec = web_server.importlib.util.find_spec
    monkeypatch.setattr(web_server.importlib.util, "find_spec",
                        lambda name, *a: None if name == "plotly" else find_spec(name, *a))


def test_web_without_plotly_is_bad_input_naming_the_extra_before_any_run(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from cli_typer import app

    monkeypatch.chdir(tmp_path)
    hide_plotly(monkeypatch)
    result = CliRunner().invoke(app, ["distributed-train", "digits-diloco", "--web"])
    assert result.exit_code == 2, result.output
    assert install_extra("web") in result.output and "Traceback" not in result.output
    assert "simulating" not in result.output and not (tmp_path / "runs").exists()


def test_without_a_terminal_the_page_stops_with_the_command():
    out = io.StringIO()
    web = WebDashboard()
    assert keep_serving(web, Console(file=out, width=200), stdin=io.StringIO("")) is False
    assert "no terminal is attached" in out.getvalue()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{web.port}/state", timeout=5)


# ---------------------------------------------------------------------------- across hosts


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    from sshd_fixture import serve_sshd

    yield from serve_sshd(tmp_path_factory)


@pytest.mark.slow
def test_a_run_across_hosts_shows_each_host_and_rank_on_the_page(sshd, tmp_path):
    from faces_support import TINY as TINY_KEYS
    from faces_support import sshd_hosts

    from distributed.app.run import TrainRequest, parse_overrides, train

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(sshd_hosts(sshd)))
    request = TrainRequest("digits-diloco", hosts=str(hosts),
                           overrides=parse_overrides([*TINY_KEYS, f"output_dir={tmp_path / 'o'}"]),
                           known_hosts=str(sshd.known_hosts), ssh_config=str(sshd.ssh_config),
                           run_dir=str(tmp_path / "launch"))
    out = io.StringIO()
    with WebDashboard() as web:
        train(request, Console(file=out, width=160), live=False, web=web)
        status, body = get(f"http://127.0.0.1:{web.port}/state")
    assert status == 200, out.getvalue()
    view = json.loads(body)
    addresses = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert [(r["rank"], r["host"], r["step"], r["state"]) for r in view["ranks"]] == [
        (rank, host, 20, "done") for rank, host in enumerate(addresses)]
    assert all(r["bytes_sent"] > 0 and r["samples_per_s"] > 0 for r in view["ranks"])
    assert view["runs"][0]["status"] == "done" and view["runs"][0]["summary"]["steps"] == 20
    assert sorted({p["host"] for p in view["points"]}) == addresses  # throughput per host
    assert "[127.0.0.3:2] step 20/20" in out.getvalue()  # the terminal dashboard too


# ---------------------------------------------------------------------------- the command


def start_command(args: list[str], cwd: Path, stdin=subprocess.DEVNULL,
                  command: str = "distributed-train"):
    """Start ``cli_typer.py COMMAND ARGS``; its output lines are collected in a list by a
    thread (so a full pipe never stalls it). Returns the process, the lines, and the URL."""
    proc = subprocess.Popen([*warm.cli_command(), command,
                             *args], cwd=cwd, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "160", "PYTHONPATH": str(ROOT)})
    lines: list[str] = []
    found = threading.Event()

    def collect() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "dashboard: http" in line:
                found.set()
        found.set()

    threading.Thread(target=collect, daemon=True).start()
    found.wait(120)
    match = next((re.search(r"dashboard: (http://\S+)", x) for x in lines
                  if "dashboard: http" in x), None)
    if match is None:
        proc.kill()
        proc.wait()
        pytest.fail("the command printed no dashboard URL:\n" + "".join(lines))
    return proc, lines, match.group(1)


def wait_for(condition, timeout: float, what: str, lines: list[str] | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout} s waiting for {what}" +
                ("\n" + "".join(lines[-40:]) if lines else ""))


@pytest.mark.slow
def test_cli_web_host_0000_serves_only_with_the_printed_token(tmp_path):
    proc, lines, url = start_command(["digits-diloco", *TINY, "--web", "--web-host", "0.0.0.0"],
                                     tmp_path)
    try:
        token = re.search(r"\?token=([\w-]+)", url)
        assert token, url
        port = int(re.search(r":(\d+)/", url).group(1))
        assert get(f"http://127.0.0.1:{port}/state")[0] == 403
        status, body = get(f"http://127.0.0.1:{port}/state?token={token.group(1)}")
        assert status == 200 and json.loads(body)["title"].startswith("digits-diloco")
        assert proc.wait(300) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines)
    assert "the URL's token is required" in output
    assert "no terminal is attached" in output  # CI: it exits at the end


@pytest.mark.slow
def test_compare_web_shows_each_strategy_as_a_run_until_enter(tmp_path):
    leader, follower = os.openpty()
    proc, lines, url = start_command(["digits-base", "--strategies", "ddp,diloco", *TINY,
                                      "--out", str(tmp_path / "c.png"), "--web"], tmp_path,
                                     stdin=follower, command="compare")
    try:
        wait_for(lambda: any("keeps serving" in x for x in lines), 400, "the end of the runs",
                 lines)
        assert any("plot written to" in x for x in lines)  # the page waits after the outputs
        view = json.loads(get(url + "state")[1])
        assert [(r["name"], r["status"]) for r in view["runs"]] == [("ddp", "done"),
                                                                    ("diloco", "done")]
        assert view["runs"][1]["config"]["strategy"] == "diloco"
        assert sorted((r["run"], r["step"], r["state"]) for r in view["ranks"]) == [
            (0, 20, "done"), (0, 20, "done"), (1, 20, "done"), (1, 20, "done")]
        os.write(leader, b"\n")
        assert proc.wait(60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
        os.close(follower)


@pytest.fixture
def chromium():
    """Headless Chromium driven by selenium, logging the page's console."""
    yield from launch_chromium()


@pytest.fixture
def chromium_eager():
    """Headless Chromium whose ``get`` returns once the page is parsed, without waiting for
    its scripts that load asynchronously (plotly.js)."""
    yield from launch_chromium("eager")


def launch_chromium(page_load_strategy: str = "normal"):
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is not installed (the dev extra has it)")
    from selenium.webdriver.chrome.service import Service

    if not (shutil.which("chromium") and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip("chromium or chromedriver is not installed (tests/setup_system.sh installs "
                    "chromium and chromium-driver)")
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    options.page_load_strategy = page_load_strategy
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


ROWS_JS = """return Array.from(document.querySelectorAll('tr.rank-row')).map(r => ({
  rank: Number(r.dataset.rank), step: Number(r.dataset.step), state: r.dataset.state,
  cells: Array.from(r.cells).map(c => c.textContent)}));"""
HOSTS_JS = """return Array.from(document.querySelectorAll('tr.host-row')).map(r =>
  Object.fromEntries(Array.from(r.cells).filter(c => c.offsetParent !== null)
    .map(c => [c.className.split(' ')[0], c.textContent])));"""
POINTS_JS = """const gd = document.getElementById(arguments[0]);
return gd && gd.data ? gd.data.filter(t => t.meta !== 'smoothed')
  .reduce((n, t) => n + t.x.length, 0) : 0;"""


def severe(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


@pytest.mark.slow(reason="Chromium follows a whole run's page")
def test_page_in_chromium_follows_each_rank_and_keeps_the_final_state(tmp_path, chromium):
    # stdin is a terminal, so after the run the command keeps serving until Enter
    leader, follower = os.openpty()
    proc, lines, url = start_command([*SLOW_RUN, "--web"], tmp_path, stdin=follower)
    try:
        chromium.get(url)

        def training() -> list[dict] | None:
            rows = chromium.execute_script(ROWS_JS)
            return rows if len(rows) == 2 and all(r["step"] > 0 for r in rows) else None

        first = wait_for(training, 240, "both ranks to report a step", lines)
        time.sleep(2.0)
        second = chromium.execute_script(ROWS_JS)
        assert [r["rank"] for r in second] == [0, 1]
        for before, after in zip(first, second):
            assert after["step"] > before["step"], (first, second)
            assert after["cells"][4].endswith("/400")  # the step column: step/max_steps
        assert "hidden" in chromium.find_element("id", "config").text
        for chart in ("chart-loss-step", "chart-loss-bytes", "chart-throughput"):
            wait_for(lambda c=chart: chromium.execute_script(POINTS_JS, c) > 0, 10,
                     f"data points in {chart}")
        # the host at a glance, from the ranks' monitors
        # (the link's figure comes with the ranks' first collective after their monitors')
        host = wait_for(lambda: [h for h in chromium.execute_script(HOSTS_JS)
                                 if h.get("cpu", "-") != "-" and h.get("link", "-") != "-"],
                        60, "the host's figures, its link's among them", lines)
        assert [h["host"] for h in host] == ["local"]
        assert re.fullmatch(r"[\d.]+ [MG]bit/s", host[0]["link"]), host
        assert re.fullmatch(r"\d+%", host[0]["cpu"]) and host[0]["rss"].endswith(" GiB"), host
        assert re.fullmatch(r"[\d.]+ GiB of [\d.]+ GiB", host[0]["available"]), host
        assert "gpu" not in host[0]  # no GPU: no GPU columns

        wait_for(lambda: any("keeps serving" in x for x in lines), 400,
                 "the end of the run", lines)
        status = chromium.find_element("id", "status")
        wait_for(lambda: "finished" in status.text, 10, "the page to show the run finished")
        final = chromium.execute_script(ROWS_JS)
        assert [(r["step"], r["state"]) for r in final] == [(400, "done"), (400, "done")]
        assert "400 steps" in chromium.find_element("id", "summary").text
        assert severe(chromium) == []

        os.write(leader, b"\n")
        assert proc.wait(60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
        os.close(follower)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "state", timeout=5)  # the page stopped with the command


@pytest.mark.slow
def test_lan_page_in_chromium_loads_its_scripts_and_state_with_the_token(chromium):
    with WebDashboard("0.0.0.0") as web:
        web.begin_run("digits", {"lr": 0.1}, 2)
        for n in (1, 2, 3):
            for rank in (0, 1):
                web.on_event(step(rank, n, 1.0 / n))
        base = f"http://127.0.0.1:{web.port}/"
        chromium.get(base)
        assert "403" in chromium.find_element("tag name", "body").text
        chromium.get(base + f"?token={web.token}")
        wait_for(lambda: len(chromium.execute_script(ROWS_JS)) == 2, 20, "the rows")
        assert chromium.execute_script("return typeof Plotly") == "object"
        wait_for(lambda: chromium.execute_script(POINTS_JS, "chart-loss-step") == 6, 10,
                 "the six points of the loss chart")
        assert [e for e in severe(chromium) if "403" not in e["message"]] == []


@pytest.mark.slow
def test_page_in_chromium_counts_while_running_then_shows_the_runs_own_duration(chromium):
    clock = Clock()
    with WebDashboard() as web:
        web.state.clock = clock
        web.begin_run("digits", {}, 1)
        web.on_event(start(0, 2))
        clock.now += 11
        web.on_event(step(0, 1))
        chromium.get(f"http://127.0.0.1:{web.port}/")
        status = chromium.find_element("id", "status")
        wait_for(lambda: "running" in status.text, 20, "the running run in the header")
        seconds = int(re.search(r"· (\d+) s$", status.text).group(1))
        assert seconds >= 11
        # between messages the page counts on by itself
        wait_for(lambda: int(re.search(r"· (\d+) s$", status.text).group(1)) > seconds, 5,
                 "the header to count on")
        web.on_event(step(0, 2))
        line = chromium.find_element("id", "connection")
        assert line.text == "live"
        web.finish({"steps": 2, "wall_s": 20.7})
        wait_for(lambda: "finished" in status.text, 10, "the finished run in the header")
        assert status.text == "digits: finished · 20.7 s"
        # the command still serves the page, but the run is over: not "live", no heartbeat
        wait_for(lambda: line.text == "the run has ended; this is its final state", 10,
                 "the connection line to say the run has ended")
        ages = [td.text for td in chromium.find_elements("css selector", "td.heartbeat")]
        assert ages == ["-"], ages
        time.sleep(2.0)
        assert status.text == "digits: finished · 20.7 s"  # it does not count on
        clock.now += 140  # opened again two minutes later
        chromium.refresh()
        status = chromium.find_element("id", "status")
        wait_for(lambda: "finished" in status.text, 20, "the finished run after a reload")
        assert status.text == "digits: finished · 20.7 s"
        assert severe(chromium) == []


def visible_headers(driver) -> list[str]:
    return [th.text for th in driver.find_elements("css selector", "#ranks th")
            if th.is_displayed()]


@pytest.mark.slow
def test_page_in_chromium_shows_validation_accuracy_as_the_terminal_table_does(chromium):
    with WebDashboard() as web:
        web.begin_run("digits", {}, 2)
        for rank in (0, 1):
            web.on_event(step(rank, 1, 1.0))
        chromium.get(f"http://127.0.0.1:{web.port}/")
        wait_for(lambda: len(chromium.execute_script(ROWS_JS)) == 2, 20, "the rows")
        assert "val acc" not in visible_headers(chromium)  # no accuracy yet: no column
        web.on_event(step(0, 2, 0.5, val_loss=0.4, val_accuracy=0.875))
        web.on_event(step(1, 2, 0.6, val_loss=0.5, val_accuracy=0.8))
        wait_for(lambda: "val acc" in visible_headers(chromium), 10, "the accuracy column")
        headers = visible_headers(chromium)
        assert headers.index("val acc") == headers.index("val loss") + 1
        cells = [[td.text for td in row.find_elements("css selector", "td") if td.is_displayed()]
                 for row in chromium.find_elements("css selector", "tr.rank-row")]
        assert [row[headers.index("val acc")] for row in cells] == ["87.5%", "80.0%"]
        web.finish({"steps": 2, "final_train_loss": 0.55, "final_val_loss": 0.4,
                    "final_val_accuracy": 0.875, "bytes_per_node": 2000, "wall_s": 1.0})
        summary = chromium.find_element("id", "summary")
        wait_for(lambda: "val acc 87.5% (rank 0)" in summary.text, 10, "accuracy in the summary")
        assert severe(chromium) == []


@pytest.mark.slow
def test_page_in_chromium_shows_each_hosts_figures_and_warns_of_low_memory(chromium):
    with WebDashboard() as web:
        web.begin_run("digits", {}, 2, ["mac-a", "10.0.0.2"])
        web.on_event({"event": "link", "rank": 0, "in_flight": True, "done": 0.375,
                      "rate_bps": 38.2e6})
        web.on_event(system(0, 3.4))
        chromium.get(f"http://127.0.0.1:{web.port}/")
        wait_for(lambda: len(chromium.execute_script(HOSTS_JS)) == 1, 20, "the host's row")
        assert chromium.execute_script(HOSTS_JS) == [
            {"host": "mac-a", "link": "38.2 Mbit/s", "sync": "38%", "waiting": "-", "cpu": "13%",
             "rss": "1.5 GiB", "available": "3.4 GiB of 16 GiB"}]
        web.on_event(system(1, 0.8, gpu="cuda:0", gpu_percent=91.0, gpu_bytes=6 * GIB,
                            gpu_total_bytes=80 * GIB))
        wait_for(lambda: len(chromium.execute_script(HOSTS_JS)) == 2, 10, "the second host")
        low = chromium.execute_script(HOSTS_JS)[1]
        assert low["available"] == "0.8 GiB of 16 GiB LOW"
        assert (low["gpu"], low["gpu-memory"]) == ("91%", "6.0 GiB of 80 GiB")
        warning = chromium.find_element("id", "host-warnings").text
        assert warning == "10.0.0.2 has 0.8 GiB of 16 GiB memory left"
        assert severe(chromium) == []


Y_RANGE_JS = """const gd = document.getElementById(arguments[0]);
return gd && gd._fullLayout && gd.data && gd.data.length ? gd._fullLayout.yaxis.range : null;"""


@pytest.mark.slow
def test_page_in_chromium_throughput_chart_is_not_flattened_by_the_first_step(chromium):
    with WebDashboard() as web:
        web.begin_run("digits", {}, 2, ["a", "a"])
        for event in warm_start_steps():
            web.on_event(event)
        chromium.get(f"http://127.0.0.1:{web.port}/")
        wait_for(lambda: chromium.execute_script(Y_RANGE_JS, "chart-throughput"), 20,
                 "the throughput chart")
        low, high = chromium.execute_script(Y_RANGE_JS, "chart-throughput")
        assert 4000 <= high < 6000, (low, high)  # a steady 4,000 samples/s fills the chart
        assert severe(chromium) == []


PLACEHOLDERS_JS = """return Array.from(document.querySelectorAll('.placeholder')).map(p => ({
  chart: p.dataset.for, shown: p.offsetWidth > 0 && p.offsetHeight > 0,
  text: p.textContent, covers: p.getBoundingClientRect().height >=
    document.getElementById(p.dataset.for).getBoundingClientRect().height}));"""
CHARTS = ["chart-loss-step", "chart-loss-bytes", "chart-throughput"]


def placeholders(driver) -> dict[str, dict]:
    return {p["chart"]: p for p in driver.execute_script(PLACEHOLDERS_JS)}


@pytest.mark.slow
def test_page_in_chromium_shows_a_placeholder_in_each_chart_until_plotly_has_drawn_it(
        chromium_eager):
    driver = chromium_eager
    gate = threading.Event()
    with WebDashboard() as web:
        serve_plotly = web._server.plotly_js
        web._server.plotly_js = lambda: (gate.wait(60), serve_plotly())[1]  # a slow link
        try:
            web.begin_run("digits", {}, 2)
            driver.get(f"http://127.0.0.1:{web.port}/")
            # the table does not wait for plotly.js, and each chart's box says what it waits for
            wait_for(lambda: len(driver.execute_script(ROWS_JS)) == 2, 20, "the rows")
            shown = placeholders(driver)
            assert sorted(shown) == sorted(CHARTS)
            for box in shown.values():
                assert box["shown"] and box["covers"], box
                assert "loading the chart library" in box["text"], box
            assert "loss vs step" in shown["chart-loss-step"]["text"]
        finally:
            gate.set()
        wait_for(lambda: driver.execute_script("return typeof Plotly") == "object", 30,
                 "plotly.js to load")
        wait_for(lambda: all("waiting for the first step" in p["text"] and p["shown"]
                             for p in placeholders(driver).values()), 10,
                 "the placeholders to wait for the first step")
        web.on_event(step(0, 1, 2.0))
        web.on_event(step(1, 1, 2.1))
        for chart in ("chart-loss-step", "chart-loss-bytes"):
            wait_for(lambda c=chart: driver.execute_script(POINTS_JS, c) == 2, 10,
                     f"the points of {chart}")
            wait_for(lambda c=chart: not placeholders(driver)[c]["shown"], 5,
                     f"the placeholder of {chart} to go")
        # throughput needs half a second of a host's training (step() trains 0.5 s a step)
        assert "once a host has trained" in placeholders(driver)["chart-throughput"]["text"]
        for rank in (0, 1):
            web.on_event(step(rank, 2, 1.5))
        wait_for(lambda: driver.execute_script(POINTS_JS, "chart-throughput") > 0, 10,
                 "the throughput chart")
        wait_for(lambda: not placeholders(driver)["chart-throughput"]["shown"], 5,
                 "the throughput placeholder to go")
        assert severe(driver) == []


@pytest.mark.slow
def test_page_in_chromium_says_when_plotly_js_cannot_be_loaded(chromium, tmp_path):
    with WebDashboard() as web:
        web._server.plotly_path = tmp_path / "gone" / "plotly.min.js"  # removed meanwhile
        status, body = get(f"http://127.0.0.1:{web.port}/plotly.min.js")
        assert status == 500 and f"reinstall it: {install_extra('web')}".encode() in body
        web.begin_run("digits", {}, 1)
        web.on_event(step(0, 1))
        chromium.get(f"http://127.0.0.1:{web.port}/")
        wait_for(lambda: all("did not load" in p["text"] and p["shown"]
                             for p in placeholders(chromium).values()), 10,
                 "the placeholders to say plotly.js did not load")
        # the rest of the page works: the rank's row comes with the event stream
        wait_for(lambda: len(chromium.execute_script(ROWS_JS)) == 1, 10, "the rank's row")


TRACES_JS = """const gd = document.getElementById(arguments[0]);
return (gd.data || []).map(t => ({name: t.name, kind: t.meta, y: Array.from(t.y),
  opacity: t.opacity === undefined ? 1 : t.opacity, color: t.line && t.line.color}));"""


def tensorboard_smoothing(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: a debiased exponential moving average."""
    last, out = 0.0, []
    for count, value in enumerate(values, 1):
        last = last * weight + (1 - weight) * value
        out.append(last / (1 - weight ** count))
    return out


def log_variation(values: list[float]) -> float:
    """How much a curve jumps about on a log axis: the sum of its steps in decades."""
    return sum(abs(math.log10(b) - math.log10(a)) for a, b in zip(values, values[1:]))


def set_smoothing(driver, value: str) -> None:
    driver.execute_script("""const s = document.getElementById('smoothing');
        s.value = arguments[0]; s.dispatchEvent(new Event('input'));""", value)


@pytest.mark.slow
def test_page_in_chromium_smooths_per_step_loss_by_default_and_keeps_the_raw_points(chromium):
    noise = random.Random(5)
    losses = {rank: [10 ** noise.uniform(-6, 0) for _ in range(200)] for rank in (0, 1)}
    with WebDashboard() as web:
        web.begin_run("digits", {}, 2)
        for n in range(1, 201):
            for rank in (0, 1):
                web.on_event(step(rank, n, losses[rank][n - 1]))
        chromium.get(f"http://127.0.0.1:{web.port}/")
        wait_for(lambda: chromium.execute_script(POINTS_JS, "chart-loss-step") == 400, 20,
                 "the 400 points of the loss chart")
        slider = chromium.find_element("id", "smoothing")
        assert slider.get_attribute("value") == "0.9"  # on by default
        assert chromium.find_element("id", "smoothing-value").text == "0.90"
        for chart in ("chart-loss-step", "chart-loss-bytes"):
            traces = chromium.execute_script(TRACES_JS, chart)
            assert [(t["name"], t["kind"]) for t in traces] == [
                ("rank 0", "raw"), ("rank 0", "smoothed"), ("rank 1", "raw"), ("rank 1", "smoothed")]
            for rank in (0, 1):
                raw, smoothed = traces[2 * rank], traces[2 * rank + 1]
                assert raw["y"] == pytest.approx(losses[rank], rel=1e-12)
                assert raw["opacity"] < 0.5 and raw["color"] == smoothed["color"]  # faint, behind
                assert smoothed["y"] == pytest.approx(tensorboard_smoothing(losses[rank], 0.9),
                                                      rel=1e-9)
                assert log_variation(smoothed["y"]) < log_variation(raw["y"]) / 5  # readable
        # the raw points alone, once smoothing is off; the choice outlives a reload
        set_smoothing(chromium, "0")
        assert chromium.find_element("id", "smoothing-value").text == "off"
        traces = chromium.execute_script(TRACES_JS, "chart-loss-step")
        assert [(t["kind"], t["opacity"]) for t in traces] == [("raw", 1), ("raw", 1)]
        set_smoothing(chromium, "0.5")
        chromium.find_element("id", "show-raw").click()  # smoothed curves only
        traces = chromium.execute_script(TRACES_JS, "chart-loss-step")
        assert [t["kind"] for t in traces] == ["smoothed", "smoothed"]
        assert traces[0]["y"] == pytest.approx(tensorboard_smoothing(losses[0], 0.5), rel=1e-9)
        chromium.refresh()
        wait_for(lambda: chromium.execute_script(TRACES_JS, "chart-loss-step"), 20,
                 "the loss chart after a reload")
        assert chromium.find_element("id", "smoothing").get_attribute("value") == "0.5"
        assert not chromium.find_element("id", "show-raw").is_selected()
        assert severe(chromium) == []
