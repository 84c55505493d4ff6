"""Run folders on the machine that keeps a run's outputs: which runs a base folder holds,
and claiming a folder for a new run so that no run writes over another.

A run writes into a folder of its own. The first run from a base folder (a
profile's ``output_dir``, default ``runs/NAME``) gets the base folder itself;
the next ones get ``BASE-2``, ``BASE-3``, ... . ``run.json`` in a folder says
which run it holds (profile, settings fingerprint, start time: the identity
:mod:`distributed.profiles.run_dir` computes), and ``BASE.latest`` names the
newest run started from the base (a symbolic link to its folder, or a one-line
file holding the folder's name where links cannot be made).

A folder *holds a run* when it has any of :data:`OUTPUTS`. A new run claims a
free folder by creating its ``run.json`` exclusively (a hard link of a written
temporary file: two runs starting at once never take the same folder).

The app and the worker call :func:`handle` in process; for a run across hosts
whose master is another machine the launcher ships this file to the master as
source and runs it there with the stdin loader (``main(message)`` prints one
JSON object). Standard library only, Python 3.8+.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

#: The file in a run's folder that says which run it is.
RUN_FILE = "run.json"
#: What a run writes into its folder; a folder with any of them holds a run.
OUTPUTS = ("run.json", "model.safetensors", "summary.json", "trace.jsonl", "checkpoints", "logs")
#: ``BASE + LATEST_SUFFIX`` names the newest run started from ``BASE``.
LATEST_SUFFIX = ".latest"
#: An earlier run's outputs are moved here (inside the folder) before they are deleted.
TRASH_PREFIX = ".replaced-"
_STEP_FILE = re.compile(r"^step(\d{8})\.ckpt$")
_RANK_DIR = re.compile(r"^rank(\d+)$")


def numbered(base: str, n: int) -> str:
    """The ``n``-th run folder of ``base``: ``base`` itself for 1, ``base-n`` after."""
    return base if n == 1 else f"{base}-{n}"


def holds_run(folder: str) -> bool:
    """Whether ``folder`` has any of a run's :data:`OUTPUTS`."""
    return any(os.path.lexists(os.path.join(folder, name)) for name in OUTPUTS)


#: The largest ``run.json`` read (a run's identity takes a few KiB).
_MAX_RUN_FILE = 16 << 20


def _read_regular(path: str, max_bytes: int) -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``max_bytes``; an
    ``OSError`` for a FIFO or a device (opened without waiting for a writer), or a larger
    file (whoever writes in the folder chooses what it holds)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
            raise OSError(f"{path} is not a regular file of at most {max_bytes:,} bytes")
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise OSError(f"{path} is over {max_bytes:,} bytes")
    return data


def read_identity(folder: str) -> dict[str, Any] | None:
    """The identity in ``folder``'s ``run.json``; None when there is none, or it is not a
    run identity (a folder from before identities, a damaged file)."""
    try:
        identity = json.loads(_read_regular(os.path.join(folder, RUN_FILE), _MAX_RUN_FILE))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(identity, dict) or not isinstance(identity.get("fingerprint"), str):
        return None
    return identity


def newest_steps(folder: str, run_name: str) -> dict[str, int]:
    """Each rank's newest checkpoint step (not yet verified) in ``folder``, by rank (as a
    string: a JSON key); ranks without a checkpoint are left out."""
    root = os.path.join(folder, "checkpoints", run_name)
    steps: dict[str, int] = {}
    try:
        entries = os.listdir(root)
    except OSError:
        return steps
    for entry in entries:
        rank = _RANK_DIR.match(entry)
        if rank is None:
            continue
        try:
            names = os.listdir(os.path.join(root, entry))
        except OSError:
            continue
        found = [int(m.group(1)) for m in map(_STEP_FILE.match, names) if m]
        if found:
            steps[str(int(rank.group(1)))] = max(found)
    return steps


def run_folders(base: str) -> list[str]:
    """``base`` and its numbered siblings ``base-N`` that exist, in number order."""
    base = os.path.normpath(base)
    parent, name = os.path.split(base)
    pattern = re.compile(re.escape(name) + r"(?:-([1-9][0-9]*))?")
    found: list[tuple[int, str]] = []
    try:
        entries = os.listdir(parent or ".")
    except OSError:
        return []
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match is None or match.group(1) == "1":
            continue
        n = int(match.group(1) or 1)
        if os.path.isdir(numbered(base, n)):
            found.append((n, numbered(base, n)))
    return [folder for _, folder in sorted(found)]


def latest_path(base: str) -> str:
    """Where the pointer to ``base``'s newest run is: ``base.latest``."""
    return os.path.normpath(base) + LATEST_SUFFIX


def latest(base: str) -> str | None:
    """The folder ``base.latest`` names (a link's target or the file's line), or None."""
    pointer = latest_path(base)
    parent = os.path.dirname(pointer)
    try:
        if os.path.islink(pointer):
            target = os.readlink(pointer)
        elif os.path.isfile(pointer):
            with open(pointer, encoding="utf-8") as f:
                target = f.read().strip()
        else:
            return None
    except OSError:
        return None
    return os.path.join(parent, target) if target else None


def scan(base: str, run_name: str) -> dict[str, Any]:
    """Every run folder of ``base``: whether it holds a run, its identity and its ranks'
    newest checkpoint steps; and which one ``base.latest`` names."""
    base = os.path.normpath(base)
    runs = [{"folder": folder, "holds_run": holds_run(folder),
             "identity": read_identity(folder), "steps": newest_steps(folder, run_name)}
            for folder in run_folders(base)]
    return {"base": base, "latest": latest(base), "runs": runs}


def _temporary_json(folder: str, obj: Any) -> str:
    """``obj`` written (and flushed to disk) to a new temporary file in ``folder``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{RUN_FILE}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def write_identity(folder: str, identity: dict[str, Any], exclusive: bool = False) -> bool:
    """Write ``identity`` as ``folder/run.json`` atomically.

    Args:
        exclusive: only when there is no ``run.json`` yet (False when there is one).
    """
    os.makedirs(folder, exist_ok=True)
    tmp = _temporary_json(folder, identity)
    target = os.path.join(folder, RUN_FILE)
    try:
        if not exclusive:
            os.replace(tmp, target)
            return True
        try:
            os.link(tmp, target)  # fails if it exists: the claim is one atomic step
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                return False
            with open(tmp, "rb") as source, os.fdopen(fd, "wb") as f:
                shutil.copyfileobj(source, f)
                f.flush()
                os.fsync(f.fileno())
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def point_latest(base: str, folder: str) -> None:
    """Make ``base.latest`` name ``folder`` (replaced atomically)."""
    pointer = latest_path(base)
    parent = os.path.dirname(pointer) or "."
    target = os.path.relpath(folder, parent)
    # A name of this call's own: claims in threads of one process must not share it.
    tmp = os.path.join(parent, f".{os.path.basename(pointer)}.{os.getpid()}."
                               f"{os.urandom(4).hex()}.tmp")
    try:
        os.symlink(target, tmp, target_is_directory=True)
    except (OSError, NotImplementedError):  # no symbolic links here: a one-line file
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(target + "\n")
    if os.path.isdir(pointer) and not os.path.islink(pointer):
        os.unlink(tmp)
        raise OSError(f"{pointer} is a folder, not a pointer to the latest run: rename it")
    os.replace(tmp, pointer)


def clear_outputs(folder: str) -> list[str]:
    """Remove an earlier run's :data:`OUTPUTS` from ``folder`` and leave the rest.

    Each is first renamed into one hidden folder inside ``folder`` (a rename is atomic:
    an interruption leaves every output either in place or in that folder), which is then
    deleted; such folders left by an earlier interruption are deleted too.

    Returns:
        The names removed.
    """
    trash = os.path.join(folder, f"{TRASH_PREFIX}{os.getpid()}-{time.time_ns()}")
    moved = []
    for name in OUTPUTS:
        path = os.path.join(folder, name)
        if os.path.lexists(path):
            os.makedirs(trash, exist_ok=True)
            os.rename(path, os.path.join(trash, name))
            moved.append(name)
    for entry in os.listdir(folder) if os.path.isdir(folder) else []:
        if entry.startswith(TRASH_PREFIX):
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
    return moved


def look(base: str) -> dict[str, Any]:
    """What an overwrite of ``base`` would replace, touching nothing: ``{"identity": the
    earlier run's identity or None, "outputs": the names of :data:`OUTPUTS` there}``."""
    base = os.path.normpath(base)
    return {"identity": read_identity(base),
            "outputs": [name for name in OUTPUTS if os.path.lexists(os.path.join(base, name))]}


def claim_new(base: str, identity: dict[str, Any], overwrite: bool = False) -> dict[str, Any]:
    """Claim a folder for a new run and write its ``run.json``; point ``base.latest`` to it.

    Args:
        base: the base folder.
        identity: the new run's identity.
        overwrite: take ``base`` itself, removing an earlier run's outputs there
            (:func:`clear_outputs`); otherwise the first of ``base``, ``base-2``, ...
            that holds no run.

    Returns:
        ``{"folder": the folder, "replaced": the earlier run's outputs removed,
        "replaced_identity": that run's identity or None, "previous_latest": the folder
        ``base.latest`` named before, or None}``.
    """
    base = os.path.normpath(base)
    if overwrite:
        earlier = read_identity(base)
        removed = clear_outputs(base) if os.path.isdir(base) else []
        write_identity(base, identity)
        previous = latest(base)
        point_latest(base, base)
        return {"folder": base, "replaced": removed, "replaced_identity": earlier,
                "previous_latest": previous}
    n = 1
    while True:
        folder = numbered(base, n)
        n += 1
        if os.path.isdir(folder) and holds_run(folder):
            continue
        if os.path.exists(folder) and not os.path.isdir(folder):
            continue  # a file of that name: not ours to touch
        if write_identity(folder, identity, exclusive=True):
            previous = latest(base)
            point_latest(base, folder)
            return {"folder": folder, "replaced": [], "replaced_identity": None,
                    "previous_latest": previous}


def release(base: str, folder: str, identity: dict[str, Any],
            previous_latest: str | None) -> dict[str, Any]:
    """Undo :func:`claim_new` for a run refused before it wrote anything: remove ``folder``
    when it holds nothing but this run's ``run.json``, and point ``base.latest`` back to
    ``previous_latest`` (or remove it when there was none). A folder holding anything
    else, or another run's identity, is left as it is.

    Returns:
        ``{"released": whether the folder was removed}``.
    """
    base, folder = os.path.normpath(base), os.path.normpath(folder)
    try:
        entries = os.listdir(folder)
    except OSError:
        return {"released": False}
    if entries != [RUN_FILE] or read_identity(folder) != identity:
        return {"released": False}
    os.unlink(os.path.join(folder, RUN_FILE))
    try:
        os.rmdir(folder)
    except OSError:  # something arrived meanwhile: it stays
        return {"released": False}
    pointed = latest(base)
    if pointed is not None and os.path.normpath(pointed) == folder:
        if previous_latest and os.path.isdir(previous_latest):
            point_latest(base, previous_latest)
        else:
            os.unlink(latest_path(base))
    return {"released": True}


def record_resume(folder: str, when: str, step: int | None = None) -> None:
    """Add a resume (its time and step) to the ``resumed`` list of ``folder``'s ``run.json``."""
    identity = read_identity(folder)
    if identity is None:
        return
    resumed = list(identity.get("resumed") or [])
    resumed.append({"at": when, "step": step})
    write_identity(folder, {**identity, "resumed": resumed})


def put_text(folder: str, name: str, text: str) -> str:
    """Write ``text`` as ``folder/name`` atomically (a file the launcher made for the run,
    such as its trace); returns the path. ``name`` is a plain file name."""
    if os.path.basename(name) != name or name in ("", ".", ".."):
        raise OSError(f"{name!r} is not a plain file name")
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return os.path.join(folder, name)


def merge_json(folder: str, name: str, fields: dict[str, Any]) -> str:
    """Add ``fields`` to the JSON object in ``folder/name`` (a run's ``summary.json``) and
    write it back atomically; returns the path. A missing file is an ``OSError``."""
    path = os.path.join(folder, name)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise OSError(f"{path} does not hold a JSON object")
    data.update(fields)
    return put_text(folder, name, json.dumps(data, indent=2) + "\n")


def handle(message: dict[str, Any]) -> dict[str, Any]:
    """Do what ``message["action"]`` asks: ``scan`` (``base``, ``run_name``), ``look``
    (``base``), ``claim``
    (``base``, ``identity``, ``overwrite``), ``resumed`` (``folder``, ``when``,
    ``step``), ``put`` (``folder``, ``name``, ``text``) or ``merge`` (``folder``,
    ``name``, ``fields``); errors come back as ``{"error": why}``."""
    action = message.get("action")
    try:
        if action == "scan":
            return scan(str(message["base"]), str(message["run_name"]))
        if action == "look":
            return look(str(message["base"]))
        if action == "claim":
            return claim_new(str(message["base"]), dict(message["identity"]),
                             bool(message.get("overwrite")))
        if action == "release":
            previous = message.get("previous_latest")
            return release(str(message["base"]), str(message["folder"]),
                           dict(message["identity"]), str(previous) if previous else None)
        if action == "resumed":
            record_resume(str(message["folder"]), str(message["when"]), message.get("step"))
            return {}
        if action == "put":
            return {"path": put_text(str(message["folder"]), str(message["name"]),
                                     str(message["text"]))}
        if action == "merge":
            return {"path": merge_json(str(message["folder"]), str(message["name"]),
                                       dict(message["fields"]))}
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": f"unknown action {action!r}"}


def main(message: dict[str, Any]) -> None:
    """Entry point called by the loader with the message read from stdin."""
    print(json.dumps({"cwd": str(Path.cwd()), **handle(message)}), flush=True)
