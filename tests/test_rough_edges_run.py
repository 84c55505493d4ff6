"""What a new user tripped over on the way to a run, each through the command line as they
typed it (``python cli_typer.py ...`` in a subprocess, so stderr is the real one).

SSH errors that say what happened; ``profiles`` fast and tolerant of a bad profile;
``--resume`` of a finished run; warnings as one plain line; ``--set`` checked before work
starts; what ``--dry-run`` tells; warnings before a run that cannot go as meant; the
``--resume`` command after Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import warm
from ranks import ROOT, interrupt_after_checkpoints

from distributed.app.console import quiet_library_logs


def cli(*args: str, cwd: Path | None = None, timeout: float = 300,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the command line as a user would; stdout and stderr apart (wide, so that a
    table's cells stay whole)."""
    env = {**os.environ, "COLUMNS": "400", **(env or {})}
    return subprocess.run([*warm.cli_command(), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=timeout, env=env)


# --- 1. SSH errors ------------------------------------------------------------------------


class FakeServer:
    """A TCP server on a loopback address that accepts and then stays silent or closes."""

    def __init__(self, address: str, mode: str) -> None:
        self.sock = socket.socket()
        self.sock.bind((address, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.mode = mode
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.mode == "close":
                conn.close()
            else:
                self.held.append(conn)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the accept() a close alone would not
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(10)
        for conn in self.held:
            conn.close()


@pytest.fixture
def fake_ssh(request) -> Iterator[FakeServer]:
    server = FakeServer("127.0.0.9", request.param)
    yield server
    server.close()


def hosts_file(path: Path, worker: str, port: int) -> Path:
    path.write_text(json.dumps({
        "master": "127.0.0.1", "workers": [{"host": worker, "ssh_port": port}],
        "python_env": sys.executable, "project_path": str(ROOT)}))
    return path


NO_TRACE = ("Traceback", "paramiko", "Exception (client)", "No existing session")


@pytest.mark.slow
@pytest.mark.parametrize("fake_ssh", ["silent"], indirect=True)
def test_check_hosts_says_a_silent_port_sent_no_greeting_and_how_long_it_waited(
        fake_ssh, tmp_path):
    hosts = hosts_file(tmp_path / "hosts.json", "127.0.0.9", fake_ssh.port)
    started = time.monotonic()
    result = cli("check-hosts", hosts, "--ssh-timeout", "1.5")
    took = time.monotonic() - started
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    flat = " ".join(out.split())
    assert (f"127.0.0.9:{fake_ssh.port} accepted the TCP connection but sent no SSH greeting "
            "in 1.5 s: is sshd running there, or is another service on that port?") in flat
    for word in NO_TRACE:
        assert word not in out, out
    assert took < 30, took  # one wait for the greeting, not one per attempt


@pytest.mark.slow
@pytest.mark.parametrize("fake_ssh", ["close"], indirect=True)
def test_check_hosts_says_a_closed_connection_closed_at_once(fake_ssh, tmp_path):
    hosts = hosts_file(tmp_path / "hosts.json", "127.0.0.9", fake_ssh.port)
    result = cli("check-hosts", hosts, "--ssh-timeout", "5")
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    flat = " ".join(out.split())
    assert f"127.0.0.9:{fake_ssh.port} closed the connection at once before the SSH greeting " \
           "(after 0." in flat
    assert "within 5 s" not in flat and "in 5.0 s" not in flat
    for word in NO_TRACE:
        assert word not in out, out


@pytest.mark.slow
@pytest.mark.parametrize("fake_ssh", ["silent"], indirect=True)
def test_train_on_hosts_reports_the_silent_host_without_traceback(fake_ssh, tmp_path):
    hosts = hosts_file(tmp_path / "hosts.json", "127.0.0.9", fake_ssh.port)
    result = cli("distributed-train", "digits-diloco", "--hosts", hosts, "--ssh-timeout", "1",
                 "--set", "max_steps=2")
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "sent no SSH greeting in 1.0 s" in " ".join(out.split())
    for word in NO_TRACE:
        assert word not in out, out


def test_paramiko_log_lines_show_only_with_debug():
    quiet_library_logs(False)
    assert not logging.getLogger("paramiko").propagate
    assert all(isinstance(h, logging.NullHandler) for h in logging.getLogger("paramiko").handlers)
    quiet_library_logs(True)
    assert any(type(h) is logging.StreamHandler for h in logging.getLogger("paramiko").handlers)
    quiet_library_logs(False)


def test_quiet_library_logs_replaces_its_own_handler_and_keeps_the_users():
    """Each command calls it again in the same process (the wizard, CliRunner): its handler
    must not pile up, and a handler someone else put on paramiko stays."""
    logger = logging.getLogger("paramiko")
    theirs = logging.NullHandler()
    logger.addHandler(theirs)
    for debug in (False, True, True, False, False):
        quiet_library_logs(debug)
    ours = [h for h in logger.handlers if getattr(h, "_exogym", False)]
    assert len(ours) == 1 and type(ours[0]) is logging.NullHandler
    assert theirs in logger.handlers and not logger.propagate


# --- 2. profiles ---------------------------------------------------------------------------


def cpu_seconds(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the command line; and the CPU seconds it used (not wall time: the machine may be
    busy with other work, and the point is what the command itself does)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = cli(*args)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return result, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.slow
def test_profiles_lists_the_good_ones_and_marks_the_bad_one_with_its_error(tmp_path):
    config = tmp_path / "config.ini"
    config.write_text((ROOT / "config.ini").read_text() + "\n[distributed:broken]\n"
                      "base_profile = no-such-profile\nmax_steps = 3\n\n"
                      "[distributed:bad-steps]\nbase_profile = digits-base\nmax_steps = abc\n")
    result = cli("profiles", "--config", config)
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    for name in ("digits-diloco", "digits-ddp", "chargpt-diloco", "broken", "bad-steps"):
        assert name in out
    assert "not usable here: no profile 'no-such-profile' (base_profile of 'broken')" in out
    assert "max_steps must be an integer >= 1 or None, got 'abc'" in out
    assert out.count("not usable here") == 2


@pytest.mark.slow
def test_profiles_check_finds_an_unknown_key(tmp_path):
    config = tmp_path / "config.ini"
    config.write_text((ROOT / "config.ini").read_text() + "\n[distributed:typo]\n"
                      "base_profile = digits-diloco\nmax_step = 3\n")
    quick = cli("profiles", "--config", config)
    assert quick.returncode == 0 and "not usable" not in quick.stdout
    checked = cli("profiles", "--config", config, "--check")
    assert checked.returncode == 0, checked.stderr
    assert "unknown key 'max_step' (did you mean 'max_steps'?)" in " ".join(
        checked.stdout.split())


@pytest.mark.slow
def test_profiles_fails_when_no_profile_can_run(tmp_path):
    config = tmp_path / "config.ini"
    config.write_text("[distributed:broken]\nbase_profile = nothing\n")
    result = cli("profiles", "--config", config)
    assert result.returncode == 2
    assert "broken" in result.stdout and "no profile" in result.stderr


@pytest.mark.slow
def test_profiles_answers_without_importing_torch():
    result, cpu = cpu_seconds("profiles")
    assert result.returncode == 0, result.stderr
    assert "digits-diloco" in result.stdout
    assert cpu < 2.0, cpu  # importing torch alone takes 3 s of CPU here

    from distributed.app.profile_list import list_profiles

    code = ("import sys; from distributed.app.profile_list import list_profiles; "
            "list_profiles(full_check=False); print('torch' in sys.modules)")
    check = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           cwd=ROOT)
    assert check.stdout.strip() == "False", check.stderr
    path, entries = list_profiles(full_check=False)
    assert all(entry.why_not is None for entry in entries), entries


def test_builtin_task_names_known_without_torch_match_the_tasks():
    from distributed.tasks import BUILTIN_TASK_NAMES
    from distributed.tasks.builtin import BUILTIN_TASKS

    assert tuple(BUILTIN_TASKS) == BUILTIN_TASK_NAMES


# --- 5. --set checked before work starts ---------------------------------------------------


@pytest.mark.slow
def test_set_value_of_the_wrong_type_fails_before_anything_starts():
    result, cpu = cpu_seconds("distributed-train", "digits-diloco", "--set", "max_steps=abc")
    assert result.returncode == 2
    assert "simulating" not in result.stdout + result.stderr
    assert ("--set max_steps=abc: max_steps must be an integer >= 1 or None, got 'abc' "
            "(profile digits-diloco)") in " ".join(result.stderr.split())
    assert cpu < 1.5, cpu  # no torch import before the check


# --- 4. shipped profiles do not warn; our warnings are one plain line ----------------------

TINY_RUN = ["--set", "max_steps=2", "--set", "num_nodes=2", "--set", "val_size=16",
            "--set", "checkpoint_interval=None", "--set", "num_threads=1"]


@pytest.mark.slow
def test_every_shipped_profile_resolves_and_builds_its_strategy_without_a_warning():
    from distributed.profiles.profile import ProfileSet

    profiles = ProfileSet()
    for name in profiles.names():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            profile = profiles.get(name)
            resolved = profile.resolved
            resolved.strategy_cls(**resolved.strategy_kwargs)
            if profile.task == "digits":  # cheap to build; the others load more
                resolved.task_fn(**resolved.task_kwargs)


@pytest.mark.slow
def test_digits_demo_runs_without_a_warning(tmp_path):
    result = cli("distributed-train", "digits-demo", *TINY_RUN, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower(), result.stderr
    assert json.loads((tmp_path / "runs/digits-demo/summary.json").read_text())["steps"] == 2


def assert_plain_warning(stderr: str, text: str) -> None:
    """``text`` is on a ``warning: ...`` line; no Python warning form (file:line, category,
    source line) anywhere."""
    flat = " ".join(stderr.split())
    assert f"warning: {text}" in flat, stderr
    assert "Warning:" not in stderr and ".py:" not in stderr, stderr


# --- 7. warnings before the start ----------------------------------------------------------


@pytest.mark.slow
def test_a_run_whose_h_and_batch_cannot_go_as_set_warns_and_still_runs(tmp_path):
    result = cli("distributed-train", "digits-diloco", *TINY_RUN, "--set", "H=5",
                 "--set", "batch_size=1000", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_plain_warning(result.stderr, "H=5 > max_steps=2: DiLoCo would never communicate")
    assert_plain_warning(result.stderr, "batch_size=1000 is larger than one rank's share of "
                                        "the data (719 of 1438 training samples over 2 ranks)")
    assert "simulation finished" in result.stdout
    assert (tmp_path / "runs/digits-diloco/summary.json").is_file()


@pytest.mark.slow
def test_many_more_ranks_than_cores_is_warned_with_the_numbers():
    from distributed.app.run import run_warnings
    from distributed.profiles.profile import load_profile

    profile = load_profile("digits-diloco", overrides={"num_nodes": 65})
    assert run_warnings(profile, 65, 2) == [
        "65 ranks on 2 cores (32.5 per core): they take turns, so each step will be slow; "
        "up to 8 ranks keep it reasonable"]
    assert run_warnings(profile, 8, 2) == []
    result = cli("distributed-train", "digits-diloco", "--dry-run", "--set", "num_nodes=65")
    assert result.returncode == 0, result.stderr
    cores = os.cpu_count()
    if cores and 65 > 4 * cores:
        assert f"note: 65 ranks on {cores} cores" in result.stdout


# --- 6. what --dry-run tells ---------------------------------------------------------------


@pytest.mark.slow
def test_dry_run_on_hosts_says_the_hosts_replace_num_nodes_and_the_key_file_is_missing(
        tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({
        "master": "127.0.0.1", "workers": ["127.0.0.2", "127.0.0.3"],
        "ssh_key_path": str(tmp_path / "no_such_key"), "python_env": sys.executable,
        "project_path": str(ROOT)}))
    result = cli("distributed-train", "digits-diloco", "--hosts", hosts, "--dry-run",
                 "--set", "H=400")
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "note: the hosts file's 3 ranks replace the profile's num_nodes=4" in out
    assert f"note: key file {tmp_path / 'no_such_key'} for " in out
    assert "(rank 1) does not exist on this machine" in out
    assert "note: H=400 > max_steps=300: DiLoCo would never communicate" in out


# --- 3. --resume of a finished run; totals from the rank rows ------------------------------

RESUMABLE = [*TINY_RUN, "--set", "checkpoint_interval=1", "--set", "H=2"]


def result_files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in ("summary.json", "model.safetensors")}


@pytest.mark.slow
def test_resume_of_a_finished_run_says_so_and_leaves_its_results_intact(tmp_path):
    first = cli("distributed-train", "digits-diloco", *RESUMABLE, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    out = tmp_path / "runs/digits-diloco"
    before = result_files(out)
    assert json.loads(before["summary.json"])["steps"] == 2

    again = cli("distributed-train", "digits-diloco", *RESUMABLE, "--resume", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    said = " ".join(again.stdout.split())
    assert ("runs/digits-diloco already finished at step 2 (max_steps=2); nothing to resume. "
            "Its results are in runs/digits-diloco/summary.json") in said
    assert "[local:" not in said  # no rank was started (each says "[local:R] ...")
    assert result_files(out) == before

    # The worker alone (as each host runs it) keeps them too.
    worker = subprocess.run(
        [sys.executable, "-m", "distributed.worker", "--profile", "digits-diloco", "--resume",
         "--quiet", *RESUMABLE],
        capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert worker.returncode == 0, worker.stderr
    assert "nothing to resume" in worker.stdout
    assert result_files(out) == before


def test_the_run_totals_are_computed_from_the_rank_rows():
    from io import StringIO

    from rich.console import Console

    from distributed.app.dashboard import Dashboard
    from exogym.report.summary import summarize

    text = StringIO()
    dashboard = Dashboard(2, console=Console(file=text, width=200), live=False)
    for rank in (0, 1):  # ranks resumed at their last step: a start and a done, no step
        dashboard.on_event({"event": "start", "rank": rank, "step": 2, "max_steps": 2})
        dashboard.on_event({"event": "done", "rank": rank, "step": 2, "comm_bytes": 300})
    dashboard.finish(summarize([], 2, 1.0))
    rows = [line.split("│")[1:-1] for line in text.getvalue().splitlines()
            if line.startswith("│")]
    rank_rows = [r for r in rows if len(r) == 7]
    totals = [r for r in rows if len(r) == 7 and r[0].strip() == "2" and "local" not in r[1]]
    assert [r[3].strip() for r in rank_rows if "local" in r[1]] == ["2", "2"]
    assert totals and totals[0][1].strip() == "2", text.getvalue()  # steps, as each rank says
    assert totals[0][5].strip() == "300 B", text.getvalue()


# --- 8. Ctrl-C prints the --resume command -------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_after_a_checkpoint_prints_the_exact_resume_command(tmp_path):
    args = ["distributed-train", "digits-diloco", "--set", "max_steps=100000", "--set",
            "num_nodes=2", "--set", "checkpoint_interval=5", "--set", "num_threads=1",
            "--set", "val_size=16", "--logger", "none"]
    returncode, _, err = interrupt_after_checkpoints(
        args, tmp_path, tmp_path / "runs/digits-diloco/checkpoints/digits-diloco/rank0")
    assert returncode == 130, err
    assert ("this run's newest checkpoint, at step" in err
            and "is in runs/digits-diloco/checkpoints/digits-diloco;" in err), err
    command = err.strip().splitlines()[-1].strip()
    assert command == ("python cli_typer.py distributed-train digits-diloco --set "
                       "max_steps=100000 --set num_nodes=2 --set checkpoint_interval=5 --set "
                       "num_threads=1 --set val_size=16 --set logger=none --resume"), err


# --- 7, across hosts: the same warnings, and the run still starts --------------------------


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    from sshd_fixture import serve_sshd

    yield from serve_sshd(tmp_path_factory)


@pytest.mark.slow
def test_a_run_on_hosts_warns_about_h_and_the_batch_and_still_runs(sshd, tmp_path):
    from faces_support import sshd_hosts

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(sshd_hosts(sshd, workers=1)))
    out_dir = tmp_path / "out"
    result = cli("distributed-train", "digits-diloco", "--hosts", hosts,
                 "--known-hosts", sshd.known_hosts, "--ssh-config", sshd.ssh_config,
                 *TINY_RUN, "--set", "H=5", "--set", "batch_size=1000",
                 "--set", f"output_dir={out_dir}")
    everything = result.stdout + result.stderr
    assert result.returncode == 0, everything
    assert_plain_warning(result.stderr, "H=5 > max_steps=2: DiLoCo would never communicate")
    assert ("warning: batch_size=1000 is larger than one rank's share of the data (719 of "
            "1438 training samples over 2 ranks)") in " ".join(everything.split())
    assert "all 2 ranks finished" in result.stdout
    assert json.loads((out_dir / "summary.json").read_text())["steps"] == 2
