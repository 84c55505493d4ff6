"""Text from elsewhere (the LAN, a file) shown as it is: the characters a terminal would act
on rather than show, written as escapes. Standard library only, so that modules kept light
(the launcher, the hosts file) can use it."""

from __future__ import annotations

import unicodedata


def unprintable(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on rather than show: control
    characters (NUL, escape, newline, ...) and format characters (the bidirectional
    overrides that reorder what follows, zero-width ones), as ``\\x1b``, ``\\u202e``."""
    return [_escaped(c) for c in text if unicodedata.category(c) in ("Cc", "Cf")]


def printable(text: str, keep: str = "") -> str:
    """``text`` with every character :func:`unprintable` names written as its escape, so
    that text from elsewhere (the LAN, a file) shows as it is and cannot move the cursor,
    hide what follows or reorder it. The characters of ``keep`` (``"\\n"``: the lines of
    a message) stay as they are."""
    return "".join(_escaped(c) if c not in keep and unicodedata.category(c) in ("Cc", "Cf")
                   else c for c in text)


def _escaped(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 \
        else f"\\U{code:08x}"
