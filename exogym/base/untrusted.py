"""Reading files that someone else may have written (a run folder's ``run.json``,
``summary.json``, trace): only regular files, only up to a stated size, JSON of any depth
refused with an error instead of Python's ``RecursionError``.

Opening a FIFO blocks until a writer comes, and ``/dev/zero`` (or a link to it) never
ends: each is refused before a byte is read (the file is opened without blocking and
checked with ``fstat``). Standard library only, so that light modules (the run listing,
the launcher) can use it.
"""

from __future__ import annotations

import json
import os
import stat
from typing import IO, Any

__all__ = ["MAX_RUN_FILE_BYTES", "MAX_TRACE_BYTES", "NotARegularFile", "TooDeepJSON",
           "TooLargeFile", "json_loads", "open_regular", "read_json", "read_limited"]

#: The largest ``run.json`` or ``summary.json`` read: a run's records take a few KiB.
MAX_RUN_FILE_BYTES = 16 << 20
#: The largest trace read whole (a million steps of a few ranks take well under this).
MAX_TRACE_BYTES = 1 << 30


class NotARegularFile(OSError):
    """A path that is a FIFO, a device, a socket or a folder, where a file was expected."""


class TooLargeFile(OSError):
    """A file over the size stated for its kind."""


class TooDeepJSON(ValueError):
    """JSON nested deeper than Python's parser goes (it would raise ``RecursionError``)."""


def _kind(mode: int) -> str:
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else
            "a folder" if stat.S_ISDIR(mode) else "not a regular file")


def open_regular(path: str | os.PathLike[str], max_bytes: int | None = None) -> IO[bytes]:
    """``path`` opened for reading in binary, when it is a regular file (a link to one is
    followed) of at most ``max_bytes``.

    Raises:
        NotARegularFile: a FIFO, a device, a socket or a folder, naming it; nothing waits
            for a FIFO's writer.
        TooLargeFile: a file over ``max_bytes``, naming it and the limit.
        OSError: it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFile(f"{os.fspath(path)} is {_kind(info.st_mode)}, not a file: "
                                  "not read")
        if max_bytes is not None and info.st_size > max_bytes:
            raise TooLargeFile(f"{os.fspath(path)} is {info.st_size:,} bytes, over the "
                               f"{max_bytes:,} such a file may be: not read")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_limited(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` (one that grows past
    them while read is refused too); errors as :func:`open_regular`."""
    with open_regular(path, max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TooLargeFile(f"{os.fspath(path)} grew over the {max_bytes:,} bytes such a "
                           "file may be while it was read: not read")
    return data


def json_loads(text: str | bytes, where: str = "the JSON") -> Any:
    """``json.loads(text)``; JSON nested deeper than Python parses is a :class:`TooDeepJSON`
    naming ``where``, not a ``RecursionError``."""
    try:
        return json.loads(text)
    except RecursionError:
        raise TooDeepJSON(f"{where} nests lists or objects deeper than can be read: not a "
                         "file this program writes") from None


def read_json(path: str | os.PathLike[str], max_bytes: int = MAX_RUN_FILE_BYTES) -> Any:
    """The JSON in the regular file ``path`` (UTF-8, at most ``max_bytes``).

    Raises:
        OSError: as :func:`open_regular`.
        ValueError: not UTF-8 or not JSON; :class:`TooDeepJSON`: nested too deep.
    """
    data = read_limited(path, max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{os.fspath(path)} is not UTF-8 text (byte {exc.start})") from None
    return json_loads(text, os.fspath(path))
