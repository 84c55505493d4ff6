#!/usr/bin/env python3
"""The exogym command line, run from a checkout: ``python cli_typer.py COMMAND`` is what an
installed ``exogym COMMAND`` is (``pip install "exogym[distributed]"``).

    python cli_typer.py distributed-train                       # digits-diloco, simulated here
    python cli_typer.py distributed-train digits-diloco --hosts distributed_hosts.json
    python cli_typer.py setup-hosts distributed_hosts.json      # copy the project, make the venvs
    python cli_typer.py --help                                  # every command

The commands live in ``distributed/faces/cli.py``.
"""

import sys

from distributed.faces.cli import app

if __name__ == "__main__":
    sys.exit(app())
