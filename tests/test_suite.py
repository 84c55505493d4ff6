"""The suite's own rules: every test file keeps a test in the fast lane, every module of the
project imports, tests take their ports from tests/ports.py, and a warm command behaves as
a fresh one (docs/development.md)."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm
from ports import ephemeral_range, free_port

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _marked_slow(decorators: list[ast.expr]) -> bool:
    return any("mark.slow" in ast.unparse(d) for d in decorators)


def fast_tests(path: Path) -> list[str]:
    """The test functions of ``path`` not marked slow (nor by the module's pytestmark)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            if "mark.slow" in ast.unparse(node.value):
                return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _marked_slow(node.decorator_list):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name.startswith("test_") and not _marked_slow(node.decorator_list):
            found.append(node.name)
    return found


@pytest.mark.slow
def test_every_test_file_keeps_a_test_in_the_fast_lane():
    files = sorted(TESTS.glob("test_*.py"))
    assert len(files) > 50
    without = [f.name for f in files if not fast_tests(f)]
    assert without == [], f"no test of these files runs in the fast lane: {without}"


def test_marked_slow_is_seen_through_decorators_and_the_module_mark(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text("import pytest\n\n@pytest.mark.slow(reason='x')\ndef test_a():\n    pass\n\n"
                      "@pytest.mark.slow\ndef test_b():\n    pass\n\ndef test_c():\n    pass\n")
    assert fast_tests(sample) == ["test_c"]
    sample.write_text("import pytest\npytestmark = [pytest.mark.slow]\n\ndef test_c():\n    pass\n")
    assert fast_tests(sample) == []


def test_every_module_of_the_project_imports():
    """Each module of exogym and distributed, imported in a command of its own: every file
    under the two packages is a module that imports."""
    code = ("import importlib, json, pkgutil, exogym, distributed\n"
            "names = []\n"
            "for package in (exogym, distributed):\n"
            "    for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
            "        importlib.import_module(module.name)\n"
            "        names.append(module.name)\n"
            "print(json.dumps(names))\n")
    done = subprocess.run([*warm.python(), "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    on_disk = set()
    for top in ("exogym", "distributed"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            if len(parts) > 1 and all(p.isidentifier() for p in parts):
                on_disk.add(".".join(parts))
    assert set(json.loads(done.stdout.splitlines()[-1])) == on_disk


FIXED_PORT = re.compile(r"""(?:port["']?\s*[:=]\s*["']?|MASTER_PORT=)(\d{4,5})\b""", re.I)
#: Files whose port numbers are only parsed, checked or printed, never bound; and the link
#: probe, which listens inside a network namespace its bed made for it alone.
PARSED_ONLY = {"test_hosts.py", "test_rank_environment.py", "test_slurm.py",
               "test_discovery.py", "linkprobe.py"}


def test_no_test_takes_a_fixed_port():
    """A port a test binds comes from free_port(): a number written into a test would
    collide with another test process, another checkout's suite, or a run of this machine."""
    found = []
    for path in sorted(p for p in TESTS.rglob("*.py") if p.name not in PARSED_ONLY):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in FIXED_PORT.finditer(line):
                if int(match.group(1)) >= 1024:
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_a_port_taken_is_free_outside_the_ephemeral_range_and_not_given_twice():
    taken = {free_port() for _ in range(20)}
    assert len(taken) == 20 and not taken & set(ephemeral_range())
    other = subprocess.run([sys.executable, "-c", "import ports\nprint([ports.free_port() "
                            "for _ in range(200)])"], cwd=TESTS, capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert other.returncode == 0, other.stderr
    assert not taken & set(ast.literal_eval(other.stdout))  # another process gets others


def test_a_warm_command_gets_its_own_folder_environment_arguments_streams_and_session(
        tmp_path):
    code = ("import json, os, sys\n"
            "data = sys.stdin.read()\n"
            "print(json.dumps({'cwd': os.getcwd(), 'argv': sys.argv, 'env': os.environ.get('X'),"
            " 'data': data, 'sid': os.getsid(0) == os.getpid(), 'path0': sys.path[0],"
            " 'has_exogym': 'exogym' in sys.modules}))\n"
            "print('to stderr', file=sys.stderr)\n"
            "sys.exit(3)\n")
    done = subprocess.run([*warm.python(), "-c", code, "a", "b c"], cwd=tmp_path, input="in",
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "X": "mine"})
    assert done.returncode == 3 and done.stderr == "to stderr\n", done.stderr
    import json

    seen = json.loads(done.stdout)
    assert seen == {"cwd": str(tmp_path), "argv": ["-c", "a", "b c"], "env": "mine",
                    "data": "in", "sid": True, "path0": "", "has_exogym": False}


def test_a_warm_command_ends_as_the_command_ends_and_takes_the_signals_its_client_gets(
        tmp_path):
    # Short sleeps: a signal that comes after Python last looked for one and before a sleep
    # starts is taken only when that sleep ends (the test passes SIGTERM on right after
    # "ready", which is when a sleep is about to start).
    waiting = ("import signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
               "print('ready', flush=True)\n"
               "for _ in range(600):\n"
               "    time.sleep(0.1)\n")
    proc = subprocess.Popen([*warm.python(), "-c", waiting], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)  # passed on: the command's handler runs
    assert proc.wait(timeout=30) == 7
    proc = subprocess.Popen([*warm.python(), "-c", waiting], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    forked = warm.pid_of(proc)
    assert forked != proc.pid
    warm.send_signal(proc, signal.SIGKILL)  # the command itself is killed: its client says so
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc = subprocess.Popen([*warm.python(), "-c", waiting], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    forked = warm.pid_of(proc)
    proc.kill()  # the client killed (a test's timeout): the command goes with it
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{forked}").exists() and \
            Path(f"/proc/{forked}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, f"the warm command {forked} outlived its client"
        time.sleep(0.05)


@pytest.mark.parametrize("variable", ["OMP_NUM_THREADS", "PYTHONWARNINGS"])
def test_a_command_whose_import_time_environment_differs_runs_fresh(variable):
    code = "import sys; print('torch' in sys.modules)"
    warmed = subprocess.run([*warm.python(), "-c", code], capture_output=True, text=True,
                            timeout=60)
    fresh = subprocess.run([*warm.python(), "-c", code], capture_output=True, text=True,
                           timeout=60, env={**os.environ, variable: "3" if "NUM" in variable
                                            else "ignore"})
    assert (warmed.stdout, fresh.stdout) == ("True\n", "False\n")


def test_a_process_forked_from_the_test_process_leaves_the_warm_server_running():
    """A rank forked from a test process runs the test process's exit handlers when it ends:
    the warm server is the test process's alone, and stays up for its next commands."""
    warm.python()
    server = warm._server
    child = os.fork()
    if child == 0:  # as a forked rank that ends through sys.exit
        import atexit

        atexit._run_exitfuncs()
        os._exit(0)
    os.waitpid(child, 0)
    time.sleep(0.5)
    assert server.poll() is None
    done = subprocess.run([*warm.python(), "-c", "print('still here')"], capture_output=True,
                          text=True, timeout=60)
    assert done.stdout == "still here\n" and warm._server is server


@pytest.mark.slow
def test_the_warm_server_takes_the_environment_from_before_any_test(monkeypatch):
    """Started while a test had set an import-time variable for itself, the server would
    turn away every later command of the test process as one whose environment differs."""
    if warm._server is not None:
        warm._stop_server(warm._server, warm._socket_path, os.getpid())
    monkeypatch.setattr(warm, "_server", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    code = "import os, sys; print('torch' in sys.modules, os.environ.get('CUDA_VISIBLE_DEVICES'))"
    first = subprocess.run([*warm.python(), "-c", code], capture_output=True, text=True,
                           timeout=60)
    monkeypatch.undo()
    later = subprocess.run([*warm.python(), "-c", code], capture_output=True, text=True,
                           timeout=60)
    assert (first.stdout, later.stdout) == ("False 7\n", "True None\n")
