"""The rendezvous store as a control plane: small messages only, never tensors.

Ranks meet at a key/value store (torch's ``TCPStore``): the launcher's on real
hosts, the trainer's in a simulation. It carries who is present, round
decisions, loss generations, heartbeats, votes and the addresses
``torch.distributed`` groups exchange when they form. Tensors travel on real
transports (shared memory, gloo, NCCL), never through it: torch's store
server drops the connection of a client that sends a value over 8 MiB, and a
store every rank polls must stay quick.

The server listens on the address it is given alone (:func:`listen_on`): a
local run's store on loopback is out of reach of every other machine.

A run across hosts also signs every value it writes (:class:`SignedStore`):
the launcher draws a key for the run and hands it to each rank over SSH, and a
value whose signature does not hold is ignored and counted
(:func:`ignored_messages`), never acted on. The store's front checks the same
signatures before the store sees a write, and lets a delete through only for a key
the run marked deleted first (:meth:`SignedStore.delete_key`), so a stranger who
reaches the port cannot stop the run, change its membership or plant an address.

:class:`ControlStore` is the only way the project writes to a store. A value
over :data:`MAX_VALUE_BYTES` is refused in the writer, naming the key, instead
of reaching the server.

That binds only the project's own writes. A run across hosts hosts its store behind
a bounded front (:mod:`exogym.comm.store_front`): torch's server listens on loopback
alone, and the public address is served by a relay that holds every peer to bounds
on connections, time and bytes, so that what a stranger sends costs the process that
hosts the store a bounded amount of memory and descriptors.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .signing import DELETION_MARK, HELLO_KEY, opened, signature
from .store_front import FrontLimits, StoreFront, describe_refused

#: The largest value the project puts in a store.
MAX_VALUE_BYTES = 64 * 1024


class ControlValueTooLarge(ValueError):
    """A value too large for the control plane was about to be written to the store."""


def _encoded(key: str, value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else bytes(value)
    if len(data) > MAX_VALUE_BYTES:
        raise ControlValueTooLarge(
            f"store key {key!r}: a value of {len(data):,} bytes is over the control plane's "
            f"{MAX_VALUE_BYTES:,}; tensors travel on the collectives' transports, not the store")
    return data


#: Bytes of a run's store key (:func:`new_run_key`).
RUN_KEY_BYTES = 32
#: Seconds between looks at a key that holds a forged value, waiting for a signed one.
_FORGED_POLL_S = 0.05
#: How a read of a signed store's probe begins (:meth:`SignedStore._read`); random bytes of
#: the client's own follow, so that no signed value, and no value anyone else writes, is it.
_PROBE = b"\x00exogym-probe-"
#: Counters a process remembers the highest value of (an older value sent again is ignored).
_COUNTER_MEMORY = 4096


def _counter(value: bytes | None) -> int | None:
    """A signed counter's number: ``b"7"`` (set as a number) or ``b"7:NONCE"`` (added to);
    None for a value that is neither."""
    if value is None:
        return None
    head = value.split(b":", 1)[0]
    return int(head) if head.isdigit() else None


def new_run_key() -> bytes:
    """A fresh random key for one run's store."""
    return os.urandom(RUN_KEY_BYTES)


class UnsignedValueError(RuntimeError):
    """A key of a signed store held only values this run did not sign, until the wait ran out."""


#: Keys named in the report of ignored operations: the most recently seen this many.
_KEYS_NAMED = 16


def _tally(keys: collections.OrderedDict[str, int], key: str) -> None:
    """Count ``key`` once more in ``keys``, which keeps the :data:`_KEYS_NAMED` most recent."""
    keys[key] = keys.get(key, 0) + 1
    keys.move_to_end(key)
    while len(keys) > _KEYS_NAMED:
        keys.popitem(last=False)


class _Ignored:
    """The values this process found unsigned, counted once per key and value, and the
    keys it found deleted by others, counted once each time one goes missing."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.keys: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.last: dict[str, bytes] = {}
        self.deleted = 0
        self.deleted_keys: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.missing: set[str] = set()  # keys found deleted, not yet seen set again

    def note(self, key: str, raw: bytes) -> None:
        with self.lock:
            if self.last.get(key) == raw:
                return  # the same forged value, looked at again while waiting
            if len(self.last) >= _COUNTER_MEMORY:
                self.last.pop(next(iter(self.last)))
            self.last[key] = raw
            self.count += 1
            _tally(self.keys, key)

    def note_deleted(self, key: str) -> None:
        with self.lock:
            if key in self.missing:
                return  # the same deletion, looked at again
            if len(self.missing) >= _COUNTER_MEMORY:
                self.missing.pop()
            self.missing.add(key)
            self.deleted += 1
            _tally(self.deleted_keys, key)

    def note_present(self, key: str) -> None:
        if key in self.missing:
            with self.lock:
                self.missing.discard(key)


_IGNORED = _Ignored()


def ignored_messages() -> tuple[int, list[str]]:
    """How many store values this process ignored as unsigned, and the keys (newest last)."""
    with _IGNORED.lock:
        return _IGNORED.count, list(_IGNORED.keys)


def deleted_keys() -> tuple[int, list[str]]:
    """How many times this process found a key of the run deleted by something other than
    its ranks, and the keys (newest last)."""
    with _IGNORED.lock:
        return _IGNORED.deleted, list(_IGNORED.deleted_keys)


def describe_ignored(fronts: bool = True) -> str:
    """A sentence on the unsigned values and the deletions this process ignored, and with
    ``fronts`` the writes and deletes the store fronts it serves refused; ``""`` when none.
    A process that reports its own front's refusals passes ``fronts=False``."""
    count, keys = ignored_messages()
    deleted, gone = deleted_keys()
    said = []
    refused = describe_refused() if fronts else ""
    if refused:
        said.append(refused)
    if count:
        said.append(f"ignored {count} store value{'s' if count != 1 else ''} not signed by "
                    f"this run (at {', '.join(keys[-3:])})")
    if deleted:
        said.append(f"ignored {deleted} deletion{'s' if deleted != 1 else ''} of the run's "
                    f"keys, which its ranks never delete (at {', '.join(gone[-3:])})")
    if not said:
        return ""
    return " and ".join(said) + ": something other than the run's ranks writes to its store"


class _Trips(threading.local):
    """This thread's round trips to a store (:func:`store_round_trips`)."""

    count = 0


_TRIPS = _Trips()


def store_round_trips() -> int:
    """How many round trips to a store the calling thread has made (every call the project
    makes reaches the store's server once; a signed read of an unset key twice).

    A rank's training thread reads it around its steps: the control plane's work on the
    step's path (:mod:`exogym.membership.hosts`), which must stay off it while the
    membership holds."""
    return _TRIPS.count


class _Counted:
    """A torch store whose every call is counted as one round trip of the calling thread."""

    def __init__(self, store: dist.Store):
        self.store = store

    def set(self, key: str, value: bytes) -> None:
        _TRIPS.count += 1
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        _TRIPS.count += 1
        return self.store.get(key)

    def add(self, key: str, amount: int) -> int:
        _TRIPS.count += 1
        return self.store.add(key, amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        _TRIPS.count += 1
        return self.store.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        _TRIPS.count += 1
        return self.store.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        _TRIPS.count += 1
        return self.store.multi_get(keys)

    def delete_key(self, key: str) -> bool:
        _TRIPS.count += 1
        return self.store.delete_key(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        _TRIPS.count += 1
        if timeout is None:
            self.store.wait(keys)
        else:
            self.store.wait(keys, timeout)

    def num_keys(self) -> int:
        _TRIPS.count += 1
        return self.store.num_keys()


class SignedStore(dist.Store):
    """A store whose every value carries an HMAC-SHA256 signature under the run's key.

    It is a ``torch.distributed`` store, so the groups ``torch.distributed`` forms
    through it (gloo's rendezvous addresses) are signed too. A value is signed
    together with its key, so a signed value cannot be moved to another key. A
    value that does not verify is ignored and counted (:func:`ignored_messages`):
    ``check`` and ``get_if_set`` see the key as unset, ``get`` waits for a signed
    value (raising :class:`UnsignedValueError` after the store's timeout), and a
    counter keeps the highest value this process saw, so an older value written
    back is not taken.

    Args:
        inner: the store that holds the signed values (a ``TCPStore``).
        key: the run's key (:func:`new_run_key`), at least 16 bytes.
        timeout_s: how long ``get`` waits for a signed value.
    """

    def __init__(self, inner: dist.Store, key: bytes, timeout_s: float,
                 port: int | None = None):
        super().__init__()
        if len(key) < 16:
            raise ValueError(f"a run's store key must be at least 16 bytes, got {len(key)}")
        self.inner = inner
        self._ops = _Counted(inner)
        self._probe = _PROBE + os.urandom(16)
        self._key = bytes(key)
        self.timeout_s = timeout_s
        self._port = port
        # counter -> (the highest value this process saw, the stored bytes it saw it as)
        self._counters: collections.OrderedDict[str, tuple[int, bytes]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        """The store's port: its front's where it has one, else the inner store's."""
        return self._port if self._port is not None else self.inner.port

    # -- signing ------------------------------------------------------------------------
    def _signature(self, key: str, value: bytes) -> bytes:
        return signature(self._key, key.encode(), value)

    def _sign(self, key: str, value: str | bytes) -> bytes:
        data = _encoded(key, value)
        return data + self._signature(key, data)

    def _verified(self, key: str, raw: bytes) -> bytes | None:
        """The value of a signed ``raw`` (the deletion mark included); None (noted) when its
        signature does not hold."""
        raw = bytes(raw)
        value = opened(self._key, key.encode(), raw)
        if value is None:
            _IGNORED.note(key, raw)
        return value

    def _open(self, key: str, raw: bytes) -> bytes | None:
        """The value of a signed ``raw``; None when its signature does not hold (noted) or
        the key is being deleted (its deletion mark: as good as unset)."""
        value = self._verified(key, raw)
        return None if value == DELETION_MARK else value

    def _forged(self, key: str) -> UnsignedValueError:
        return UnsignedValueError(
            f"store key {key!r} held only values not signed by this run for "
            f"{self.timeout_s:g} s: something other than the run's ranks writes to its store "
            f"(port {self.port}); the run stops rather than act on them")

    # -- the store's calls --------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:  # noqa: D102 - dist.Store's
        self._ops.set(key, self._sign(key, value))

    def get(self, key: str) -> bytes:  # noqa: D102
        deadline = time.monotonic() + self.timeout_s
        while True:
            value = self._open(key, self._ops.get(key))
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise self._forged(key)
            time.sleep(_FORGED_POLL_S)

    def lookup(self, key: str) -> tuple[bool, bytes | None]:
        """``(set, value)`` of ``key`` now: whether anything is stored there, and the value
        (None when unset or forged)."""
        raw, value = self._read(key)
        return raw is not None, value

    def _read(self, key: str) -> tuple[bytes | None, bytes | None]:
        """``(raw, value)`` of ``key`` now: ``(None, None)`` when unset, value None when forged."""
        # One round trip: a compare-and-set that can never match answers with the value,
        # or with the probe itself when the key is unset. The probe is this client's own
        # secret, so no one can have stored it: the probe back means unset.
        raw = bytes(self._ops.compare_set(key, self._probe, self._probe))
        if raw == self._probe:
            return None, None
        value = self._verified(key, raw)
        if value == DELETION_MARK:
            return None, None  # being deleted
        return raw, value

    def check(self, keys: list[str]) -> bool:  # noqa: D102
        if len(keys) == 1:
            return self._read(keys[0])[1] is not None
        if not self._ops.check(keys):
            return False
        raws = self._ops.multi_get(keys)
        return all(self._open(k, raw) is not None for k, raw in zip(keys, raws))

    def get_if_set(self, key: str) -> bytes | None:
        """The value of ``key``; None when it is unset or holds a value this run did not sign."""
        return self._read(key)[1]

    def values_if_set(self, keys: list[str]) -> list[bytes] | None:
        """The values of ``keys`` when every one holds a value this run signed; None at once
        otherwise (one round trip, two when all are set)."""
        if not self._ops.check(keys):
            return None
        values = [self._open(k, raw) for k, raw in zip(keys, self._ops.multi_get(keys))]
        return None if any(v is None for v in values) else values

    def multi_get(self, keys: list[str]) -> list[bytes]:  # noqa: D102
        raws = self._ops.multi_get(keys)
        out = [self._open(k, raw) for k, raw in zip(keys, raws)]
        return [v if v is not None else self.get(k) for k, v in zip(keys, out)]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:  # noqa: D102
        expected_raw = b"" if expected in ("", b"") else self._sign(key, expected)
        desired_raw = self._sign(key, desired)
        deadline = time.monotonic() + self.timeout_s
        while True:
            now = bytes(self._ops.compare_set(key, expected_raw, desired_raw))
            if now == desired_raw:
                return _encoded(key, desired)
            value = self._open(key, now)
            if value is not None:
                return value
            # A forged value sits where the run expects its own: replace it, as if unset.
            if expected_raw == b"":
                if bytes(self._ops.compare_set(key, now, desired_raw)) == desired_raw:
                    return _encoded(key, desired)
            elif time.monotonic() > deadline:
                raise self._forged(key)
            else:
                time.sleep(_FORGED_POLL_S)

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        if amount == 0:
            return self._count(key)
        with self._lock:
            seen = self._counters.get(key)
        known = None if seen is None else seen[0]
        # One compare-and-set, from the bytes this process last saw (or from unset): when
        # the guess is wrong the store answers with what it holds, and the next try uses that.
        current = known or 0
        expected = b"" if seen is None else seen[1]
        deadline = time.monotonic() + self.timeout_s
        while True:
            # A nonce of this write's own: two processes adding to the same value must not
            # write the same bytes, or each would take the other's write for its own.
            desired = self._sign(key, f"{current + amount}:{os.urandom(8).hex()}")
            now = bytes(self._ops.compare_set(key, expected, desired))
            if now == desired:
                self._remember(key, current + amount, desired)
                return current + amount
            if expected and now == expected:  # unset: a counter never goes below what was seen
                expected = b""
                continue
            current, expected = self._settle(key, now, known, deadline)

    def _count(self, key: str) -> int:
        """The counter ``key``: 0 when unset (or what this process saw, if higher)."""
        with self._lock:
            seen = self._counters.get(key)
        known = None if seen is None else seen[0]
        deadline = time.monotonic() + self.timeout_s
        while True:
            raw, _ = self._read(key)
            if raw is None:
                if seen is None:
                    self._remember(key, 0, b"")
                return known or 0
            current, expected = self._settle(key, raw, known, deadline)
            if expected == raw:
                self._remember(key, current, raw)
                return current

    def _settle(self, key: str, raw: bytes, known: int | None, deadline: float
                ) -> tuple[int, bytes]:
        """``(value, signed value)`` of the counter whose store value is ``raw``.

        A forged value, or a signed one below what this process saw (written back), is
        ignored: the counter is put back to the highest value seen, or, by a process that
        never saw it, waited for until ``deadline`` (then :class:`UnsignedValueError`).
        """
        value = self._open(key, raw)
        number = _counter(value)
        if number is not None and number >= (known or 0):
            return number, raw
        if number is not None:
            _IGNORED.note(key, raw)  # an older value written back
        if known is None:
            if time.monotonic() > deadline:
                raise self._forged(key)
            time.sleep(_FORGED_POLL_S)
            return 0, b""
        restored = self._sign(key, str(known))
        self._ops.compare_set(key, raw, restored)
        return known, restored

    def _remember(self, key: str, value: int, raw: bytes) -> None:
        with self._lock:
            seen = self._counters.get(key)
            if seen is None or value >= seen[0]:
                self._counters[key] = (value, raw)
            self._counters.move_to_end(key)
            while len(self._counters) > _COUNTER_MEMORY:
                self._counters.popitem(last=False)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``: its signed deletion mark first, so that the store's front, which
        lets no delete through for a key whose last write was not that mark, lets this one
        through (:mod:`exogym.comm.signing`)."""
        with self._lock:
            self._counters.pop(key, None)
        self._ops.set(key, self._sign(key, DELETION_MARK))
        return self._ops.delete_key(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # noqa: D102
        self._ops.wait(keys, timeout)

    def num_keys(self) -> int:  # noqa: D102
        return self._ops.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:  # noqa: D102
        self.inner.set_timeout(timeout)


class ControlStore:
    """A client (or the server) of the rendezvous store, holding small values only.

    Args:
        store: the torch store it wraps (``raw``, which a ``torch.distributed``
            group is formed through).
        key: the run's key: every value is then signed and checked
            (:class:`SignedStore`); None for a store only this machine reaches.
        timeout_s: with ``key``, how long a read waits for a signed value.
        front: the bounded front that serves the store's public address, where this
            process hosts it (:func:`open_store`); closed with this store.
    """

    def __init__(self, store: dist.Store, key: bytes | None = None, timeout_s: float = 300.0,
                 front: StoreFront | None = None):
        self.signed = key is not None
        self.front = front
        port = None if front is None else front.port
        self.raw: dist.Store = store if key is None else SignedStore(store, key, timeout_s, port)
        # The project's calls, each counted (a signed store counts its own).
        self._calls: Any = self.raw if key is not None else _Counted(store)

    @property
    def port(self) -> int:
        """The store's port: the one others reach it at."""
        return self.front.port if self.front is not None else self.raw.port

    def describe_refused(self) -> str:
        """A sentence on the writes and deletes this store's front refused for want of the
        run's signature (:meth:`StoreFront.describe_refused`); ``""`` when none, or when
        this process serves no front."""
        return "" if self.front is None else self.front.describe_refused()

    def close(self) -> None:
        """Stop serving others, where this process hosts the store behind a front."""
        if self.front is not None:
            self.front.close()

    def set(self, key: str, value: str | bytes) -> None:
        """Set ``key``; refuses a value over :data:`MAX_VALUE_BYTES`."""
        self._calls.set(key, _encoded(key, value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it up to the store's timeout."""
        return self._calls.get(key)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 reads it); its new value."""
        return int(self._calls.add(key, amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``""``: absent); what it holds then."""
        return self._calls.compare_set(key, expected, _encoded(key, desired))

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key of ``keys`` is set."""
        return self._calls.check(list(keys))

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""
        return self._calls.delete_key(key)

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        """Block until every key of ``keys`` is set; False after ``timeout_s`` seconds."""
        try:
            self._calls.wait(list(keys), timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 - torch raises its store error on a timeout
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                return False
            raise
        return True

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, in one round trip (waiting for them as :meth:`get` does)."""
        return self._calls.multi_get(list(keys))

    def get_if_set(self, key: str) -> bytes | None:
        """The value of ``key``, or None at once when it is not set (or, signed, forged)."""
        if isinstance(self.raw, SignedStore):
            return self.raw.get_if_set(key)
        return self._calls.get(key) if self._calls.check([key]) else None

    def values_if_set(self, keys: Sequence[str]) -> list[bytes] | None:
        """The values of ``keys`` when every one is set (signed, by the run); None at once
        otherwise: a wait for several keys polls with one round trip, and reads them
        with one more."""
        if isinstance(self.raw, SignedStore):
            return self.raw.values_if_set(list(keys))
        if not self._calls.check(list(keys)):
            return None
        return list(self._calls.multi_get(list(keys)))


def next_beat(last: int) -> int:
    """The heartbeat after ``last``: milliseconds of the wall clock, always above ``last``.

    Beats only go up, also across a rank's restarts on its host, so a watcher takes
    a beat only when it is higher than every one it saw: an earlier beat written
    back to the store (by anyone who read it there) does not make a rank look alive.
    """
    return max(last + 1, time.time_ns() // 1_000_000)


def beat_news(store: ControlStore, key: str, seen: int = 0) -> int | None:
    """The heartbeat at ``key``: 0 when none (or, in a signed store, none signed); None
    when a key that held a beat was deleted or overwritten by a stranger, which says
    nothing of the rank.

    A rank never deletes its heartbeat, so in a signed store a key found unset after
    a beat was seen there was deleted by something without the run's key: the deletion
    is counted (:func:`deleted_keys`, :func:`describe_ignored`), once each time the key
    goes missing, as a forged value there is (:func:`ignored_messages`). Neither may a
    watcher take for the rank's silence.

    Args:
        store: the run's store.
        key: the heartbeat's key.
        seen: the highest beat this process saw at ``key`` (0: none yet).
    """
    if not isinstance(store.raw, SignedStore):
        value = store.get_if_set(key)
    else:
        found, value = store.raw.lookup(key)
        if found:
            _IGNORED.note_present(key)
        elif seen > 0:
            _IGNORED.note_deleted(key)
        if value is None and seen > 0:
            return None
    return int(value) if value is not None and value.isdigit() else 0


def read_beat(store: ControlStore, key: str, seen: int = 0) -> int:
    """The heartbeat at ``key``; 0 when none (or, in a signed store, none signed), also
    when it was deleted after ``seen`` (counted: :func:`beat_news`)."""
    return beat_news(store, key, seen) or 0


def open_store(addr: str, port: int, *, is_master: bool = False, world_size: int | None = None,
               timeout_s: float = 300.0, key: bytes | None = None,
               front: FrontLimits | bool | None = None) -> ControlStore:
    """The TCP store ranks meet at: hosted here (``is_master``) or reached at ``addr:port``.

    Args:
        addr: the store's address.
        port: its port; 0 on the master lets the operating system pick one (``store.port``).
        is_master: host the store in this process.
        world_size: processes that will join through it (None: not known yet).
        timeout_s: how long a call on the store waits.
        key: the run's key (a run across hosts): every value is signed and checked.
        front: on the master, serve ``addr:port`` through a bounded front
            (:class:`~exogym.comm.store_front.StoreFront`, with these limits, or its
            defaults for True) and torch's server on loopback alone. None: a front
            for a run across hosts (``key`` given), none for a local one.
    """
    if not is_master:
        client = ControlStore(dist.TCPStore(addr, port, world_size, is_master=False,
                                            timeout=timedelta(seconds=timeout_s),
                                            wait_for_workers=False), key, timeout_s)
        if key is not None:  # the front lets the connection idle once it has seen this
            client.raw.set(HELLO_KEY, os.urandom(8).hex())
        return client
    if front is None:
        front = key is not None
    public: socket.socket | None = None
    if front:
        public = listen_on(addr, port)
        try:
            listener = listen_on("127.0.0.1", 0)
        except OSError:
            public.close()
            raise
        serve_at = "127.0.0.1"
    else:
        listener = listen_on(addr, port)
        serve_at = addr
    port = listener.getsockname()[1]
    fd = listener.detach()  # the store's server owns the socket from here, and closes it
    try:
        store = dist.TCPStore(serve_at, port, world_size, is_master=True,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        if public is not None:
            public.close()
        raise
    if public is None:
        return ControlStore(store, key, timeout_s)
    limits = front if isinstance(front, FrontLimits) else None
    served = StoreFront(public, (serve_at, port), limits, deletion_mark=DELETION_MARK,
                        opened=None if key is None else functools.partial(opened, key))
    control = ControlStore(store, key, timeout_s, front=served)
    weakref.finalize(control, served.close)
    return control


def listen_on(addr: str, port: int) -> socket.socket:
    """A TCP socket listening on ``addr:port`` alone (port 0: one the system picks).

    torch's ``TCPStore`` asked to serve on ``127.0.0.1`` listens on every interface
    (``*:PORT``), so anyone on the network could read and write a local run's store;
    handed this socket (``master_listen_fd``) it serves on the one address given.

    Raises:
        OSError: naming the address, when it is not one of this machine's or the port
            is taken.
    """
    try:
        family, kind, proto, _, where = socket.getaddrinfo(
            addr, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise OSError(f"the store's address {addr!r} does not resolve: {exc}") from None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        raise OSError(exc.errno, f"cannot listen on {addr}:{port} for the store: "
                                 f"{exc.strerror or exc}") from None
    listener.set_inheritable(False)
    return listener
