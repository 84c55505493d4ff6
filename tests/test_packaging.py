"""Every third-party module the code imports is declared in pyproject.toml, in an extra
that installs it, and no shipped module needs a development-only package.

deptry reads the imports and maps them to the installed distributions, so these tests
run in the environment of ``pip install -e ".[dev]"``. Its settings are
``[tool.deptry]`` in pyproject.toml: a plain ``deptry .`` checks the code that ships
(exogym/, distributed/, cli_typer.py, wizard.py); a second run here checks tests/,
bench/, examples/ and docs/, which may also import the ``dev`` and ``docs`` extras.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: What the second run leaves out: the shipped code (the first run's) and what is no code of ours.
NOT_DEV_CODE = [r"\.?venv", r"\.git", "build", "site", "exogym/", "distributed/",
                r"cli_typer\.py", r"wizard\.py", r"setup\.py"]


def deptry(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``deptry .`` in ``root``; its report (on stderr) in ``stdout``."""
    return subprocess.run([sys.executable, "-m", "deptry", ".", "--no-ansi", *args], cwd=root,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)


def scanned_files(result: subprocess.CompletedProcess[str]) -> int:
    found = re.search(r"Scanning (\d+) files", result.stdout)
    assert found, result.stdout
    return int(found[1])


@pytest.mark.slow
def test_shipped_code_imports_only_declared_runtime_packages():
    result = deptry(ROOT)
    assert result.returncode == 0, f"deptry . found dependency issues:\n{result.stdout}"
    assert scanned_files(result) > 100, result.stdout  # exogym/ and distributed/ have more


@pytest.mark.slow
def test_tests_benches_examples_and_docs_import_only_declared_packages():
    excludes = [arg for pattern in NOT_DEV_CODE for arg in ("--exclude", pattern)]
    # DEP004 (a dev package imported) is what this code may do; DEP002 (declared, unused)
    # is the first run's question, which sees the code that uses them.
    result = deptry(ROOT, *excludes, "--ignore", "DEP002,DEP004")
    assert result.returncode == 0, f"deptry found dependency issues:\n{result.stdout}"
    assert scanned_files(result) > 100, result.stdout  # tests/ alone has more


def test_deptry_settings_refuse_a_missing_a_transitive_and_a_dev_import(tmp_path: Path):
    """The settings are not vacuous: a shipped module importing a package nobody declared
    (DEP001), one that only arrives with another (ptyprocess, pexpect's, DEP003) and a
    dev-only package (pexpect, DEP004) each fail the check."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "exogym").mkdir()
    (tmp_path / "exogym" / "__init__.py").write_text(
        "import torch\nimport no_such_module_anywhere\nimport ptyprocess\nimport pexpect\n")
    result = deptry(tmp_path, "--ignore", "DEP002")
    assert result.returncode != 0
    for code, module in [("DEP001", "no_such_module_anywhere"), ("DEP003", "ptyprocess"),
                         ("DEP004", "pexpect")]:
        assert f"{code} '{module}'" in result.stdout, result.stdout
