"""The SSH launcher against a real sshd: launch, pre-flight, stop, secrets, restarts, sync.

The ranks are small Python scripts written into a temporary project. Rank 0
runs on this machine as 127.0.0.1 (no SSH); the other ranks log in over SSH
to 127.0.0.2, 127.0.0.3, ... where the test sshd listens (see sshd_fixture).
Processes are identified by the PIDs the ranks write, and looked up in /proc.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import warm
from ports import free_port
from rich.console import Console
from sshd_fixture import SSHD, serve_sshd

from distributed.hosts.hostsfile import HostsConfig, HostSpec, load_hosts
from distributed.hosts.onhost.probe import hash_files
from distributed.hosts.remote import rank_command, shell_path
from distributed.hosts.session import HostSession
from distributed.hosts.ssh import SSHOptions
from distributed.launch.launcher import (
    Launcher,
    LaunchError,
    LaunchOptions,
    LaunchResult,
    OutputLine,
    PreflightError,
    RankProgram,
    is_this_machine,
    launch,
    split_options,
)
from distributed.launch.progress import ProgressWatch
from distributed.launch.script import run_script_on_hosts
from exogym.report.metrics import METRIC_PREFIX

ROOT = Path(__file__).resolve().parents[1]

RANK_SCRIPTS = {
    # prints its variables and arguments, one metric event and one stderr line
    "show_env.py": """
        import json, os, sys
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "EXOGYM_RESTART", "EXOGYM_RUN_DIR", "EXTRA", "SSH_CONNECTION",
                "GLOO_SOCKET_IFNAME", "EXOGYM_DEVICE"]
        print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}))
        print("ARGV " + json.dumps(sys.argv[1:]))
        rank = int(os.environ["RANK"])
        print(PREFIX + json.dumps({"event": "step", "rank": rank, "step": 1, "train_loss": 0.5}))
        print("a line on stderr", file=sys.stderr)
    """,
    # writes its PIDs (and a child's) where the test finds them, then sleeps until stopped
    "sleeper.py": """
        import json, os, subprocess, sys, time
        from pathlib import Path
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        run_dir = Path(os.environ["EXOGYM_RUN_DIR"])
        pids = {"pid": os.getpid(), "supervisor": os.getppid(), "pgid": os.getpgid(0),
                "child": child.pid}
        tmp = run_dir / f"pids{os.environ['RANK']}.tmp"
        tmp.write_text(json.dumps(pids))
        tmp.rename(run_dir / f"pids{os.environ['RANK']}.json")
        print("sleeping", flush=True)
        time.sleep(120)
    """,
    # rank 1 fails with exit code 3 after a few lines; the others sleep
    "fail_rank1.py": """
        import os, sys, time
        if os.environ["RANK"] == "1":
            time.sleep(0.3)
            for i in range(3):
                print(f"boom {i}", flush=True)
            sys.exit(3)
        time.sleep(120)
    """,
    # proves it has the secrets without showing them (then shows one, to test redaction)
    "secret.py": """
        import hashlib, os, time
        from pathlib import Path
        run_dir = Path(os.environ["EXOGYM_RUN_DIR"])
        for name in ("WANDB_API_KEY", "MY_TOKEN"):
            value = os.environ.get(name, "")
            print(name, hashlib.sha256(value.encode()).hexdigest(), flush=True)
        print("careless:", os.environ.get("MY_TOKEN"), flush=True)
        (run_dir / f"ready{os.environ['RANK']}").write_text("")
        deadline = time.time() + 30
        while not (run_dir / "release").exists() and time.time() < deadline:
            time.sleep(0.05)
    """,
    # counts to 10, checkpointing each step; rank 2 dies at step 5 on the first start
    "resume.py": """
        import os, signal, sys, time
        from pathlib import Path
        rank, restart = int(os.environ["RANK"]), int(os.environ["EXOGYM_RESTART"])
        ckpt = Path(os.environ["EXOGYM_RUN_DIR"]) / f"ckpt{rank}"
        step = 0
        if "--resume" in sys.argv:
            step = int(ckpt.read_text())
            print(f"resumed from step {step}", flush=True)
        while step < 10:
            step += 1
            # a checkpoint as the project writes one: whole or not at all (a rank stopped
            # mid-write left an empty file to resume from)
            ckpt.with_suffix(".tmp").write_text(str(step))
            ckpt.with_suffix(".tmp").replace(ckpt)
            if rank == 2 and restart == 0 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.02)
        if restart == 0:
            time.sleep(120)  # the first start never finishes: rank 2 dies
        print(f"done at step {step} after restart {restart}", flush=True)
    """,
    # steps a few times, then stops advancing: rank 0 says it waits in an all-reduce,
    # rank 1 hangs in its own step without a word
    "stall.py": """
        import json, os, time
        rank = int(os.environ["RANK"])
        print(PREFIX + json.dumps({"event": "start", "rank": rank, "step": 0,
                                   "round_steps": 1}), flush=True)
        for step in range(1, 6):
            print(PREFIX + json.dumps({"event": "step", "rank": rank, "step": step}),
                  flush=True)
            time.sleep(0.05)
        if rank == 0:
            print(PREFIX + json.dumps({"event": "waiting", "rank": 0, "since_s": 1.0,
                                       "what": "an all-reduce of 16.0 MiB"}), flush=True)
        time.sleep(120)
    """,
    "marker.py": """
        import os
        from pathlib import Path
        (Path(os.environ["EXOGYM_RUN_DIR"]) / f"started{os.environ['RANK']}").write_text("")
    """,
    # rank 1's host runs low on memory: its monitor says so three times
    "low_memory.py": """
        import json, os
        rank = int(os.environ["RANK"])
        for available in (3.0, 0.8, 0.7, 0.6):
            print(PREFIX + json.dumps({
                "event": "system", "rank": rank, "pid": os.getpid(), "cpu_percent": 50.0,
                "rss_bytes": 2**30, "mem_available_bytes": int(available * 2**30) if rank else
                8 * 2**30, "mem_total_bytes": 16 * 2**30,
                "low_memory": bool(rank) and available < 1.6}), flush=True)
    """,
}


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHD]:
    """One real sshd on 127.0.0.2-6 for every test here (see sshd_fixture)."""
    yield from serve_sshd(tmp_path_factory)


def write_project(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, body in RANK_SCRIPTS.items():
        text = textwrap.dedent(body).replace("PREFIX", repr(METRIC_PREFIX))
        (path / name).write_text(text)
    (path / "pyproject.toml").write_text('[project]\nname = "demo"\nversion = "1.2.3"\n')
    return path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return write_project(tmp_path / "project")


class Run:
    """Builds launchers for one test: hosts, SSH settings and collectors."""

    def __init__(self, sshd: SSHD, project: Path, tmp_path: Path) -> None:
        self.sshd = sshd
        self.project = project
        self.run_dir = tmp_path / "run"
        self.out = io.StringIO()
        self.lines: list[OutputLine] = []
        self.events: list[dict[str, Any]] = []
        self.port = free_port()

    def worker(self, address: str, **extra: Any) -> dict[str, Any]:
        return {"host": address, "ssh_port": self.sshd.port, **extra}

    def hosts(self, workers: list[Any] | None = None, master: Any = "127.0.0.1",
              **top: Any) -> dict[str, Any]:
        if workers is None:
            workers = [self.worker("127.0.0.2"), self.worker("127.0.0.3")]
        return {"master": master, "workers": workers, "ssh_user": self.sshd.user,
                "ssh_key_path": str(self.sshd.key_path), "python_env": sys.executable,
                "project_path": str(self.project), "master_port": self.port, **top}

    def options(self, **kw: Any) -> dict[str, Any]:
        """``launch()`` keyword arguments for the test sshd, short timeouts and collectors."""
        options: dict[str, Any] = {
            "run_dir": self.run_dir, "known_hosts_path": self.sshd.known_hosts,
            "ssh_config_path": self.sshd.ssh_config, "allow_agent": False,
            "look_for_keys": False, "connect_timeout": 3.0, "probe_timeout": 20.0,
            "grace_period": 2.0, "project_root": self.project,
            "console": Console(file=self.out, width=220), "on_output": self.lines.append,
            "on_event": self.events.append}
        options.update(kw)
        return options

    def ssh(self, **kw: Any) -> SSHOptions:
        return SSHOptions(known_hosts_path=self.sshd.known_hosts,
                          ssh_config_path=self.sshd.ssh_config, allow_agent=False,
                          look_for_keys=False, connect_timeout=3.0, **kw)

    def launcher(self, hosts: dict[str, Any], program: RankProgram, **kw: Any) -> Launcher:
        flat = self.options(**kw)
        callbacks = {name: flat.pop(name) for name in ("console", "on_output", "on_event")}
        options, ssh = split_options(flat)
        return Launcher(hosts, program, options=options, ssh=ssh, **callbacks)

    def output_of(self, rank: int) -> list[str]:
        return [line.text for line in self.lines if line.rank == rank]


@pytest.fixture
def run(sshd: SSHD, project: Path, tmp_path: Path) -> Run:
    return Run(sshd, project, tmp_path)


def alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def group_members(pgids: set[int]) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if fields[0] != "Z" and int(fields[2]) in pgids:
                members.append(int(entry))
    return members


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def read_pids(run_dir: Path, ranks: range) -> dict[int, dict[str, int]]:
    wait_for(lambda: all((run_dir / f"pids{r}.json").exists() for r in ranks), 20,
             "every rank to write its PIDs")
    return {r: json.loads((run_dir / f"pids{r}.json").read_text()) for r in ranks}


def assert_nothing_left(pids: dict[int, dict[str, int]]) -> None:
    every = [p for d in pids.values() for p in (d["pid"], d["supervisor"], d["child"])]
    wait_for(lambda: not any(alive(p) for p in every), 5, f"processes {every} to end")
    pgids = {d["pgid"] for d in pids.values()}
    wait_for(lambda: not group_members(pgids), 5, f"process groups {pgids} to empty")


class InBackground:
    """Runs ``launcher.run()`` in a thread, so the test can act while ranks run."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.result: LaunchResult | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.launcher.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.error = exc

    def join(self, timeout: float) -> LaunchResult:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the launcher did not return within {timeout} s"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


# --------------------------------------------------------------------------- launching


@pytest.mark.slow
def test_three_ranks_get_their_variables_arguments_output_events_and_logs(run):
    assert "AcceptEnv" not in (run.sshd.log_path.parent / "sshd_config").read_text()
    tricky = ["two words", "it's", "$(touch INJECTED)", "a;b", ""]
    launcher = run.launcher(run.hosts(), RankProgram.from_script("show_env.py", tricky),
                            env={"EXTRA": "x y"})
    with launcher:
        result = launcher.run()

    assert result.ok, result.describe()
    assert [(r.rank, r.host, r.exit_code, r.reason) for r in result.ranks] == [
        (0, "127.0.0.1", 0, "finished"), (1, "127.0.0.2", 0, "finished"),
        (2, "127.0.0.3", 0, "finished")]
    for rank in range(3):
        out = run.output_of(rank)
        env = json.loads(next(t for t in out if t.startswith("ENV "))[4:])
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "3"
        assert env["LOCAL_RANK"] == "0" and env["EXOGYM_RESTART"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == str(run.port)
        assert env["EXOGYM_RUN_DIR"] == str(run.run_dir) and env["EXTRA"] == "x y"
        # rank 0 ran here without SSH; the others came in through sshd
        assert (env["SSH_CONNECTION"] is None) == (rank == 0)
        assert json.loads(next(t for t in out if t.startswith("ARGV "))[5:]) == tricky
    assert not (run.project / "INJECTED").exists()

    assert sorted((e["rank"], e["host"], e["step"]) for e in run.events) == [
        (0, "127.0.0.1", 1), (1, "127.0.0.2", 1), (2, "127.0.0.3", 1)]
    assert not any(METRIC_PREFIX in line.text for line in run.lines)
    stderr = [str(line) for line in run.lines if line.stream == "stderr"]
    assert sorted(stderr) == [f"[127.0.0.{r + 1}:{r}] a line on stderr" for r in range(3)]

    for rank in range(3):
        log = (run.run_dir / f"rank{rank}.log").read_text()
        assert "ENV {" in log and METRIC_PREFIX in log and "a line on stderr" in log
        assert result.ranks[rank].log_path == run.run_dir / f"rank{rank}.log"
    index = json.loads((run.run_dir / "launch.json").read_text())
    assert [r["host"] for r in index["ranks"]] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert index["attempts"][0]["ok"] is True


@pytest.mark.slow
def test_interface_and_device_of_a_host_reach_its_rank(run):
    hosts = run.hosts(workers=[run.worker("127.0.0.2", interface="lo", device="cpu")])
    result = launch(hosts, RankProgram.from_script("show_env.py"), check=True, **run.options())
    assert result.ok
    env1 = json.loads(next(t for t in run.output_of(1) if t.startswith("ENV "))[4:])
    env0 = json.loads(next(t for t in run.output_of(0) if t.startswith("ENV "))[4:])
    assert (env1["GLOO_SOCKET_IFNAME"], env1["EXOGYM_DEVICE"]) == ("lo", "cpu")
    assert (env0["GLOO_SOCKET_IFNAME"], env0["EXOGYM_DEVICE"]) == (None, None)


@pytest.mark.slow
def test_master_over_ssh_runs_rank_zero_remotely(run):
    hosts = run.hosts(master=run.worker("127.0.0.2"), workers=[run.worker("127.0.0.3")])
    with run.launcher(hosts, RankProgram.from_script("show_env.py")) as launcher:
        assert not launcher.master_local
        result = launcher.run()
    assert result.ok, result.describe()
    env0 = json.loads(next(t for t in run.output_of(0) if t.startswith("ENV "))[4:])
    assert env0["SSH_CONNECTION"] is not None and env0["MASTER_ADDR"] == "127.0.0.2"


# --------------------------------------------------------------------------- stopping


@pytest.mark.slow
def test_killing_one_remote_rank_stops_all_others_and_leaves_nothing(run):
    launcher = run.launcher(run.hosts(), RankProgram.from_script("sleeper.py"))
    with launcher:
        background = InBackground(launcher)
        pids = read_pids(run.run_dir, range(3))
        killed_at = time.monotonic()
        os.kill(pids[2]["pid"], signal.SIGKILL)
        result = background.join(timeout=30)
        stopped_within = time.monotonic() - killed_at

    assert stopped_within < 10
    assert not result.ok
    failed = result.first_failure
    assert failed is not None and (failed.rank, failed.host) == (2, "127.0.0.3")
    assert failed.exit_code == 128 + signal.SIGKILL
    assert failed.reason == "killed by SIGKILL (exit code 137)"
    assert [r.stopped for r in result.ranks] == [True, True, False]
    message = result.describe()
    assert message.startswith("rank 2 on 127.0.0.3 (127.0.0.3:2) failed: killed by SIGKILL")
    assert "sleeping" in message
    assert_nothing_left(pids)


@pytest.mark.slow
def test_a_dropped_ssh_connection_stops_the_job_and_names_the_rank(run):
    launcher = run.launcher(run.hosts(), RankProgram.from_script("sleeper.py"))
    with launcher:
        background = InBackground(launcher)
        pids = read_pids(run.run_dir, range(3))
        stat = Path(f"/proc/{pids[1]['supervisor']}/stat").read_text()
        session = int(stat[stat.rfind(")") + 2:].split()[1])  # the sshd serving rank 1
        assert Path(f"/proc/{session}/cmdline").read_bytes().startswith(b"sshd")
        os.kill(session, signal.SIGKILL)
        result = background.join(timeout=30)
    failed = result.first_failure
    assert failed is not None and failed.label == "127.0.0.2:1"
    assert failed.exit_code is None
    assert failed.reason == (f"the SSH connection to {run.sshd.user}@127.0.0.2:{run.sshd.port} "
                             "was lost")
    assert result.ranks[0].stopped and result.ranks[2].stopped
    assert_nothing_left(pids)  # rank 1's supervisor saw its stdin close and stopped it


@pytest.mark.slow
def test_rank_exit_code_and_last_lines_name_the_failure(run):
    launcher = run.launcher(run.hosts(), RankProgram.from_script("fail_rank1.py"))
    with launcher:
        result = launcher.run()
    failed = result.first_failure
    assert failed is not None and failed.label == "127.0.0.2:1"
    assert (failed.exit_code, failed.reason) == (3, "exited with code 3")
    assert failed.last_lines == ("boom 0", "boom 1", "boom 2")
    assert result.ranks[0].stopped and result.ranks[2].stopped
    with pytest.raises(LaunchError) as caught:
        result.raise_for_failure()
    assert "rank 1 on 127.0.0.2 (127.0.0.2:1) failed: exited with code 3" in str(caught.value)
    assert "boom 2" in str(caught.value)
    assert caught.value.result is result


@pytest.mark.slow
def test_a_run_that_makes_no_progress_is_stopped_naming_what_each_rank_waits_for(run):
    launcher = run.launcher(run.hosts([run.worker("127.0.0.2")]),
                            RankProgram.from_script("stall.py"), stall_after=3.0)
    started = time.monotonic()
    with launcher:
        result = launcher.run()
    assert time.monotonic() - started < 60
    assert not result.ok and all(r.stopped for r in result.ranks)
    message = result.describe()
    assert message.startswith("stopped: no progress for "), message
    assert "after step 5" in message
    assert "rank 0 on 127.0.0.1 waits for an all-reduce of 16.0 MiB" in message
    assert "no wait reported by rank 1 on 127.0.0.2" in message


@pytest.mark.slow
def test_a_host_low_on_memory_is_told_once_naming_it_and_what_it_has_left(run):
    launcher = run.launcher(run.hosts([run.worker("127.0.0.2")]),
                            RankProgram.from_script("low_memory.py"))
    with launcher:
        assert launcher.run().ok
    told = [line for line in run.out.getvalue().splitlines() if "memory left" in line]
    assert told == ["[launcher] 127.0.0.2 has 0.8 GiB of 16 GiB memory left"]
    assert sum(e["event"] == "system" for e in run.events) == 8  # every event still delivered


def test_progress_bound_is_ten_measured_rounds_and_at_least_five_minutes():
    now = [0.0]
    watch = ProgressWatch(clock=lambda: now[0])
    watch.on_event({"event": "start", "rank": 0, "round_steps": 20})
    assert watch.stalled() is None and watch.bound_s() == 300.0
    for step in range(1, 41):  # 2 s a step: 40 s a round of 20 steps
        now[0] += 2.0
        watch.on_event({"event": "step", "rank": 0, "step": step, "host": "a"})
    assert watch.round_s() == 40.0 and watch.bound_s() == 400.0
    now[0] += 399.0
    assert watch.stalled() is None
    now[0] += 2.0
    assert watch.stalled().startswith("no progress for 401 s (the bound: 10 rounds of 40.0 s")
    fixed = ProgressWatch(stall_s=5.0, clock=lambda: now[0])
    assert fixed.stalled() is None  # not training yet: no bound runs



def test_a_rank_done_training_is_not_lost_while_it_writes_its_outputs_without_a_heartbeat():
    """With min_nodes the launcher judges ranks by their heartbeat, which a rank stops when
    it reports the end of its training; averaging and writing a large model's outputs
    after that took longer than ``lost_after``, and every rank was stopped as lost before
    the final model and summary were written."""
    from types import SimpleNamespace

    from distributed.launch.elastic_attempt import ElasticAttempt

    progress = ProgressWatch()
    beats = {0: 7, 1: 7}
    lost: list[int] = []
    attempt = SimpleNamespace(
        runs={r: SimpleNamespace(running=True, beat_heard_at=0.0) for r in (0, 1)}, lost={},
        beats={}, lost_after=10.0, store=None, progress=progress,
        comm=SimpleNamespace(read_beat=lambda store, key, seen=0:
                             beats[int(key.rsplit("/", 1)[1])]),
        _lose=lambda rank, why: (lost.append(rank), attempt.lost.update({rank: why})))
    ElasticAttempt._watch_heartbeats(attempt, 0.0)
    beats.update({0: 8, 1: 8})  # both beat, then go quiet
    ElasticAttempt._watch_heartbeats(attempt, 1.0)
    for rank in (0, 1):
        progress.on_event({"event": "step", "rank": rank, "step": 5})
    progress.on_event({"event": "done", "rank": 0, "step": 5})
    ElasticAttempt._watch_heartbeats(attempt, 30.0)  # neither has beaten for 29 s
    assert lost == [1]
    # A process of the rank that starts again (it rejoins) is judged by its heartbeat.
    progress.on_event({"event": "start", "rank": 0, "round_steps": 1})
    ElasticAttempt._watch_heartbeats(attempt, 31.0)
    assert lost == [1, 0]


DRIVER = """
import json, signal, sys
from distributed.launch.launcher import Launcher, RankProgram, split_options
hosts = json.loads(sys.argv[1])
options, ssh = split_options(json.loads(sys.argv[2]))
with Launcher(hosts, RankProgram.from_script("sleeper.py"), options=options, ssh=ssh) as launcher:
    result = launcher.run()
restored = (signal.getsignal(signal.SIGINT) is signal.default_int_handler
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
print("RESULT " + json.dumps({"interrupted": result.interrupted, "restored": restored,
                              "stopped": [r.stopped for r in result.ranks]}), flush=True)
sys.exit(130 if result.interrupted else 1)
"""


def start_driver(run: Run) -> subprocess.Popen[str]:
    options = {"run_dir": str(run.run_dir), "known_hosts_path": str(run.sshd.known_hosts),
                   "ssh_config_path": str(run.sshd.ssh_config), "allow_agent": False,
                   "look_for_keys": False, "connect_timeout": 3.0, "grace_period": 2.0,
                   "project_root": str(run.project)}
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, json.dumps(run.hosts()), json.dumps(options)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
        start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_launcher_stops_every_rank(run, signum):
    driver = start_driver(run)
    try:
        pids = read_pids(run.run_dir, range(3))
        driver.send_signal(signum)
        out, _ = driver.communicate(timeout=20)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == 130, out
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    assert result == {"interrupted": signal.Signals(signum).name, "restored": True,
                      "stopped": [True] * 3}
    assert_nothing_left(pids)


@pytest.mark.slow
def test_ranks_stop_themselves_when_the_launcher_is_killed(run):
    driver = start_driver(run)
    try:
        pids = read_pids(run.run_dir, range(3))
        driver.kill()  # no cleanup possible: the supervisors see their stdin close
        driver.wait(timeout=5)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert_nothing_left(pids)


@pytest.mark.slow
def test_max_restarts_restarts_the_job_which_resumes_and_finishes(run):
    hosts = run.hosts(master=run.worker("127.0.0.2"),
                      workers=[run.worker("127.0.0.3"), run.worker("127.0.0.4")])
    program = RankProgram.from_script("resume.py", resume_args=["--resume"])
    with run.launcher(hosts, program, max_restarts=1) as launcher:
        result = launcher.run()

    assert result.ok, result.describe()
    assert result.restarts == 1
    first = result.attempts[0]
    assert first.first_failure is not None and first.first_failure.rank == 2
    assert first.first_failure.reason == "killed by SIGKILL (exit code 137)"
    assert "resumed from step 5" in run.output_of(2)
    for rank in range(3):
        assert "done at step 10 after restart 1" in run.output_of(rank)
    index = json.loads((run.run_dir / "launch.json").read_text())
    assert [a["ok"] for a in index["attempts"]] == [False, True]
    assert index["attempts"][0]["first_failure"] == "127.0.0.4:2"
    log = (run.run_dir / "rank2.log").read_text()
    assert "start 0" in log and "start 1" in log  # both starts in one log


# --------------------------------------------------------------------------- secrets


@pytest.mark.slow
def test_secret_reaches_the_rank_but_no_command_line_log_or_index(run):
    token, key = "tok-" + os.urandom(8).hex(), "key-" + os.urandom(8).hex()
    launcher = run.launcher(run.hosts(), RankProgram.from_script("secret.py"),
                            env={"WANDB_API_KEY": key}, secrets={"MY_TOKEN": token})
    with launcher:
        background = InBackground(launcher)
        wait_for(lambda: all((run.run_dir / f"ready{r}").exists() for r in range(3)), 20,
                 "every rank to read its secrets")
        seen_in = []
        for entry in os.listdir("/proc"):
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if token.encode() in cmdline or key.encode() in cmdline:
                seen_in.append(entry)
        (run.run_dir / "release").write_text("")
        result = background.join(timeout=30)

    assert result.ok, result.describe()
    assert seen_in == []
    for rank in range(3):
        out = run.output_of(rank)
        assert f"WANDB_API_KEY {hashlib.sha256(key.encode()).hexdigest()}" in out
        assert f"MY_TOKEN {hashlib.sha256(token.encode()).hexdigest()}" in out
        assert "careless: ***" in out
    written = [p.read_text() for p in run.run_dir.iterdir() if p.is_file()]
    assert written and not any(token in text or key in text for text in written)
    shown = run.out.getvalue() + "".join(str(line) for line in run.lines)
    assert token not in shown and key not in shown
    plan = launcher.plan()[1]
    assert set(plan.secret_names) == {"MY_TOKEN", "WANDB_API_KEY"}
    assert "WANDB_API_KEY" not in plan.env_names and key not in plan.command


# --------------------------------------------------------------------------- dry run


def test_dry_run_prints_each_command_and_variable_names_and_starts_nothing(run):
    silent = socket.socket()
    silent.bind(("127.0.0.6", 0))
    silent.listen(8)
    silent.setblocking(False)
    silent_port = silent.getsockname()[1]
    hosts = run.hosts(workers=[
        {"host": "127.0.0.6", "ssh_port": silent.getsockname()[1], "interface": "eth7"},
        {"host": "127.0.0.5", "ssh_port": silent.getsockname()[1], "ssh_user": "bob"}])
    launcher = run.launcher(hosts, RankProgram.from_profile("digits-diloco",
                                                            overrides={"max_steps": 5}),
                            secrets={"MY_TOKEN": "hush-hush-value"}, max_restarts=1)
    plans = launcher.dry_run()
    out = run.out.getvalue()

    with pytest.raises(BlockingIOError):
        silent.accept()  # nobody connected
    silent.close()
    assert not run.run_dir.exists()
    assert "hush-hush-value" not in out
    for plan in plans:
        assert f"command:   {plan.by_hand}" in out  # what a person runs by hand
        assert plan.command not in out  # the launcher's supervisor, fed on stdin
        assert f"rank {plan.rank} on {plan.host.host}" in out
    assert f"over SSH as bob@127.0.0.5:{silent_port}" in out and "this machine, no SSH" in out
    assert "eth7 (set in the hosts file)" in out
    assert "GLOO_SOCKET_IFNAME" in plans[1].env_names
    assert "secrets:   MY_TOKEN (over stdin" in out
    assert "on restart adds: --resume" in out
    assert f"port:      {run.port} on 127.0.0.1 (this rank listens)" in out
    tokens = shlex.split(plans[2].command)
    assert tokens[:2] == ["cd", str(run.project)]
    assert tokens[-6:] == ["-m", "distributed.worker", "--profile", "digits-diloco", "--set",
                           "max_steps=5"]
    assert "RANK=2" in tokens and f"MASTER_PORT={run.port}" in tokens


# --------------------------------------------------------------------------- pre-flight


def preflight_problems(run: Run, hosts: dict[str, Any], **kw: Any) -> list[str]:
    """Run the job expecting pre-flight to refuse it; its problems. Checks nothing started."""
    launcher = run.launcher(hosts, RankProgram.from_script("marker.py"), **kw)
    with launcher, pytest.raises(PreflightError) as caught:
        launcher.run()
    assert not run.run_dir.exists() or not list(run.run_dir.glob("started*"))
    assert "nothing was started" in str(caught.value)
    return caught.value.report.problems


def fingerprint_of(public_key: str) -> str:
    blob = base64.b64decode(public_key.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def test_preflight_refuses_an_unknown_host_key_and_shows_its_fingerprint(run, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    (problem,) = preflight_problems(run, run.hosts(workers=[run.worker("127.0.0.2")]),
                                    known_hosts_path=empty)
    assert problem.startswith(f"[127.0.0.2:1] 127.0.0.2:{run.sshd.port}: unknown host key "
                              f"(ssh-ed25519 {fingerprint_of(run.sshd.host_public_key)})")
    assert "accept_new_host_keys=True" in problem and "--accept-new-host-keys" in problem
    assert empty.read_text() == ""


@pytest.mark.slow
def test_accept_new_host_keys_records_the_key_once_then_plain_checks_pass(run, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("# kept\n")
    hosts = run.hosts()
    with run.launcher(hosts, RankProgram.from_script("marker.py"), known_hosts_path=known,
                      accept_new_host_keys=True) as launcher:
        report = launcher.session.preflight()
    assert report.ok
    lines = known.read_text().splitlines()
    assert lines[0] == "# kept"
    assert sorted(lines[1:]) == sorted(run.sshd.known_hosts_line(a).strip()
                                       for a in ("127.0.0.2", "127.0.0.3"))
    assert any("trusted a new host key" in n for n in report.checks[1].notes)
    with run.launcher(hosts, RankProgram.from_script("marker.py"),
                      known_hosts_path=known) as launcher:
        assert launcher.session.preflight().ok


def test_a_changed_host_key_is_refused_even_when_accepting_new_keys(run, tmp_path):
    other = (run.sshd.wrong_key_path.parent / "wrong_key.pub").read_text().split()
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.2]:{run.sshd.port} {other[0]} {other[1]}\n")
    (problem,) = preflight_problems(run, run.hosts(workers=[run.worker("127.0.0.2")]),
                                    known_hosts_path=known, accept_new_host_keys=True)
    assert "HOST KEY CHANGED" in problem
    assert f"ssh-keygen -R '[127.0.0.2]:{run.sshd.port}' -f {known}" in problem
    assert known.read_text().count("\n") == 1


def test_preflight_names_a_wrong_user_key(run):
    worker = run.worker("127.0.0.2", ssh_key_path=str(run.sshd.wrong_key_path))
    (problem,) = preflight_problems(run, run.hosts(workers=[worker]))
    assert problem.startswith(f"[127.0.0.2:1] authentication failed for {run.sshd.user}@"
                              f"127.0.0.2:{run.sshd.port} with key {run.sshd.wrong_key_path}")
    assert "ssh-copy-id" in problem


def test_preflight_never_prompts_for_a_key_passphrase(run, tmp_path):
    locked = tmp_path / "locked_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret phrase", "-f",
                    str(locked)], check=True)
    worker = run.worker("127.0.0.2", ssh_key_path=str(locked))
    (problem,) = preflight_problems(run, run.hosts(workers=[worker]))
    assert problem.startswith(f"[127.0.0.2:1] {run.sshd.user}@127.0.0.2:{run.sshd.port}: the key "
                              f"({locked}) is protected by a passphrase and no prompt is ever "
                              "shown; load it into your agent with `ssh-add <key>`")


def test_preflight_names_a_missing_key_file(run):
    worker = run.worker("127.0.0.2", ssh_key_path="/nonexistent/id_ed25519")
    (problem,) = preflight_problems(run, run.hosts(workers=[worker]))
    assert "key file /nonexistent/id_ed25519 does not exist on this machine" in problem


def test_preflight_names_a_missing_python(run):
    worker = run.worker("127.0.0.2", python_env="/nonexistent/bin/python")
    (problem,) = preflight_problems(run, run.hosts(workers=[worker]))
    assert problem.startswith("[127.0.0.2:1] python_env /nonexistent/bin/python was not found")


def old_python() -> str | None:
    """An interpreter older than the project supports, when this machine has one."""
    check = "import sys; sys.exit(sys.version_info >= (3, 10))"
    candidates = [shutil.which(name) for name in ("python3.8", "python3.9")]
    candidates += sorted(str(p) for p in Path("~/.pyenv/versions").expanduser().glob(
        "3.[89].*/bin/python"))
    for found in filter(None, candidates):
        if subprocess.run([found, "-c", check], capture_output=True,
                          check=False).returncode == 0:
            return found
    return None


@pytest.mark.slow
@pytest.mark.skipif(old_python() is None, reason="no Python older than 3.10 on this machine")
def test_preflight_names_a_python_that_is_too_old(run):
    worker = run.worker("127.0.0.2", python_env=old_python())
    problems = preflight_problems(run, run.hosts(workers=[worker]))
    assert any(p.startswith(f"[127.0.0.2:1] python_env {old_python()} is Python 3.")
               and "the project needs 3.10 or newer" in p for p in problems)


def test_preflight_names_a_missing_project_path(run):
    worker = run.worker("127.0.0.3", project_path="/nonexistent/project")
    (problem,) = preflight_problems(run, run.hosts(workers=[worker]))
    assert problem.startswith("[127.0.0.3:1] project_path /nonexistent/project does not exist")
    assert "sync=True" in problem


@pytest.mark.slow
def test_preflight_names_a_master_port_in_use(run):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", run.port))
        taken.listen(1)
        problems = preflight_problems(run, run.hosts())
    assert problems == [
        (f"[127.0.0.1:0] master port {run.port} is taken on 127.0.0.1: something else listens "
         f'there (Address already in use); set another "master_port" in the hosts file (one '
         "free on 127.0.0.1), or leave it out to let the run pick a free one, or stop what "
         f"listens there (`ss -ltnp 'sport = :{run.port}'` on 127.0.0.1 shows it)")]


@pytest.mark.slow
def test_preflight_names_a_master_port_in_use_on_a_remote_master(run):
    hosts = run.hosts(master=run.worker("127.0.0.2"), workers=[run.worker("127.0.0.3")])
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", run.port))
        taken.listen(1)
        (problem,) = preflight_problems(run, hosts)
    assert problem.startswith(f"[127.0.0.2:0] master port {run.port} is taken on 127.0.0.2: "
                              "something else listens there")


def first_choice_taken(run: Run, hosts: dict[str, Any]) -> HostsConfig:
    """The hosts without a "master_port", whose first choice is the test's own port (the
    default's part: torch's default port may be anyone's on a shared machine)."""
    config = load_hosts({k: v for k, v in hosts.items() if k != "master_port"})
    assert not config.master_port_given
    return dataclasses.replace(config, master_port=run.port)


@pytest.mark.slow
@pytest.mark.parametrize("remote", [False, True], ids=["local-master", "remote-master"])
def test_a_taken_default_master_port_is_replaced_by_a_free_one(run, remote):
    master = run.worker("127.0.0.2") if remote else "127.0.0.1"
    config = first_choice_taken(run, run.hosts(master=master,
                                               workers=[run.worker("127.0.0.3")]))
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", run.port))
        taken.listen(1)
        with run.launcher(config, RankProgram.from_script("show_env.py")) as launcher:
            result = launcher.run()
    assert result.ok, result.describe()
    picked = launcher.config.master_port
    assert picked != run.port
    envs = [json.loads(next(t for t in run.output_of(r) if t.startswith("ENV "))[4:])
            for r in (0, 1)]
    assert [e["MASTER_PORT"] for e in envs] == [str(picked), str(picked)]
    out = run.out.getvalue()
    master_host = "127.0.0.2" if remote else "127.0.0.1"
    assert f"master port {picked} on {master_host}: the hosts file names no" in out
    assert f"master port {run.port} is taken on {master_host}, and the hosts file names no " \
           f'"master_port": the run uses port {picked}' in " ".join(out.split())


def test_a_free_default_master_port_is_kept(run):
    config = first_choice_taken(run, run.hosts(workers=[run.worker("127.0.0.2")]))
    with run.launcher(config, RankProgram.from_script("marker.py")) as launcher:
        report = launcher.session.preflight(show=False)
    assert report.ok and report.master_port == run.port == launcher.config.master_port
    assert "master port" not in run.out.getvalue()


def test_preflight_lists_the_files_whose_code_differs(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run.project, copy)
    (copy / "sleeper.py").write_text("print('changed')\n")
    worker = run.worker("127.0.0.2", project_path=str(copy))
    (problem,) = preflight_problems(run, run.hosts(workers=[worker]))
    assert problem.startswith("[127.0.0.2:1] code differs from the master's (hash ")
    assert "in 1 file: sleeper.py; sync the checkouts" in problem


def test_preflight_names_a_refused_connection(run):
    closed = free_port()
    (problem,) = preflight_problems(
        run, run.hosts(workers=[{"host": "127.0.0.6", "ssh_port": closed}]))
    assert problem == (f"[127.0.0.6:1] connection refused by 127.0.0.6:{closed}: no SSH server "
                       'listens there; start sshd on that host or fix "ssh_port" in the hosts '
                       "file")


def test_preflight_names_a_host_that_does_not_answer(run):
    # a listener whose one-connection backlog is full drops every further SYN
    with socket.socket() as full, socket.socket() as filler:
        full.bind(("127.0.0.6", 0))
        full.listen(0)
        filler.connect(full.getsockname())
        port = full.getsockname()[1]
        started = time.monotonic()
        (problem,) = preflight_problems(
            run, run.hosts(workers=[{"host": "127.0.0.6", "ssh_port": port}]),
            connect_timeout=1.0)
    assert time.monotonic() - started < 10
    assert problem.startswith(f"[127.0.0.6:1] no answer from 127.0.0.6:{port} within 1 s")


def test_preflight_reports_every_host_at_once_in_one_table(run, tmp_path):
    hosts = run.hosts(workers=[
        run.worker("127.0.0.2", python_env="/nonexistent/bin/python"),
        run.worker("127.0.0.3", project_path="/nonexistent/project"),
        run.worker("127.0.0.4", interface="nope0"),
        run.worker("127.0.0.5"),
        {"host": "127.0.0.6", "ssh_port": free_port()},
    ])
    with run.launcher(hosts, RankProgram.from_script("marker.py")) as launcher:
        report = launcher.session.preflight(raise_on_failure=False)
    assert not report.ok
    assert [c.ok for c in report.checks] == [True, False, False, False, True, False]
    assert [c.ssh for c in report.checks] == ["local", "ok", "ok", "ok", "ok", "FAILED"]
    assert report.checks[3].problems[0].startswith("interface nope0 does not exist on this host")
    assert report.checks[4].port == "reachable" and report.checks[4].interface == "lo (route)"
    assert report.checks[0].versions == "torch " + report.checks[4].probe["torch"] + \
        " · project 1.2.3"
    table = run.out.getvalue()
    assert table.count("Pre-flight: 6 hosts") == 1
    for c in report.checks:
        assert c.host in table
    assert table.count("FAILED") >= 4
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False and len(data["checks"]) == 6


# --------------------------------------------------------------------------- ssh config, agent


@pytest.mark.slow
def test_ssh_config_supplies_hostname_port_user_and_key(run, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(f"Host worker-a\n  HostName 127.0.0.3\n  Port {run.sshd.port}\n"
                      f"  User {run.sshd.user}\n  IdentityFile {run.sshd.key_path}\n")
    hosts = run.hosts(workers=["worker-a"])
    del hosts["ssh_user"], hosts["ssh_key_path"]
    with run.launcher(hosts, RankProgram.from_script("show_env.py"),
                      ssh_config_path=config) as launcher:
        assert launcher.plan()[1].login == f"{run.sshd.user}@127.0.0.3:{run.sshd.port}"
        result = launcher.run()
    assert result.ok, result.describe()
    env = json.loads(next(t for t in run.output_of(1) if t.startswith("ENV "))[4:])
    assert env["SSH_CONNECTION"].split()[2] == "127.0.0.3"


@pytest.fixture
def agent(sshd: SSHD, tmp_path: Path) -> Iterator[str]:
    if shutil.which("ssh-agent") is None or shutil.which("ssh-add") is None:
        pytest.skip("ssh-agent is not installed (openssh-client)")
    sock = str(tmp_path / "agent.sock")
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", sock], stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: os.path.exists(sock), 5, "ssh-agent's socket")
        subprocess.run(["ssh-add", "-q", str(sshd.key_path)], check=True,
                       env={**os.environ, "SSH_AUTH_SOCK": sock}, capture_output=True)
        yield sock
    finally:
        proc.terminate()
        proc.wait(timeout=5)


def test_agent_keys_log_in_without_any_key_file(run, agent, monkeypatch):
    monkeypatch.setenv("SSH_AUTH_SOCK", agent)
    hosts = run.hosts(workers=[run.worker("127.0.0.2")])
    del hosts["ssh_key_path"]
    with run.launcher(hosts, RankProgram.from_script("marker.py"), allow_agent=True) as launcher:
        assert launcher.session.preflight().ok


# --------------------------------------------------------------------------- sync


@pytest.mark.slow
def test_sync_copies_tracked_files_then_the_run_uses_them(run, tmp_path):
    (run.project / "pkg").mkdir()
    (run.project / "pkg" / "data.txt").write_text("payload\n")
    (run.project / "tool.sh").write_text("#!/bin/sh\n")
    (run.project / "tool.sh").chmod(0o755)
    subprocess.run(["git", "init", "-q", str(run.project)], check=True)
    subprocess.run(["git", "-C", str(run.project), "add", "."], check=True)
    (run.project / "untracked.py").write_text("x = 1\n")
    remote = tmp_path / "remote" / "checkout"
    hosts = run.hosts(workers=[run.worker("127.0.0.2", project_path=str(remote))])

    with run.launcher(hosts, RankProgram.from_script("show_env.py"), sync=True) as launcher:
        result = launcher.run()
        assert result.ok, result.describe()
        again = launcher.session.sync()

    tracked = subprocess.run(["git", "-C", str(run.project), "ls-files"], check=True,
                             capture_output=True, text=True).stdout.split()
    for rel in tracked:
        assert (remote / rel).read_bytes() == (run.project / rel).read_bytes()
    assert (remote / "tool.sh").stat().st_mode & 0o777 == 0o755
    assert not (remote / "untracked.py").exists()
    assert not list(remote.rglob("*.exogym-sync.tmp"))
    assert [(s.copied, s.unchanged) for s in again] == [(0, len(tracked))]
    assert "synced 127.0.0.2: " + f"{len(tracked)} files copied" in run.out.getvalue()


# --------------------------------------------------------------------------- host session


def session_for(run: Run, hosts: dict[str, Any]) -> HostSession:
    return HostSession(hosts, ssh=run.ssh(), project_root=run.project, probe_timeout=20.0,
                       console=Console(file=run.out, width=220))


@pytest.mark.slow
def test_a_host_session_preflights_and_fetches_with_no_program(run):
    (run.project / "written.txt").write_text("from a rank\n")
    with session_for(run, run.hosts()) as session:
        report = session.preflight()
        over_sftp = session.fetch(1, "written.txt", run.run_dir / "from1.txt")
        here = session.fetch(0, run.project / "written.txt", run.run_dir / "from0.txt")
        assert session.shell(1).alive()
    assert report.ok, str(report)
    assert [(c.ssh, c.where) for c in report.checks] == [
        ("local", "local"), ("ok", f"{run.sshd.user}@127.0.0.2:{run.sshd.port}"),
        ("ok", f"{run.sshd.user}@127.0.0.3:{run.sshd.port}")]
    assert session.report is report and "Pre-flight: 3 hosts" in run.out.getvalue()
    assert over_sftp.read_text() == here.read_text() == "from a rank\n"
    assert session.shell(1) is None  # closing the session closed its connections


@pytest.mark.slow
def test_a_launcher_runs_on_a_checked_session_and_leaves_it_open(run):
    hosts = run.hosts()
    program = RankProgram.from_script("show_env.py")
    with session_for(run, hosts) as session:
        report = session.preflight()
        worker = session.shell(1)
        with Launcher(hosts, program, options=LaunchOptions(run_dir=run.run_dir, grace_period=2.0),
                      session=session, on_output=run.lines.append,
                      console=Console(file=run.out, width=220)) as launcher:
            result = launcher.run()
        assert result.ok, result.describe()
        assert session.report is report  # pre-flight had passed: the run did not repeat it
        assert run.out.getvalue().count("Pre-flight: 3 hosts") == 1
        assert session.shell(1) is worker and worker.alive()  # the session's owner closes it
        with pytest.raises(ValueError, match="ssh cannot be given with session="):
            Launcher(hosts, program, session=session, ssh=run.ssh())
        with pytest.raises(ValueError, match="opened for other hosts"):
            Launcher(run.hosts(workers=[run.worker("127.0.0.2")]), program, session=session)
    env1 = json.loads(next(t for t in run.output_of(1) if t.startswith("ENV "))[4:])
    assert env1["SSH_CONNECTION"] is not None


# --------------------------------------------------------------------------- without sshd


def test_launcher_module_does_not_import_torch_or_paramiko():
    code = ("import sys; import distributed.launch.launcher; "
            "print(sorted(m for m in ('torch', 'paramiko', 'rich') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_flat_options_split_into_launch_options_and_ssh_options():
    options, ssh = split_options({"run_dir": "runs/x", "max_restarts": 2, "sync": True,
                                  "known_hosts_path": "kh", "allow_agent": False})
    assert options == LaunchOptions(run_dir="runs/x", max_restarts=2, sync=True)
    assert ssh == SSHOptions(known_hosts_path="kh", allow_agent=False)


def test_the_link_probe_defaults_to_half_a_second_or_to_its_environment_variable(monkeypatch):
    monkeypatch.delenv("EXOGYM_LINK_PROBE_S", raising=False)
    assert LaunchOptions().link_probe_s == 0.5
    monkeypatch.setenv("EXOGYM_LINK_PROBE_S", "0")
    assert LaunchOptions().link_probe_s == 0.0
    assert LaunchOptions(link_probe_s=2).link_probe_s == 2  # the caller's value wins
    for bad in ("abc", "-1", "61", "nan"):
        monkeypatch.setenv("EXOGYM_LINK_PROBE_S", bad)
        with pytest.raises(ValueError, match=rf"EXOGYM_LINK_PROBE_S='{bad}': give the seconds "
                                             r"of the link probe, from 0 \(no probe\) to 60"):
            LaunchOptions()


@pytest.mark.slow
def test_a_bad_link_probe_variable_is_refused_before_any_host_is_reached(tmp_path):
    """The hosts' SSH ports are listeners of the test's: the refusal comes before any
    connection to them."""
    port = free_port("127.0.0.1", "127.0.0.2")
    listeners = [socket.create_server((address, port)) for address in ("127.0.0.1", "127.0.0.2")]
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"master": "127.0.0.1", "workers": [{"host": "127.0.0.2"}],
                                 "ssh_port": port, "python_env": sys.executable,
                                 "project_path": str(ROOT)}))
    try:
        done = subprocess.run([*warm.cli_command(), "distributed-train", "digits-diloco",
                               "--hosts", str(hosts)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "EXOGYM_LINK_PROBE_S": "fast", "CI": "true"})
        assert done.returncode == 2, done.stdout + done.stderr
        assert "EXOGYM_LINK_PROBE_S='fast'" in done.stdout + done.stderr
        for listener in listeners:  # nobody knocked
            listener.setblocking(False)
            with pytest.raises(BlockingIOError):
                listener.accept()
    finally:
        for listener in listeners:
            listener.close()


def test_an_unknown_flat_option_is_named_with_the_close_one_before_anything_starts(tmp_path):
    hosts = {"master": "127.0.0.1", "workers": [], "python_env": sys.executable,
             "project_path": str(tmp_path)}
    program = RankProgram.from_script("x.py")
    with pytest.raises(TypeError) as caught:
        launch(hosts, program, known_host_path="kh", run_dir=tmp_path / "run")
    message = str(caught.value)
    assert message.startswith("launch() got unknown argument 'known_host_path' (did you mean "
                              "'known_hosts_path'?)")
    assert "Accepted: " in message and "grace_period" in message and "allow_agent" in message
    assert not (tmp_path / "run").exists()

    with pytest.raises(TypeError, match=r"NetworkTrainer\(launcher_options=...\) got unknown "
                                        r"argument 'max_restart' \(did you mean 'max_restarts'"):
        run_script_on_hosts(load_hosts(hosts), program, launcher_options={"max_restart": 1})


def test_rank_command_quotes_every_piece_and_sets_variables_with_env():
    command = rank_command("/srv/my gym", "/opt/py env/bin/python",
                           {"RANK": "1", "NOTE": "it's $HOME"}, ["train.py", "--x", "a;b"])
    tokens = shlex.split(command)
    assert tokens[:3] == ["cd", "/srv/my gym", "&&"]
    assert tokens[3:7] == ["exec", "env", "RANK=1", "NOTE=it's $HOME"]
    assert tokens[7] == "/opt/py env/bin/python"
    assert tokens[-3:] == ["train.py", "--x", "a;b"]


def test_home_relative_paths_expand_on_the_host():
    assert shell_path("~/gym") == '"$HOME"/gym'
    assert shell_path("~/my gym") == "\"$HOME\"/'my gym'"
    assert shell_path("/abs/path") == "/abs/path"
    out = subprocess.run(["sh", "-c", f"echo {shell_path('~/x y')}"], check=True,
                         capture_output=True, text=True,
                         env={"HOME": "/home/u", "PATH": os.environ["PATH"]})
    assert out.stdout.strip() == "/home/u/x y"


def test_a_stdlib_probe_runs_with_the_hosts_python3_until_setup_made_its_environment(
        tmp_path):
    """The wizard's link measurement reaches a host before setup-hosts: neither its
    python_env nor its project exists yet, and the receiver runs with its python3."""
    import json as json_module

    from distributed.hosts.remote import NO_PYTHON, standalone_command

    code = "import sys\ndef main(m):\n    print(sys.executable, flush=True)\n"
    fake_bin, no_python = tmp_path / "bin", tmp_path / "only-sh"
    for folder in (fake_bin, no_python):
        folder.mkdir()
        (folder / "sh").symlink_to("/bin/sh")
    (fake_bin / "python3").symlink_to(sys.executable)

    def probe(python_env: str, path: str) -> subprocess.CompletedProcess:
        message = json_module.dumps({"code": code}) + "\n"
        return subprocess.run(["/bin/sh", "-c", standalone_command(python_env)], input=message,
                              capture_output=True, text=True, timeout=60,
                              env={"HOME": str(tmp_path), "PATH": path})

    missing = "~/exogym/.venv/bin/python"  # what setup would make: not there yet
    assert probe(missing, str(fake_bin)).stdout.strip() == str(fake_bin / "python3")
    assert probe(sys.executable, str(no_python)).stdout.strip() == sys.executable  # its own
    assert probe(missing, str(no_python)).returncode == NO_PYTHON


def test_profile_program_passes_overrides_device_and_resume_flag():
    program = RankProgram.from_profile("digits-diloco", config="config.ini",
                                       overrides={"lr": 0.1, "compile": False})
    host = HostSpec(rank=1, host="h", python_env="python3", project_path="/p", device="mps")
    assert program.argv(host, restart=0) == [
        "-m", "distributed.worker", "--profile", "digits-diloco", "--config", "config.ini",
        "--set", "lr=0.1", "--set", "compile=false", "--set", "device=mps"]
    assert program.argv(host, restart=1)[-1] == "--resume"
    script = RankProgram.from_script("train.py", ["--epochs", "3"])
    assert script.argv(host, restart=2) == ["train.py", "--epochs", "3"]
    with pytest.raises(ValueError, match='each override must look like "key=value"'):
        RankProgram.from_profile("x", overrides=["lr"])


def test_a_profiles_file_from_outside_the_project_is_sent_to_other_hosts_by_its_content(
        tmp_path):
    config = tmp_path / "mine.ini"
    config.write_text("[distributed:x]\ntask = digits\n")
    program = RankProgram.from_profile("x", config=str(config))
    host = HostSpec(rank=1, host="h", python_env="python3", project_path="/p")
    sent = dict(program.sent_files)
    [(there, data)] = sent.items()
    assert there.startswith(".exogym/profiles/") and there.endswith("/mine.ini")
    assert data == config.read_bytes() and program.config_there == there
    argv = program.argv(host, local=False)
    assert argv[argv.index("--config") + 1] == there  # another host reads the copy sent
    local = program.argv(host, local=True)
    assert local[local.index("--config") + 1] == str(config)  # this machine, the file itself

    (tmp_path / "mine.local.ini").write_text("[distributed:y]\ninherits = x\n")
    both = RankProgram.from_profile("y", config=str(config))
    assert sorted(p.rsplit("/", 1)[1] for p, _ in both.sent_files) == ["mine.ini",
                                                                       "mine.local.ini"]
    assert both.config_there != there  # other content, another folder: runs never meet
    inside = RankProgram.from_profile("x", config="config.ini")  # every host's copy has it
    assert inside.sent_files == () and inside.config_there is None


def test_caller_may_not_set_rank_variables_or_bad_names(run):
    hosts = load_hosts({"master": "127.0.0.1", "workers": [], "python_env": sys.executable,
                        "project_path": "/tmp"})
    program = RankProgram.from_script("x.py")
    with pytest.raises(ValueError, match="RANK is set by the launcher for each rank"):
        Launcher(hosts, program, options=LaunchOptions(env={"RANK": "3"}))
    with pytest.raises(ValueError, match="'1BAD' is not a valid variable name"):
        Launcher(hosts, program, options=LaunchOptions(env={"1BAD": "x"}))
    with pytest.raises(ValueError, match="NOT_SET_ANYWHERE has no value"):
        Launcher(hosts, program, options=LaunchOptions(secret_names=["NOT_SET_ANYWHERE"]))


def test_this_machine_is_recognised_but_other_loopback_addresses_are_hosts():
    assert is_this_machine("127.0.0.1") and is_this_machine("localhost")
    assert not is_this_machine("127.0.0.2")
    assert not is_this_machine("192.0.2.123")  # TEST-NET: nobody's address


def test_code_hash_covers_names_and_contents(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    first, files = hash_files(tmp_path, ["a.py", "missing.py"])
    assert files["missing.py"] is None
    (tmp_path / "a.py").write_text("x = 2\n")
    assert hash_files(tmp_path, ["a.py", "missing.py"])[0] != first
