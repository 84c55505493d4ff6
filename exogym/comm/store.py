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

:class:`ControlStore` is the only way the project writes to a store. A value
over :data:`MAX_VALUE_BYTES` is refused in the writer, naming the key, instead
of reaching the server.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

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


class ControlStore:
    """A client (or the server) of the rendezvous store, holding small values only.

    Args:
        store: the torch store it wraps (``raw``, which a ``torch.distributed``
            group is formed through).
    """

    def __init__(self, store: dist.Store):
        self.raw = store

    @property
    def port(self) -> int:
        """The store's port (a ``TCPStore``'s)."""
        return self.raw.port

    def set(self, key: str, value: str | bytes) -> None:
        """Set ``key``; refuses a value over :data:`MAX_VALUE_BYTES`."""
        self.raw.set(key, _encoded(key, value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it up to the store's timeout."""
        return self.raw.get(key)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 reads it); its new value."""
        return int(self.raw.add(key, amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``""``: absent); what it holds then."""
        return self.raw.compare_set(key, expected, _encoded(key, desired))

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key of ``keys`` is set."""
        return self.raw.check(list(keys))

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""
        return self.raw.delete_key(key)

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        """Block until every key of ``keys`` is set; False after ``timeout_s`` seconds."""
        try:
            self.raw.wait(list(keys), timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 - torch raises its store error on a timeout
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                return False
            raise
        return True

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, in one round trip (waiting for them as :meth:`get` does)."""
        return self.raw.multi_get(list(keys))

    def get_if_set(self, key: str) -> bytes | None:
        """The value of ``key``, or None at once when it is not set."""
        return self.raw.get(key) if self.raw.check([key]) else None


def open_store(addr: str, port: int, *, is_master: bool = False, world_size: int | None = None,
               timeout_s: float = 300.0) -> ControlStore:
    """The TCP store ranks meet at: hosted here (``is_master``) or reached at ``addr:port``.

    Args:
        addr: the store's address.
        port: its port; 0 on the master lets the operating system pick one (``store.port``).
        is_master: host the store in this process.
        world_size: processes that will join through it (None: not known yet).
        timeout_s: how long a call on the store waits.
    """
    if not is_master:
        return ControlStore(dist.TCPStore(addr, port, world_size, is_master=False,
                                          timeout=timedelta(seconds=timeout_s),
                                          wait_for_workers=False))
    listener = listen_on(addr, port)
    port = listener.getsockname()[1]
    fd = listener.detach()  # the store's server owns the socket from here, and closes it
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=True,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return ControlStore(store)


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
