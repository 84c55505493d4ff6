"""Open the browser dashboard for one command, and keep it serving once the run is over.

With ``--web`` a command prints the page's URL before training starts
(:func:`open_web`). When the run has finished, the page shows its final state
for as long as the command lives (:func:`keep_serving`): on a terminal the
command says so and waits for Enter or Ctrl-C; with no terminal attached (CI,
a pipe, ``nohup``) it says the page stops with it and exits at once. A run
that fails or is interrupted ends the command, and the page with it.
"""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console

from .server import WebDashboard


def open_web(enabled: bool, console: Console, *, host: str = "127.0.0.1", port: int = 0,
             title: str = "exogym") -> WebDashboard | None:
    """The command's ``WebDashboard``, serving, its URL printed; None when not ``enabled``.

    Args:
        enabled: ``--web`` was given.
        console: where the URL goes.
        host: ``--web-host``; port: ``--web-port`` (0: a free port).
        title: the page's title.

    Raises:
        ImportError: plotly is missing (the message names the extra).
        ValueError: the address cannot be bound.
    """
    if not enabled:
        return None
    web = WebDashboard(host, port, title=title)
    shared = " (shared on the LAN: the URL's token is required)" if web.token else ""
    console.print(f"dashboard: {web.url}{shared}", markup=False, soft_wrap=True)
    return web


def keep_serving(web: WebDashboard | None, console: Console, stdin: TextIO | None = None
                 ) -> bool:
    """After the run: keep the page up until Enter or Ctrl-C when a person is at a
    terminal, then stop it. Returns True when it waited, False otherwise."""
    if web is None:
        return False
    stdin = stdin or sys.stdin
    try:
        if not (stdin is not None and stdin.isatty()):
            console.print(f"The run is over; no terminal is attached, so the dashboard at "
                          f"{web.url} stops now.", markup=False, soft_wrap=True)
            return False
        console.print(f"The run is over; the dashboard keeps serving its final state at "
                      f"{web.url}. Press Enter (or Ctrl-C) to exit.",
                      markup=False, soft_wrap=True)
        try:
            stdin.readline()
        except KeyboardInterrupt:
            pass
        return True
    finally:
        web.stop()
