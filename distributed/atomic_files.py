"""Write files and whole directories atomically: a reader sees the old state or the new one.

Everything is first written to a temporary sibling (same filesystem), then moved into
place with one rename. A crash or a concurrent writer never leaves a half-written
checkpoint, metadata file or speech folder behind under the final name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder.

    Args:
        path: Destination file; its parent folder must exist.
        text: Full new content.
        encoding: Text encoding of the file.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding=encoding, newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def new_temp_dir_beside(target: str | os.PathLike) -> Path:
    """Create an empty temporary folder next to ``target`` (same filesystem, so renames work)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))


def publish_dir(tmp_dir: Path, target: str | os.PathLike, replace: bool) -> bool:
    """Move the finished folder ``tmp_dir`` to ``target`` with a rename.

    Args:
        tmp_dir: A complete folder made by :func:`new_temp_dir_beside`.
        target: Final name.
        replace: If ``target`` exists, swap it out (the old folder is deleted afterwards).
            If false and ``target`` exists, ``tmp_dir`` is deleted and ``target`` is kept:
            the first of several concurrent writers wins.

    Returns:
        True if ``tmp_dir`` became ``target``, False if an existing ``target`` was kept.
    """
    target = Path(target)
    old: Path | None = None
    if replace and target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.rmdir(old)
        try:
            os.rename(target, old)
        except FileNotFoundError:
            old = None  # someone else removed it in between; nothing to swap out
    try:
        os.rename(tmp_dir, target)
    except OSError:
        # On POSIX, renaming onto a non-empty folder fails: another writer finished first.
        if not target.is_dir():
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return False
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return True

