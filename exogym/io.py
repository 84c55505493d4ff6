"""Atomic file writes: a file is either the old version or the new, never half of one.

Imports nothing heavy (torch only inside ``atomic_torch_save``), so the launcher
and the CLI can use it without slowing their start.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def _atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], None],
            mode: int | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename (``mode``: chmod)."""
    return _atomic(path, lambda f: f.write(data), mode)


def atomic_write_text(path: str | os.PathLike, text: str, mode: int | None = None) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, default=repr) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` to ``path`` atomically."""
    import torch

    return _atomic(path, lambda f: torch.save(obj, f))
