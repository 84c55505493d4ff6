"""Atomic file writes: a file is either the old version or the new, never half of one.

A written file gets the mode any new file of the user gets (``0o666`` less the
umask; folders ``0o777`` less it), not the ``0o600`` of the temporary file it
starts as; pass ``mode=0o600`` where a secret is written. A full disk (or quota)
removes the temporary file and raises :class:`DiskFullError`,
``no space left on device: PATH``.

Imports nothing heavy (torch only inside ``atomic_torch_save``), so the launcher
and the CLI can use it without slowing their start.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def current_umask() -> int:
    """This process's umask, read without changing it where the system tells it
    (``/proc/self/status``; elsewhere set and restored at once)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def usual_file_mode() -> int:
    """The mode a new file gets here: ``0o666`` less the umask."""
    return 0o666 & ~current_umask()


def usual_dir_mode() -> int:
    """The mode a new folder gets here: ``0o777`` less the umask."""
    return 0o777 & ~current_umask()


#: The errors of a full disk, or of a user's quota on it.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """A write found its disk (or the user's quota) full; its message names the file.

    An ``OSError`` with ``errno`` ENOSPC or EDQUOT, so callers that handle OSError still do.
    """

    def __init__(self, path: str | os.PathLike, code: int = errno.ENOSPC) -> None:
        super().__init__(code, "no space left on device", str(path))
        self.path = str(path)

    def __str__(self) -> str:
        return f"no space left on device: {self.path}"


def _disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL


def _temp_beside(path: Path) -> Path:
    """A name for a temporary file beside ``path`` that nothing else uses."""
    return path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def _atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], None],
            mode: int | None = None, durable: bool = True,
            then: Callable[[], None] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:
        while True:
            # The name is known before the file exists: a signal that stops the process
            # right after the file is made (Ctrl-C, SIGTERM) still finds it to remove.
            tmp = _temp_beside(path)
            try:
                fd = os.open(tmp, _CREATE, 0o600)
                break
            except FileExistsError:
                tmp = None  # not ours: another name
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        # made 0o600, whatever the umask
        os.chmod(tmp, usual_file_mode() if mode is None else mode)
        if then is None:
            os.replace(tmp, path)
        else:
            # imported here: every module that writes a file imports this one, and the
            # import chains of exogym stay short (tests/test_layers.py)
            from exogym.base.stop_signal import done_whole

            with done_whole():  # the file and what announces it: both, or neither
                os.replace(tmp, path)
                tmp = None
                then()
    except BaseException as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        # torch.save reports a failed write as a RuntimeError whose cause is the OSError
        cause = exc if _disk_full(exc) else exc.__cause__ or exc.__context__
        if _disk_full(cause) and not isinstance(exc, DiskFullError):
            raise DiskFullError(path, cause.errno) from exc  # type: ignore[union-attr]
        raise
    return path


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None],
                 then: Callable[[], None] | None = None) -> Path:
    """Call ``write`` with a temporary file beside ``path``, then flush it to disk and
    rename it to ``path`` (removed instead if ``write`` raises).

    ``then`` is called right after the rename, in the same block
    (:func:`exogym.base.stop_signal.done_whole`): an interruption (Ctrl-C, SIGTERM) comes
    before the rename or after ``then`` has returned, never between, so what announces
    the file (a checkpoint's step event) is never lost while the file stays.
    """
    return _atomic(path, write, then=then)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename.

    ``mode``: the file's permissions (default: the user's usual, ``0o666`` less the umask).
    """
    return _atomic(path, lambda f: f.write(data), mode)


def atomic_copy_stream(path: str | os.PathLike, source: IO[bytes],
                       chunk_bytes: int = 8 << 20) -> Path:
    """Copy the readable ``source`` to ``path`` atomically, ``chunk_bytes`` at a time (a
    file of any size passes through a fixed amount of memory)."""
    return _atomic(path, lambda f: shutil.copyfileobj(source, f, chunk_bytes))


def atomic_write_text(path: str | os.PathLike, text: str, mode: int | None = None) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, default=repr) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike, durable: bool = True) -> Path:
    """``torch.save`` to ``path`` atomically.

    ``durable=False`` skips the flush to disk before the rename, for a file
    that is read once and deleted (a rank handing its state to its parent):
    readers still see the whole file or none of it.
    """
    import torch

    return _atomic(path, lambda f: torch.save(obj, f), durable=durable)


def new_temp_dir_beside(target: str | os.PathLike) -> Path:
    """Create an empty temporary folder next to ``target`` (same filesystem, so renames work)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    folder.chmod(usual_dir_mode())  # mkdtemp made it 0o700; it becomes the published folder
    return folder


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



#: The safetensors name of each dtype.
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


def atomic_save_safetensors(state: dict[str, Any], path: str | os.PathLike,
                            metadata: dict[str, str] | None = None) -> Path:
    """Write a model's state dict to ``path`` as safetensors, atomically.

    The file is written tensor by tensor (the header first: every tensor's dtype,
    shape and place), never built whole in memory, so saving a model costs no more
    than its largest non-contiguous tensor. Tensors that share memory (tied weights)
    are stored each on its own, as the format wants; the file loads with
    ``safetensors.torch.load_file`` into a plain dict for ``model.load_state_dict``.
    ``metadata`` (strings only) lands in the header.
    """
    import torch

    bad = {k: type(v).__name__ for k, v in (metadata or {}).items() if not isinstance(v, str)}
    if bad:
        raise TypeError(f"safetensors metadata values must be strings, got {bad}")
    tensors = {key: tensor.detach() for key, tensor in state.items()}
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key in sorted(tensors):
        tensor = tensors[key]
        kind = SAFETENSORS_DTYPES.get(str(tensor.dtype).removeprefix("torch."))
        if kind is None:
            raise TypeError(f"{key}: safetensors cannot store a tensor of {tensor.dtype}")
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": kind, "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned

    def write(f: IO[bytes]) -> None:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for key in sorted(tensors):
            tensor = tensors[key].to("cpu").contiguous().reshape(-1)
            if tensor.numel():
                f.write(memoryview(tensor.view(torch.uint8).numpy()))

    return _atomic(path, write)
