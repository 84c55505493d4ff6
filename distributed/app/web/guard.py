"""What both dashboards' HTTP servers refuse and keep quiet about.

- **DNS rebinding.** A page on a stranger's site can make its own host name
  resolve to 127.0.0.1 (or this machine's LAN address) and then read a dashboard
  as if it were its own origin. The browser still sends the stranger's name in
  ``Host``, so a request whose ``Host`` is not one of this dashboard's own
  addresses is refused with 421: on loopback ``127.0.0.1:PORT``, ``[::1]:PORT`` or
  ``localhost:PORT``; bound elsewhere, an address literal or this machine's own
  name, with the dashboard's port. An address literal cannot be rebound.
- **What one peer may cost.** Connections per address and in all, the time a
  request may take and its size are bounded (``connection_limits.py``).
- **Closed connections.** A browser that closes a tab mid-response resets its
  connection; ``socketserver`` would print that as a traceback into the
  training's terminal. Resets and broken pipes are dropped; any other error is
  reported as one line on stderr, at most :data:`ERRORS_SHOWN` times per server.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading
from typing import Any

from .connection_limits import BoundedHTTPServer

__all__ = ["ERRORS_SHOWN", "QuietHTTPServer", "host_allowed", "MISDIRECTED"]

#: Errors a server reports on stderr before it reports only their count.
ERRORS_SHOWN = 5
#: The body of the 421 answer.
MISDIRECTED = (b"421: this dashboard answers only requests addressed to it by its own address "
               b"(the URL the command printed)\n")
#: Raised when the client went away: not worth a word.
GONE = (ConnectionError, TimeoutError)


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def _own_names() -> set[str]:
    names = {"localhost"}
    try:
        name = socket.gethostname().lower()
    except OSError:
        return names
    if name:
        names |= {name, name.split(".", 1)[0], name.split(".", 1)[0] + ".local"}
    return names


def host_allowed(header: str | None, bound: str, port: int) -> bool:
    """Whether a request's ``Host`` header names this dashboard.

    Args:
        header: the request's ``Host`` (None when absent: refused).
        bound: the address the server listens on.
        port: the port it listens on.
    """
    if not header:
        return False
    header = header.strip().lower()
    if header.startswith("["):
        host, _, rest = header[1:].partition("]")
        given_port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, given_port = header.rpartition(":") if ":" in header else (header, "", "")
    if given_port != str(port):
        return False
    address = _literal(host)
    bound_address = _literal(bound)
    if bound_address is not None and bound_address.is_loopback:
        return host == "localhost" or (address is not None and address.is_loopback)
    return address is not None or host in _own_names()


class QuietHTTPServer(BoundedHTTPServer):
    """A bounded threading HTTP server that does not print a traceback when a client goes
    away."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._errors = 0
        self._errors_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, GONE):
            return
        with self._errors_lock:
            self._errors += 1
            count = self._errors
        if count > ERRORS_SHOWN:
            return
        where = client_address[0] if isinstance(client_address, tuple) else client_address
        more = "; further errors are not shown" if count == ERRORS_SHOWN else ""
        print(f"dashboard: answering {where} failed: {type(error).__name__}: {error}{more}",
              file=sys.stderr, flush=True)
