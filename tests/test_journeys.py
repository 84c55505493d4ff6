"""Journeys a person takes, typed in a real terminal (a pty) as the person types them.

- the wizard, from nothing to a trained model on two hosts that are apart (each its own
  network and mount namespace: its own home and /tmp, only the system's python3, no
  checkout): LAN discovery finding nothing, a wrong answer corrected, the optional paths
  left empty, setup, pre-flight, training and its summary; then ``setup-hosts`` again
  (nothing to do, then one changed file) and a ``--min-nodes`` run on those hosts;
- the wizard stopped with Ctrl-C after some answers: it says what was not kept;
- the quick start's command, then what its last lines point to: ``runs``, ``replay`` and
  loading the final model;
- a local run whose rank is killed with ``kill -9`` after a checkpoint: the message says
  how to resume, and that command continues the run to its end.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faces_support import plain
from ranks import ROOT, free_port

pexpect = pytest.importorskip("pexpect", reason="the journeys are typed in a terminal: "
                                                "pip install pexpect")

WIZARD = str(ROOT / "wizard.py")
CLI = str(ROOT / "cli_typer.py")
CLEAR = "\x15"  # Ctrl-U: empty the line before typing over a default


def terminal_env(**extra: str) -> dict[str, str]:
    """A person's environment in a terminal: no launcher variables, a colour terminal."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PROMPT_TOOLKIT_NO_CPR="1",
               TERM="xterm-256color", **extra)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CI"):
        env.pop(key, None)
    return env


class Terminal:
    """A command in a pty of 50 rows and 160 columns, with everything it printed kept."""

    def __init__(self, args: list[str], cwd: Path, timeout: float = 120,
                 program: str = sys.executable, **env: str) -> None:
        self.child = pexpect.spawn(program, args, cwd=str(cwd), env=terminal_env(**env),
                                   dimensions=(50, 160), timeout=timeout, encoding="utf-8",
                                   codec_errors="replace")
        self.log = io.StringIO()
        self.kept = open(cwd / "screen.log", "a", encoding="utf-8")  # noqa: SIM115
        self.child.logfile_read = self

    def write(self, text: str) -> None:
        """What the command printed: kept, and written to ``screen.log`` as it comes."""
        self.log.write(text)
        self.kept.write(text)
        self.kept.flush()

    def flush(self) -> None:
        self.kept.flush()

    def answer(self, prompt: str, keys: str) -> None:
        self.expect(prompt)
        self.child.send(keys)

    def expect(self, pattern: str, timeout: float = -1) -> None:
        """Wait for ``pattern``; on a timeout or an end first, fail showing the screen."""
        try:
            self.child.expect(pattern, timeout=timeout)
        except (pexpect.TIMEOUT, pexpect.EOF) as exc:
            raise AssertionError(f"waited for {pattern!r} in vain ({type(exc).__name__}); "
                                 f"the screen ends:\n{self.screen()[-4000:]}") from None

    def end(self, timeout: float = 300) -> tuple[int | None, str]:
        """Wait for the command to end; its exit status and its screen as plain text."""
        try:
            self.child.expect(pexpect.EOF, timeout=timeout)
        finally:
            self.child.close()
            self.kept.close()
        return self.child.exitstatus, self.screen()

    def screen(self) -> str:
        return plain(self.log.getvalue())


def project_config(folder: Path) -> Path:
    config = folder / "config.ini"
    config.write_text((ROOT / "config.ini").read_text())
    return config


# --------------------------------------------------------------------------- the wizard


@pytest.mark.slow(
    reason="two hosts apart get the project and a Python environment of their own from the "
           "wizard's setup (torch installed from wheels on each), train, are set up again "
           "and train with --min-nodes")
def test_the_wizard_from_nothing_to_a_trained_model_on_two_hosts_that_are_apart(tmp_path):
    from netbed import Testbed, check_requirements
    from netbed.apart import check_apart
    from netns import netns_available

    missing = netns_available() or "; ".join(check_requirements(pin=False)) or check_apart()
    if missing:
        pytest.skip(missing)
    config = project_config(tmp_path)
    known_hosts = tmp_path / "known_hosts"  # empty: the wizard offers to trust the hosts
    known_hosts.write_text("")
    out = tmp_path / "out"
    with Testbed(2, subnet="10.213.47", pin=False, apart=True) as bed:
        h0, h1 = bed.hosts
        ssh = ["--known-hosts", str(known_hosts), "--ssh-config", str(bed.ssh_config)]
        term = Terminal([WIZARD, "--config", str(config), *ssh, "--run-dir",
                         str(tmp_path / "launch"), "--strategy", "diloco",
                         "--set", f"output_dir={out}", "--set", "num_threads=1",
                         "--set", "val_interval=10", "--set", "val_size=64",
                         "--set", "checkpoint_interval=None"], tmp_path)
        try:
            term.expect(r"No other machines found")  # nothing runs an agent on new hosts
            term.answer("Where should it train", "\x1b[B\r")  # the second: several machines
            term.answer("SSH user on the workers", CLEAR + "root\r")
            term.answer("SSH private key", CLEAR + str(bed.key_path) + "\r")
            term.answer("SSH port of the workers", CLEAR + "70000\r")  # a slip, corrected
            term.expect(r"65535")
            term.child.send(CLEAR + "22\r")
            term.answer("Python on every host", CLEAR + "\r")  # left empty, as the README says
            term.answer("checkout on every host", CLEAR + "\r")
            term.answer("Address of the master", CLEAR + bed.uplink_address + "\r")
            term.answer("Training port on the master", CLEAR + str(free_port()) + "\r")
            term.expect(rf"ok.*{re.escape(bed.uplink_address)}: ssh local")
            for number, host in ((1, h0), (2, h1)):
                term.answer(f"Address of worker {number}", host.address + "\r")
                term.expect(rf"{re.escape(host.address)} gets this project and its Python "
                            "from setup-hosts")
                if number == 1:
                    term.answer("Trust these host keys", "y")
                term.expect(rf"{re.escape(host.address)}: project_path ~/exogym does not exist")
                term.answer(rf"Keep {re.escape(host.address)} anyway", "\r")  # kept: the default
            term.answer("Address of worker 3", "\r")
            term.answer("Which profile", "\r")
            term.answer("Training steps", CLEAR + "20\r")
            term.answer("how fast is it", "\r")  # measured
            term.expect(rf"Measured [\d,]+ Mbit/s to {re.escape(h0.address)}")
            term.answer("Local steps between two rounds of communication, H", "\r")
            term.answer("Name of the profile to write", CLEAR + "journey\r")
            term.answer("Set up the hosts now", "\r")  # offered, and the default, since
            term.expect(r"setup took [\d.]+ s", timeout=900)  # pre-flight found nothing yet
            term.answer("Start training now", "\r")
            status, screen = term.end(timeout=300)
        finally:
            term.child.close(force=True)
        assert status == 0, term.screen()[-5000:]
        assert "all 3 ranks finished" in screen, screen[-3000:]
        assert json.loads((out / "summary.json").read_text())["steps"] == 20
        assert (out / "model.safetensors").is_file()

        # What setup left on each host: the project and an environment in its own home, made
        # from the system's python3 with the lock's torch; the hosts file names both.
        hosts_file = tmp_path / "distributed_hosts.json"
        written = json.loads(hosts_file.read_text())
        assert [w.get("python_env") for w in written["workers"]] == [
            "~/exogym/.venv/bin/python"] * 2, written
        assert [w.get("project_path") for w in written["workers"]] == ["~/exogym"] * 2
        for host in (h0, h1):
            home = bed.home(host)
            assert (home / "exogym" / ".venv" / "exogym-setup.json").is_file()
            assert (home / "exogym" / "distributed" / "worker" / "__main__.py").is_file()
            version = subprocess.run(bed.in_host(
                host, "/root/exogym/.venv/bin/python", "-c",
                "import sys, torch; print(sys.base_prefix, torch.__version__)"),
                capture_output=True, text=True, timeout=120)
            assert version.stdout.split() == ["/usr", "2.13.0+cpu"], version.stderr
        assert screen.count("installed from wheels sent") == 2, screen[-4000:]
        sent = [int(n) for n in re.findall(r"installing (\d+) wheels sent from here", screen)]
        assert len(sent) == 2 and min(sent) > 10, screen[-4000:]
        copied = re.findall(r"synced 10\.213\.47\.\d: (\d+) files copied \(\d+ bytes\), "
                            r"(\d+) unchanged", screen)
        assert len(copied) == 2 and all(int(c) > 100 and u == "0" for c, u in copied), copied
        assert "rank" in screen and "10.213.47.2" in screen

        # setup-hosts again, as the run's last lines and the docs say: nothing to do; one
        # changed file travels alone.
        env = {**os.environ, "CI": "true"}

        def setup() -> dict:
            done = subprocess.run([sys.executable, CLI, "setup-hosts", str(hosts_file),
                                   "--json", *ssh], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
            assert "ready to train" in done.stdout
            return json.loads(done.stdout.strip().splitlines()[-1])

        # A hosts file that leaves the paths out, as a person writes one: setup finds what
        # it made, writes the paths in and keeps the file it replaced.
        for worker in written["workers"]:
            del worker["python_env"], worker["project_path"]
        hosts_file.write_text(json.dumps(written))
        again = setup()
        assert [w["python_env"] for w in json.loads(hosts_file.read_text())["workers"]] == [
            "~/exogym/.venv/bin/python"] * 2
        assert json.loads((tmp_path / "distributed_hosts.json.bak").read_text()) == written
        assert {h["environment"] for h in again["hosts"]} == {"unchanged"}
        assert [h["files_copied"] for h in again["hosts"]] == [0, 0]
        os.utime(ROOT / "distributed" / "hosts" / "provision.py")
        third = setup()
        assert [h["files_copied"] for h in third["hosts"]] == [1, 1]

        # The profile the wizard wrote, on the same hosts, with --min-nodes.
        second = tmp_path / "second"
        command = [sys.executable, CLI, "distributed-train", "journey", "--config", str(config),
                   "--hosts", str(hosts_file), "--min-nodes", "2", *ssh,
                   "--run-dir", str(tmp_path / "launch-2")]
        for pair in ("max_steps=40", "H=10", f"output_dir={second}"):
            command += ["--set", pair]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
        assert json.loads((second / "summary.json").read_text())["steps"] == 40
        assert (second / "model.safetensors").is_file()


@pytest.mark.slow(
    reason="two hosts apart with one home get one environment (torch from wheels) and one "
           "copy of the project, then train")
def test_two_hosts_apart_sharing_one_home_are_set_up_once_and_train(tmp_path):
    """The trial's dead end: hosts whose home is one (NFS) folder, the paths left out of the
    hosts file. setup-hosts as a person types it: one copy, one environment, the sharing
    named; then a run on both hosts."""
    from netbed import Testbed, check_requirements
    from netbed.apart import check_apart
    from netns import netns_available

    missing = netns_available() or "; ".join(check_requirements(pin=False)) or check_apart()
    if missing:
        pytest.skip(missing)
    with Testbed(2, subnet="10.213.49", pin=False, apart=True, shared_home=True) as bed:
        h0, h1 = bed.hosts
        assert bed.home(h0) == bed.home(h1)
        hosts = tmp_path / "hosts.json"
        hosts.write_text(json.dumps(bed.hosts_config(free_port(), launcher_is_master=True)))
        ssh = ["--known-hosts", str(bed.known_hosts), "--ssh-config", str(bed.ssh_config)]
        status, screen = shell(shlex.join([sys.executable, CLI, "setup-hosts", str(hosts),
                                           *ssh]), tmp_path, timeout=600)
        assert status == 0, screen[-4000:]
        assert (f"hosts {h0.address} and {h1.address} share ~/exogym: set up once from "
                f"{h0.address}") in screen, screen[-4000:]
        assert (f"hosts {h0.address} and {h1.address} share the environment ~/exogym/.venv: "
                f"made once, on {h0.address}") in screen, screen[-4000:]
        assert screen.count("installing ") == 1, screen[-4000:]  # one environment built
        home = bed.home(h0)
        assert (home / "exogym" / ".venv" / "exogym-setup.json").is_file()
        assert not list(home.glob("exogym/**/*.exogym-sync.tmp"))

        out = tmp_path / "run"
        status, screen = shell(shlex.join([
            sys.executable, CLI, "distributed-train", "digits-diloco", "--hosts", str(hosts),
            *ssh, "--run-dir", str(tmp_path / "launch"), "--set", "max_steps=20",
            "--set", "H=10", "--set", "num_threads=1",
            "--set", "val_size=64", "--set", "checkpoint_interval=None",
            "--set", f"output_dir={out}"]), tmp_path, timeout=300)
        assert status == 0, screen[-4000:]
        assert "all 3 ranks finished" in screen, screen[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 20


def test_ctrl_c_in_the_middle_of_the_wizard_says_the_answers_are_not_kept(tmp_path):
    config = project_config(tmp_path)
    term = Terminal([WIZARD, "--config", str(config), "--no-run"], tmp_path, timeout=60)
    try:
        term.answer("Where should it train", "\x1b[B\r")
        term.answer("SSH user on the workers", CLEAR + "alice\r")
        term.answer("SSH private key", "\x03")
        status, screen = term.end(timeout=30)
    finally:
        term.child.close(force=True)
    assert status not in (0, None), screen
    assert "Cancelled; nothing was written." in screen, screen[-2000:]
    assert "The 2 answers given are not kept" in screen, screen[-2000:]
    # nothing beside what was there (screen.log is this test's record of the screen)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.ini", "screen.log"]


# --------------------------------------------------------------------------- local runs


def exogym_command() -> str:
    """The ``exogym`` command the quick start installs, or skip saying how to get it."""
    beside = Path(sys.executable).parent / "exogym"  # this interpreter's own, off PATH
    found = shutil.which("exogym") or (str(beside) if beside.is_file() else None)
    if found is None:
        pytest.skip("no exogym command on PATH: install the project as the README's quick "
                    "start does (pip install -e '.[distributed,examples]' -c constraints.txt)")
    return found


def shell(line: str, cwd: Path, timeout: float = 120) -> tuple[int | None, str]:
    """``line`` typed at a shell prompt in ``cwd``: its exit status and its screen."""
    term = Terminal(["-c", line], cwd, timeout=timeout, program="bash")
    try:
        return term.end(timeout=timeout)
    finally:
        term.child.close(force=True)


def next_steps(screen: str) -> tuple[list[str], list[str]]:
    """The commands after "next steps:" on a run's last lines, and the Python lines that
    load its model."""
    lines = screen[screen.rindex("next steps:"):].splitlines()[1:]
    commands = [line.split("#")[0].strip() for line in lines
                if line.startswith("  ") and not line.startswith("    ")
                and line.strip().startswith("exogym ")]
    python = [line[4:] for line in lines if line.startswith("    ")]
    return commands, python


@pytest.mark.slow(reason="the quick start's run, then runs, replay and the model loaded")
def test_the_quick_start_then_each_next_step_its_last_lines_point_to(tmp_path):
    exogym = exogym_command()
    status, screen = shell(f"{exogym} distributed-train --set max_steps=60", tmp_path)
    assert status == 0, screen[-3000:]
    assert "final model in runs/digits-diloco/model.safetensors" in screen, screen[-3000:]
    commands, python = next_steps(screen)
    assert [c.split()[1] for c in commands] == ["runs", "replay"], screen[-2000:]

    status, listed = shell(commands[0], tmp_path)  # exogym runs
    assert status == 0, listed
    row = next(line for line in listed.splitlines() if "runs/digits-diloco" in line)
    assert "finished" in row and "60" in row, listed

    status, replayed = shell(commands[1], tmp_path)  # exogym replay runs/digits-diloco
    assert status == 0, replayed[-3000:]
    assert "val loss at step 60" in replayed
    assert (tmp_path / "runs" / "digits-diloco" / "replay" / "replay.json").is_file()

    script = tmp_path / "load_model.py"  # the lines as printed, then the model used
    script.write_text("\n".join([
        *python, "from exogym.data.digits import digits_datasets",
        "x, y = digits_datasets()[1].tensors",
        "accuracy = (model.logits(x).argmax(-1) == y).float().mean().item()",
        "print(f'accuracy {accuracy:.3f}')"]) + "\n")
    status, loaded = shell(f"{sys.executable} {script}", tmp_path)
    assert status == 0, loaded[-3000:]
    accuracy = float(re.search(r"accuracy ([\d.]+)", loaded).group(1))
    assert accuracy > 0.5, loaded  # the trained model, not a fresh one (about 0.1)


@pytest.mark.slow(reason="a local run killed with kill -9 after a checkpoint, then resumed")
def test_a_rank_killed_with_kill_9_after_a_checkpoint_says_how_to_resume_and_resume_does(
        tmp_path):
    psutil = pytest.importorskip("psutil")
    exogym = exogym_command()
    term = Terminal(["distributed-train", "--set", "max_steps=1000", "--set",
                     "checkpoint_interval=100", "--set", "num_threads=1"], tmp_path,
                    timeout=120, program=exogym)
    checkpoints = tmp_path / "runs" / "digits-diloco" / "checkpoints"
    try:
        deadline = time.monotonic() + 120
        while not list(checkpoints.glob("*/rank0/step*.ckpt")):
            assert time.monotonic() < deadline, "no checkpoint in 120 s: " + term.screen()[-2000:]
            assert term.child.isalive(), "the run ended before its first checkpoint"
            time.sleep(0.02)
        ranks = psutil.Process(term.child.pid).children()
        assert ranks, "the run has no rank processes"
        os.kill(ranks[0].pid, signal.SIGKILL)
        status, screen = term.end(timeout=120)
    finally:
        term.child.close(force=True)
    assert status not in (0, None), screen[-3000:]
    assert "died with exit code -9" in screen, screen[-3000:]
    told = re.search(r"newest checkpoint, at step (\d+), .*; to continue it:\s*\n\s*(.+)", screen)
    assert told is not None, screen[-3000:]
    step, resume = int(told.group(1)), told.group(2).strip()
    assert step >= 100 and step % 100 == 0 and resume.endswith("--resume"), resume

    status, resumed = shell(resume, tmp_path, timeout=180)
    assert status == 0, resumed[-3000:]
    assert f"from step {step}" in resumed, resumed[-3000:]
    summary = json.loads((tmp_path / "runs" / "digits-diloco" / "summary.json").read_text())
    assert summary["steps"] == 1000, summary
