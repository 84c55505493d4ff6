"""The wizard, driven in a real pseudo-terminal against the test sshd, and with --yes as CI runs it;
plus the pieces it writes files and measures the link with."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from faces_support import plain, sshd_hosts
from ranks import ROOT, free_port
from sshd_fixture import serve_sshd

from distributed.hosts.hostsfile import load_hosts
from distributed.profiles.profile import ProfileSet, load_profile
from distributed.profiles.setup_files import format_value, has_profile, with_profile, write_with_backup

WIZARD = str(ROOT / "wizard.py")
TINY_SETS = ["--set", "num_threads=1", "--set", "val_interval=10", "--set", "val_size=64",
             "--set", "checkpoint_interval=None"]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    yield from serve_sshd(tmp_path_factory)


def wizard_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PROMPT_TOOLKIT_NO_CPR="1", **extra)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def project_config(tmp_path: Path) -> Path:
    config = tmp_path / "config.ini"
    config.write_text((ROOT / "config.ini").read_text())
    return config


# --------------------------------------------------------------------------- files


def test_profile_values_read_back_as_written():
    from distributed.profiles.profile import parse_value

    for value in (3, 0.7, 1e-3, True, False, None, "adamw", [1, 2], "cuda:0"):
        assert parse_value(format_value(value)) == value
    with pytest.raises(ValueError, match="reads back"):
        format_value("12")  # would read back as an int


def test_a_profile_section_is_replaced_in_place_and_the_rest_is_kept():
    text = "# my notes\n[distributed:a]\ntask = digits\n\n[distributed:b]\n# keep me\ntask = x\n"
    replaced = with_profile(text, "a", {"task": "chargpt", "H": 5})
    assert replaced == ("# my notes\n[distributed:a]\ntask = chargpt\nH = 5\n\n"
                        "[distributed:b]\n# keep me\ntask = x\n")
    appended = with_profile(text, "c", {"task": "digits"})
    assert appended == text + "\n[distributed:c]\ntask = digits\n"
    assert has_profile(appended, "c") and not has_profile(text, "c")


def test_write_with_backup_keeps_the_previous_file_and_skips_same_content(tmp_path):
    path = tmp_path / "hosts.json"
    assert write_with_backup(path, "one\n") is None
    backup = write_with_backup(path, "two\n")
    assert backup == tmp_path / "hosts.json.bak" and backup.read_text() == "one\n"
    assert path.read_text() == "two\n"
    assert write_with_backup(path, "two\n") is None and backup.read_text() == "one\n"


def test_link_measurement_sends_to_a_worker_and_times_what_arrived(sshd):
    from distributed.hosts.linkspeed import measure_link
    from distributed.hosts.ssh import SSHOptions

    worker = load_hosts(sshd_hosts(sshd, workers=1)).workers[0]
    options = SSHOptions(known_hosts_path=sshd.known_hosts, ssh_config_path=sshd.ssh_config,
                         allow_agent=False, look_for_keys=False)
    measured = measure_link(worker, options, seconds=0.3)
    assert measured.host == "127.0.0.2"
    assert measured.bytes >= 256 * 1024 and measured.seconds > 0
    assert measured.mbit_per_s == pytest.approx(measured.bytes * 8 / measured.seconds / 1e6)


# --------------------------------------------------------------------------- without a terminal


def test_without_a_terminal_and_without_yes_it_says_so_and_exits_2(tmp_path):
    done = subprocess.run([sys.executable, WIZARD], cwd=tmp_path, env=wizard_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs a terminal" in done.stderr and "--yes" in done.stderr


def test_yes_without_hosts_writes_a_profile_and_runs_the_local_simulation(tmp_path):
    config = project_config(tmp_path)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, WIZARD, "--yes", "--config", str(config), "--set", "max_steps=20",
         "--set", "num_nodes=2", "--set", f"output_dir={out}", *TINY_SETS],
        cwd=tmp_path, env=wizard_env(), stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    profile = load_profile("digits-diloco-2nodes", config)
    assert profile.strategy == "diloco" and profile.values["max_steps"] == 20
    assert profile.values["num_nodes"] == 2
    assert (tmp_path / "config.ini.bak").read_text() == (ROOT / "config.ini").read_text()
    assert "[local:1] done at step 20" in done.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 20
    assert not (tmp_path / "distributed_hosts.json").exists()  # one machine: no hosts file


def test_yes_with_a_hosts_file_checks_every_host_and_uses_it(sshd, tmp_path):
    hosts_file = tmp_path / "distributed_hosts.json"
    hosts_file.write_text(json.dumps(sshd_hosts(sshd)))
    written = hosts_file.read_text()
    config = project_config(tmp_path)
    done = subprocess.run(
        [sys.executable, WIZARD, "--yes", "--no-run", "--config", str(config),
         "--known-hosts", str(sshd.known_hosts), "--ssh-config", str(sshd.ssh_config),
         "--bandwidth-mbit", "50", "--set", "max_steps=20"],
        cwd=tmp_path, env=wizard_env(), stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Pre-flight: 3 hosts" in done.stdout
    assert "Estimates for 3 machines at 50 Mbit/s" in done.stdout
    assert load_profile("digits-diloco-3hosts", config).values["num_nodes"] == 3
    assert "--hosts distributed_hosts.json" in done.stdout
    assert hosts_file.read_text() == written  # the user's file is used, not rewritten
    assert not (tmp_path / "distributed_hosts.json.bak").exists()


# --------------------------------------------------------------------------- in a terminal


def test_wizard_in_a_terminal_builds_hosts_trusts_keys_writes_files_and_trains(sshd, tmp_path):
    pexpect = pytest.importorskip("pexpect", reason="pip install pexpect")
    config = project_config(tmp_path)
    known_hosts = tmp_path / "known_hosts"  # empty: the wizard must offer to trust the workers
    known_hosts.write_text("")
    out = tmp_path / "out"
    args = [WIZARD, "--config", str(config), "--known-hosts", str(known_hosts),
            "--ssh-config", str(sshd.ssh_config), "--run-dir", str(tmp_path / "launch"),
            "--set", f"output_dir={out}", *TINY_SETS]
    child = pexpect.spawn(sys.executable, args, cwd=str(tmp_path),
                          env=wizard_env(TERM="xterm-256color"), dimensions=(50, 160),
                          timeout=120, encoding="utf-8", codec_errors="replace")
    child.logfile_read = log = io.StringIO()
    clear = "\x15"  # Ctrl-U: empty the line before typing over a default

    def answer(prompt: str, keys: str) -> None:
        child.expect(prompt)
        child.send(keys)

    try:
        answer("Where should it train", "\x1b[B\r")  # the second choice: several machines
        answer("SSH user on the workers", clear + sshd.user + "\r")
        answer("SSH private key", clear + str(sshd.key_path) + "\r")
        answer("SSH port of the workers", clear + str(sshd.port) + "\r")
        answer("Python on every host", clear + sys.executable + "\r")
        answer("checkout on every host", clear + str(ROOT) + "\r")
        answer("Address of the master", clear + "127.0.0.1\r")
        answer("Training port on the master", clear + str(free_port()) + "\r")
        child.expect(r"ok.*127\.0\.0\.1: ssh local")
        answer("Address of worker 1", "127.0.0.2\r")
        answer("Trust these host keys", "y")
        child.expect(r"ok.*127\.0\.0\.2: ssh ok")
        answer("Address of worker 2", "127.0.0.3\r")
        child.expect(r"ok.*127\.0\.0\.3: ssh ok")  # trusted without asking again
        answer("Address of worker 3", "\r")
        answer("Which profile", "\r")
        answer("how fast is it", "\r")  # measure
        child.expect(r"Measured [\d,]+ Mbit/s to 127\.0\.0\.2")
        answer("Which strategy", "\r")
        answer("Training steps", clear + "20\r")
        answer("Name of the profile to write", clear + "wizard-test\r")
        answer("Copy this checkout", "n")
        answer("Start training now", "y")
        child.expect(pexpect.EOF, timeout=300)
    finally:
        child.close()
        screen = plain(log.getvalue())
    assert child.exitstatus == 0, screen[-4000:]

    hosts = load_hosts(tmp_path / "distributed_hosts.json")
    assert [h.host for h in hosts.hosts] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert all(h.ssh_port == sshd.port for h in hosts.workers)
    profile = ProfileSet(config).get("wizard-test")
    assert (profile.strategy, profile.values["max_steps"], profile.values["num_nodes"]) == (
        "diloco", 20, 3)
    assert {line.split()[0] for line in known_hosts.read_text().splitlines()} == {
        f"[127.0.0.2]:{sshd.port}", f"[127.0.0.3]:{sshd.port}"}
    assert json.loads((out / "summary.json").read_text())["steps"] == 20
    assert (tmp_path / "launch" / "rank1.log").is_file()
    assert "all 3 ranks finished" in screen
    for rank, host in enumerate(("127.0.0.1", "127.0.0.2", "127.0.0.3")):
        assert f"│    {rank} │ {host}" in screen  # the dashboard's row for the rank


def test_estimates_time_each_strategy_with_its_own_step(monkeypatch):
    """DeMo's and SPARTA's rows are planned with their own measured step, not DiLoCo's."""
    from distributed.app import setup
    from distributed.planning.estimate import ModelFacts
    from distributed.profiles.profile import load_profile

    step_ms = {"diloco": 10.0, "ddp": 11.0, "sparta": 13.0, "fedavg": 12.0, "demo": 40.0}
    timed = []

    def fake_measure(profile, ranks_here=1, num_nodes=None, task=None, **_):
        assert task is not None and len(task) == 3  # built once by the caller
        timed.append((profile.strategy, ranks_here, num_nodes))
        return ModelFacts(num_params=1000, compute_s_per_step=step_ms[profile.strategy] / 1000,
                          batch_size=16, threads=1, shapes=((10, 100),))

    monkeypatch.setattr(setup, "measure_model", fake_measure)
    estimates = setup.estimate_strategies(load_profile("digits-diloco"),
                                          ("ddp", "diloco", "sparta", "fedavg", "demo"),
                                          nodes=3, mbit=100.0, simulated=False)
    assert sorted(s for s, _, _ in timed) == sorted(step_ms)  # each once, DiLoCo's reused
    assert all(ranks == 1 and nodes == 3 for _, ranks, nodes in timed)
    assert {row.strategy: row.compute_ms for row in estimates.rows} == pytest.approx(step_ms)
    assert estimates.facts.compute_s_per_step == pytest.approx(0.010)


# --------------------------------------------------------------------------- rough edges


def spawn_wizard(tmp_path: Path, *args: str):
    """The wizard in a pseudo-terminal, its screen recorded; returns (child, log)."""
    pexpect = pytest.importorskip("pexpect", reason="pip install pexpect")
    child = pexpect.spawn(sys.executable, [WIZARD, *args], cwd=str(tmp_path),
                          env=wizard_env(TERM="xterm-256color"), dimensions=(50, 160),
                          timeout=120, encoding="utf-8", codec_errors="replace")
    child.logfile_read = log = io.StringIO()
    return child, log


def test_ctrl_c_at_the_first_question_says_nothing_was_written(tmp_path):
    import pexpect

    config = project_config(tmp_path)
    before = config.read_text()
    child, log = spawn_wizard(tmp_path, "--config", str(config))
    try:
        child.expect("Where should it train")
        child.send("\x03")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    screen = plain(log.getvalue())
    assert child.exitstatus == 130, screen
    assert "Cancelled; nothing was written." in screen
    assert "ranks" not in screen.split("Where should it train", 1)[1]
    assert config.read_text() == before and not (tmp_path / "config.ini.bak").exists()


def test_a_single_way_to_get_the_link_speed_is_not_a_menu_and_the_name_follows_the_strategy(
        tmp_path):
    import pexpect

    config = project_config(tmp_path)
    # a profile of that name with other settings already exists: the suggestion avoids it
    config.write_text(config.read_text() + "\n[distributed:digits-sparta-4nodes]\n"
                      "base_profile = digits-sparta\nmax_steps = 7\n")
    child, log = spawn_wizard(tmp_path, "--config", str(config), "--no-run")
    clear = "\x15"
    try:
        child.expect("Where should it train")
        child.send("\r")  # this machine only: there is no worker to measure the link to
        child.expect("Which profile")
        child.send("\r")
        child.expect("How many nodes")
        child.send("\r")
        index = child.expect(["how fast is it", "Bandwidth between the machines"])
        assert index == 1, "a menu with a single item was shown"
        child.send("\r")
        child.expect("Which strategy")
        child.send("\x1b[B\r")  # from diloco down to sparta
        child.expect("Training steps")
        child.send("\r")
        child.expect(r"Name of the profile to write: \S*digits-sparta-4nodes-2")
        child.send(clear + "digits-diloco\r")  # a taken name, with other settings
        child.expect("Replace it")
        child.send("n")
        child.expect(r"Name of the new profile instead: \S*digits-sparta-4nodes-2")
        child.send("\r")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    screen = plain(log.getvalue())
    assert child.exitstatus == 0, screen[-3000:]
    assert "no worker to measure the link to" in screen
    assert "digits-diloco-2" not in screen
    profiles = ProfileSet(config)
    assert profiles.get("digits-sparta-4nodes-2").strategy == "sparta"
    assert profiles.values("digits-sparta-4nodes")["max_steps"] == 7  # left as it was
    assert profiles.get("digits-diloco").strategy == "diloco"


def test_a_loopback_master_with_a_worker_elsewhere_is_refused_and_the_master_asked_again(
        tmp_path):
    import pexpect

    child, log = spawn_wizard(tmp_path, "--config", str(project_config(tmp_path)))
    clear = "\x15"
    try:
        child.expect("Where should it train")
        child.send("\x1b[B\r")  # several machines
        for prompt in ("SSH user", "SSH private key", "SSH port", "Python on every host",
                       "checkout on every host"):
            child.expect(prompt)
            child.send("\r")
        child.expect("Address of the master")
        child.send(clear + "127.0.0.1\r")
        child.expect("Training port on the master")
        child.send(clear + str(free_port()) + "\r")
        child.expect("Address of worker 1")
        child.send("10.255.255.1\r")
        child.expect("loopback address")
        child.expect("Address of the master")  # asked again
        child.send("\x03")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    screen = plain(log.getvalue())
    assert child.exitstatus == 130, screen[-3000:]
    assert "worker 10.255.255.1 is another machine" in " ".join(screen.split())
    assert "Checking 10.255.255.1" not in screen  # refused before any connection
    assert "Cancelled; nothing was written." in screen
