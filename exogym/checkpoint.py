"""Checkpoints of one rank: written atomically, verified on load, the newest few kept.

Layout: ``<dir>/rank<r>/step<00000100>.ckpt``. A file is a magic header, the
SHA-256 of the payload, then the ``torch.save`` payload; a truncated or
corrupted file fails the check and is skipped in favour of an older one. Every
rank of a run must resume from the same step, so the step is agreed on by all
ranks (see ``TrainNode``), never chosen by one.
"""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path
from typing import Any

import torch

from exogym.io import atomic_write_bytes

MAGIC = b"EXOGYM-CKPT-1\n"
_NAME = re.compile(r"^step(\d{8})\.ckpt$")


class CheckpointError(ValueError):
    """A checkpoint file is missing, partial or corrupted."""


def rank_dir(root: str | Path, rank: int) -> Path:
    """Folder holding rank ``rank``'s checkpoints under a run's checkpoint folder."""
    return Path(root) / f"rank{rank}"


def checkpoint_path(root: str | Path, rank: int, step: int) -> Path:
    """Path of rank ``rank``'s checkpoint at ``step``."""
    return rank_dir(root, rank) / f"step{step:08d}.ckpt"


def save_checkpoint(state: dict[str, Any], root: str | Path, rank: int, step: int,
                    keep: int = 3) -> Path:
    """Write ``state`` atomically and delete all but the newest ``keep`` checkpoints."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path = atomic_write_bytes(
        checkpoint_path(root, rank, step), MAGIC + hashlib.sha256(payload).digest() + payload
    )
    for old in list_steps(root, rank)[:-keep]:
        checkpoint_path(root, rank, old).unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read and verify a checkpoint; :class:`CheckpointError` if it is not whole."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    head = len(MAGIC) + 32
    if len(data) < head or not data.startswith(MAGIC):
        raise CheckpointError(f"{path} is not a complete exogym checkpoint (bad header)")
    digest, payload = data[len(MAGIC):head], data[head:]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path} is partial or corrupted (checksum mismatch)")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means unusable
        raise CheckpointError(f"{path} cannot be loaded: {exc}") from exc


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
