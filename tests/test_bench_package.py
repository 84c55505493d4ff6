"""The benchmarks are one package, each run as ``python -m bench.NAME``: every module of it
imports and every bench answers ``--help``; none is over 400 lines; no test imports a bench
(what both use is the tests' helper ``tests/netbed``, which needs nothing but the
standard library); and no
script of the benches, the tests or the examples edits the module search path (only
``tests/conftest.py`` does, for the tests' own helpers)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
MAX_LINES = 400
#: An edit of the module search path: insert, append, extend, slice or item assignment, +=.
PATH_EDIT = re.compile(r"sys\.path(\.(insert|append|extend)\b|\[[^\]]*\]\s*=[^=]|\s*\+=)")

#: Imports every module it is given, then runs every bench given with ``--help``, in this one
#: process; prints the failures as JSON. A module that needs an optional package this machine
#: lacks (whisper's, selenium) counts as importing.
PROBE = """
import contextlib, importlib, io, json, runpy, sys, warnings
warnings.filterwarnings("ignore", "'bench", RuntimeWarning)  # runpy: imported before it runs
modules, benches = json.loads(sys.argv[1]), json.loads(sys.argv[2])
ours = {"bench", "distributed", "exogym", "tests"}
failed = {}
for name in modules:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in ours:
            failed[name] = repr(exc)
    except BaseException as exc:
        failed[name] = repr(exc)
for name in benches:
    if name in failed:
        continue
    sys.argv = [name, "--help"]
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        failed[name] = "--help did not exit"
    except SystemExit as exc:
        if exc.code not in (0, None) or "usage:" not in said.getvalue():
            failed[name] = f"--help exited with {exc.code}: {said.getvalue()[-500:]}"
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in ours:
            failed[name] = repr(exc)
    except BaseException as exc:
        failed[name] = repr(exc)
print(json.dumps(failed))
"""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def bench_modules() -> list[str]:
    return sorted(module_name(p) for p in BENCH.rglob("*.py"))


def benches() -> list[str]:
    """What runs as ``python -m bench.NAME``: a module beside ``bench/__init__.py``, or a
    package there with a ``__main__.py``."""
    found = [f"bench.{p.stem}" for p in BENCH.glob("*.py") if p.name != "__init__.py"]
    found += [f"bench.{p.parent.name}" for p in BENCH.glob("*/__main__.py")]
    return sorted(found)


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.slow
def test_every_bench_module_imports_and_every_bench_answers_help():
    assert "bench.multihost" in benches() and "bench.sim_speed" in benches()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(bench_modules()), json.dumps(benches())],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


def test_no_bench_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in BENCH.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"split these by role: {long}"


@pytest.mark.slow
def test_no_test_imports_a_bench():
    found = []
    for path in python_files("tests"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                      for name in names if name.split(".")[0] == "bench"]
    assert found == [], "what a test and a bench share belongs in tests/netbed or the project"


def test_only_conftest_edits_the_module_search_path():
    # tests/warm.py builds a warm command's search path as an interpreter would build it
    allowed = {ROOT / "tests" / "conftest.py", ROOT / "tests" / "warm.py"}
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in python_files("bench", "tests", "examples") if path not in allowed
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if PATH_EDIT.search(line)]
    assert found == [], ("run the script as a module from the project root, or give it "
                         "PYTHONPATH, instead: " + "; ".join(found))


def test_netbed_needs_only_the_standard_library():
    # Its link probe runs inside the bed's hosts by path, and tests and benches both import it.
    found = []
    for path in python_files("tests/netbed"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}" for name in names
                      if name.split(".")[0] not in (*sys.stdlib_module_names, "netbed")]
    assert found == []


def test_the_bed_runs_its_hosts_in_this_checkout():
    # The hosts file a bed writes names the project's root as every host's checkout.
    from netbed.bed import PROJECT_ROOT

    assert PROJECT_ROOT == ROOT
    assert (PROJECT_ROOT / "cli_typer.py").is_file() and (PROJECT_ROOT / "distributed").is_dir()
