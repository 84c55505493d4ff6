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


@pytest.mark.slow
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


@pytest.mark.slow
def test_without_a_terminal_and_without_yes_it_says_so_and_exits_2(tmp_path):
    done = subprocess.run([sys.executable, WIZARD], cwd=tmp_path, env=wizard_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs a terminal" in done.stderr and "--yes" in done.stderr


@pytest.mark.slow
def test_yes_without_hosts_writes_a_profile_and_runs_the_local_simulation(tmp_path):
    config = project_config(tmp_path)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, WIZARD, "--yes", "--config", str(config), "--strategy", "diloco",
         "--set", "max_steps=20", "--set", "num_nodes=2", "--set", f"output_dir={out}",
         *TINY_SETS],
        cwd=tmp_path, env=wizard_env(), stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    profile = load_profile("digits-diloco-2nodes", config)
    assert profile.strategy == "diloco" and profile.values["max_steps"] == 20
    assert profile.values["num_nodes"] == 2
    assert "[local:1] done at step 20" in done.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 20
    assert not (tmp_path / "distributed_hosts.json").exists()  # one machine: no hosts file


@pytest.mark.slow(
    reason="pre-flight of every host over SSH, then a run across them")
def test_yes_with_a_hosts_file_checks_every_host_and_uses_it(sshd, tmp_path):
    hosts_file = tmp_path / "distributed_hosts.json"
    hosts_file.write_text(json.dumps(sshd_hosts(sshd)))
    written = hosts_file.read_text()
    config = project_config(tmp_path)
    done = subprocess.run(
        [sys.executable, WIZARD, "--yes", "--no-run", "--config", str(config),
         "--known-hosts", str(sshd.known_hosts), "--ssh-config", str(sshd.ssh_config),
         "--bandwidth-mbit", "50", "--strategy", "diloco", "--set", "max_steps=20"],
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


@pytest.mark.slow(
    reason="the wizard answered in a terminal, then its run across hosts over SSH")
def test_wizard_in_a_terminal_builds_hosts_trusts_keys_writes_files_and_trains(sshd, tmp_path):
    pexpect = pytest.importorskip("pexpect", reason="pip install pexpect")
    config = project_config(tmp_path)
    known_hosts = tmp_path / "known_hosts"  # empty: the wizard must offer to trust the workers
    known_hosts.write_text("")
    out = tmp_path / "out"
    args = [WIZARD, "--config", str(config), "--known-hosts", str(known_hosts),
            "--ssh-config", str(sshd.ssh_config), "--run-dir", str(tmp_path / "launch"),
            "--strategy", "diloco", "--set", f"output_dir={out}", *TINY_SETS]
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
        answer("Training steps", clear + "20\r")
        answer("how fast is it", "\r")  # measure
        child.expect(r"Measured [\d,]+ Mbit/s to 127\.0\.0\.2")
        child.expect(r"Strategy diloco \(--strategy\): DiLoCo H=10,")  # the one H below 20
        answer("Local steps between two rounds of communication, H", "\r")
        answer("Name of the profile to write", clear + "wizard-test\r")
        # the hosts run this machine's own Python, which setup never touches: it says so
        answer("Set up the hosts now", "y")
        child.expect(r"setting up the hosts failed")
        child.expect(r"is no virtual environment that setup made or can use")
        answer("Copy this project.s files", "n")
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
    assert (profile.strategy, profile.values["max_steps"], profile.values["num_nodes"],
            profile.values["H"]) == ("diloco", 20, 3, 10)
    assert {line.split()[0] for line in known_hosts.read_text().splitlines()} == {
        f"[127.0.0.2]:{sshd.port}", f"[127.0.0.3]:{sshd.port}"}
    assert json.loads((out / "summary.json").read_text())["steps"] == 20
    assert (tmp_path / "launch" / "rank1.log").is_file()
    assert "all 3 ranks finished" in screen
    # The profiles file lies outside the project, on a disk the hosts share with this
    # machine: they read it where it is, and no copy is written into their project.
    from distributed.launch.program import profiles_to_send

    there = profiles_to_send(str(config))[1]
    assert there is not None and not (ROOT / there).exists()
    for rank, host in enumerate(("127.0.0.1", "127.0.0.2", "127.0.0.3")):
        assert f"│    {rank} │ {host}" in screen  # the dashboard's row for the rank


# --------------------------------------------------------------------------- one planner


#: Seconds of one step of 32 samples here, per strategy: what the fake timing returns.
STEP_S = {"diloco": 0.010, "ddp": 0.011, "fedavg": 0.011, "sparta": 0.013, "demo": 0.040}


def fixed_steps(monkeypatch) -> list[tuple[str, int]]:
    """Every step the planner times here takes a fixed time (by strategy and batch), so two
    runs of it give the same figures; returns the (strategy, batch) of each timing."""
    from distributed.app import measurements
    from distributed.planning.estimate import ModelFacts

    timed: list[tuple[str, int]] = []

    def measure_model(profile, ranks_here=1, steps=10, warmup=3, num_nodes=None, task=None):
        batch = int(profile.values.get("batch_size") or 32)
        timed.append((profile.strategy, batch))
        return ModelFacts(num_params=9_610, batch_size=batch, threads=1,
                          compute_s_per_step=STEP_S[profile.strategy] * batch / 32,
                          shapes=((128, 64), (128,), (10, 128), (10,)))

    monkeypatch.setattr(measurements, "measure_model", measure_model)
    return timed


def wizard_in_process(tmp_path: Path, *args: str):
    """The wizard run here with --yes (what a person accepting every default gets)."""
    from typer.testing import CliRunner

    import wizard

    return CliRunner().invoke(wizard.app, ["--yes", "--no-run", "--hosts",
                                           str(tmp_path / "no_hosts.json"), *args],
                              env={"COLUMNS": "220"})


def table_speedups(screen: str) -> dict[str, str]:
    """The speedup column of the wizard's table, by strategy label."""
    rows = {}
    for line in screen.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 7 and cells[0] and cells[5].endswith("x"):
            rows[cells[0]] = cells[5]
    return rows


@pytest.mark.slow
def test_the_wizards_table_its_recommendation_and_recommend_give_the_same_figures(
        tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cli_typer import app as cli

    timed = fixed_steps(monkeypatch)
    config = project_config(tmp_path)
    done = wizard_in_process(tmp_path, "--config", str(config), "--set", "num_nodes=4",
                             "--bandwidth-mbit", "100")
    assert done.exit_code == 0, done.output
    shown = table_speedups(done.output)
    line = next(x for x in done.output.splitlines() if x.startswith("Recommended: "))

    answer = CliRunner().invoke(cli, ["recommend", "digits-diloco", "--config", str(config),
                                      "--link-mbit", "100", "--set", "num_nodes=4", "--json"])
    assert answer.exit_code == 0, answer.output
    rec = json.loads(answer.stdout)
    assert shown == {c["label"]: f"{c['speedup']:.2f}x" for c in rec["candidates"]}
    assert line == f"Recommended: {rec['reason']}"
    pick = next(c for c in rec["candidates"] if c["label"] == rec["label"])
    assert f"{pick['speedup']:.2f}x predicted" in line and shown[rec["label"]] in line
    ddp = next(c for c in rec["candidates"] if c["name"] == "ddp")
    assert f"({ddp['speedup']:.2f}x)" in line  # DDP's figure in the line is the table's
    # Each compute kind timed with its own step, and the reference with every node's batch.
    assert {"ddp", "sparta", "demo"} <= {strategy for strategy, _ in timed}
    assert ("ddp", 4 * 32) in timed


def test_accepting_the_recommendation_writes_its_settings(tmp_path, monkeypatch):
    fixed_steps(monkeypatch)
    config = project_config(tmp_path)
    done = wizard_in_process(tmp_path, "--config", str(config), "--set", "num_nodes=4",
                             "--bandwidth-mbit", "100")
    assert done.exit_code == 0, done.output
    line = next(x for x in done.output.splitlines() if x.startswith("Recommended: "))
    assert line.startswith("Recommended: DiLoCo H=100:"), line  # the fixed steps' pick
    profile = load_profile("digits-diloco-4nodes", config)
    # digits-diloco itself has H = 20: the profile carries the H recommended, not its base's.
    assert (profile.strategy, profile.values["H"]) == ("diloco", 100)
    assert "DiLoCo H=100" in profile.values["description"]
    assert "? Which strategy? DiLoCo H=100: " in done.output  # offered, and taken
    assert "(recommended) (default)" in done.output


def test_a_setting_given_with_set_is_offered_instead_and_predicted_again(tmp_path,
                                                                        monkeypatch):
    fixed_steps(monkeypatch)
    config = project_config(tmp_path)
    done = wizard_in_process(tmp_path, "--config", str(config), "--set", "num_nodes=4",
                             "--set", "H=40", "--bandwidth-mbit", "100")
    assert done.exit_code == 0, done.output
    assert "H (a larger H sends less" in done.output and ": 40 (default)" in done.output
    assert "DiLoCo H=40: communication is" in done.output  # predicted by the same model
    assert load_profile("digits-diloco-4nodes", config).values["H"] == 40


def test_the_wizard_writes_profiles_beside_config_ini_and_leaves_config_ini_alone(
        tmp_path, monkeypatch):
    fixed_steps(monkeypatch)
    config = project_config(tmp_path)
    shared = config.read_text()
    local = tmp_path / "config.local.ini"
    args = ["--config", str(config), "--set", "num_nodes=4", "--bandwidth-mbit", "100"]
    done = wizard_in_process(tmp_path, *args)
    assert done.exit_code == 0, done.output
    assert f"Wrote profile digits-diloco-4nodes to {local}" in " ".join(done.output.split())
    assert config.read_text() == shared and not (tmp_path / "config.ini.bak").exists()
    assert ProfileSet(config).source("digits-diloco-4nodes") == local
    assert "digits-diloco-4nodes" not in ProfileSet(config, local=False).names()
    first = local.read_text()

    # Again with other settings: a free name beside the first, the previous file kept.
    done = wizard_in_process(tmp_path, *args, "--set", "H=50")
    assert done.exit_code == 0, done.output
    assert load_profile("digits-diloco-4nodes-2", config).values["H"] == 50
    assert load_profile("digits-diloco-4nodes", config).values["H"] == 100
    assert (tmp_path / "config.local.ini.bak").read_text() == first
    assert config.read_text() == shared


def test_a_profile_written_under_a_shared_name_takes_its_place_from_the_local_file(tmp_path):
    from distributed.app import wizard_steps

    config = project_config(tmp_path)
    shared = config.read_text()
    values = {**load_profile("digits-diloco", config).values, "H": 64}
    path, backup = wizard_steps.write_profile(config, "digits-diloco", values)
    assert (path, backup) == (tmp_path / "config.local.ini", None)
    assert wizard_steps.profile_file(config, "digits-diloco") == path
    assert load_profile("digits-diloco", config).values["H"] == 64
    assert ProfileSet(config, local=False).values("digits-diloco")["H"] == 20
    assert config.read_text() == shared
    assert path.read_text().startswith("# This checkout's own profiles, read after config.ini")


def test_the_wizard_shows_no_progress_lines_of_its_own_making(tmp_path, monkeypatch):
    fixed_steps(monkeypatch)
    done = wizard_in_process(tmp_path, "--config", str(project_config(tmp_path)),
                             "--set", "num_nodes=2", "--bandwidth-mbit", "10")
    assert done.exit_code == 0, done.output
    assert "[recommend]" not in done.output and "pass 1 of" not in done.output
    assert "Timing a step of digits-diloco's model" in done.output


# --------------------------------------------------------------------------- rough edges


def spawn_wizard(tmp_path: Path, *args: str):
    """The wizard in a pseudo-terminal, its screen recorded; returns (child, log)."""
    pexpect = pytest.importorskip("pexpect", reason="pip install pexpect")
    child = pexpect.spawn(sys.executable, [WIZARD, *args], cwd=str(tmp_path),
                          env=wizard_env(TERM="xterm-256color"), dimensions=(50, 160),
                          timeout=120, encoding="utf-8", codec_errors="replace")
    child.logfile_read = log = io.StringIO()
    return child, log


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_single_way_to_get_the_link_speed_is_not_a_menu_and_the_name_follows_the_strategy(
        tmp_path):
    import pexpect

    config = project_config(tmp_path)
    # a profile of that name with other settings already exists: the suggestion avoids it
    config.write_text(config.read_text() + "\n[distributed:digits-sparta-4nodes]\n"
                      "base_profile = digits-sparta\nmax_steps = 7\n")
    child, log = spawn_wizard(tmp_path, "--config", str(config), "--no-run",
                              "--strategy", "sparta")
    clear = "\x15"
    try:
        child.expect("Where should it train")
        child.send("\r")  # this machine only: there is no worker to measure the link to
        child.expect("Which profile")
        child.send("\r")
        child.expect("How many nodes")
        child.send("\r")
        child.expect("Training steps")
        child.send("\r")
        index = child.expect(["how fast is it", "Bandwidth between the machines"])
        assert index == 1, "a menu with a single item was shown"
        child.send("\r")
        child.expect("Share of the weights averaged every step")
        child.send("\r")
        child.expect(r"Name of the profile to write: \S*digits-sparta-4nodes-2")
        child.send(clear + "digits-diloco\r")  # a taken name, with other settings
        child.expect(r"in its place \(config\.ini stays as it is\)")
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


@pytest.mark.slow
def test_in_a_terminal_the_highlighted_pick_is_taken_with_its_setting_changed(tmp_path):
    """Timing shows as a progress display; Enter takes the recommended strategy, and its
    setting (DiLoCo's H, SPARTA's p) is asked with the recommended value, here changed."""
    import re

    import pexpect

    config = project_config(tmp_path)
    child, log = spawn_wizard(tmp_path, "--config", str(config), "--no-run",
                              "--bandwidth-mbit", "100")
    clear = "\x15"
    try:
        for prompt in ("Where should it train", "Which profile", "How many nodes",
                       "Training steps"):
            child.expect(prompt)
            child.send("\r")
        child.expect(r"Recommended: ([^:]+):")
        pick = child.match.group(1)
        child.expect(r"Which strategy")
        child.expect(re.escape(pick) + r": [\d.]+x, .* per step \(recommended\)")
        child.send("\r")
        styled = r"(?:\x1b\[[0-9;]*m)*"  # the default answer's colour
        index = child.expect([r"same loss\): " + styled + r"(\d+)",
                              r"averaged every step, p: " + styled + r"([\d.]+)",
                              "Name of the profile to write"])
        typed = {0: ("H", "30"), 1: ("p_sparta", "0.01")}.get(index)
        if typed is not None:
            assert pick.endswith(f"={child.match.group(1)}"), (pick, child.match.group(1))
            child.send(clear + typed[1] + "\r")
            child.expect("Name of the profile to write")
        child.send("\r")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    screen = plain(log.getvalue())
    assert child.exitstatus == 0, screen[-3000:]
    assert "Timing: " in screen and "[recommend]" not in screen  # rich's display, no lines
    profiles = ProfileSet(config)
    name = next(n for n in profiles.names() if profiles.source(n) != config)
    profile = profiles.get(name)
    assert profile.strategy == pick.split()[0].lower()
    if typed is not None:
        key, value = typed
        assert profile.values[key] == (int(value) if key == "H" else float(value))
        label = f"{pick.split()[0]} {'H' if key == 'H' else 'p'}={value}"
        assert f"{label}: communication is" in screen  # the change predicted again


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_profile_whose_extra_is_missing_is_refused_before_any_question(tmp_path):
    """Simulated here, the whisper task needs the whisper extra: said at once, with the
    command that installs it, not after every question."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text("import sys\nsys.modules['peft'] = None\n")
    env = wizard_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocked), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, WIZARD, "--yes", "--profile", "whisper-tiny-diloco",
                           "--hosts", str(tmp_path / "no_hosts.json")],
                          cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    said = done.stdout + done.stderr
    assert "profile whisper-tiny-diloco cannot run here: needs the whisper extra" in said, said
    assert "pip install -e '.[whisper]'" in said
    assert "How many nodes" not in said and "Training steps" not in said


# --------------------------------------------------------------------------- hosts asked for


class ScriptedAsker:
    """Answers the wizard's questions from a list, in order, as a person types them: an
    answer its question's check refuses is recorded and the question asked again."""

    def __init__(self, answers: list) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []
        self.refused: list[tuple[str, str]] = []
        self.assume_yes = False
        self.answered = 0

    def _next(self, message: str):
        self.asked.append(message)
        answer = self.answers.pop(0)
        self.answered += 1
        return answer

    def text(self, message, default="", validate=None):
        while True:
            answer = self._next(message)
            said = validate(answer) if validate is not None else True
            if said is True:
                return answer
            self.refused.append((message, said))

    def confirm(self, message, default=True):
        answer = self._next(message)
        return default if answer is None else answer

    def select(self, message, choices, default):
        return self._next(message)


def asked_wizard(tmp_path: Path, answers: list, monkeypatch):
    """A wizard answered by ``answers``, whose pre-flight finds the master ready and every
    other host without the project (as a new machine is)."""
    from rich.console import Console

    from distributed.faces import guided_setup

    monkeypatch.setattr(guided_setup.Wizard, "check", lambda self, config: config)
    monkeypatch.setattr(guided_setup.Wizard, "show_host_check",
                        lambda self, config, host: host == config.master.host)
    asker = ScriptedAsker(answers)
    wizard = guided_setup.Wizard(
        Console(file=io.StringIO(), width=200), asker, hosts_path=tmp_path / "hosts.json",
        config_path=project_config(tmp_path), profile=None, strategy=None, overrides={},
        bandwidth_mbit=None, start=False, run_dir=None, ssh={})
    return wizard, asker


def test_hosts_without_python_or_project_take_this_machines_and_setup_hosts_for_the_others(
        tmp_path, monkeypatch):
    from distributed.hosts.sync import PROJECT_ROOT

    wizard, asker = asked_wizard(tmp_path, [
        "hosts", "alice", "", "22", "", "", "10.0.0.1", str(free_port()),
        "10.0.0.2", None,  # pre-flight finds nothing there yet: kept (the default) for setup
        ""], monkeypatch)
    config = wizard.build_hosts()
    assert config is not None and not asker.refused and not asker.answers
    assert (config.master.python_env, config.master.project_path) == (sys.executable,
                                                                        str(PROJECT_ROOT))
    worker = config.workers[0]
    assert (worker.python_env, worker.project_path) == ("~/exogym/.venv/bin/python", "~/exogym")
    assert config.workers[0].ssh_user == "alice"


def test_a_hosts_file_problem_is_said_at_its_question_and_that_question_asked_again(
        tmp_path, monkeypatch):
    wizard, asker = asked_wizard(tmp_path, [
        "hosts", "alice", "", "22", "", "/",  # the filesystem's root cannot take the project
        "~/gym", "10.0.0.1", str(free_port()), ""], monkeypatch)
    assert wizard.build_hosts() is None  # no workers: a simulation here
    [(question, why)] = asker.refused
    assert "checkout on every host" in question and "filesystem's root" in why
    assert asker.asked.count(question) == 2 and not asker.answers


def test_ctrl_c_after_answers_says_they_are_not_kept(tmp_path, monkeypatch):
    wizard, asker = asked_wizard(tmp_path, ["hosts", "alice", "", "22"], monkeypatch)
    with pytest.raises(IndexError):  # the person stops answering: the Ctrl-C's place
        wizard.build_hosts()
    said = wizard.cancelled_message()
    assert said.startswith("Cancelled; nothing was written.")
    assert "The 4 answers given are not kept" in said
