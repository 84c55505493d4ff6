"""The command line as a mature tool: what a person meets before, around and after a command.

Each test pins one rough edge a user met: ``--version`` and shell completion
on both faces, the command list in ``--help`` whole, a printed command that
runs as printed, output to a file or a pipe not folded at 80 columns, plurals,
extras named with the command that installs them, compare's time columns and
what ``recommend`` tells to run. The programs run as programs (a real bash
completes them), except where Typer's test runner is enough to read a message.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from ranks import ROOT
from typer.testing import CliRunner

import cli_typer

runner = CliRunner()


def program(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``args`` (a program of the project, its arguments) with this Python first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PATH": path, **(env or {})})


def flat(text: str) -> str:
    """``text`` with every run of white space as one space (help pages wrap lines)."""
    return " ".join(text.split())


# --------------------------------------------------------------------------- --version


@pytest.mark.parametrize("face", ["cli_typer.py", "wizard.py"])
def test_version_names_the_package_version_the_commit_and_python(face):
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                         re.M).group(1)
    done = program(sys.executable, face, "--version")
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith(f"exogym {declared} ({face}"), line
    assert f"Python {sys.version.split()[0]}" in line
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    if head.returncode == 0:
        assert f"commit {head.stdout.strip()}" in line, line


def test_version_answers_without_importing_torch():
    code = ("import sys\nfrom typer.testing import CliRunner\nimport cli_typer\n"
            "result = CliRunner().invoke(cli_typer.app, ['--version'])\n"
            "assert result.exit_code == 0 and 'exogym' in result.output, result.output\n"
            "print('torch' in sys.modules)\n")
    done = program(sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


# --------------------------------------------------------------------------- completion


def bash_completions(face: str, words: list[str]) -> list[str]:
    """What a real bash offers for ``./FACE WORDS...<Tab>``, through the script the program's
    ``--show-completion bash`` prints."""
    function = "_" + re.sub(r"[^a-zA-Z0-9_]", "", face.replace("-", "_")) + "_completion"
    line = " ".join(shlex.quote(w) for w in [f"./{face}", *words])
    script = (f"source <(./{face} --show-completion bash)\n"
              f"COMP_WORDS=({line}); COMP_CWORD={len(words)}\n"
              f"{function} ./{face}\n"
              'printf "%s\\n" "${COMPREPLY[@]}"\n')
    done = program("bash", "-c", script)
    assert done.returncode == 0, done.stderr
    return [w for w in done.stdout.splitlines() if w]


def test_bash_completes_commands_options_and_profile_names():
    assert bash_completions("cli_typer.py", ["distributed-tr"]) == ["distributed-train"]
    assert bash_completions("cli_typer.py", ["compare", "--strat"]) == ["--strategies"]
    profiles = bash_completions("cli_typer.py", ["compare", "digits-d"])
    assert {"digits-ddp", "digits-diloco"} <= set(profiles)
    assert all(p.startswith("digits-d") for p in profiles)
    assert "--yes" in bash_completions("wizard.py", ["--y"])


def test_profile_completion_reads_the_config_given(tmp_path):
    config = tmp_path / "mine.ini"
    config.write_text("[distributed:zebra-run]\ntask = digits\n")
    assert bash_completions("cli_typer.py", ["compare", "--config", str(config), "z"]) == [
        "zebra-run"]


@pytest.mark.parametrize("face", ["cli_typer.py", "wizard.py"])
def test_install_completion_writes_the_script_and_sources_it_from_bashrc(tmp_path, face):
    done = program("bash", "-c", f"./{face} --install-completion", env={"HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    script = tmp_path / ".bash_completions" / f"{face}.sh"
    assert "complete -o default -F" in script.read_text()
    assert str(script) in (tmp_path / ".bashrc").read_text()


def test_both_faces_run_by_their_name():
    for face in ("cli_typer.py", "wizard.py"):
        assert os.access(ROOT / face, os.X_OK), face
        assert (ROOT / face).read_text().startswith("#!/usr/bin/env python3\n"), face


# --------------------------------------------------------------------------- --help


def test_top_level_help_lists_every_command_with_its_whole_summary():
    done = program(sys.executable, "cli_typer.py", "--help", env={"COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    commands = done.stdout.split("Commands:", 1)[1]
    assert "..." not in commands and "…" not in commands
    group = typer.main.get_command(cli_typer.app)
    for name, command in group.commands.items():
        summary = flat((command.help or "").split("\n\n")[0])
        assert summary and summary in flat(commands), (name, summary, commands)
    assert all(len(line) <= 80 for line in done.stdout.splitlines())
