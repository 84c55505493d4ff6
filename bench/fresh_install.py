"""How long a newcomer waits: the README's first command in a fresh clone, a fresh virtual
environment and an empty pip cache, from the command to the first training line.

Clones this checkout (its committed state) into a temporary folder, makes a venv there,
points pip's cache at a new empty folder, and runs the first command of the README's quick
start as written: its install (the part before the first ``&&``), then the rest, which
trains. Prints the seconds to the end of the install, to the first training line
(``[local:N] step ...``) and to the end. ``--uv`` times the same install with
``uv pip install`` instead (uv comes from pip first, untimed, and gets an empty cache of
its own; it does not read pip's settings, so pip's find-links are passed on to it).
Run from the project root:

    python -m bench.fresh_install
    python -m bench.fresh_install --uv
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from bench.harness import ROOT
from bench.harness.tables import print_table
from tests.doc_blocks import code_block

#: A line the run prints for a step of training.
TRAINING_LINE = re.compile(r"\[local:\d+\] step \d+")


def first_command(readme: Path) -> str:
    """The first line of the README's quick-start block."""
    return code_block(str(readme), "## Quick start", "bash").splitlines()[0]


def with_uv(install: str) -> str:
    """``install`` (a ``pip install ...``) as ``uv pip install ...``; uv compiles nothing
    unless asked, so pip's ``--no-compile`` has no counterpart."""
    if not install.startswith("pip install "):
        raise SystemExit(f"the README's install is not a plain pip install: {install!r}")
    return "uv " + install.replace(" --no-compile", "")


def venv_env(venv: Path, cache: Path) -> dict[str, str]:
    """The environment of a shell with ``venv`` activated and empty caches."""
    env = dict(os.environ, VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{os.environ['PATH']}",
               PIP_CACHE_DIR=str(cache / "pip"), UV_CACHE_DIR=str(cache / "uv"))
    env.pop("PYTHONPATH", None)
    if "PIP_FIND_LINKS" in os.environ:  # uv reads no pip settings
        env["UV_FIND_LINKS"] = os.environ["PIP_FIND_LINKS"]
    return env


def timed(command: str, *, cwd: Path, env: dict[str, str], started: float,
          log: Path) -> tuple[float | None, float]:
    """Run ``command`` in bash; seconds since ``started`` to its first training line (None
    when there was none) and to its end. Its output goes to ``log``."""
    first = None
    with open(log, "a") as out:
        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if first is None and TRAINING_LINE.search(line):
                first = time.perf_counter() - started
        code = proc.wait()
    if code != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{command!r} exited with {code}; the end of its output:\n{tail}")
    return first, time.perf_counter() - started


def measure(uv: bool, console: Console) -> tuple[str, float, float | None, float]:
    """Clone, venv, the README's first command: (its install, and its three figures)."""
    with tempfile.TemporaryDirectory(prefix="fresh-install-") as tmp:
        work = Path(tmp)
        clone = work / "exogym"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        install, _, run = first_command(clone / "README.md").partition(" && ")
        if not run:
            raise SystemExit(f"the README's first command has no '&&' after its install: {install!r}")
        subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
        env = venv_env(work / "venv", work / "cache")
        if uv:
            subprocess.run(["pip", "install", "-q", "uv"], env=env, check=True)
            install = with_uv(install)
        log = work / "output.log"
        console.print(f"{install} && {run}  (in {clone})", markup=False, highlight=False)
        started = time.perf_counter()
        timed(install, cwd=clone, env=env, started=started, log=log)
        installed = time.perf_counter() - started
        first, end = timed(run, cwd=clone, env=env, started=started, log=log)
        return install, installed, first, end


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fresh_install",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--uv", action="store_true",
                        help="also time the install with uv pip install, for comparison")
    args = parser.parse_args()
    console = Console()
    rows = []
    for uv in (False, True) if args.uv else (False,):
        install, installed, first, end = measure(uv, console)
        rows.append(("uv pip" if uv else "pip", f"{installed:.0f} s",
                     "none" if first is None else f"{first:.0f} s", f"{end:.0f} s"))
    print_table(f"the README's first command, fresh venv, empty cache ({os.cpu_count()} cores)",
                ("install with", "installed", "first training line", "end"), rows,
                left=("install with",), console=console, title_justify="left")


if __name__ == "__main__":
    main()
