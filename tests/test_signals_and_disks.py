"""A full disk names the file it could not write and leaves no temporary file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from exogym.base import io as exo_io
from exogym.base.io import DiskFullError, atomic_torch_save, atomic_write_bytes


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_names_the_file_and_leaves_no_temporary_file(tmp_path, monkeypatch, code):
    target = tmp_path / "run" / "model.bin"

    real_fdopen = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(code, os.strerror(code))

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(exo_io.os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode)))
    for write in (lambda: atomic_write_bytes(target, b"x" * 1000),
                  lambda: atomic_torch_save({"w": torch.zeros(100)}, target)):
        with pytest.raises(DiskFullError) as raised:
            write()
        assert str(raised.value) == f"no space left on device: {target}"
        assert raised.value.errno == code and isinstance(raised.value, OSError)
        assert list(target.parent.iterdir()) == []  # the temporary file is gone


def test_a_disk_without_room_for_the_temporary_file_says_so(tmp_path, monkeypatch):
    target = tmp_path / "trace.jsonl"

    def no_inode(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(exo_io.tempfile, "mkstemp", no_inode)
    with pytest.raises(DiskFullError, match=f"^no space left on device: {target}$"):
        exo_io.atomic_write_text(target, "{}")


def test_other_write_errors_pass_unchanged(tmp_path, monkeypatch):
    real_fdopen = os.fdopen

    def denied(fd, mode):
        real_fdopen(fd, mode).close()
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(exo_io.os, "fdopen", denied)
    with pytest.raises(PermissionError):
        atomic_write_bytes(tmp_path / "f", b"x")
    assert list(Path(tmp_path).iterdir()) == []
