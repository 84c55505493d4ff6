"""Rough edges a new user hit in compare, --help, the wizard and the results, each pinned.

Real parts throughout: the CLI and the wizard run as programs (their help at 80
columns), files are written under a chosen umask in a fresh process, and the
comparison plot is read back from matplotlib's own objects.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import typer.main
from ranks import ROOT

import cli_typer
import wizard

# --------------------------------------------------------------------------- --help


def _help_pages() -> list[tuple[str, list[str], object]]:
    """(program, argv, click command) for every command of both faces."""
    pages = []
    group = typer.main.get_command(cli_typer.app)
    pages.append(("cli_typer.py", [], group))
    for name, command in group.commands.items():
        pages.append(("cli_typer.py", [name], command))
    pages.append(("wizard.py", [], typer.main.get_command(wizard.app)))
    return pages


@pytest.mark.slow
@pytest.mark.parametrize("program,argv,command", _help_pages(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_help_fits_80_columns_names_every_option_whole_and_shows_flags_bare(program, argv,
                                                                           command):
    env = {**os.environ, "COLUMNS": "80", "TERM": "xterm"}
    done = subprocess.run([sys.executable, program, *argv, "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    page = done.stdout
    too_wide = [line for line in page.splitlines() if len(line) > 80]
    assert not too_wide, too_wide
    assert "…" not in page, page
    assert "<bool>" not in page, page
    for param in command.params:
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("-"):
                assert re.search(rf"(^|[\s,/]){re.escape(opt)}($|[\s,=/])", page, re.M), (
                    opt, page)
        if getattr(param, "is_flag", False):
            for opt in param.opts:
                # a flag is shown alone: no value placeholder after its name
                line = next(ln for ln in page.splitlines()
                            if re.search(rf"(^|[\s,]){re.escape(opt)}(\s|$|/|,)", ln))
                after = line.split(opt, 1)[1]
                assert not after.startswith(" <"), (opt, line)


# --------------------------------------------------------------------------- file modes

_WRITE_EVERY_KIND = r"""
import os, stat, sys, json
from pathlib import Path
import torch
from exogym.base.io import (atomic_write_text, atomic_write_json, atomic_write_bytes,
                       atomic_torch_save, atomic_save_safetensors, new_temp_dir_beside,
                       publish_dir)
from exogym.run.checkpoint import save_checkpoint
from distributed.profiles.setup_files import write_with_backup
from distributed.app.compare import plot_comparison, StrategyResult
out = Path(sys.argv[1])
atomic_write_text(out / "summary.txt", "x")
atomic_write_json(out / "summary.json", {"a": 1})
atomic_write_bytes(out / "secret.key", b"k", mode=0o600)
atomic_torch_save({"w": torch.zeros(2)}, out / "state.pt")
atomic_save_safetensors({"w": torch.zeros(2)}, out / "model.safetensors")
write_with_backup(out / "hosts.json", "{}")
write_with_backup(out / "hosts.json", "{ }")
tmp = new_temp_dir_beside(out / "folder")
(tmp / "inner.txt").write_text("x")
publish_dir(tmp, out / "folder", replace=False)
plot_comparison([StrategyResult("ddp", None, {}, [(0, 0, 1.0), (10, 100, 0.5)])],
                out / "compare.png")
save_checkpoint({"w": torch.zeros(2)}, out / "checkpoints", 0, 1)
print(json.dumps({str(p.relative_to(out)) + ("/" if p.is_dir() else ""):
                  stat.S_IMODE(p.stat().st_mode) for p in sorted(out.rglob("*"))}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o022, 0o644, 0o755),
                                                       (0o027, 0o640, 0o750)])
def test_written_files_get_the_users_usual_mode_and_a_secret_stays_private(tmp_path, umask,
                                                                          file_mode, dir_mode):
    import json

    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run([sys.executable, "-c", _WRITE_EVERY_KIND, str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: os.umask(umask))
    assert done.returncode == 0, done.stderr
    modes = json.loads(done.stdout.splitlines()[-1])
    assert modes.pop("secret.key") == 0o600
    shown = {k: oct(v) for k, v in modes.items()}
    assert {"folder/", "folder/inner.txt", "compare.png", "model.safetensors",
            "hosts.json.bak"} <= set(modes), shown
    assert any(k.startswith("checkpoints/") and not k.endswith("/") for k in modes), shown
    for name, mode in modes.items():
        assert mode == (dir_mode if name.endswith("/") else file_mode), (name, shown)


# --------------------------------------------------------------------------- compare


def test_zero_bytes_sent_are_drawn_at_zero_on_an_axis_that_says_how_it_is_scaled():
    import matplotlib.pyplot as plt

    from distributed.app.compare import StrategyResult, comparison_figure

    results = [StrategyResult("ddp", None, {}, [(0, 0, 2.0), (10, 4000, 1.0), (20, 8000, 0.5)]),
               StrategyResult("diloco", None, {}, [(0, 0, 2.1), (10, 0, 1.5), (20, 3000, 0.6)])]
    fig = comparison_figure(results)
    try:
        by_bytes = fig.axes[1]
        assert by_bytes.get_xscale() == "symlog"
        diloco = next(line for line in by_bytes.get_lines() if line.get_label() == "diloco")
        assert list(diloco.get_xdata()) == [0, 0, 3000]  # drawn as sent, not moved to 1 byte
        left, right = by_bytes.get_xlim()
        assert left <= 0 < 3000 < 8000 <= right
        assert 0 in list(by_bytes.get_xticks())
        assert "0 means nothing sent" in by_bytes.get_xlabel()
        assert "linear below 1000 B" in by_bytes.get_xlabel()  # the decade of 3000
    finally:
        plt.close(fig)


def test_compare_of_a_base_profile_takes_each_strategy_from_its_named_profile():
    from distributed.app.compare import plan_comparison, strategy_profiles

    names = ["ddp", "diloco", "sparta", "fedavg", "demo"]
    assert strategy_profiles("digits-base", names) == {
        s: f"digits-{s}" for s in names}
    plans = {p.strategy: p.values for p in plan_comparison("digits-base", names)}
    assert plans["fedavg"]["H"] == 10 and plans["fedavg"]["island_size"] == 2
    assert plans["diloco"]["H"] == 20 and plans["diloco"]["outer_lr"] == 0.7
    assert plans["sparta"]["p_sparta"] == 0.005
    assert plans["demo"]["compression_topk"] == 16 and plans["demo"]["lr"] == 0.001
    assert plans["ddp"]["lr"] == 0.003  # DeMo's own lr stays DeMo's
    assert "checkpoint_interval" not in plans["fedavg"]  # a run key of digits-diloco: not taken
    # the user's --set still wins over a named profile's setting
    plans = {p.strategy: p.values for p in plan_comparison("digits-base", ["fedavg"],
                                                          overrides={"H": 3})}
    assert plans["fedavg"]["H"] == 3


@pytest.mark.slow
def test_compare_shows_the_settings_first_and_writes_the_plot_into_its_output_folder(
        tmp_path, monkeypatch):
    from faces_support import TINY
    from typer.testing import CliRunner

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    out = tmp_path / "runs"
    args = ["compare", "digits-base", "--config", str(ROOT / "config.ini"),
            "--strategies", "ddp,fedavg"]
    for pair in [*TINY, f"output_dir={out}"]:
        args += ["--set", pair]
    result = CliRunner().invoke(cli_typer.app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = result.output
    settings = text[text.index("Settings each strategy runs with"):text.index("fedavg: val loss")]
    fedavg_row = next(line for line in settings.splitlines() if "fedavg" in line)
    assert "digits-fedavg" in fedavg_row and "H=10" in fedavg_row
    assert text.index("Settings each strategy runs with") < text.index("ddp: val loss")
    fedavg_result = next(line for line in text[text.index("2 strategies"):].splitlines()
                         if "fedavg" in line)
    assert "%" in fedavg_result.split("│")[3]  # the digits task's validation accuracy
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert f"plot written to {out / 'compare.png'}" in text
    assert not list(work.iterdir())  # nothing lands in the current folder


# --------------------------------------------------------------------------- hosts file


def test_a_loopback_master_with_workers_on_other_machines_is_refused_naming_the_fields():
    from distributed.hosts.hostsfile import HostsFileError, load_hosts

    text = ('{\n  "master": "127.0.0.1",\n  "workers": ["10.0.0.2", "127.0.0.3", '
            '{"host": "192.168.1.7"}],\n  "python_env": "/x/python",\n  "project_path": "/x"\n}')
    with pytest.raises(HostsFileError) as caught:
        load_hosts_text(text)
    (problem,) = caught.value.problems
    assert problem.startswith('hosts file line 2: "master" is "127.0.0.1", a loopback address')
    assert '"workers[0]" ("10.0.0.2")' in problem and '"workers[2].host" ("192.168.1.7")' in problem
    assert "127.0.0.3" not in problem  # a loopback worker can reach it
    assert "LAN address" in problem, problem
    # loopback everywhere (one machine, the tests' hosts) and a real master stay valid
    load_hosts({"master": "127.0.0.1", "workers": ["127.0.0.2", "localhost"],
                "python_env": "/x/python", "project_path": "/x"})
    load_hosts({"master": "10.0.0.1", "workers": ["10.0.0.2"], "python_env": "/x/python",
                "project_path": "/x"})
    with pytest.raises(HostsFileError, match='"master" is "localhost"'):
        load_hosts({"master": "localhost", "workers": ["10.0.0.2"], "python_env": "/x/python",
                    "project_path": "/x"})


def load_hosts_text(text: str):
    import tempfile
    from pathlib import Path

    from distributed.hosts.hostsfile import load_hosts

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "hosts.json"
        path.write_text(text)
        return load_hosts(path)


# --------------------------------------------------------------------------- results


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _dashboard(clock: _Clock, log_every: int = 10):
    import io

    from rich.console import Console

    from distributed.app.dashboard import Dashboard

    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)
    return Dashboard(1, console=console, live=False, log_every=log_every, clock=clock), out


def _feed_steps(dashboard, clock: _Clock, steps: range, seconds_per_step: float,
                accuracy: float | None = None) -> None:
    for step in steps:
        clock.now += seconds_per_step
        event = {"event": "step", "rank": 0, "step": step, "train_loss": 1.0,
                 "samples": step * 32, "wall_s": step * seconds_per_step, "comm_bytes": 0}
        if step % 10 == 0:
            event.update(val_loss=0.9, val_global_loss=0.8)
            if accuracy is not None:
                event["val_accuracy"] = accuracy
        dashboard.on_event(event)


def _rendered(renderable) -> str:
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=200).print(renderable)
    return out.getvalue()


def test_live_table_title_and_log_lines_show_the_time_left_from_the_recent_step_rate():
    clock = _Clock()
    dashboard, out = _dashboard(clock)
    dashboard.on_event({"event": "start", "rank": 0, "max_steps": 100})
    _feed_steps(dashboard, clock, range(1, 21), seconds_per_step=0.5)  # 80 steps left at 2/s
    title = _rendered(dashboard.render()).splitlines()[0]
    assert "about 40 s left" in title, title
    assert "ETA 40 s" in out.getvalue().splitlines()[-1]  # the plain line of step 20
    # the rate is the recent one: the run slows down to 1 step/s, the estimate follows
    _feed_steps(dashboard, clock, range(21, 61), seconds_per_step=1.0)
    title = _rendered(dashboard.render()).splitlines()[0]
    assert "about 40 s left" in title, title  # 40 steps left at 1 step/s
    _feed_steps(dashboard, clock, range(61, 101), seconds_per_step=1.0)
    dashboard.on_event({"event": "done", "rank": 0, "step": 100})
    assert ", done)" in _rendered(dashboard.render()).splitlines()[0]


def test_validation_accuracy_shows_in_the_live_table_the_lines_and_the_summaries():
    from rich.console import Console

    from exogym.report.summary import RunReporter

    clock = _Clock()
    dashboard, out = _dashboard(clock)
    dashboard.on_event({"event": "start", "rank": 0, "max_steps": 20})
    _feed_steps(dashboard, clock, range(1, 21), seconds_per_step=0.1, accuracy=0.8125)
    assert "val acc" in _rendered(dashboard.render()) and "81.2%" in _rendered(dashboard.render())
    assert "acc 81.2%" in out.getvalue()
    summary = dashboard.summary(5.0)
    assert summary["final_val_accuracy"] == 0.8125  # the key summary.json holds
    shown = _rendered(dashboard.summary_table(summary))
    assert "val acc" in shown and "81.2%" in shown
    import io

    printed = io.StringIO()
    RunReporter(1, console=Console(file=printed, width=200)).finish(summary)
    assert "val acc" in printed.getvalue() and "81.2%" in printed.getvalue()
    # a task without accuracy gets no such column
    plain_dash, _ = _dashboard(_Clock())
    plain_dash.on_event({"event": "start", "rank": 0, "max_steps": 20})
    _feed_steps(plain_dash, _Clock(), range(1, 11), seconds_per_step=0.1)
    assert "val acc" not in _rendered(plain_dash.render())
    assert "val acc" not in _rendered(plain_dash.summary_table(plain_dash.summary(1.0)))
