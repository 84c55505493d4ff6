"""How fast the faces answer --help: `python cli_typer.py --help`, every command's, and the wizard's.

Each is run as a fresh process several times; the table gives the fastest
and the median wall time, next to a bare `python -c pass` for the
interpreter's own start. Also says whether importing the CLI pulls in torch
(it must not). Run from the project root:

    python bench/cli_help_time.py
    python bench/cli_help_time.py --repeat 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("distributed-train", "check-hosts", "profiles", "compare", "whisper-convert",
            "whisper-synthesize")


def wall_times(args: list[str], repeat: int) -> list[float]:
    """Seconds each of ``repeat`` runs of ``python ARGS`` took, start to exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - started)
    return times


def heavy_imports() -> list[str]:
    """Heavy modules that importing the CLI and the wizard loads (should be none)."""
    code = ("import sys, cli_typer, wizard; "
            "print(' '.join(m for m in ('torch', 'paramiko', 'matplotlib', 'questionary') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True).stdout
    return out.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each command (default 5)")
    args = parser.parse_args()

    cases = [("python -c pass (interpreter start)", ["-c", "pass"]),
             ("cli_typer.py --help", ["cli_typer.py", "--help"])]
    cases += [(f"cli_typer.py {c} --help", ["cli_typer.py", c, "--help"]) for c in COMMANDS]
    cases.append(("wizard.py --help", ["wizard.py", "--help"]))

    table = Table(title=f"--help wall time, {args.repeat} runs each", title_justify="left")
    for column in ("command", "fastest", "median"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for name, argv in cases:
        times = wall_times(argv, args.repeat)
        table.add_row(name, f"{min(times) * 1000:.0f} ms",
                      f"{statistics.median(times) * 1000:.0f} ms")
    console = Console()
    console.print(table)
    heavy = heavy_imports()
    console.print("heavy modules imported by `import cli_typer, wizard`: "
                  + (", ".join(heavy) if heavy else "none"))


if __name__ == "__main__":
    main()
