"""The rendezvous store as a control plane: small messages only, never tensors.

Ranks meet at a key/value store (torch's ``TCPStore``): the launcher's on real
hosts, the trainer's in a simulation. It carries who is present, round
decisions, loss generations, heartbeats, votes and the addresses
``torch.distributed`` groups exchange when they form. Tensors travel on real
transports (shared memory, gloo, NCCL), never through it: torch's store
server drops the connection of a client that sends a value over 8 MiB, and a
store every rank polls must stay quick.

:class:`ControlStore` is the only way the project writes to a store. A value
over :data:`MAX_VALUE_BYTES` is refused in the writer, naming the key, instead
of reaching the server.
"""

from __future__ import annotations

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
    return ControlStore(dist.TCPStore(addr, port, world_size, is_master=is_master,
                                      timeout=timedelta(seconds=timeout_s),
                                      wait_for_workers=False))
