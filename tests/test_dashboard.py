"""The live dashboard: plain lines off a terminal, a row per rank on one, and a real run's screen."""

from __future__ import annotations

import io
import os
import re
import sys

import pytest
from faces_support import plain
from ranks import ROOT
from rich.console import Console

from distributed.app.dashboard import Dashboard


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(rank: int, n: int, **extra) -> dict:
    return {"event": "step", "rank": rank, "step": n, "train_loss": 1.0 / n, "lr": 0.01,
            "comm_bytes": 1024 * n, "samples": 32 * n, "wall_s": 0.01 * n, **extra}


def feed_run(dashboard: Dashboard, ranks: int = 2, steps: int = 20) -> None:
    for rank in range(ranks):
        dashboard.on_event({"event": "start", "rank": rank, "max_steps": steps})
    for n in range(1, steps + 1):
        for rank in range(ranks):
            extra = {"val_loss": 0.7, "val_global_loss": 0.5} if n == steps else {}
            dashboard.on_event(step(rank, n, **extra))
    for rank in range(ranks):
        dashboard.on_event({"event": "done", "rank": rank, "step": steps,
                            "comm_bytes": 1024 * steps})


def test_off_a_terminal_it_prints_plain_lines_for_starts_every_tenth_step_and_ends():
    out = io.StringIO()
    dashboard = Dashboard(2, ["mac-a", "mac-b"], console=Console(file=out, width=120))
    feed_run(dashboard)
    dashboard.finish()
    text = out.getvalue()
    assert "\x1b" not in text  # no colours, no cursor movement
    lines = text.splitlines()
    assert "[mac-a:0] started, 20 steps" in lines
    assert [line for line in lines if line.startswith("[mac-b:1] step")] == [
        f"[mac-b:1] step {n}/20 | loss {1 / n:.4f} | "
        + ("val 0.5000 | " if n == 20 else "")
        + f"3200.0 samples/s | sent {1024 * n / 1024:.1f} KiB"
        for n in range(2, 21, 2)]
    assert "[mac-b:1] done at step 20, sent 20.0 KiB" in lines
    assert "run summary" in text and "0.5000" in text  # the summary has the final val loss


def test_the_table_has_a_row_per_rank_and_the_totals():
    clock = Clock()
    dashboard = Dashboard(3, ["a", "b", "c"], console=Console(file=io.StringIO(), width=200),
                          live=False, clock=clock)
    dashboard.on_event({"event": "start", "rank": 0, "max_steps": 50})
    dashboard.on_event(step(0, 7))
    clock.now += 2.5
    dashboard.on_event(step(1, 5, host="b-renamed"))
    clock.now += 1.0
    out = io.StringIO()
    Console(file=out, width=200).print(dashboard.render())
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
            for line in out.getvalue().splitlines() if line.startswith("│")}
    assert rows["0"][:5] == ["0", "a", "training", "7/50", "0.1429"]
    assert rows["0"][6:] == ["3200.0", "7.0 KiB", "3.5 s ago"]
    assert rows["1"][1:4] == ["b-renamed", "training", "5"]
    assert rows["1"][-1] == "1.0 s ago"
    assert rows["2"][1:4] == ["c", "waiting", "0"] and rows["2"][-1] == "-"
    assert rows["all"][1:4] == ["3 ranks", "0/3 done", "0-7"]
    assert rows["all"][6:] == ["6400.0", "12.0 KiB", "1.0 s ago"]


def test_launcher_outcomes_and_output_lines_show():
    out = io.StringIO()
    dashboard = Dashboard(2, console=Console(file=out, width=120))
    dashboard.on_event(step(1, 3))
    dashboard.set_status(1, "failed")
    dashboard.on_output("[10.0.0.2:1] Traceback: boom")
    assert "[local:1] failed at step 3" in out.getvalue()
    assert "[10.0.0.2:1] Traceback: boom" in out.getvalue()
    assert dashboard.ranks[1].status == "failed"


def test_summary_comes_from_the_events_when_no_trainer_gives_one():
    dashboard = Dashboard(2, console=Console(file=io.StringIO()), live=False)
    feed_run(dashboard, steps=10)
    summary = dashboard.summary(wall_s=4.0)
    assert summary["steps"] == 10 and summary["num_nodes"] == 2
    assert summary["final_val_global_loss"] == 0.5
    assert summary["bytes_per_node"] == 10 * 1024 and summary["wall_s"] == 4.0


@pytest.mark.slow
def test_a_real_runs_screen_in_a_terminal_shows_a_row_per_rank_with_changing_steps(tmp_path):
    pexpect = pytest.importorskip("pexpect", reason="pip install pexpect")
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="130", LINES="40",
               PYTHONPATH=str(ROOT))
    args = [str(ROOT / "cli_typer.py"), "distributed-train", "digits-ddp"]
    for pair in ("max_steps=3000", "num_nodes=2", "val_interval=1500", "val_size=64",
                 "num_threads=1", f"output_dir={tmp_path / 'out'}"):
        args += ["--set", pair]
    child = pexpect.spawn(sys.executable, args, cwd=str(ROOT), env=env, dimensions=(40, 130),
                          timeout=240, encoding="utf-8", codec_errors="replace")
    child.expect(pexpect.EOF)
    child.close()
    screen = plain(child.before)
    assert child.exitstatus == 0, screen[-3000:]
    assert "[local:0] step" not in screen  # a terminal gets the table, not log lines
    steps = {0: set(), 1: set()}
    for rank, done in re.findall(r"│\s+([01]) │ local\s+│ \w+\s+│\s+(\d+)/3000", screen):
        steps[int(rank)].add(int(done))
    assert all(len(seen) >= 3 for seen in steps.values()), (steps, screen[-3000:])
    assert all(max(seen) == 3000 for seen in steps.values())
    assert re.search(r"│\s+all │ 2 ranks\s+│ 2/2 done", screen)
    # the host at a glance: its link, sync, waiting, CPU and memory, from the ranks' monitors
    assert re.search(r"│ local\s+│\s+[\d.]+ [MG]bit/s │\s+(idle|\d+%) │\s+\d+% │\s+\d+% │"
                     r"\s+[\d.]+ GiB │\s+[\d.]+ GiB of [\d.]+ GiB", screen), screen[-3000:]
    assert "run summary" in screen


def test_the_live_table_fits_an_80_column_terminal_without_cutting_a_cell():
    out = io.StringIO()
    hosts = ["10.213.91.254", "10.213.91.1", "10.213.91.2", "gpu-box-under-the-desk"]
    dashboard = Dashboard(4, hosts, console=Console(file=io.StringIO(), width=80), live=False)
    for rank in range(4):
        dashboard.on_event({"event": "start", "rank": rank, "max_steps": 10000})
        dashboard.on_event(step(rank, 7391, val_loss=0.1234, val_accuracy=0.9765))
    Console(file=out, width=80).print(dashboard.render())
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    shown = "\n".join(lines)
    assert "…" not in shown, shown
    for cell in ("7391/10000", "gpu-box-under-the-desk", "0.1234", "loss"):
        assert cell in shown, shown
    wide = Dashboard(4, hosts, console=Console(file=io.StringIO(), width=200), live=False)
    for rank in range(4):
        wide.on_event(step(rank, 7391))
    drawn = io.StringIO()
    Console(file=drawn, width=200).print(wide.render())
    assert "last report" in drawn.getvalue() and "samples/s" in drawn.getvalue()


@pytest.mark.slow
def test_profiles_at_80_columns_is_a_block_per_profile_with_no_value_split(tmp_path):
    import subprocess

    done = subprocess.run([sys.executable, str(ROOT / "cli_typer.py"), "profiles"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert "  batch_size=32 max_steps=300 lr=0.003 H=20" in lines
    assert not any(line.rstrip().endswith("batch_si") for line in lines)
    names = [line.split()[0] for line in lines if line and not line.startswith((" ", "Prof"))]
    assert "digits-diloco" in names and len(lines) < 3.5 * len(names) + 5


def test_a_step_reported_again_is_told_once():
    """A rank that stops reports its last step again: one line for it, not two."""
    out = io.StringIO()
    clock = Clock()
    dashboard = Dashboard(1, ["a"], console=Console(file=out, width=200), live=False,
                          clock=clock)
    dashboard.on_event({"event": "start", "rank": 0, "max_steps": 300})
    dashboard.on_event(step(0, 141, val_loss=0.5))
    dashboard.on_event(step(0, 141, val_loss=0.5))
    lines = [line for line in out.getvalue().splitlines() if "step 141" in line]
    assert len(lines) == 1, out.getvalue()


GIB = 2**30


def link(rank: int, done: float | None, rate_bps: float | None, **extra) -> dict:
    return {"event": "link", "rank": rank, "in_flight": done is not None, "done": done,
            "rate_bps": rate_bps, **extra}


def system(rank: int, pid: int, rss_gib: float, available_gib: float, **extra) -> dict:
    return {"event": "system", "rank": rank, "pid": pid, "cpu_percent": 57.0, "cores": 8,
            "rss_bytes": int(rss_gib * GIB), "mem_available_bytes": int(available_gib * GIB),
            "mem_total_bytes": 16 * GIB, "low_memory": available_gib < 1.6, **extra}


def timed(rank: int, n: int, wall_s: float, comm_s: float, compute_s: float) -> dict:
    return step(rank, n, wall_s=wall_s, comm_s=comm_s, compute_s=compute_s)


def table_rows(text: str) -> dict[str, list[str]]:
    """Each row of a drawn table (the header's too) by its first cell."""
    rows = {}
    for line in text.splitlines():
        bar = line[:1]
        if bar in ("│", "┃"):
            cells = [c.strip() for c in line.split(bar)[1:-1]]
            rows[cells[0]] = cells
    return rows


def test_the_hosts_table_shows_each_hosts_link_waiting_cpu_memory_and_gpu():
    out = io.StringIO()
    dashboard = Dashboard(3, ["mac-a", "mac-b", "mac-b"], console=Console(file=out, width=200),
                          live=False)
    assert dashboard.hosts_table() is None  # nothing reported yet: no table
    for n, wall in enumerate((1.0, 2.0, 3.0), start=1):
        dashboard.on_event(timed(0, n, wall, 0.25, 0.75))  # a second a step, a quarter waiting
        dashboard.on_event(timed(1, n, 2 * wall, 1.5, 0.5))  # three quarters
        dashboard.on_event(timed(2, n, 2 * wall, 0.5, 1.5))  # a quarter
    dashboard.on_event(link(0, 0.4, 38.2e6))
    dashboard.on_event(link(1, 0.5, 10e6))
    dashboard.on_event(link(2, 0.3, 12e6))
    dashboard.on_event(system(0, 11, 1.5, 3.4, gpu="mps", gpu_bytes=2 * GIB,
                              gpu_total_bytes=12 * GIB))
    dashboard.on_event(system(1, 21, 1.0, 2.0))
    dashboard.on_event(system(2, 22, 1.25, 0.8))  # the host's newest figures: low on memory
    dashboard.on_event(system(2, 22, 1.25, 0.8))
    drawn = io.StringIO()
    Console(file=drawn, width=200).print(dashboard.frame())
    rows = table_rows(drawn.getvalue())
    assert rows["host"] == ["host", "link", "sync", "waiting", "CPU", "ranks' memory",
                            "available", "GPU", "GPU memory"]
    assert rows["mac-a"] == ["mac-a", "38.2 Mbit/s", "40%", "25%", "57%", "1.5 GiB",
                             "3.4 GiB of 16 GiB", "-", "2.0 GiB of 12 GiB"]
    # two ranks: their rates summed, the least advanced sync, their waits averaged
    assert rows["mac-b"] == ["mac-b", "22.0 Mbit/s", "30%", "50%", "57%", "2.2 GiB",
                             "0.8 GiB of 16 GiB LOW", "-", "-"]
    assert "mac-b has 0.8 GiB of 16 GiB memory left" in drawn.getvalue()  # the caption
    assert rows["0"][1:3] == ["mac-a", "training"]  # the ranks' table is still there
    told = [line for line in out.getvalue().splitlines() if "memory left" in line]
    assert told == ["this machine has 0.8 GiB of 16 GiB memory left"]  # once
    dashboard.on_event(link(0, None, 40.1e6))  # its collective ended
    drawn = io.StringIO()
    Console(file=drawn, width=200).print(dashboard.hosts_table())
    assert table_rows(drawn.getvalue())["mac-a"][1:3] == ["40.1 Mbit/s", "idle"]


def test_a_hosts_low_memory_relayed_by_the_launcher_is_told_by_the_launcher_not_here():
    out = io.StringIO()
    dashboard = Dashboard(1, ["10.0.0.2"], console=Console(file=out, width=200), live=False)
    dashboard.on_event(system(0, 7, 1.0, 0.5, host="10.0.0.2"))
    assert "memory left" not in out.getvalue()
    drawn = io.StringIO()
    Console(file=drawn, width=200).print(dashboard.hosts_table())
    assert "10.0.0.2 has 0.5 GiB of 16 GiB memory left" in drawn.getvalue()


def test_the_hosts_table_fits_an_80_column_terminal():
    dashboard = Dashboard(2, ["gpu-box-under-the-desk", "10.213.91.254"],
                          console=Console(file=io.StringIO(), width=80), live=False)
    for rank in (0, 1):
        dashboard.on_event(link(rank, 0.123, 987.6e6))
        dashboard.on_event(system(rank, rank, 123.4, 12.3, gpu=f"cuda:{rank}",
                                  gpu_percent=99.0, gpu_bytes=70 * GIB,
                                  gpu_total_bytes=80 * GIB))
    out = io.StringIO()
    Console(file=out, width=80).print(dashboard.hosts_table())
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert all(len(line) <= 80 for line in lines) and "…" not in out.getvalue(), lines
    for cell in ("gpu-box-under-the-desk", "987.6 Mbit/s", "12%", "12 GiB of 16 GiB"):
        assert cell in out.getvalue()  # the link, its sync and the memory left stay
