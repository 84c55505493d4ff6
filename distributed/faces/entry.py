"""The installed ``exogym`` command: the command line of :mod:`.cli`, or, when the
``distributed`` extra that it needs is missing, one line that says how to install it."""

from __future__ import annotations

import sys

#: What ``pip install exogym`` alone leaves out and the command line needs.
NEEDS_EXTRA = ("typer", "click", "questionary", "paramiko", "zeroconf")


def main() -> int:
    """Run ``exogym ARGS``; exit 2 with the install command when the extra is missing."""
    try:
        from .cli import app
    except ModuleNotFoundError as exc:
        if exc.name not in NEEDS_EXTRA:
            raise
        from ..app.about import install_extra

        print(f"exogym: the command line needs the 'distributed' extra ({exc.name} is not "
              f"installed); install it with: {install_extra('distributed')}", file=sys.stderr)
        return 2
    return app()


if __name__ == "__main__":
    sys.exit(main())
