"""Messages name what exists for how the project was installed: a checkout's
``python cli_typer.py`` and ``pip install -e '.[x]'``, the wheel's ``exogym`` and
``pip install 'exogym[x]'``; and the README's wheel install works from any folder."""

from __future__ import annotations

import ast
import re
import shlex
import sys
from pathlib import Path

import pytest
from doc_blocks import code_block
from ranks import ROOT
from typer.testing import CliRunner

from exogym.base import install_mode

#: What only a checkout has: its scripts, its example files, its editable install.
CHECKOUT_ONLY = ("cli_typer.py", "wizard.py", "pip install -e", ".json.example", "this checkout",
                 "This checkout")
#: What only the wheel's install says.
WHEEL_ONLY = ("pip install 'exogym[",)


@pytest.fixture
def installed(tmp_path, monkeypatch) -> Path:
    """The mode switch the helper reads: exogym/ found in a site-packages folder (no
    pyproject.toml, no cli_typer.py beside it) holding the package's lock."""
    site = tmp_path / "site-packages"
    (site / "exogym_distributed").mkdir(parents=True)
    (site / "exogym_distributed" / "constraints.txt").write_text("torch==2.13.0\n")
    monkeypatch.setattr(install_mode, "PROJECT_ROOT", site)
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "bin" / "exogym")])
    return site


def shown(text: str) -> str:
    return " ".join(text.split())


def test_from_a_checkout_messages_name_the_checkouts_commands():
    assert install_mode.from_checkout()
    assert install_mode.install_extra("whisper") == "pip install -e '.[whisper]' -c constraints.txt"
    if Path(sys.argv[0]).name != "exogym":
        assert install_mode.command("agent") == "python cli_typer.py agent"
        assert install_mode.wizard_command() == "python wizard.py"


def test_installed_messages_name_the_exogym_command_and_the_wheels_extras(installed):
    assert not install_mode.from_checkout()
    lock = installed / "exogym_distributed" / "constraints.txt"
    assert install_mode.install_extra("whisper") == f"pip install 'exogym[whisper]' -c {lock}"
    assert install_mode.command("agent") == "exogym agent"
    assert install_mode.wizard_command() == "exogym wizard"


def test_installed_every_message_a_person_meets_names_no_checkout_only_thing(installed, tmp_path,
                                                                           monkeypatch):
    from distributed.app.run import TrainRequest, train_command
    from distributed.hosts.hostsfile import HostsFileError, load_hosts
    from distributed.hosts.sync import BUILTIN_CONFIG
    from distributed.profiles.setup_files import local_profiles_header
    from distributed.tasks.extras import missing_extra, needed_extra

    said = []
    with pytest.raises(HostsFileError) as missing:
        load_hosts(tmp_path / "no_hosts.json")
    said.append(str(missing.value))
    said.append(local_profiles_header("config.ini"))
    said.append(train_command(TrainRequest(profile="digits-diloco", config=str(BUILTIN_CONFIG))))
    monkeypatch.setitem(sys.modules, "peft", None)
    said += [missing_extra("whisper"), needed_extra("whisper")]
    for text in said:
        assert not [s for s in CHECKOUT_ONLY if s in text], text
    assert "exogym wizard" in said[0]
    assert said[2] == "exogym distributed-train digits-diloco"  # the built-in config is the default
    assert "pip install 'exogym[whisper]' -c " in said[3]


def test_installed_the_command_line_refuses_a_missing_extra_with_the_wheels_install_line(
        installed, monkeypatch, tmp_path):
    from cli_typer import app

    monkeypatch.setitem(sys.modules, "peft", None)
    result = CliRunner().invoke(app, ["distributed-train", "whisper-tiny-diloco",
                                      "--set", f"output_dir={tmp_path / 'runs' / 'w'}"])
    assert result.exit_code == 2, result.output
    assert "pip install 'exogym[whisper]' -c " in shown(result.output), result.output
    assert not [s for s in CHECKOUT_ONLY if s in result.output], result.output


def literals(path: Path):
    """The string constants of ``path`` that are not docstrings, with their lines."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_message_names_a_command_file_or_install_line_of_one_mode_by_hand():
    """Such names come from exogym.base.install_mode, which knows the mode; a string written
    by hand says the same thing in both modes, and so the wrong thing in one."""
    found = []
    for path in sorted([*ROOT.glob("exogym/**/*.py"), *ROOT.glob("distributed/**/*.py")]):
        if path.name == "install_mode.py":
            continue
        for line, text in literals(path):
            if any(s in text for s in (*CHECKOUT_ONLY, *WHEEL_ONLY)):
                found.append(f"{path.relative_to(ROOT)}:{line}: {text[:80]!r}")
    assert not found, "\n".join(found)


# --------------------------------------------------------------------------- the wheel


def readme_install() -> list[str]:
    return [line.strip() for line in code_block("README.md", "**Installed**", "bash").splitlines()
            if line.strip()]


def test_the_readmes_wheel_install_roots_every_path_names_the_lock_and_the_default_profiles_extra():
    from distributed.faces.guided_setup import DEFAULT_PROFILE
    from distributed.profiles.profile import load_profile
    from distributed.tasks.extras import TASK_EXTRAS

    lines = readme_install()
    root = lines[0]
    assert re.fullmatch(r"EXOGYM=\S+", root), root
    install = next(shlex.split(line) for line in lines if line.startswith("pip install"))
    wheel = next(shlex.split(line) for line in lines if line.startswith("pip wheel"))
    for words in (install, wheel):
        for word in words:
            if "/" in word or word in (".", "dist", "constraints.txt"):
                assert word.startswith("$EXOGYM/") or word == "$EXOGYM", (word, words)
    assert install[install.index("-c") + 1] == "$EXOGYM/constraints.txt"
    extras = set(re.fullmatch(r"exogym\[(.*)\]", install[2])[1].split(","))
    task = load_profile(DEFAULT_PROFILE).task
    assert {"distributed", TASK_EXTRAS[task][0]} <= extras
    assert lines[-1] == "exogym distributed-train"


def test_a_missing_package_of_the_default_profile_is_refused_before_any_folder(monkeypatch,
                                                                              tmp_path):
    from cli_typer import app

    monkeypatch.setitem(sys.modules, "sklearn", None)
    runs = tmp_path / "runs"
    result = CliRunner().invoke(app, ["distributed-train", "--set",
                                      f"output_dir={runs / 'digits'}"])
    assert result.exit_code == 2, result.output
    assert "examples extra" in result.output and "pip install" in result.output, result.output
    assert not runs.exists()
