"""The rank environment has one owner: what the launcher writes, the rank reads back unchanged.

``distributed.worker.environment`` spells every variable a rank is started with
and both builds them (``RankEnvironment.variables``) and reads them
(``rank_environment``). These tests start from the launcher's own command lines
and check that the rank sees what the launcher meant, and they scan the source
so that no second copy of a variable's name comes back elsewhere.
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from distributed.hosts.hostsfile import load_hosts
from distributed.launch.faults import plan_faults
from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram
from distributed.worker import environment
from distributed.worker.environment import (
    ALL_VARIABLES,
    LAUNCHER_VARIABLES,
    RankEnvironment,
    rank_environment,
)

ROOT = Path(__file__).resolve().parents[1]
OWNER = ROOT / "distributed" / "worker" / "environment.py"
#: Files that must spell some names themselves, and which names. Each entry says why; the
#: scan fails when an entry is no longer needed, so the list only shrinks.
SPELLED_ELSEWHERE = {
    # Runs on hosts from its own source, standard library only: it cannot import the owner,
    # so it defines the store key pipe's name and the owner imports it from there.
    "distributed/hosts/onhost/bootstrap.py": {"EXOGYM_STORE_KEY_FD"},
}


def launched_variables(command: str) -> dict[str, str]:
    """The ``NAME=value`` words a rank's command line sets after ``env`` (inside ``ssh``'s
    quoted command for a rank by hand on another host)."""
    words = shlex.split(command)
    if "env" not in words:
        words = shlex.split(words[-1])
    start = words.index("env") + 1
    variables = {}
    for word in words[start:]:
        name, equals, value = word.partition("=")
        if not equals or not name.isidentifier():
            break
        variables[name] = value
    return variables


def test_every_launcher_field_comes_back_from_the_variables_it_writes():
    written = RankEnvironment(
        rank=3, world_size=5, master_addr="10.0.0.1", master_port=41511, local_rank=1,
        local_world_size=2, min_nodes=2, lost_after=2.5, node_rank=2, restart=4,
        run_dir="runs/launch-1", device="cuda:1", interface="eth7",
        throttle_file="runs/launch-1/inject/ab-rank3.json")
    variables = written.variables()

    assert set(LAUNCHER_VARIABLES) <= set(variables)
    assert variables["NCCL_SOCKET_IFNAME"] == variables["GLOO_SOCKET_IFNAME"] == "eth7"
    assert variables["PYTHONUNBUFFERED"] == "1"
    assert rank_environment(variables) == written


def test_a_rank_without_optional_settings_round_trips_and_writes_none_of_them():
    written = RankEnvironment(0, 1, "127.0.0.1", 41500, node_rank=0, run_dir="/tmp/run")
    variables = written.variables()

    for name in ("EXOGYM_DEVICE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
                 "EXOGYM_THROTTLE_FILE", "EXOGYM_MIN_NODES", "EXOGYM_LOST_AFTER"):
        assert name not in variables
    assert rank_environment(variables) == written


def test_the_hosts_settings_win_over_the_callers_variables_and_the_callers_follow_the_rank_ones():
    written = RankEnvironment(0, 2, "10.0.0.1", 41500, node_rank=0, run_dir="r",
                              interface="eth1", device="mps")
    variables = written.variables(extra={"GLOO_SOCKET_IFNAME": "wlan0", "EXOGYM_DEVICE": "cpu",
                                         "MY_SETTING": "x"})

    assert variables["GLOO_SOCKET_IFNAME"] == "eth1" and variables["EXOGYM_DEVICE"] == "mps"
    names = list(variables)
    assert names.index("PYTHONUNBUFFERED") < names.index("MY_SETTING")
    assert names[:len(LAUNCHER_VARIABLES)] == list(LAUNCHER_VARIABLES)


def test_the_command_line_the_launcher_builds_reads_back_as_each_ranks_environment(tmp_path):
    hosts = {"master": "127.0.0.1", "master_port": 41533, "python_env": sys.executable,
             "project_path": str(tmp_path), "slots": 2,
             "workers": [{"host": "127.0.0.2", "interface": "eth7", "device": "cpu", "slots": 3}]}
    faults = plan_faults(["slow:127.0.0.2@step=3x0.5"], load_hosts(hosts), max_steps=10,
                         min_nodes=3)
    launcher = Launcher(hosts, RankProgram.from_script("train.py"), faults=faults,
                        options=LaunchOptions(run_dir=tmp_path / "runs" / "one",
                                              project_root=tmp_path, min_nodes=3, lost_after=4.0,
                                              env={"MY_SETTING": "on"}))
    plans = launcher.plan(restart=2)

    assert [p.rank for p in plans] == [0, 1, 2, 3, 4]
    for plan in plans:
        variables = launched_variables(plan.command)
        assert variables == launched_variables(plan.by_hand)
        assert tuple(variables) == plan.env_names
        assert variables["MY_SETTING"] == "on"
        read = rank_environment(variables)
        worker = plan.host.rank == 1
        assert read == RankEnvironment(
            rank=plan.rank, world_size=5, master_addr="127.0.0.1", master_port=41533,
            local_rank=plan.local_rank, local_world_size=plan.host.slots, min_nodes=3,
            lost_after=4.0, node_rank=plan.host.rank, restart=2, run_dir="runs/one",
            device="cpu" if worker else None, interface="eth7" if worker else None,
            throttle_file=launcher.injector.throttle_path(plan.rank))


def test_the_caller_may_set_none_of_the_launchers_variables(tmp_path):
    hosts = {"master": "127.0.0.1", "workers": [], "python_env": sys.executable,
             "project_path": str(tmp_path)}
    for name in LAUNCHER_VARIABLES:
        with pytest.raises(ValueError, match=f"{name} is set by the launcher for each rank"):
            Launcher(hosts, RankProgram.from_script("x.py"), options=LaunchOptions(
                env={name: "1"}, project_root=tmp_path))


def string_literals(path: Path) -> list[tuple[int, str]]:
    """Every plain string constant in ``path`` with its line (f-string parts included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_no_module_but_the_owner_spells_a_rank_variable():
    names = set(ALL_VARIABLES)
    sources = sorted((ROOT / "distributed").rglob("*.py")) + [ROOT / "cli_typer.py"]
    found: dict[str, set[str]] = {}
    copies = []
    for path in sources:
        if path == OWNER:
            continue
        where = path.relative_to(ROOT).as_posix()
        for line, value in string_literals(path):
            if value in names:
                found.setdefault(where, set()).add(value)
                if value not in SPELLED_ELSEWHERE.get(where, set()):
                    copies.append(f"{where}:{line}: {value!r}")
    assert not copies, ("rank variables spelled outside distributed/worker/environment.py; "
                        "import its constants (or RankEnvironment.variables) instead:\n  "
                        + "\n  ".join(copies))
    stale = {where: sorted(spelled - found.get(where, set()))
             for where, spelled in SPELLED_ELSEWHERE.items() if spelled - found.get(where, set())}
    assert not stale, f"these no longer spell the names: drop them from SPELLED_ELSEWHERE: {stale}"


def test_the_scan_sees_a_copied_name(tmp_path):
    copy = tmp_path / "copy.py"
    copy.write_text('import os\nrun_dir = os.environ.get("EXOGYM_RUN_DIR")\n'
                    'doc = f"set MASTER_ADDR={1}"\n')
    assert [value for _, value in string_literals(copy) if value in ALL_VARIABLES] == [
        "EXOGYM_RUN_DIR"]


def test_every_name_is_spelled_once_in_the_owner():
    spelled = [value for _, value in string_literals(OWNER) if value in ALL_VARIABLES]
    assert len(ALL_VARIABLES) == len(set(ALL_VARIABLES))
    assert sorted(spelled) == sorted(set(ALL_VARIABLES) - {environment.STORE_KEY_FD_VARIABLE})


def test_the_owner_loads_on_a_host_without_heavy_imports():
    code = ("import sys, distributed.worker.environment\n"
            "heavy = {'torch', 'numpy', 'paramiko', 'rich', 'typer', 'questionary'}\n"
            "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
