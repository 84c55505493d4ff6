"""Checkpoints of one rank: written atomically, verified on load, the newest few kept.

Layout: ``<dir>/rank<r>/step<00000100>.ckpt``. A file is a magic header, the
SHA-256 of the payload, then the payload: ``torch.save`` of the state's JSON
description and its tensors (:mod:`exogym.base.plain_state`), read back with
``weights_only=True``, so a checkpoint someone else wrote can hold wrong numbers but
never runs code when it is loaded. A truncated or corrupted file fails the check
and is skipped in favour of an older one. Every
rank of a run must resume from the same step, so the step is agreed on by all
ranks (see ``TrainNode``), never chosen by one.
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from exogym.base import plain_state
from exogym.base.io import atomic_write

MAGIC = b"EXOGYM-CKPT-2\n"
#: The header of checkpoints whose payload was a pickle (loading one could run code).
PICKLED_MAGIC = b"EXOGYM-CKPT-1\n"
#: A checkpoint is read this much at a time.
CHUNK_BYTES = 8 << 20
_NAME = re.compile(r"^step(\d{8})\.ckpt$")


class CheckpointError(ValueError):
    """A checkpoint file is missing, partial or corrupted."""


def rank_dir(root: str | Path, rank: int) -> Path:
    """Folder holding rank ``rank``'s checkpoints under a run's checkpoint folder."""
    return Path(root) / f"rank{rank}"


def checkpoint_path(root: str | Path, rank: int, step: int) -> Path:
    """Path of rank ``rank``'s checkpoint at ``step``."""
    return rank_dir(root, rank) / f"step{step:08d}.ckpt"


class _Hashing:
    """A file being written that hashes what passes through it."""

    def __init__(self, f: IO[bytes]):
        self.f = f
        self.hash = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class _From(io.RawIOBase):
    """A file read from ``offset`` on, as if it began there (torch reads the payload's
    zip archive in place, never copied whole into memory)."""

    def __init__(self, f: IO[bytes], offset: int):
        super().__init__()
        self.f = f
        self.offset = offset
        f.seek(offset)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self.f.readinto(buffer)

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos += self.offset
        return self.f.seek(pos, whence) - self.offset

    def tell(self) -> int:
        return self.f.tell() - self.offset


def save_checkpoint(state: dict[str, Any], root: str | Path, rank: int, step: int,
                    keep: int = 3, announce: Callable[[], None] | None = None) -> Path:
    """Write ``state`` atomically and delete all but the newest ``keep`` checkpoints.

    The payload streams to the file as ``torch.save`` writes it, hashed on the way
    (its checksum is written into the header last): a checkpoint of any size costs no
    memory beyond the state itself.

    ``announce`` is called once the checkpoint is in place, before an interruption can
    stop the process (:func:`exogym.base.io.atomic_write`'s ``then``): a rank sends the
    step's event there, since a resumed run starts after the steps a checkpoint holds and
    the trace must hold them too.
    """

    description, tensors = plain_state.split(state)
    payload = {"state": description.decode("utf-8"), "tensors": tensors}

    def write(f: IO[bytes]) -> None:
        f.write(MAGIC + bytes(32))
        hashing = _Hashing(f)
        torch.save(payload, hashing)
        f.seek(len(MAGIC))
        f.write(hashing.hash.digest())
        f.seek(0, io.SEEK_END)

    path = atomic_write(checkpoint_path(root, rank, step), write, then=announce)
    for old in list_steps(root, rank)[:-keep]:
        checkpoint_path(root, rank, old).unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read and verify a checkpoint; :class:`CheckpointError` if it is not whole.

    The checksum is computed reading the file in chunks, and the state loaded from the
    file in place: nothing holds the whole file in memory.
    """
    path = Path(path)
    head = len(MAGIC) + 32
    try:
        with open(path, "rb") as f:
            header = f.read(head)
            if header.startswith(PICKLED_MAGIC):
                raise CheckpointError(f"{path} was written by an earlier exogym as a pickle, "
                                      "which could run code when loaded: it is not loaded; "
                                      "start the run afresh")
            if len(header) < head or not header.startswith(MAGIC):
                raise CheckpointError(f"{path} is not a complete exogym checkpoint (bad header)")
            digest = hashlib.sha256()
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
            if digest.digest() != header[len(MAGIC):]:
                raise CheckpointError(f"{path} is partial or corrupted (checksum mismatch)")
            try:
                payload = torch.load(io.BufferedReader(_From(f, head), CHUNK_BYTES),
                                     map_location="cpu", weights_only=True)
                if not isinstance(payload, dict) or not isinstance(payload.get("state"), str) \
                        or not isinstance(payload.get("tensors"), list):
                    raise plain_state.PlainStateError("the payload is not a state and tensors")
                return plain_state.join(payload["state"].encode("utf-8"), payload["tensors"])
            except Exception as exc:  # noqa: BLE001 - any failure to read it means unusable
                raise CheckpointError(f"{path} cannot be loaded: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc


def list_steps(root: str | Path, rank: int) -> list[int]:
    """Steps with a checkpoint file for ``rank`` (not yet verified), oldest first."""
    folder = rank_dir(root, rank)
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match:
            steps.append(int(match.group(1)))
    return sorted(steps)
