"""The house's layers, read from the source: every import points down, and none forms a cycle.

    faces (cli_typer.py, wizard.py) -> distributed.faces (the command line, the wizard)
    -> distributed.app
    -> distributed.{launch, worker, planning, profiles}   (launch -> worker -> profiles,
                                                           planning -> profiles)
    -> distributed.{hosts, tasks} -> exogym -> torch
    (distributed.hosts.onhost: shipped to hosts as source, imports nothing of the project)

and inside exogym, folder by folder, each importing only the ones after it:

    exogym (the package and exo gym's import paths) -> run -> data -> config
    -> membership -> report -> sim -> strategy -> comm -> base

Every import counts, at the top of a file or inside a function, so a lazy
import cannot hide an upward arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# exogym's folders from the top down: each may import the ones after it.
EXOGYM_ORDER = ["exogym", "exogym.run", "exogym.data", "exogym.config", "exogym.membership",
                "exogym.report", "exogym.sim", "exogym.strategy", "exogym.comm", "exogym.base"]
EXOGYM = set(EXOGYM_ORDER)

# What each layer may import from the project, besides itself.
ALLOWED: dict[str, set[str]] = {
    "faces": {"distributed.faces"},
    "distributed.faces": {"distributed.app"},
    "distributed.app": {"distributed.launch", "distributed.worker", "distributed.planning",
                        "distributed.profiles", "distributed.hosts", "distributed.tasks",
                        *EXOGYM},
    "distributed.launch": {"distributed.worker", "distributed.profiles", "distributed.hosts",
                           *EXOGYM},
    "distributed.worker": {"distributed.profiles", "distributed.hosts", "distributed.tasks",
                           *EXOGYM},
    "distributed.planning": {"distributed.profiles", "distributed.hosts", "distributed.tasks",
                             *EXOGYM},
    "distributed.profiles": {"distributed.hosts", "distributed.tasks", *EXOGYM},
    "distributed.hosts.onhost": set(),
    "distributed.hosts": {"distributed.hosts.onhost", *EXOGYM},
    "distributed.tasks": {*EXOGYM},
    "distributed.entry": {"distributed.app", "distributed.launch", "distributed.tasks"},
}
ALLOWED.update({layer: set(EXOGYM_ORDER[i + 1:]) for i, layer in enumerate(EXOGYM_ORDER)})


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
        name = longest_known(name, known)
        if name and name != module:
            found.add(name)

    for node in ast.walk(tree):
        for name in imported_names(node, package, known):
            add(name)
    return found


def longest_known(name: str, known: set[str]) -> str:
    """The longest dotted prefix of ``name`` that is a project module ('' for none)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def imported_names(node: ast.AST, package: str, known: set[str]) -> list[str]:
    """The names an ``import`` or ``from ... import`` statement reaches (none for other nodes):
    a ``from`` import names the module it imports from, or the submodule it imports."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    names = []
    for alias in node.names:
        full = f"{base}.{alias.name}"
        names.append(full if full in known else base)
    return names


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {m: imports_of(m, p, known) for m, p in modules.items()}


@pytest.mark.slow
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


@pytest.mark.slow
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


# --------------------------------------------------------------------------- exogym's own rooms


def runtime_imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Project modules ``module`` imports when it is imported: module level only, leaving
    out ``if TYPE_CHECKING:`` blocks and imports inside functions. Importing ``a.b.c``
    runs ``a`` and ``a.b`` too, so they count."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def add(name: str) -> None:
        name = longest_known(name, known)
        if not name or name == module:
            return
        found.add(name)
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in known and not module.startswith(parent + "."):
                found.add(parent)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody,
                              *(h.body for h in node.handlers)):
                    visit(block)
            else:
                for name in imported_names(node, package, known):
                    add(name)

    visit(tree.body)
    return found


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest path of imports in an acyclic ``graph``, as the modules along it."""
    memo: dict[str, list[str]] = {}

    def from_(module: str) -> list[str]:
        if module not in memo:
            memo[module] = [module]
            for target in graph.get(module, ()):
                chain = [module, *from_(target)]
                if len(chain) > len(memo[module]):
                    memo[module] = chain
        return memo[module]

    return max((from_(m) for m in graph), key=len)


def test_exogym_keeps_at_most_four_top_level_modules_and_its_roles_in_folders():
    package = ROOT / "exogym"
    top = sorted(p.name for p in package.glob("*.py"))
    assert len(top) <= 4, f"exogym/ holds {len(top)} modules at its top level: {top}"
    folders = sorted(p for p in package.iterdir() if (p / "__init__.py").exists())
    assert len(folders) >= 5, folders
    for folder in folders:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8")))
        assert doc and doc.strip(), f"exogym/{folder.name}/__init__.py says nothing of its role"
        assert f"exogym.{folder.name}" in EXOGYM_ORDER, (
            f"exogym/{folder.name}/ has no place in EXOGYM_ORDER")


def test_the_longest_runtime_import_chain_in_exogym_is_six_modules_at_most():
    modules = {m: p for m, p in project_modules().items() if m.startswith("exogym")}
    known = set(modules)
    graph = {m: runtime_imports(m, p, known) for m, p in modules.items()}
    chain = longest_chain(graph)
    assert len(chain) <= 6, f"{len(chain)} modules: {' -> '.join(chain)}"


def test_the_chain_count_sees_a_long_chain(tmp_path):
    """The checker itself: a chain of seven is measured as seven, a TYPE_CHECKING import not at all."""
    names = [f"pkg.m{i}" for i in range(7)]
    graph = {}
    for i, name in enumerate(names):
        source = tmp_path / f"m{i}.py"
        lines = ["from typing import TYPE_CHECKING"]
        if i + 1 < len(names):
            lines.append(f"import {names[i + 1]}")
        lines.append("if TYPE_CHECKING:\n    import pkg.m0")
        source.write_text("\n".join(lines) + "\n")
        graph[name] = runtime_imports(name, source, set(names))
    assert graph["pkg.m6"] == set()
    assert len(longest_chain(graph)) == 7
