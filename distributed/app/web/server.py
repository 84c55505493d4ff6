"""The dashboard in the browser: a small HTTP server and the progress sink that feeds it.

``WebDashboard`` is an ``exogym.report.summary.ProgressSink`` (``on_event``, ``close``,
``finish``, plus the terminal dashboard's ``on_output`` and ``set_status``), so
it is fed exactly like ``distributed.app.dashboard.Dashboard``: by
``Trainer.fit(progress=...)`` in a local simulation, by the launcher's
``on_event`` across hosts (``distributed.app.fanout.FanOut`` feeds both).

The server is the standard library's ``ThreadingHTTPServer`` in a daemon thread:

- ``/`` the page (``index.html``, ``app.js``, ``app.css`` from this folder);
- ``/plotly.min.js`` the charts' library, read from the installed ``plotly``
  package (nothing comes from a CDN, so the page works offline on a LAN);
- ``/state`` a JSON snapshot (``WebState.view``);
- ``/events`` server-sent events: a full snapshot first, then what changed,
  at most every 0.2 s, so an update reaches the page well within a second.

Bound to 127.0.0.1 by default. Bound to any other address (``0.0.0.0`` shares
it on the LAN) it requires a random token, given in the printed URL
(``?token=...``); the page, once opened with it, keeps it in a cookie. Any
request without it gets 403. A request whose ``Host`` is not the dashboard's own
address gets 421, on loopback too (``guard.py``: against DNS rebinding). What one
peer may cost the process that trains (connections, time, bytes) is bounded
(``connection_limits.py``).
"""

from __future__ import annotations

import hmac
import importlib.util
import ipaddress
import json
import secrets
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from exogym.base.install_mode import install_extra

from .connection_limits import BoundedHandler, Limits
from .guard import MISDIRECTED, QuietHTTPServer, host_allowed
from .state import WebState

__all__ = ["WEB_EXTRA_HINT", "WebDashboard", "plotly_js_path"]

STATIC = Path(__file__).resolve().parent / "static"
PAGES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/index.html": ("index.html", "text/html; charset=utf-8"),
         "/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/app.css": ("app.css", "text/css; charset=utf-8")}
COOKIE = "exogym_token"
#: The install line of the web extra, as this install needs it.
WEB_EXTRA_HINT = install_extra("web")
#: Seconds between two messages of one event stream (changes in between are merged).
PUSH_INTERVAL_S = 0.2
#: Seconds ``stop`` gives open pages to receive the final state.
FLUSH_S = 1.0
#: Seconds of silence after which an event stream sends a comment, to notice a closed page.
KEEPALIVE_S = 10.0


def plotly_js_path() -> Path:
    """The ``plotly.min.js`` bundle shipped inside the installed ``plotly`` package.

    Raises:
        ImportError: when plotly is not installed, naming the extra that brings it.
    """
    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        raise ImportError(f"--web draws its charts with plotly.js from the plotly package, which "
                          f"is not installed: {WEB_EXTRA_HINT}")
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise ImportError(f"the installed plotly package has no {path}; reinstall it: "
                          f"{WEB_EXTRA_HINT}")
    return path


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def lan_address() -> str:
    """This machine's address on its LAN (the one its default route leaves from)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostname()


class _Handler(BoundedHandler):
    """Answers the page, its files, ``/state`` and ``/events``."""

    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # the training's output is what the terminal shows

    def _authorized(self, query: Mapping[str, list[str]]) -> bool:
        token = self.server.token
        if token is None:
            return True
        given = query.get("token", [""])[0]
        if not given:
            cookie = SimpleCookie(self.headers.get("Cookie", ""))
            given = cookie[COOKIE].value if COOKIE in cookie else ""
        return hmac.compare_digest(given.encode(), token.encode())

    def _send(self, status: int, body: bytes, content_type: str,
              headers: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802 - the base's name
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802 - the base's name
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if not host_allowed(self.headers.get("Host"), *self.server.server_address[:2]):
            self._send(HTTPStatus.MISDIRECTED_REQUEST, MISDIRECTED, "text/plain; charset=utf-8",
                       {"Connection": "close"})
            self.close_connection = True
            return
        if url.path == "/favicon.ico":
            self._send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
            return
        if not self._authorized(query):
            self._send(HTTPStatus.FORBIDDEN,
                       b"403: this dashboard is shared with a token: open the URL the command "
                       b"printed, with its ?token=...\n", "text/plain; charset=utf-8")
            return
        if url.path in PAGES:
            name, content_type = PAGES[url.path]
            headers = {"Cache-Control": "no-cache"}
            if self.server.token is not None and query.get("token"):
                headers["Set-Cookie"] = f"{COOKIE}={self.server.token}; Path=/; HttpOnly; " \
                                        "SameSite=Strict"
            self._send(HTTPStatus.OK, (STATIC / name).read_bytes(), content_type, headers)
        elif url.path == "/plotly.min.js":
            try:
                script = self.server.plotly_js()
            except OSError as exc:  # e.g. plotly uninstalled while the command runs
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR,
                           f"500: cannot read {self.server.plotly_path}: "
                           f"{exc.strerror or exc}; reinstall it: {WEB_EXTRA_HINT}\n".encode(),
                           "text/plain; charset=utf-8")
                return
            self._send(HTTPStatus.OK, script, "text/javascript; charset=utf-8",
                       {"Cache-Control": "max-age=3600"})
        elif url.path == "/state":
            body = json.dumps(self.server.state.view(0)).encode()
            self._send(HTTPStatus.OK, body, "application/json", {"Cache-Control": "no-store"})
        elif url.path == "/events":
            self._stream()
        else:
            self._send(HTTPStatus.NOT_FOUND, f"404: no {url.path} here\n".encode(),
                       "text/plain; charset=utf-8")

    def _stream(self) -> None:
        """Server-sent events: a full view, then each change, until the page or server goes."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        state = self.server.state
        version, since = -1, 0
        view: dict[str, Any] = {"closed": False}
        me = threading.get_ident()
        self.server.sent[me] = version
        try:
            while not self.server.stopping.is_set():
                now = state.wait_for_change(version, KEEPALIVE_S)
                if self.server.stopping.is_set():
                    break
                if now == version:
                    self.wfile.write(b": keepalive\n\n")
                else:
                    view = state.view(since)
                    version, since = view["version"], view["seq"]
                    self.wfile.write(b"data: " + json.dumps(view).encode() + b"\n\n")
                self.wfile.flush()
                self.server.sent[me] = version
                if view["closed"]:
                    break
                self.server.stopping.wait(PUSH_INTERVAL_S)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            pass  # the page was closed
        finally:
            self.server.sent.pop(me, None)


class _Server(QuietHTTPServer):
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], state: WebState, token: str | None,
                 plotly_path: Path, limits: Limits) -> None:
        self.limits = limits
        self.state = state
        self.token = token
        self.plotly_path = plotly_path
        self.stopping = threading.Event()
        self.sent: dict[int, int] = {}  # the state version each open event stream has sent
        self._plotly: bytes | None = None
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address_family = family
        super().__init__(address, _Handler)

    def plotly_js(self) -> bytes:
        if self._plotly is None:
            self._plotly = self.plotly_path.read_bytes()
        return self._plotly


class WebDashboard:
    """A run's live page in the browser, fed with metric events like the terminal dashboard.

    Args:
        host: the address to listen on: ``127.0.0.1`` (this machine only) or e.g.
            ``0.0.0.0`` (the LAN, which then needs the token of the printed URL).
        port: the port; 0 picks a free one.
        title: the page's title.
        token: the token a non-loopback page needs (default: a random one; never
            required on a loopback address).
        limits: what one peer may cost the server (default: :class:`Limits`' own).

    Raises:
        ImportError: when plotly (which ships plotly.js) is not installed.
        ValueError: when the port is out of range or the address cannot be bound (e.g. the
            port is taken).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, title: str = "exogym",
                 token: str | None = None, limits: Limits | None = None) -> None:
        plotly_path = plotly_js_path()
        if not 0 <= port <= 65535:
            raise ValueError(f"--web-port {port} is not a port: give 1-65535, or 0 for a free one")
        self.state = WebState(title)
        self.host = host
        if token is None and not is_loopback(host):
            token = secrets.token_urlsafe(16)
        self.token = None if is_loopback(host) else token
        try:
            self._server = _Server((host, port), self.state, self.token, plotly_path,
                                   limits or Limits())
        except OSError as exc:
            raise ValueError(f"--web cannot listen on {host}:{port}: {exc.strerror or exc}; give "
                          f"another --web-port (0 picks a free one)") from exc
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.2},
                                        name="exogym-web", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """Where to open the page (with the token when one is needed)."""
        shown = self.host
        if shown in ("0.0.0.0", "::", ""):
            shown = lan_address()
        if ":" in shown:
            shown = f"[{shown}]"
        query = f"?token={self.token}" if self.token else ""
        return f"http://{shown}:{self.port}/{query}"

    # ------------------------------------------------------------------ the sink

    def begin_run(self, name: str, config: Mapping[str, Any] | None = None,
                  num_ranks: int = 0, hosts: Sequence[str] | Mapping[int, str] | None = None
                  ) -> None:
        """Start showing a new run (its rows, its configuration); later events belong to it."""
        self.state.begin_run(name, config, num_ranks, hosts)

    def on_event(self, event: dict[str, Any]) -> None:
        """Take one metric event."""
        self.state.on_event(event)

    def on_output(self, line: Any) -> None:
        """A rank's printed line: the terminal shows it; the page does not."""

    def set_status(self, rank: int, status: str) -> None:
        """Mark a rank's outcome (``done``, ``failed``, ``stopped``)."""
        self.state.set_status(rank, status)

    def close(self) -> None:
        """The ranks stopped; the page keeps the last state (the server keeps serving)."""

    def finish(self, summary: Mapping[str, Any] | None = None, title: str = "run summary"
               ) -> None:
        """The run succeeded: show its final figures (a title with "failed" marks it failed)."""
        self.state.end_run(summary, failed="failed" in title)

    def fail(self) -> None:
        """The run stopped without finishing: show it as failed."""
        self.state.end_run(None, failed=True)

    # ------------------------------------------------------------------ the server

    def stop(self) -> None:
        """Stop serving (idempotent); open pages lose their connection."""
        if self._server.stopping.is_set():
            return
        self.state.close()
        final = self.state.version
        deadline = time.monotonic() + FLUSH_S  # let open pages receive the final state
        while time.monotonic() < deadline and any(v < final for v in self._server.sent.values()):
            time.sleep(0.02)
        self._server.stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> WebDashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
