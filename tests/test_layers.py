"""The house's layers, read from the source: every import points down, and none forms a cycle.

    faces (cli_typer.py, wizard.py) -> distributed.app
    -> distributed.{launch, worker, planning, profiles}   (launch -> worker -> profiles,
                                                           planning -> profiles)
    -> distributed.{hosts, tasks} -> exogym -> torch
    (distributed.hosts.onhost: shipped to hosts as source, imports nothing of the project)

Every import counts, at the top of a file or inside a function, so a lazy
import cannot hide an upward arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What each layer may import from the project, besides itself.
ALLOWED: dict[str, set[str]] = {
    "faces": {"distributed.app"},
    "distributed.app": {"distributed.launch", "distributed.worker", "distributed.planning",
                        "distributed.profiles", "distributed.hosts", "distributed.tasks",
                        "exogym"},
    "distributed.launch": {"distributed.worker", "distributed.profiles", "distributed.hosts",
                           "exogym"},
    "distributed.worker": {"distributed.profiles", "distributed.hosts", "distributed.tasks",
                           "exogym"},
    "distributed.planning": {"distributed.profiles", "distributed.hosts", "distributed.tasks",
                             "exogym"},
    "distributed.profiles": {"distributed.hosts", "distributed.tasks", "exogym"},
    "distributed.hosts.onhost": set(),
    "distributed.hosts": {"distributed.hosts.onhost", "exogym"},
    "distributed.tasks": {"exogym"},
    "distributed.entry": {"distributed.app", "distributed.launch", "distributed.tasks"},
    "exogym": set(),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    files = [*ROOT.glob("exogym/**/*.py"), *ROOT.glob("distributed/**/*.py"),
             ROOT / "cli_typer.py", ROOT / "wizard.py"]
    return {module_name(f): f for f in files}


def layer_of(module: str) -> str:
    if module in ("cli_typer", "wizard"):
        return "faces"
    if module == "distributed":
        return "distributed.entry"  # the package's lazy names
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    raise AssertionError(f"{module} belongs to no layer: add its folder to ALLOWED")


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """Project modules ``module`` imports (the longest known name each import reaches)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in known else base)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {m: imports_of(m, p, known) for m, p in modules.items()}


def test_every_import_points_down_the_layers(graph):
    wrong = []
    for module, targets in sorted(graph.items()):
        layer = layer_of(module)
        for target in sorted(targets):
            other = layer_of(target)
            if other == "distributed.hosts.onhost" and "distributed.hosts" in ALLOWED[layer]:
                continue  # the scripts shipped to hosts come with the hosts layer
            if other != layer and other not in ALLOWED[layer] and not (
                    layer == "faces" and other == "faces"):
                wrong.append(f"{module} -> {target} ({layer} may import only "
                             f"{', '.join(sorted(ALLOWED[layer])) or 'nothing of the project'})")
    assert not wrong, "upward or sideways imports:\n  " + "\n  ".join(wrong)


def test_no_import_cycles(graph):
    seen: dict[str, int] = {}  # 1: on the current path, 2: finished
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for target in sorted(graph.get(module, ())):
            if seen.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in seen:
                visit(target, path + [target])
        seen[module] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [module])
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_exogym_never_imports_distributed_or_the_faces_libraries(graph):
    banned = ("distributed", "paramiko", "typer", "questionary")
    offenders = []
    for module, path in project_modules().items():
        if not module.startswith("exogym"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{module} imports {n}" for n in names if n.split(".")[0] in banned]
    assert not offenders, offenders


def test_the_layer_rules_catch_an_upward_import(tmp_path):
    """The checker itself: an import from hosts up into launch is reported."""
    module = "distributed.hosts.example"
    source = tmp_path / "example.py"
    source.write_text("from distributed.launch.launcher import Launcher\n")
    known = {"distributed.launch.launcher", module}
    targets = imports_of(module, source, known)
    assert targets == {"distributed.launch.launcher"}
    assert layer_of("distributed.launch.launcher") not in ALLOWED[layer_of(module)]


def test_the_names_users_import_from_distributed_load_lazily():
    """``import distributed`` loads no torch; the plan's names resolve on first use."""
    import subprocess
    import sys

    code = ("import sys, distributed; assert 'torch' not in sys.modules, 'torch loaded'; "
            "from distributed import NetworkTrainer, DistributedLauncher, WhisperModelWrapper; "
            "print(NetworkTrainer.__module__, DistributedLauncher.__name__, "
            "WhisperModelWrapper.__name__)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["distributed.app.network_trainer", "Launcher",
                                   "WhisperModelWrapper"]
