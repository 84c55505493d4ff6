"""The runs of a folder tree, as ``exogym runs`` lists them, and ``runs clean``'s removal.

A run folder holds ``run.json`` (the run's identity: profile, settings, start time);
what else it holds says how the run went:

- **finished**: ``summary.json`` (written when the run ends well);
- **stopped**: its trace ends ``interrupted`` (Ctrl-C, SIGTERM, ``--inject`` stop);
- **failed**: its trace ends in an error, or it has a trace being written that has
  not grown for :data:`SILENT_S` seconds (its process was killed outright);
- **running**: a trace being written that grew within :data:`SILENT_S` seconds;
- **refused**: nothing but ``run.json`` (claimed, then refused before it wrote
  anything, by an earlier version that left such folders);
- **damaged**: a file of it cannot be read as a run's (a FIFO or a device where a file
  should be, a file over its size, JSON nested past reading): it is listed with why, and
  the other runs are listed as usual.

Whoever can write in the tree chooses what its files hold: they are read only as
regular files of a bounded size (:mod:`exogym.base.untrusted`).

``runs clean`` removes failed and refused runs (never finished, stopped or running
ones) and points each ``BASE.latest`` to the newest run left of its base. A failed or
stopped run with a checkpoint can be continued (:func:`resume_note` says how), so both
the listing and ``runs clean`` say so before anything is removed.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exogym.base.install_mode import command
from exogym.base.plural import plural
from exogym.base.untrusted import (
    MAX_RUN_FILE_BYTES,
    TooDeepJSON,
    json_loads,
    open_regular,
    read_json,
)

from ..hosts.onhost import runfolders

__all__ = ["RunRow", "clean_question", "clean_runs", "list_runs", "resume_note", "SILENT_S"]

#: A trace being written that has not grown for this long belongs to a process that died.
SILENT_S = 600.0
#: Bytes read from a trace's end to find its last lines.
_TAIL_BYTES = 64 * 1024
#: Statuses ``runs clean`` removes.
REMOVABLE = ("failed", "refused")


@dataclass(frozen=True)
class RunRow:
    """One run folder, as ``exogym runs`` lists it.

    Args:
        folder: the run's folder.
        profile, strategy: from its ``run.json``.
        status: ``finished``, ``stopped``, ``failed``, ``running``, ``refused`` or
            ``damaged``.
        steps: the steps it reached (None when nothing says).
        final_loss: its last validation loss, else its last training loss (None: none).
        size_bytes: what the folder holds on disk.
        started: its start time, as ``run.json`` records it.
        why: for a failed or damaged run, its error in a line.
        checkpoint_step: for a failed or stopped run, the newest step every rank has a
            checkpoint of (it can be resumed from there); None when there is none.
    """

    folder: Path
    profile: str
    strategy: str
    status: str
    steps: int | None
    final_loss: float | None
    size_bytes: int
    started: str
    why: str = ""
    checkpoint_step: int | None = None


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when there is none. A file that is there but
    cannot be read as a run's (not a regular file, too large, nested too deep) raises
    ``OSError`` or ``ValueError``: the run is damaged, not missing."""
    try:
        data = read_json(path, MAX_RUN_FILE_BYTES)
    except FileNotFoundError:
        return None
    except TooDeepJSON:
        raise
    except ValueError:
        return None  # not JSON (a file half written by an old version): it says nothing
    return data if isinstance(data, dict) else None


def _last_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines at the end of ``path`` (a trace), newest last; unreadable ones skipped."""
    try:
        f = open_regular(path)
    except FileNotFoundError:  # a trace being written, renamed as it ended
        return []
    with f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - _TAIL_BYTES))
        tail = f.read(_TAIL_BYTES).decode("utf-8", errors="replace").splitlines()
    if size > _TAIL_BYTES:
        tail = tail[1:]  # the first may be cut
    out = []
    for line in tail:
        try:
            value = json_loads(line, f"a line of {path}")
        except TooDeepJSON:
            raise
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def _size(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _loss(lines: list[dict[str, Any]]) -> float | None:
    for line in reversed(lines):
        for key in ("val_global_loss", "val_loss"):
            if isinstance(line.get(key), (int, float)):
                return float(line[key])
    return None


def _status(folder: Path, summary: dict[str, Any] | None, now: float
            ) -> tuple[str, int | None, float | None, str]:
    """``(status, steps, final loss, why)`` of the run in ``folder``."""
    trace = folder / "trace.jsonl"
    lines = _last_lines(trace) if os.path.lexists(trace) else []
    end = next((line for line in reversed(lines) if line.get("kind") == "end"), None)
    if summary is not None and (end is None or end.get("status") == "ok"):
        loss = summary.get("final_val_global_loss", summary.get("final_val_loss"))
        if not isinstance(loss, (int, float)):
            loss = summary.get("final_train_loss")
        steps = summary.get("steps")
        return ("finished", steps if isinstance(steps, int) else None,
                float(loss) if isinstance(loss, (int, float)) else None, "")
    if end is not None:
        steps = end.get("steps") if isinstance(end.get("steps"), int) else None
        if end.get("error") == "interrupted":
            return "stopped", steps, _loss(lines), ""
        return "failed", steps, _loss(lines), str(end.get("error") or "")
    writing = sorted(folder.glob(".trace.jsonl.*.tmp"), key=lambda p: p.stat().st_mtime)
    if writing:
        grew = writing[-1].stat().st_mtime
        partial = _last_lines(writing[-1])
        steps = max((line["step"] for line in partial if isinstance(line.get("step"), int)),
                    default=None)
        if now - grew <= SILENT_S:
            return "running", steps, _loss(partial), ""
        return ("failed", steps, _loss(partial),
                f"its trace stopped growing {int((now - grew) // 60)} min ago without an end "
                "(the process was killed)")
    entries = {p.name for p in folder.iterdir()}
    if entries <= {runfolders.RUN_FILE}:
        return "refused", None, None, "claimed, then refused before it wrote anything"
    return "failed", None, None, "it ended without a trace or a summary"


def _folders(root: Path) -> Iterator[Path]:
    """Every folder under ``root`` (itself included) that holds a ``run.json``."""
    if (root / runfolders.RUN_FILE).is_file():
        yield root
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        here = Path(dirpath)
        if here != root and runfolders.RUN_FILE in filenames:
            dirnames[:] = []  # a run's own subfolders (checkpoints, replay) hold no runs
            yield here


def list_runs(root: str | os.PathLike[str] = "runs", now: float | None = None) -> list[RunRow]:
    """The runs under ``root``, oldest first (by their start time).

    Raises:
        FileNotFoundError: naming ``root`` when it is not a folder.
    """
    base = Path(root)
    if not base.is_dir():
        raise FileNotFoundError(f"{base} is not a folder of runs (runs land in ./runs by "
                                "default; give the folder: exogym runs FOLDER)")
    now = time.time() if now is None else now
    rows = []
    for folder in _folders(base):
        try:
            rows.append(_row(folder, now))
        except (OSError, ValueError) as exc:  # one run's damage is that run's alone
            rows.append(RunRow(folder, "?", "?", "damaged", None, None, _size(folder), "",
                               str(exc)))
    return sorted(rows, key=lambda r: (r.started, str(r.folder)))


def _row(folder: Path, now: float) -> RunRow:
    """The listing's row of the run in ``folder``; ``OSError`` or ``ValueError`` when a
    file of it cannot be read as a run's."""
    identity = _read_json(folder / runfolders.RUN_FILE) or {}
    settings = identity.get("settings") if isinstance(identity.get("settings"), dict) else {}
    status, steps, loss, why = _status(folder, _read_json(folder / "summary.json"), now)
    profile = str(identity.get("profile") or "?")
    checkpoint = None
    if status in ("failed", "stopped") and profile != "?":
        # the ranks resume from the newest step all of them have
        checkpoint = min(runfolders.newest_steps(str(folder), profile).values(), default=None)
    return RunRow(folder, profile, str(settings.get("strategy") or "?"), status, steps,
                  loss, _size(folder), str(identity.get("started") or ""), why, checkpoint)


def resume_note(row: RunRow) -> str | None:
    """How to continue the run of ``row`` from its newest checkpoint, in a line naming the
    command; None when it has no checkpoint to continue from."""
    if row.checkpoint_step is None:
        return None
    line = command("distributed-train", row.profile, "--resume", "--set",
                   f"output_dir={row.folder}")
    return (f"it has a checkpoint at step {row.checkpoint_step} and can be resumed: {line} "
            "(add the --hosts, --config and --set it started with)")


def clean_question(doomed: list[RunRow], asking: bool = True) -> str:
    """What ``runs clean`` asks before removing ``doomed`` ("Remove this run?", "Remove
    these 3 runs?"), saying how many of them could be resumed; with ``asking`` False, the
    statement ("3 runs would be removed ...") for when there is no terminal to ask."""
    count = len(doomed)
    resumable = sum(1 for row in doomed if row.checkpoint_step is not None)
    if not resumable:
        kept = ""
    elif count == 1:
        kept = " (it can be resumed: removing it loses its checkpoint)"
    elif resumable == count:
        kept = (f" ({'both' if count == 2 else f'all {count}'} can be resumed: removing "
                "them loses their checkpoints)")
    else:
        kept = (f" ({resumable} of them can be resumed: removing "
                + ("it loses its checkpoint)" if resumable == 1 else
                   "them loses their checkpoints)"))
    if not asking:
        return f"{plural(count, 'run')} would be removed{kept}"
    return f"Remove {'this run' if count == 1 else f'these {count} runs'}{kept}?"


def _base_of(folder: Path) -> str:
    """The base folder ``BASE`` of a run folder ``BASE`` or ``BASE-N``."""
    name = folder.name
    head, _, number = name.rpartition("-")
    if head and number.isdigit() and int(number) >= 2:
        return str(folder.with_name(head))
    return str(folder)


def clean_runs(rows: list[RunRow]) -> list[RunRow]:
    """Remove the failed and refused runs of ``rows`` and point each ``BASE.latest`` that
    named one of them to the newest run left of that base (or remove it when none is
    left); the rows removed."""
    removed = []
    for row in rows:
        if row.status in REMOVABLE:
            shutil.rmtree(row.folder, ignore_errors=True)
            if not row.folder.exists():
                removed.append(row)
    for base in sorted({_base_of(r.folder) for r in removed}):
        pointed = runfolders.latest(base)
        if pointed is not None and os.path.isdir(pointed):
            continue
        left = [r for r in rows if r not in removed and _base_of(r.folder) == base]
        if left:
            runfolders.point_latest(base, str(max(left, key=lambda r: r.started).folder))
        elif os.path.lexists(runfolders.latest_path(base)):
            os.unlink(runfolders.latest_path(base))
    return removed
