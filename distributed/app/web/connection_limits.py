"""What one peer may cost a dashboard's HTTP server: connections, time and bytes.

A dashboard serves from inside the process that trains, so whatever a stranger
makes its server hold (a thread, a descriptor, a buffer) the training pays for.
The standard library's threading server starts a thread for every connection
and lets it wait for a request forever; here every connection is counted when
it is accepted, before any thread starts for it:

- **Connections.** At most ``per_address`` open connections from one address
  and ``total`` in all. When every place is taken, the connection that has waited
  longest without sending a byte of a request is closed to make room (an idle
  connection costs its holder nothing, so it must not keep others out); when
  none is idle, or one address holds its share, the newcomer is answered 503 and
  closed at once. Threads and descriptors are thus bounded by ``total`` (plus the
  few being closed), whatever arrives.
- **Time.** A request must arrive whole within ``request_s`` of its first byte
  (of the connection, for the first); a kept-alive connection that sends nothing
  for ``idle_s`` is closed; an answer the peer does not take within ``write_s``
  is given up.
- **Bytes.** A request line and its headers may hold ``header_bytes`` in all
  (431 beyond); a body, ``body_bytes`` (413 beyond: these servers take none). So
  what all requests hold at once is at most ``total * header_bytes``.

The first refusal of each kind is said once on stderr, naming the address and
the bound; later ones are counted (:attr:`BoundedHTTPServer.refusals`), not printed.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http import HTTPStatus
from http.client import HTTPException
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn

__all__ = ["BoundedHTTPServer", "BoundedHandler", "Limits", "RequestTooLarge"]

#: Connections being closed (to make room) beyond ``total`` before newcomers are refused.
CLOSING_MAX = 16
#: What a refused connection is told before it is closed.
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Connection: close\r\nRetry-After: 5\r\nContent-Length: 46\r\n\r\n"
        b"503: too many connections from here; try again")


@dataclass(frozen=True)
class Limits:
    """The bounds a server holds each peer to (module docstring).

    Args:
        per_address: open connections one address may hold.
        total: open connections in all.
        request_s: seconds a request may take to arrive whole.
        idle_s: seconds a kept-alive connection may wait for its next request.
        write_s: seconds an answer may wait for the peer to take it.
        header_bytes: bytes of a request line and its headers together.
        body_bytes: bytes of a request's body.
    """

    per_address: int = 16
    total: int = 64
    request_s: float = 5.0
    idle_s: float = 15.0
    write_s: float = 10.0
    header_bytes: int = 16 * 1024
    body_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("per_address", "total", "header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("request_s", "idle_s", "write_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be above 0 s, got {getattr(self, name)}")
        if self.body_bytes < 0:
            raise ValueError(f"Limits.body_bytes must be 0 or more, got {self.body_bytes}")


class RequestTooLarge(HTTPException):
    """A request line and headers longer than :attr:`Limits.header_bytes`."""


class _RequestReader:
    """A connection's incoming bytes, read against a deadline and a byte budget.

    Stands in for the handler's ``rfile`` (``readline``, ``read``, ``close``).
    """

    def __init__(self, sock: socket.socket, limits: Limits) -> None:
        self._sock = sock
        self._limits = limits
        self._buffer = bytearray()
        self._left = limits.header_bytes
        self._deadline = time.monotonic() + limits.request_s
        self.waiting_since: float | None = time.monotonic()  # None once a request has begun
        self.timed_out_mid_request = False
        self.too_large = False
        self.closed = False

    def next_request(self, wait_s: float) -> None:
        """Begin a request: a fresh budget, and ``wait_s`` for its first byte."""
        now = time.monotonic()
        self._left = self._limits.header_bytes
        self._deadline = now + wait_s
        self.too_large = False
        self.waiting_since = now
        if self._buffer:
            self._began(now)

    def _began(self, now: float) -> None:
        self.waiting_since = None
        self._deadline = min(self._deadline, now + self._limits.request_s)

    def _fill(self) -> bool:
        """Receive more bytes before the deadline; False at the end of the stream."""
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            self._timed_out()
        self._sock.settimeout(remaining)
        try:
            chunk = self._sock.recv(8192)
        except TimeoutError:
            self._timed_out()
        if chunk and self.waiting_since is not None:
            self._began(time.monotonic())
        self._buffer += chunk
        return bool(chunk)

    def _timed_out(self) -> NoReturn:
        self.timed_out_mid_request = self.waiting_since is None
        raise TimeoutError("the request did not arrive in time")

    def readline(self, size: int = -1) -> bytes:
        """One line, at most ``size`` bytes; past the budget, :class:`RequestTooLarge`."""
        limit = self._left + 1 if size < 0 else min(size, self._left + 1)
        while True:
            end = self._buffer.find(b"\n", 0, limit)
            if end >= 0:
                taken = end + 1
                break
            if len(self._buffer) >= limit or not self._fill():
                taken = min(limit, len(self._buffer))
                break
        line = bytes(self._buffer[:taken])
        del self._buffer[:taken]
        self._left -= len(line)
        if self._left < 0:
            self.too_large = True
            raise RequestTooLarge(f"the request line and headers pass "
                                  f"{self._limits.header_bytes} bytes")
        return line

    def read(self, size: int) -> bytes:
        """``size`` bytes of a body (fewer at the end of the stream)."""
        while len(self._buffer) < size and self._fill():
            pass
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def close(self) -> None:
        self.closed = True


class BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that holds each peer to :class:`Limits` (module docstring).

    Its handler must be a :class:`BoundedHandler`.
    """

    daemon_threads = True
    request_queue_size = 64
    #: The bounds; a subclass or an instance may set its own.
    limits = Limits()
    #: How the server names itself in what it says on stderr.
    label = "dashboard"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock = threading.Lock()
        self._per_address: Counter[str] = Counter()
        self._open: dict[int, tuple[socket.socket, str, _RequestReader]] = {}
        self._closing: set[int] = set()
        #: Refusals so far, by kind (``per_address``, ``total``, ``made_room``,
        #: ``request_s``, ``header_bytes``, ``body_bytes``).
        self.refusals: Counter[str] = Counter()
        super().__init__(*args, **kwargs)

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet closed (those being closed included)."""
        with self._lock:
            return len(self._open)

    @property
    def idle_connections(self) -> int:
        """Open connections waiting for a request, none of whose bytes has arrived."""
        with self._lock:
            return sum(reader.waiting_since is not None for _, _, reader in self._open.values())

    def refuse(self, kind: str, address: str, detail: str = "") -> None:
        """Count a refusal; say the first of its kind on stderr."""
        with self._lock:
            self.refusals[kind] += 1
            first = self.refusals[kind] == 1
        if not first:
            return
        limits = self.limits
        why = {"per_address": f"it holds {limits.per_address} connections, the most one "
                              f"address may",
               "total": f"{limits.total} connections are open, the most this server takes, "
                        f"and none of them can be closed to make room (none is idle)",
               "made_room": f"{limits.total} connections are open, the most this server "
                            f"takes: the one idle longest (from {detail}) was closed",
               "request_s": f"its request did not arrive whole within {limits.request_s:g} s",
               "header_bytes": f"its request line and headers passed {limits.header_bytes} "
                               f"bytes",
               "body_bytes": f"it sent a body ({detail}); this server takes at most "
                             f"{limits.body_bytes} bytes"}[kind]
        verb = "made room for" if kind == "made_room" else "refused"
        print(f"{self.label}: {verb} a connection from {address}: {why} (further ones are "
              f"counted, not shown)", file=sys.stderr, flush=True)

    def process_request(self, request: Any, client_address: Any) -> None:
        address = str(client_address[0]) if isinstance(client_address, tuple) else "?"
        kind, evicted = self._admit(request, address)
        if evicted is not None:
            self.refuse("made_room", address, evicted)
        if kind is not None:
            self.refuse(kind, address)
            self._turn_away(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def _admit(self, request: socket.socket, address: str) -> tuple[str | None, str | None]:
        """Count ``request`` in; else the kind of refusal. Also whom room was made from."""
        with self._lock:
            if self._per_address[address] >= self.limits.per_address:
                return "per_address", None
            evicted = None
            if len(self._open) - len(self._closing) >= self.limits.total:
                victim = self._idle_longest()
                if victim is None or len(self._open) >= self.limits.total + CLOSING_MAX:
                    return "total", None
                sock, evicted, _ = self._open[victim]
                self._closing.add(victim)
                self._per_address[evicted] -= 1
                if self._per_address[evicted] <= 0:
                    del self._per_address[evicted]
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # its thread reads the end, and ends
                except OSError:
                    pass
            self._per_address[address] += 1
            self._open[id(request)] = (request, address, _RequestReader(request, self.limits))
            return None, evicted

    def _idle_longest(self) -> int | None:
        idle = [(reader.waiting_since, key) for key, (_, _, reader) in self._open.items()
                if key not in self._closing and reader.waiting_since is not None]
        return min(idle)[1] if idle else None

    def reader(self, request: socket.socket) -> _RequestReader:
        """What an admitted connection's handler reads its requests from."""
        with self._lock:
            return self._open[id(request)][2]

    def _release(self, request: socket.socket) -> None:
        with self._lock:
            entry = self._open.pop(id(request), None)
            if entry is not None and id(request) not in self._closing:
                self._per_address[entry[1]] -= 1
                if self._per_address[entry[1]] <= 0:
                    del self._per_address[entry[1]]
            self._closing.discard(id(request))

    def _turn_away(self, request: socket.socket) -> None:
        try:
            request.setblocking(False)
            request.send(BUSY)
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def server_close(self) -> None:
        """Close the listening socket and every open connection, so no thread lingers."""
        with self._lock:
            sockets = [sock for sock, _, _ in self._open.values()]
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        super().server_close()


class BoundedHandler(BaseHTTPRequestHandler):
    """A request handler that reads each request within :class:`Limits` of its server."""

    server: BoundedHTTPServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.rfile = self.server.reader(self.connection)  # type: ignore[assignment]
        self._requests = 0

    def handle_one_request(self) -> None:
        reader: _RequestReader = self.rfile  # type: ignore[assignment]
        limits = self.server.limits
        if self._requests:
            reader.next_request(limits.idle_s)
        self._requests += 1
        try:
            super().handle_one_request()
        except RequestTooLarge as exc:  # the request line alone passed the bound
            self.requestline, self.request_version, self.command = "", "HTTP/1.0", ""
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, str(exc))
        if reader.too_large:  # answered 431, by the line above or by parse_request
            self.close_connection = True
            self.server.refuse("header_bytes", self.client_address[0])
        if reader.timed_out_mid_request:
            self.server.refuse("request_s", self.client_address[0])

    def parse_request(self) -> bool:
        try:
            parsed = super().parse_request()
        finally:
            self.connection.settimeout(self.server.limits.write_s)
        if not parsed:
            return False
        length = self.headers.get("Content-Length", "0").strip() or "0"
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        size = int(length) if length.isdigit() else -1
        if chunked or not 0 <= size <= self.server.limits.body_bytes:
            self.server.refuse("body_bytes", self.client_address[0],
                               "chunked" if chunked else f"Content-Length {length[:20]}")
            self.send_error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                            f"this server takes at most {self.server.limits.body_bytes} "
                            f"bytes of a request body")
            self.close_connection = True
            return False
        if size:
            self.rfile.read(size)
            self.connection.settimeout(self.server.limits.write_s)
        return True
