"""A bounded front for a store that others can reach: what one peer may cost it.

torch's ``TCPStore`` server (C++) keeps whatever it is sent: values of up to 8 MiB
each, as many as arrive, and every connection for as long as its peer keeps it. So a
stranger who reaches a run's store could make the process that hosts it (the launcher)
hold gigabytes, or every descriptor it may open, until ranks restarted after a loss
could no longer reach it.

Here the store's server listens on loopback alone, and the run's public address is
served by :class:`StoreFront`: one thread that relays each connection to the server
and reads torch's store protocol (a command byte, then its arguments: numbers as 8
little-endian bytes, keys and values as a length and the bytes) far enough to hold
every peer to :class:`FrontLimits`:

- **Connections.** At most ``per_address`` open connections from one address and
  ``total`` in all (fewer where the process may open too few descriptors: each relayed
  connection takes two; a soft limit below 4,096 is first raised toward it). A
  connection must complete torch's client handshake (validate, then ping) within
  ``handshake_s`` of being accepted, or it is closed; only then is a connection to the
  server opened for it. When every place is taken, the connection waiting longest for
  its handshake is closed to make room; when none is waiting, the newcomer is refused.
- **Time.** A request must arrive whole within ``request_s`` of its first byte; an
  answer the peer does not take within ``write_s`` is given up, and the connection
  closed. A connection past its handshake may stay idle: a rank's client waits
  between rounds for as long as the run needs. Where the store is signed, only once it
  has sent a write the run signed (each client of the project sends one as it
  connects): until then it has ``proof_s`` from being accepted, and it is the first to
  make room when every place is taken.
- **Bytes.** A key may hold ``key_bytes``, a value ``value_bytes``, a request
  ``keys_per_request`` keys and ``request_bytes`` in all; a request past one is refused
  at its length, before its payload arrives. Everything the store holds (keys, values,
  and :data:`KEY_OVERHEAD` for each key) may come to ``stored_bytes``, and what one
  address wrote to ``stored_bytes_per_address``: a write past either is refused. A
  read whose answer could pass ``reply_bytes`` is refused.
- **One request at a time.** A connection's next request reaches the server only
  once the answer to the last has passed back (as torch's own client does: a wait
  that times out sends its cancel while it waits, which is let through), so the
  server never holds more than one request and one answer of a connection.

Commands the project never sends (torch's queues, key listings, barriers) are refused.
Given the run's key (a signed store's front), it also refuses every write the run did not
sign: a set or compare-and-set whose value lacks the run's signature for its key (a
compare-and-set that expects what it would write, a signed store's read, changes nothing
and passes), any add or append, and a delete of a key whose last write was not its
signed deletion mark (:mod:`exogym.comm.signing`; the front is handed how to check them).
A refused peer's connection is closed; the first refusal of each kind is said once on
stderr, naming the address and the bound, and later ones are counted
(:attr:`StoreFront.refusals`).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["FrontLimits", "Refused", "StoreFront", "parse_request"]

#: What a store's client sends first: the validate command and its magic number.
VALIDATE, PING = 0, 13
MAGIC = 0x3C85F7CE
(SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET,
 MULTI_SET, CANCEL_WAIT) = range(1, 13)
#: The commands a client of the project may send, by name (what a refusal says).
COMMANDS = {VALIDATE: "validate", SET: "set", COMPARE_SET: "compare_set", GET: "get",
            ADD: "add", CHECK: "check", WAIT: "wait", GETNUMKEYS: "num_keys",
            DELETE_KEY: "delete_key", APPEND: "append", MULTI_GET: "multi_get",
            MULTI_SET: "multi_set", CANCEL_WAIT: "cancel_wait", PING: "ping"}
#: The server's answers to a wait.
STOP_WAITING, WAIT_CANCELED = 0, 1
#: Bytes charged for each key the store holds, beyond its name and value: what the
#: server (and this front's own count) spends on an entry.
KEY_OVERHEAD = 128
#: What an ``add`` leaves in a key at most: a signed 64-bit number in decimal.
COUNTER_BYTES = 20
#: Bytes of an answer buffered for a peer before the server's side is read no further.
_OUT_HIGH = 256 * 1024
#: Seconds between looks at the connections' deadlines.
_SWEEP_S = 0.25
#: Descriptors kept for the rest of the process when the bound in all is derived.
_SPARE_FDS = 256
#: The soft descriptor limit a front raises a lower one toward (two per connection).
_WANTED_FDS = 4096

#: Addresses named in :meth:`StoreFront.describe_refused`, at most.
_STRANGERS_NAMED = 5

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class FrontLimits:
    """The bounds a :class:`StoreFront` holds each peer to (module docstring).

    Args:
        per_address: open connections one address may hold.
        total: open connections in all.
        handshake_s: seconds a new connection has to complete torch's client handshake.
        proof_s: where the store is signed, seconds a new connection has to send a write
            the run signed (a client of the project sends one as it connects,
            :data:`exogym.comm.signing.HELLO_KEY`); one that has not may hold its place no
            longer.
        request_s: seconds a request may take to arrive whole, from its first byte.
        write_s: seconds an answer may wait for the peer to take it.
        key_bytes: bytes of one key.
        value_bytes: bytes of one value.
        keys_per_request: keys one request may name.
        request_bytes: bytes of one request.
        stored_bytes: bytes the store may hold in all (keys, values, and
            :data:`KEY_OVERHEAD` a key).
        stored_bytes_per_address: of those, bytes one address's writes may hold.
        reply_bytes: bytes an answer may come to (a read of many keys).
    """

    # A rank holds several clients of the store (22 for three ranks, a host lost and back),
    # and one more for each group it forms, kept while the group lives.
    per_address: int = 256
    total: int = 1024
    handshake_s: float = 5.0
    proof_s: float = 15.0
    request_s: float = 10.0
    write_s: float = 30.0
    key_bytes: int = 4096
    value_bytes: int = 128 * 1024  # twice the project's own (store.MAX_VALUE_BYTES)
    keys_per_request: int = 4096
    request_bytes: int = 320 * 1024
    stored_bytes: int = 64 * 1024 * 1024
    stored_bytes_per_address: int = 16 * 1024 * 1024
    reply_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("per_address", "total", "key_bytes", "value_bytes", "keys_per_request",
                     "request_bytes", "stored_bytes", "stored_bytes_per_address",
                     "reply_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"FrontLimits.{name} must be at least 1, "
                                 f"got {getattr(self, name)}")
        for name in ("handshake_s", "proof_s", "request_s", "write_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"FrontLimits.{name} must be above 0 s, "
                                 f"got {getattr(self, name)}")


class Refused(Exception):
    """A peer went past one of the front's bounds: ``kind`` names it, ``detail`` says how."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(kind, detail)
        self.kind = kind
        self.detail = detail


@dataclass
class Request:
    """One whole request of a client, as far as the front needs to know it.

    Args:
        command: its command byte.
        size: its bytes on the wire.
        keys: the keys it names.
        writes: for each key it writes, ``(key, bytes the value may then hold, append)``.
        values: for each value it writes, ``(key, expected, value)``: ``expected`` is what
            a compare-and-set expects there, None for a set.
    """

    command: int
    size: int
    keys: list[bytes]
    writes: list[tuple[bytes, int, bool]]
    values: list[tuple[bytes, bytes | None, bytes]] = field(default_factory=list)


class _Reader:
    """Fields of a request in ``data`` from ``at``; None (incomplete) at the end of the data."""

    def __init__(self, data: bytes | bytearray, limits: FrontLimits):
        self.data = data
        self.at = 1
        self.limits = limits

    def _length(self, what: str, bound: int, kind: str) -> int | None:
        if len(self.data) < self.at + 8:
            return None
        size = _U64.unpack_from(self.data, self.at)[0]
        if size > bound:
            raise Refused(kind, f"{what} of {size:,} bytes")
        self.at += 8
        return size

    def number(self) -> int | None:
        if len(self.data) < self.at + 8:
            return None
        value = _U64.unpack_from(self.data, self.at)[0]
        self.at += 8
        return value

    def count(self) -> int | None:
        value = self.number()
        if value is not None and value > self.limits.keys_per_request:
            raise Refused("keys_per_request", f"{value:,} keys in one request")
        return value

    def key(self) -> bytes | None:
        size = self._length("a key", self.limits.key_bytes, "key_bytes")
        if size is None or len(self.data) < self.at + size:
            return None
        key = bytes(self.data[self.at:self.at + size])
        self.at += size
        return key

    def value(self) -> bytes | None:
        """A value, once all of it is here."""
        size = self._length("a value", self.limits.value_bytes, "value_bytes")
        if size is None or len(self.data) < self.at + size:
            return None
        value = bytes(self.data[self.at:self.at + size])
        self.at += size
        return value

    def check_size(self) -> None:
        if self.at > self.limits.request_bytes:
            raise Refused("request_bytes", f"a request of {self.at:,} bytes or more")


def parse_request(data: bytes | bytearray, limits: FrontLimits) -> Request | None:
    """The first request in ``data``; None while it is incomplete.

    Raises:
        Refused: the request is past a bound of ``limits``, or a command the project
            never sends: as soon as the length that passes it has arrived.
    """
    if not data:
        return None
    command = data[0]
    reader = _Reader(data, limits)
    keys: list[bytes] = []
    writes: list[tuple[bytes, int, bool]] = []
    values: list[tuple[bytes, bytes | None, bytes]] = []

    def done() -> Request:
        reader.check_size()
        return Request(command, reader.at, keys, writes, values)

    if command in (VALIDATE, PING):
        if len(data) < 5:
            return None
        if command == VALIDATE and _U32.unpack_from(data, 1)[0] != MAGIC:
            raise Refused("command", "a validate command without torch's magic number")
        reader.at = 5
        return done()
    if command in (GETNUMKEYS, CANCEL_WAIT):
        return done()
    if command in (SET, APPEND, COMPARE_SET, ADD, GET, DELETE_KEY):
        key = reader.key()
        if key is None:
            return None
        keys.append(key)
        if command in (SET, APPEND):
            value = reader.value()
            if value is None:
                return None
            writes.append((key, len(value), command == APPEND))
            values.append((key, None, value))
        elif command == COMPARE_SET:
            expected = reader.value()
            if expected is None:
                return None
            value = reader.value()
            if value is None:
                return None
            writes.append((key, len(value), False))
            values.append((key, expected, value))
        elif command == ADD:
            if reader.number() is None:
                return None
            writes.append((key, COUNTER_BYTES, False))
        reader.check_size()
        return done()
    if command in (CHECK, WAIT, MULTI_GET, MULTI_SET):
        count = reader.count()
        if count is None:
            return None
        for _ in range(count):
            key = reader.key()
            if key is None:
                reader.check_size()
                return None
            keys.append(key)
            if command == MULTI_SET:
                value = reader.value()
                if value is None:
                    reader.check_size()
                    return None
                writes.append((key, len(value), False))
                values.append((key, None, value))
            reader.check_size()
        return done()
    raise Refused("command", f"command {command}, which the project never sends")


class _Answer:
    """What is left of the server's answer to a connection's request, counted as it passes."""

    def __init__(self, parts: list[tuple[str, int]]):
        self.parts = parts  # ("bytes", n) to pass n bytes; ("vector", 0) for a length and bytes
        self.head = bytearray()
        self.cancel = False  # a cancelled wait: a stop-waiting may come before the cancel's own

    @property
    def done(self) -> bool:
        return not self.parts

    def feed(self, data: memoryview) -> None:
        """Count ``data`` (all of it belongs to this connection's answers)."""
        at = 0
        while at < len(data) and self.parts:
            kind, left = self.parts[0]
            if kind == "bytes":
                if self.cancel and left == 1 and data[at] == STOP_WAITING:
                    at += 1  # the wait's own answer: the cancel's follows
                    self.cancel = False
                    continue
                taken = min(left, len(data) - at)
                at += taken
                if taken == left:
                    self.parts.pop(0)
                else:
                    self.parts[0] = (kind, left - taken)
            else:
                need = 8 - len(self.head)
                self.head += data[at:at + need]
                at += min(need, len(data) - at)
                if len(self.head) == 8:
                    size = _U64.unpack(self.head)[0]
                    self.head.clear()
                    self.parts.pop(0)
                    if size:
                        self.parts.insert(0, ("bytes", size))


def _answer_for(request: Request) -> _Answer:
    command = request.command
    if command in (SET, APPEND, MULTI_SET, VALIDATE):
        return _Answer([])
    if command in (GET, COMPARE_SET):
        return _Answer([("vector", 0)])
    if command == MULTI_GET:
        return _Answer([("vector", 0)] * len(request.keys))
    if command in (ADD, GETNUMKEYS, DELETE_KEY):
        return _Answer([("bytes", 8)])
    if command == PING:
        return _Answer([("bytes", 4)])
    return _Answer([("bytes", 1)])  # check, wait, cancel_wait


class _Connection:
    """One peer's connection, and its relay to the server once its handshake is complete."""

    def __init__(self, sock: socket.socket, address: str, now: float):
        self.sock = sock
        self.fd = sock.fileno()
        self.address = address
        self.backend: socket.socket | None = None
        self.accepted = now
        self.handshake = 0  # commands of the handshake seen: validate, then ping
        self.proven = False  # it sent a write the run signed (a signed store's front)
        self.incoming = bytearray()
        self.request_since: float | None = None  # when the request now arriving began
        self.to_server = bytearray()
        self.to_peer = bytearray()
        self.peer_waiting_since: float | None = None  # when an answer began to wait on it
        self.answer: _Answer | None = None  # the answer to the request under way
        self.waiting = False  # the request under way is a wait
        self.closed = False


class StoreFront:
    """Serves a store on a public socket, holding every peer to :class:`FrontLimits`.

    Each connection that completes torch's client handshake is relayed to the store's
    server at ``backend`` (on loopback); see the module docstring for what is bounded.

    Args:
        listener: the listening socket of the public address (:func:`listen_on`).
        backend: the store server's ``(host, port)``.
        limits: the bounds.
        label: how the front names itself in what it says on stderr.
        say: where that is said (one line each); stderr when None.
        opened: where the store is signed (:class:`~exogym.comm.store.SignedStore`), what
            opens a value written at a key under the run's key (the key's name, the value):
            the value the run signed, None when it did not
            (:func:`exogym.comm.signing.opened` with the run's key). A write is then let
            through only when it carries the run's signature, a delete only for a key whose
            last write was ``deletion_mark``, and an add or append never (a signed store
            sends neither). The rest is refused and counted (:meth:`describe_refused`).
        deletion_mark: with ``opened``, the value the run writes to a key right before it
            deletes it (:data:`exogym.comm.signing.DELETION_MARK`).
    """

    def __init__(self, listener: socket.socket, backend: tuple[str, int],
                 limits: FrontLimits | None = None, label: str = "store",
                 say: Callable[[str], None] | None = None,
                 opened: Callable[[bytes, bytes], bytes | None] | None = None,
                 deletion_mark: bytes = b""):
        self.limits = limits or FrontLimits()
        self._opened = opened
        self._deletion_mark = deletion_mark
        self._marked: set[bytes] = set()  # keys whose last write was their deletion mark
        #: Addresses that sent what only someone without the run's key sends (the first few).
        self.strangers: list[str] = []
        self.total = min(self.limits.total, descriptor_room())
        self.backend = backend
        self.label = label
        self._say = say
        self._listener = listener
        listener.setblocking(False)
        self.port: int = listener.getsockname()[1]
        #: Refusals so far, by kind (the bounds' names, and ``made_room``).
        self.refusals: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._connections: dict[int, _Connection] = {}  # by the peer socket's descriptor
        self._per_address: Counter[str] = Counter()
        self._stored: dict[bytes, int] = {}  # what each key may hold, at most
        self._holder: dict[bytes, str] = {}  # whose writes each key holds
        self._held_by: Counter[str] = Counter()  # bytes of the store each address's writes hold
        #: Bytes the store may hold now (:attr:`FrontLimits.stored_bytes`).
        self.stored_bytes = 0
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=f"{label}-front", daemon=True)
        self._thread.start()

    # -- what others read -----------------------------------------------------------------
    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet closed."""
        with self._lock:
            return len(self._connections)

    def close(self) -> None:
        """Stop serving: the listening socket and every connection are closed."""
        if self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    # -- saying ---------------------------------------------------------------------------
    def refuse(self, kind: str, address: str, detail: str = "") -> None:
        """Count a refusal; say the first of its kind."""
        self.refusals[kind] += 1
        if self.refusals[kind] != 1:
            return
        limits = self.limits
        mib = 1024 * 1024
        why = {
            "per_address": f"it holds {limits.per_address} connections, the most one address "
                           f"may",
            "total": f"{self.total} connections are open, the most this store takes, and none "
                     f"is waiting for its handshake to be closed to make room",
            "made_room": f"{self.total} connections are open, the most this store takes: the "
                         f"one waiting longest for its handshake or for a write the run "
                         f"signed (from {detail}) was closed",
            "handshake_s": f"it did not complete a store client's handshake within "
                           f"{limits.handshake_s:g} s",
            "proof_s": f"it sent nothing the run signed within {limits.proof_s:g} s, as "
                       f"the run's own clients do when they connect",
            "request_s": f"its request did not arrive whole within {limits.request_s:g} s",
            "write_s": f"it did not take its answer within {limits.write_s:g} s",
            "key_bytes": f"it sent {detail}; a key may hold {limits.key_bytes:,} bytes",
            "value_bytes": f"it sent {detail}; a value may hold {limits.value_bytes:,} bytes",
            "keys_per_request": f"it sent {detail}; a request may name "
                                f"{limits.keys_per_request:,}",
            "request_bytes": f"it sent {detail}; a request may hold "
                             f"{limits.request_bytes:,} bytes",
            "stored_bytes": f"its write would take the store past "
                            f"{limits.stored_bytes / mib:g} MiB, the most it holds",
            "stored_bytes_per_address": f"its writes would hold more than "
                                        f"{limits.stored_bytes_per_address / mib:g} MiB of "
                                        f"the store, the most one address's may",
            "reply_bytes": f"its read could answer {detail}; an answer may hold "
                           f"{limits.reply_bytes / mib:g} MiB",
            "command": f"it sent {detail}",
            "unsigned": f"it sent {detail}, not signed by the run: its ranks sign every value "
                        f"they write",
            "delete": f"it asked to delete {detail}, which the run had not marked deleted: "
                      f"its ranks mark a key before they delete it",
        }[kind]
        verb = "made room for" if kind == "made_room" else "refused"
        line = (f"{self.label}: {verb} a connection from {address}: {why} (further ones are "
                f"counted, not shown)")
        if self._say is not None:
            self._say(line)
        else:
            print(line, file=sys.stderr, flush=True)

    # -- the loop -------------------------------------------------------------------------
    def _serve(self) -> None:
        next_sweep = time.monotonic() + _SWEEP_S
        try:
            while not self._stopping:
                for key, events in self._selector.select(timeout=_SWEEP_S):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        self._on_ready(key.data, key.fileobj, events)
                now = time.monotonic()
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + _SWEEP_S
        finally:
            for conn in list(self._connections.values()):
                self._close(conn)
            self._selector.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: the listener stays ready, so pause a moment
                time.sleep(0.05)
                return
            address = str(peer[0])
            if address.startswith("::ffff:"):
                address = address[7:]
            if self._per_address[address] >= self.limits.per_address:
                self.refuse("per_address", address)
                sock.close()
                continue
            if len(self._connections) >= self.total:
                waiting = [c for c in self._connections.values() if not self._settled(c)]
                if not waiting:
                    self.refuse("total", address)
                    sock.close()
                    continue
                oldest = min(waiting, key=lambda c: c.accepted)
                self.refuse("made_room", address, oldest.address)
                self._close(oldest)
            sock.setblocking(False)
            with contextlib.suppress(OSError):  # answers go out at once, as the server's do
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, address, time.monotonic())
            with self._lock:
                self._connections[conn.fd] = conn
            self._per_address[address] += 1
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _sweep(self, now: float) -> None:
        limits = self.limits
        for conn in list(self._connections.values()):
            kind = None
            if conn.handshake < 2 and now - conn.accepted > limits.handshake_s:
                kind = "handshake_s"
            elif not self._settled(conn) and now - conn.accepted > limits.proof_s:
                kind = "proof_s"
            elif conn.request_since is not None and now - conn.request_since > limits.request_s:
                kind = "request_s"
            elif (conn.peer_waiting_since is not None
                  and now - conn.peer_waiting_since > limits.write_s):
                kind = "write_s"
            if kind is not None:
                self.refuse(kind, conn.address)
                self._close(conn)

    def _on_ready(self, conn: _Connection, sock: socket.socket, events: int) -> None:
        if conn.closed:
            return
        try:
            if sock is conn.sock:
                if events & selectors.EVENT_WRITE:
                    self._flush(conn, conn.sock, conn.to_peer)
                if events & selectors.EVENT_READ and not conn.closed:
                    self._read_peer(conn)
            else:
                if events & selectors.EVENT_WRITE:
                    self._flush(conn, sock, conn.to_server)
                if events & selectors.EVENT_READ and not conn.closed:
                    self._read_server(conn)
            if not conn.closed:
                self._advance(conn)
        except Refused as refused:
            if refused.kind in ("unsigned", "delete"):
                _note_stranger(refused.kind, conn.address, self.strangers)
            self.refuse(refused.kind, conn.address, refused.detail)
            self._close(conn)
        except OSError:
            self._close(conn)

    def _read_peer(self, conn: _Connection) -> None:
        room = self.limits.request_bytes + 64 - len(conn.incoming)
        if room <= 0:
            return
        data = conn.sock.recv(min(room, 65536))
        if not data:
            raise OSError("the peer closed its connection")
        if not conn.incoming and conn.request_since is None:
            conn.request_since = time.monotonic()
        conn.incoming += data

    def _read_server(self, conn: _Connection) -> None:
        assert conn.backend is not None
        data = conn.backend.recv(65536)
        if not data:
            raise OSError("the store's server closed the connection")
        if conn.answer is None:
            raise OSError("the store's server sent what no request asked for")
        conn.answer.feed(memoryview(data))
        if not conn.to_peer:
            conn.peer_waiting_since = time.monotonic()
        conn.to_peer += data
        self._flush(conn, conn.sock, conn.to_peer)
        if conn.answer.done:
            conn.answer = None
            conn.waiting = False

    def _flush(self, conn: _Connection, sock: socket.socket, buffer: bytearray) -> None:
        if buffer:
            try:
                sent = sock.send(buffer)
            except (BlockingIOError, InterruptedError):
                sent = 0
            del buffer[:sent]
        if buffer is conn.to_peer and not buffer:
            conn.peer_waiting_since = None

    def _advance(self, conn: _Connection) -> None:
        """Pass on the requests that may go now, and wait for what is due next."""
        while conn.incoming and not conn.to_server:
            if conn.answer is not None and not conn.waiting:
                break  # one request at a time
            request = parse_request(conn.incoming, self.limits)
            if request is None:
                break
            if conn.answer is not None:  # under a wait: only its cancel may pass
                if request.command != CANCEL_WAIT:
                    break
                conn.answer.cancel = True
                conn.waiting = False  # one cancel; what follows waits for its answer
                self._forward(conn, request)
                continue
            self._check_handshake(conn, request)
            marks = self._check_signed(request) if self._opened is not None else []
            self._check_costs(conn, request)
            # Passed: the keys it wrote now hold its values, marked deleted or not.
            for key, mark in marks:
                if mark:
                    self._marked.add(key)
                else:
                    self._marked.discard(key)
            if marks:
                conn.proven = True  # it wrote a value the run signed: it holds the key
            self._forward(conn, request)
            conn.answer = _answer_for(request)
            conn.waiting = request.command == WAIT
            if conn.answer.done:
                conn.answer = None
        if not conn.incoming:
            conn.request_since = None
        elif conn.request_since is None:
            conn.request_since = time.monotonic()
        self._watch(conn)

    def _check_handshake(self, conn: _Connection, request: Request) -> None:
        if conn.handshake == 0:
            if request.command != VALIDATE:
                raise Refused("command", f"{COMMANDS[request.command]} before a store "
                                         f"client's handshake")
            conn.handshake = 1
        elif conn.handshake == 1:
            if request.command != PING:
                raise Refused("command", f"{COMMANDS[request.command]} before a store "
                                         f"client's handshake")
            conn.handshake = 2
            backend = socket.create_connection(self.backend, timeout=10)
            backend.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            backend.setblocking(False)
            conn.backend = backend
            self._selector.register(backend, selectors.EVENT_READ, conn)
            conn.to_server += _VALIDATE_BYTES
        elif request.command == VALIDATE:
            raise Refused("command", "a second handshake")

    def _settled(self, conn: _Connection) -> bool:
        """Whether ``conn`` may keep its place while idle: past its handshake, and where
        the store is signed, proven to hold the run's key."""
        return conn.handshake >= 2 and (conn.proven or self._opened is None)

    def _check_signed(self, request: Request) -> list[tuple[bytes, bool]]:
        """Refuse what no client holding the run's key sends: a value without its
        signature, an add or append, a delete of a key not marked deleted. For each value
        the run signed that the request writes, its key and whether it is the deletion
        mark."""
        command = request.command
        if command in (ADD, APPEND):
            raise Refused("unsigned", f"{COMMANDS[command]} on {_named(request.keys[0])}")
        if command == DELETE_KEY:
            key = request.keys[0]
            if key not in self._marked:
                raise Refused("delete", _named(key))
            self._marked.discard(key)
            return []
        assert self._opened is not None
        marks: list[tuple[bytes, bool]] = []
        for key, expected, value in request.values:
            if expected is not None and expected and value == expected:
                continue  # a compare-and-set that cannot change the key: a signed store's read
            # torch's client puts "/" before every key it sends; the signature is the name's.
            opened = self._opened(key[1:] if key.startswith(b"/") else key, value)
            if opened is None:
                raise Refused("unsigned", f"a value for {_named(key)}")
            marks.append((key, opened == self._deletion_mark))
        return marks

    def describe_refused(self) -> str:
        """A sentence on the writes and deletes this front refused for want of the run's
        signature; ``""`` when none."""
        return _describe_refused(self.refusals["unsigned"], self.refusals["delete"],
                                 self.strangers)

    def _check_costs(self, conn: _Connection, request: Request) -> None:
        """Refuse a request past the bounds on what the store holds and answers; else count
        what the store may then hold, and whose writes it is."""
        if request.command in (GET, MULTI_GET):
            reply = sum(self._stored.get(k, 0) + 8 for k in request.keys)
            if reply > self.limits.reply_bytes:
                raise Refused("reply_bytes", f"{reply:,} bytes")
        if request.command == DELETE_KEY:
            self._charge(request.keys[0], 0, None)
            return
        if not request.writes:
            return
        # What each key may hold after the request, and whether the writer's bytes are
        # then all of it (a set) or perhaps none (a compare-and-set or an add may fail,
        # and then what was there stays, charged to whoever wrote it).
        after: dict[bytes, tuple[int, bool]] = {}
        for key, size, append in request.writes:
            before = after[key][0] if key in after else self._stored.get(key, 0)
            if append:
                after[key] = ((before or len(key) + KEY_OVERHEAD) + size, True)
            elif request.command in (COMPARE_SET, ADD):
                new = len(key) + KEY_OVERHEAD + size
                after[key] = (max(before, new), new > before)
            else:
                after[key] = (len(key) + KEY_OVERHEAD + size, True)
        address = conn.address
        change = sum(held - self._stored.get(k, 0) for k, (held, _) in after.items())
        if change > 0 and self.stored_bytes + change > self.limits.stored_bytes:
            raise Refused("stored_bytes")
        share = self._held_by[address] + sum(
            held - (self._stored.get(k, 0) if self._holder.get(k) == address else 0)
            for k, (held, moves) in after.items() if moves)
        if share > self._held_by[address] and share > self.limits.stored_bytes_per_address:
            raise Refused("stored_bytes_per_address")
        for key, (held, moves) in after.items():
            self._charge(key, held, address if moves else self._holder.get(key))

    def _charge(self, key: bytes, held: int, holder: str | None) -> None:
        """Count ``held`` bytes at ``key``, as ``holder``'s writes (0: the key is gone)."""
        old_holder = self._holder.pop(key, None)
        old = self._stored.pop(key, 0)
        self.stored_bytes -= old
        if old_holder is not None:
            self._held_by[old_holder] -= old
            if self._held_by[old_holder] <= 0:
                del self._held_by[old_holder]
        if held <= 0:
            return
        self._stored[key] = held
        self.stored_bytes += held
        if holder is not None:
            self._holder[key] = holder
            self._held_by[holder] += held

    def _forward(self, conn: _Connection, request: Request) -> None:
        data = bytes(conn.incoming[:request.size])
        del conn.incoming[:request.size]
        if conn.backend is None:
            return  # the handshake, which the front sends the server itself once complete
        conn.to_server += data
        self._flush(conn, conn.backend, conn.to_server)

    def _watch(self, conn: _Connection) -> None:
        """Listen for what each side may send now: backpressure, one request at a time."""
        peer_events = 0
        if len(conn.incoming) < self.limits.request_bytes + 64 and len(conn.to_peer) < _OUT_HIGH:
            peer_events |= selectors.EVENT_READ
        if conn.to_peer:
            peer_events |= selectors.EVENT_WRITE
        self._set_events(conn.sock, peer_events, conn)
        if conn.backend is not None:
            server_events = 0
            if len(conn.to_peer) < _OUT_HIGH:
                server_events |= selectors.EVENT_READ
            if conn.to_server:
                server_events |= selectors.EVENT_WRITE
            self._set_events(conn.backend, server_events, conn)

    def _set_events(self, sock: socket.socket, events: int, conn: _Connection) -> None:
        try:
            current = self._selector.get_key(sock).events
        except KeyError:
            current = 0
        if events == current:
            return
        if current and events:
            self._selector.modify(sock, events, conn)
        elif events:
            self._selector.register(sock, events, conn)
        else:
            self._selector.unregister(sock)

    def _close(self, conn: _Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        for sock in (conn.sock, conn.backend):
            if sock is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            with contextlib.suppress(OSError):
                sock.close()
        with self._lock:
            self._connections.pop(conn.fd, None)
        self._per_address[conn.address] -= 1
        if self._per_address[conn.address] <= 0:
            del self._per_address[conn.address]


#: The validate command a client begins with (the front sends it for a connection whose
#: handshake is complete, then passes the ping on).
_VALIDATE_BYTES = bytes([VALIDATE]) + _U32.pack(MAGIC)


def descriptor_room() -> int:
    """Connections a front may relay with the descriptors this process may open (two each),
    keeping a quarter of them (at most :data:`_SPARE_FDS`) for the rest of the process.

    A soft limit below :data:`_WANTED_FDS` (macOS gives a terminal 256) is first raised
    toward it, as far as the hard limit allows."""
    try:
        import resource  # not on every platform; imported here, where a front starts
    except ImportError:
        return 1 << 30
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < _WANTED_FDS:
            wanted = _WANTED_FDS if hard == resource.RLIM_INFINITY else min(hard, _WANTED_FDS)
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
                soft = wanted
    except (OSError, ValueError):
        return 1 << 30
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(16, (soft - min(_SPARE_FDS, soft // 4)) // 2)


def _named(key: bytes) -> str:
    """A key a peer sent, as a refusal names it: quoted, escapes shown, at most 80 characters."""
    text = key.decode("utf-8", errors="replace")
    return repr(text if len(text) <= 80 else text[:77] + "...")


class _Strangers:
    """What every front of this process refused for want of the run's signature."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.addresses: list[str] = []


_STRANGERS = _Strangers()


def _note_stranger(kind: str, address: str, named: list[str]) -> None:
    for addresses in (named, _STRANGERS.addresses):
        if address not in addresses and len(addresses) < _STRANGERS_NAMED:
            addresses.append(address)
    with _STRANGERS.lock:
        _STRANGERS.counts[kind] += 1


def _describe_refused(unsigned: int, deletes: int, addresses: list[str]) -> str:
    said = []
    if unsigned:
        said.append(f"{unsigned} write{'s' if unsigned != 1 else ''} not signed by the run")
    if deletes:
        said.append(f"{deletes} delete{'s' if deletes != 1 else ''} of keys the run had not "
                    f"marked deleted")
    if not said:
        return ""
    return f"refused {' and '.join(said)} (from {', '.join(addresses)})"


def describe_refused() -> str:
    """A sentence on the writes and deletes the store fronts of this process refused for
    want of the run's signature, with the first addresses they came from; ``""`` when none."""
    with _STRANGERS.lock:
        return _describe_refused(_STRANGERS.counts["unsigned"], _STRANGERS.counts["delete"],
                                 list(_STRANGERS.addresses))
