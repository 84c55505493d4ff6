"""Module names that explain themselves: one meaning per file name, private modules kept home.

Three rules, read from the source:

- no two project modules (``exogym/``, ``distributed/``, ``cli_typer.py``,
  ``wizard.py``; not ``__init__.py`` or ``__main__.py``) share a file name,
  unless one is a compatibility re-export of the other, listed in
  ``COMPATIBILITY_REEXPORTS``: a reader who sees ``elastic.py`` in a traceback
  or an import should not have to ask which one;
- a module whose name starts with ``_`` is imported only from its own package
  (the folder it is in, not its subfolders): outside it, it is not private;
- the only ``setup.py`` is the repository's own, where packaging tools look
  for it; anywhere else the name promises something it does not do.
"""

from __future__ import annotations

import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
from test_layers import imports_of

ROOT = Path(__file__).resolve().parents[1]

#: A module kept under another's file name only to re-export it for old imports:
#: ``{re-export: the module it re-exports}``, both relative to the repository root.
COMPATIBILITY_REEXPORTS: dict[str, str] = {
    "exogym/trainer.py": "exogym/run/trainer.py",  # exo gym's ``from exogym.trainer import ...``
    "exogym/train_node.py": "exogym/run/train_node.py",  # and ``exogym.train_node``
}

# Modules that break a rule above while a restructure is under way (none now).
EXOGYM_PENDING: dict[str, str] = {}

UNNAMED = ("__init__.py", "__main__.py")


def project_files(root: Path) -> list[Path]:
    """The project's modules under ``root``, as the layer test reads them."""
    files = [*root.glob("exogym/**/*.py"), *root.glob("distributed/**/*.py")]
    return sorted(files + [f for f in (root / "cli_typer.py", root / "wizard.py") if f.exists()])


def relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def dotted(path: Path, root: Path) -> str:
    """``exogym/comm/__init__.py`` -> ``exogym.comm``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def shared_file_names(root: Path, reexports: dict[str, str],
                      pending: dict[str, str]) -> dict[str, list[str]]:
    """File names held by more than one module, with their paths, less the allowed ones."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in project_files(root):
        if path.name not in UNNAMED:
            by_name[path.name].append(relative(path, root))
    shared = {}
    for name, paths in sorted(by_name.items()):
        left = [p for p in paths if p not in pending
                and not (p in reexports and reexports[p] in paths)]
        if len(left) > 1:
            shared[name] = left
    return shared


def private_part(module: str) -> int | None:
    """Index of the first part of a dotted name that starts with ``_`` (not a dunder)."""
    for i, part in enumerate(module.split(".")):
        if part.startswith("_") and not part.startswith("__"):
            return i
    return None


def private_imports_from_outside(root: Path, pending: dict[str, str]) -> list[tuple[str, str]]:
    """``(importer, private module)`` for every private module imported outside its package."""
    modules = {dotted(path, root): path for path in project_files(root)}
    known = set(modules)
    found = []
    for importer, path in sorted(modules.items()):
        home = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for target in sorted(imports_of(importer, path, known)):
            index = private_part(target)
            if index is None or relative(modules[target], root) in pending:
                continue
            parts = target.split(".")
            package, private = ".".join(parts[:index]), ".".join(parts[:index + 1])
            inside = importer == private or importer.startswith(private + ".")
            if home != package and not inside:
                found.append((importer, target))
    return found


def repository_files(root: Path) -> list[str]:
    """Files git tracks under ``root`` and those it would add (ignored ones left out)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], check=True, capture_output=True).stdout
        return [p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        return [relative(p, root) for p in root.rglob("*") if p.is_file()
                and not any(part.startswith(".") or part in ("venv", "site-packages")
                            for part in p.relative_to(root).parts)]


def misplaced_setup_files(root: Path) -> list[str]:
    return sorted(p for p in repository_files(root)
                  if Path(p).name == "setup.py" and p != "setup.py")


def test_no_two_modules_share_a_file_name():
    shared = shared_file_names(ROOT, COMPATIBILITY_REEXPORTS, EXOGYM_PENDING)
    assert not shared, (
        "modules that share a file name (rename one so each name says what it holds, or list a "
        "compatibility re-export in COMPATIBILITY_REEXPORTS):\n  "
        + "\n  ".join(f"{name}: {', '.join(paths)}" for name, paths in shared.items()))


@pytest.mark.slow
def test_private_modules_are_imported_only_from_their_own_package():
    found = private_imports_from_outside(ROOT, EXOGYM_PENDING)
    assert not found, ("private modules imported from outside their package (drop the leading "
                       "underscore, or move the importer):\n  "
                       + "\n  ".join(f"{importer} -> {target}" for importer, target in found))


def test_the_only_setup_py_is_the_repository_root():
    found = misplaced_setup_files(ROOT)
    assert not found, (f"setup.py outside the repository root: {', '.join(found)}; name the "
                       "module after what it holds (setup.py is where packaging tools look)")


@pytest.mark.slow
def test_every_allowed_exception_is_still_needed():
    """An entry that no longer breaks a rule goes, so the lists only shrink."""
    sharing = {p for paths in shared_file_names(ROOT, {}, {}).values() for p in paths}
    imported_outside = {target for _, target in private_imports_from_outside(ROOT, {})}
    known = {dotted(p, ROOT) for p in project_files(ROOT)}
    stale = [f"EXOGYM_PENDING[{path!r}] ({why}): breaks no rule now"
             for path, why in EXOGYM_PENDING.items()
             if path not in sharing and dotted(ROOT / path, ROOT) not in imported_outside]
    for reexport, original in COMPATIBILITY_REEXPORTS.items():
        if reexport not in sharing or original not in sharing \
                or Path(reexport).name != Path(original).name:
            stale.append(f"COMPATIBILITY_REEXPORTS[{reexport!r}]: shares no name with {original}")
        elif dotted(ROOT / original, ROOT) not in imports_of(dotted(ROOT / reexport, ROOT),
                                                             ROOT / reexport, known):
            stale.append(f"COMPATIBILITY_REEXPORTS[{reexport!r}]: does not import {original}")
    assert not stale, "remove these entries:\n  " + "\n  ".join(stale)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checks_catch_a_shared_name_a_private_import_and_a_stray_setup_py(tmp_path):
    write(tmp_path, {
        "exogym/__init__.py": "", "exogym/_inner.py": "", "exogym/user.py": "from exogym import _inner\n",
        "exogym/sub/__init__.py": "", "exogym/sub/elastic.py": "from exogym._inner import x\n",
        "distributed/__init__.py": "", "distributed/app/__init__.py": "",
        "distributed/app/elastic.py": "", "distributed/app/setup.py": "", "setup.py": "",
        "distributed/app/old.py": "from exogym.sub.old import *\n", "exogym/sub/old.py": "",
    })
    assert shared_file_names(tmp_path, {}, {}) == {
        "elastic.py": ["distributed/app/elastic.py", "exogym/sub/elastic.py"],
        "old.py": ["distributed/app/old.py", "exogym/sub/old.py"]}
    assert shared_file_names(tmp_path, {"distributed/app/old.py": "exogym/sub/old.py"},
                             {"exogym/sub/elastic.py": "moving"}) == {}
    assert private_imports_from_outside(tmp_path, {}) == [("exogym.sub.elastic", "exogym._inner")]
    assert private_imports_from_outside(tmp_path, {"exogym/_inner.py": "moving"}) == []
    assert misplaced_setup_files(tmp_path) == ["distributed/app/setup.py"]
