"""How fast the faces answer --help: `python cli_typer.py --help`, every command's, and the wizard's.

Each is run as a fresh process several times; the table gives the fastest
and the median wall time, next to a bare `python -c pass` for the
interpreter's own start. Also says whether importing the CLI pulls in torch
(it must not). Run from the project root:

    python -m bench.cli_help_time
    python -m bench.cli_help_time --repeat 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from rich.console import Console

from bench.harness import ROOT
from bench.harness.tables import print_table
from bench.harness.timing import timed_run

COMMANDS = ("distributed-train", "check-hosts", "profiles", "compare", "whisper-convert",
            "whisper-synthesize")


def wall_times(args: list[str], repeat: int) -> list[float]:
    """Seconds each of ``repeat`` runs of ``python ARGS`` took, start to exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return [timed_run([sys.executable, *args], env=env).wall_s for _ in range(repeat)]


def heavy_imports() -> list[str]:
    """Heavy modules that importing the CLI and the wizard loads (should be none)."""
    code = ("import sys, cli_typer, wizard; "
            "print(' '.join(m for m in ('torch', 'paramiko', 'matplotlib', 'questionary') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True).stdout
    return out.split()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cli_help_time",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each command (default 5)")
    args = parser.parse_args()

    cases = [("python -c pass (interpreter start)", ["-c", "pass"]),
             ("cli_typer.py --help", ["cli_typer.py", "--help"])]
    cases += [(f"cli_typer.py {c} --help", ["cli_typer.py", c, "--help"]) for c in COMMANDS]
    cases.append(("wizard.py --help", ["wizard.py", "--help"]))

    rows = []
    for name, argv in cases:
        times = wall_times(argv, args.repeat)
        rows.append((name, f"{min(times) * 1000:.0f} ms",
                     f"{statistics.median(times) * 1000:.0f} ms"))
    console = Console()
    print_table(f"--help wall time, {args.repeat} runs each", ("command", "fastest", "median"),
                rows, left=("command",), console=console, title_justify="left")
    heavy = heavy_imports()
    console.print("heavy modules imported by `import cli_typer, wizard`: "
                  + (", ".join(heavy) if heavy else "none"))


if __name__ == "__main__":
    main()
