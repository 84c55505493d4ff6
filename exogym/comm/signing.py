"""How a run's store values are signed, shared by its clients and by the front that serves it.

A value of a signed store is its bytes followed by an HMAC-SHA256 of the key's name and
those bytes under the run's key (:class:`exogym.comm.store.SignedStore`), so a value
signed for one key is no value of another. The store's front
(:class:`exogym.comm.store_front.StoreFront`) holds the run's key too, and lets no write
through that does not carry such a signature.

A signed store deletes a key in two steps: it first writes the key's
:data:`DELETION_MARK`, signed, then deletes it. The front lets a delete through only for a
key whose last write was that mark, so a delete from anyone without the run's key is
refused. Each client of a signed store also writes :data:`HELLO_KEY` as it connects,
so that the front knows which connections hold the run's key; the others may not stay
idle.
"""

from __future__ import annotations

import hmac

__all__ = ["DELETION_MARK", "HELLO_KEY", "SIGNATURE_BYTES", "opened", "signature"]

#: Bytes of the signature appended to every value of a signed store.
SIGNATURE_BYTES = 32
#: The key every client of a signed store writes (signed, a random value) as it connects:
#: the front then knows the connection holds the run's key and lets it stay idle.
HELLO_KEY = "exogym/hello"
#: The value a signed store writes to a key right before it deletes it; never a value the
#: project stores otherwise (it begins with a zero byte).
DELETION_MARK = b"\x00exogym-deleted"


def signature(secret: bytes, name: bytes, data: bytes) -> bytes:
    """The signature of ``data`` stored at the key ``name`` under the run's ``secret``."""
    return hmac.digest(secret, len(name).to_bytes(4, "big") + name + data, "sha256")


def opened(secret: bytes, name: bytes, raw: bytes) -> bytes | None:
    """The value of the signed ``raw`` stored at ``name``; None when its signature does not
    hold (or it is too short to carry one)."""
    if len(raw) < SIGNATURE_BYTES:
        return None
    value, tag = raw[:-SIGNATURE_BYTES], raw[-SIGNATURE_BYTES:]
    return value if hmac.compare_digest(tag, signature(secret, name, value)) else None
