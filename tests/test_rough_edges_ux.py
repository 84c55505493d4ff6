"""Rough edges a new user hit in compare, --help, the wizard and the results, each pinned.

Real parts throughout: the CLI and the wizard run as programs (their help at 80
columns), files are written under a chosen umask in a fresh process, and the
comparison plot is read back from matplotlib's own objects.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import typer.main
from ranks import ROOT

import cli_typer
import wizard

# --------------------------------------------------------------------------- --help


def _help_pages() -> list[tuple[str, list[str], object]]:
    """(program, argv, click command) for every command of both faces."""
    pages = []
    group = typer.main.get_command(cli_typer.app)
    pages.append(("cli_typer.py", [], group))
    for name, command in group.commands.items():
        pages.append(("cli_typer.py", [name], command))
    pages.append(("wizard.py", [], typer.main.get_command(wizard.app)))
    return pages


@pytest.mark.parametrize("program,argv,command", _help_pages(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_help_fits_80_columns_names_every_option_whole_and_shows_flags_bare(program, argv,
                                                                           command):
    env = {**os.environ, "COLUMNS": "80", "TERM": "xterm"}
    done = subprocess.run([sys.executable, program, *argv, "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    page = done.stdout
    too_wide = [line for line in page.splitlines() if len(line) > 80]
    assert not too_wide, too_wide
    assert "…" not in page, page
    assert "<bool>" not in page, page
    for param in command.params:
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("-"):
                assert re.search(rf"(^|[\s,/]){re.escape(opt)}($|[\s,=/])", page, re.M), (
                    opt, page)
        if getattr(param, "is_flag", False):
            for opt in param.opts:
                # a flag is shown alone: no value placeholder after its name
                line = next(ln for ln in page.splitlines()
                            if re.search(rf"(^|[\s,]){re.escape(opt)}(\s|$|/|,)", ln))
                after = line.split(opt, 1)[1]
                assert not after.startswith(" <"), (opt, line)
