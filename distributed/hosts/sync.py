"""Copy the project's tracked files to a host over SFTP, so every host runs the same code.

The files are those ``git ls-files`` lists in the local checkout, and beside
each tracked ``.ini`` file its git-ignored local profiles file when there is
one (``config.local.ini``: the profiles the wizard writes, which every host's
worker reads after ``config.ini``); the pre-flight code hash covers a subset
of the same list. A host's own local profiles file, when it differs, is kept
there as ``NAME.bak`` before it is replaced. A file whose size and
modification time already match on the host is skipped; every other file is
written to a temporary name of its own (:func:`remote_temp`) and renamed into place,
so a reader never sees half a file, a host that shares the checkout with this machine
is never truncated, and two copies written into one folder at once (two hosts sharing
it, two runs) never take each other's temporary file away. Directories are created as
needed, and one another writer made a moment before is taken as made.

A tracked symbolic link travels as a link, when what it names is inside the project
(written relative, so that it names the same file on the host); one that leads out of
the project (``/etc/passwd``, ``../../secrets``, or through a linked folder) is not
followed: nothing of what it names is copied, and the sync names it as skipped
(:func:`leaving_links`).
"""

from __future__ import annotations

import os
import posixpath
import secrets
import stat
import subprocess
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: This package's folder: ``distributed/`` in a checkout, ``exogym_distributed/`` installed.
PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: The folder holding ``exogym/`` and this package: a checkout, or the site-packages of an
#: installed wheel. What is synced to hosts, laid out the same there; ranks start in it.
PROJECT_ROOT = PACKAGE_DIR.parent
#: The name a host runs this package under (``python -m NAME.worker`` in its project_path):
#: its folder's name, since a host holds the same layout as this machine.
PACKAGE_FOLDER = PACKAGE_DIR.name


def is_checkout(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` is a checkout of this project (``exogym/``, ``config.ini`` and this
    package beside them), not a site-packages folder."""
    root = Path(root)
    return ((root / "config.ini").is_file() and (root / "exogym").is_dir()
            and (root / PACKAGE_FOLDER).is_dir())


#: The built-in profiles: ``config.ini`` of the checkout, or the copy an installed wheel holds.
BUILTIN_CONFIG = (PROJECT_ROOT / "config.ini" if is_checkout(PROJECT_ROOT)
                  else PACKAGE_DIR / "config.ini")
#: Where relative paths of a run start (``runs/``): the checkout, or installed, the folder
#: the command runs in.
WORK_ROOT = PROJECT_ROOT if is_checkout(PROJECT_ROOT) else Path.cwd()

#: Suffixes of the files whose content must match on every host (the code hash).

CODE_SUFFIXES = (".py", ".pyi", ".ini", ".toml", ".cfg")
#: How a checkout's own profiles file is named beside a profiles file: ``config.local.ini``.
LOCAL_PROFILES_SUFFIX = ".local.ini"

_SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", "node_modules", "build", "dist", "runs",
              "logs", "checkpoints", "outputs", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


def tracked_files(root: str | os.PathLike[str]) -> list[str]:
    """Relative paths of the files ``git`` tracks under ``root``.

    Under an installed wheel's site-packages, the files of ``exogym`` and this package
    (:func:`installed_files`). When ``root`` is not a git checkout (or git is missing), every file under
    it except hidden directories, caches, virtual environments and run outputs.
    """
    root = Path(root)
    if not is_checkout(root) and (root / "exogym").is_dir() and (root / PACKAGE_FOLDER).is_dir():
        return installed_files(root)
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached"],
                             check=True, capture_output=True).stdout
        files = [p for p in out.decode().split("\0") if p]
        return sorted(p for p in files if (root / p).is_file() or (root / p).is_symlink())
    except (OSError, subprocess.CalledProcessError):
        pass  # not a checkout: fall back to walking the tree
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")
                             and not (Path(dirpath, d, "pyvenv.cfg")).exists())
        for name in filenames:
            if not name.endswith((".pyc", ".pyo")):
                found.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(found)


def installed_files(root: str | os.PathLike[str]) -> list[str]:
    """The files of an installed ``exogym`` and this package under ``root`` (site-packages),
    relative to it: what a host needs to run, laid out as here."""
    root = Path(root)
    found: list[str] = []
    for top in ("exogym", PACKAGE_FOLDER):
        for dirpath, dirnames, filenames in os.walk(root / top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            found += [Path(dirpath, name).relative_to(root).as_posix() for name in filenames
                      if not name.endswith((".pyc", ".pyo"))]
    return sorted(found)


def local_profiles_path(config: str | os.PathLike[str]) -> Path:
    """Where a checkout keeps its own profiles beside the profiles file ``config``:
    ``config.ini`` -> ``config.local.ini`` (``my.ini`` -> ``my.local.ini``).

    Git ignores it (``*.local.ini``), so profiles written there never meet a
    ``git pull``; the profiles are read from it after ``config``, and it travels to
    the hosts with the tracked files (:func:`shared_files`).
    """
    path = Path(config)
    if not is_checkout(PROJECT_ROOT) and path.resolve() == BUILTIN_CONFIG.resolve():
        # installed: the built-in profiles sit in site-packages; the user's own are here
        return WORK_ROOT / ("config" + LOCAL_PROFILES_SUFFIX)
    return path.with_name(path.stem + LOCAL_PROFILES_SUFFIX)


def local_profile_files(root: str | os.PathLike[str], tracked: Sequence[str]) -> list[str]:
    """The untracked local profiles files (relative paths) beside the ``.ini`` files of
    ``tracked`` under ``root``."""
    known = set(tracked)
    found = []
    for rel in tracked:
        if rel.endswith(".ini"):
            local = local_profiles_path(rel).as_posix()
            if local not in known and (Path(root) / local).is_file():
                found.append(local)
    return found


def leaving_link(root: str | os.PathLike[str], rel: str) -> str | None:
    """Where ``root/rel`` really is when a symbolic link (``rel`` itself, or a folder on
    its way) leads it out of ``root``; None when it stays inside."""
    top = os.path.realpath(root)
    real = os.path.realpath(os.path.join(top, rel))
    if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
        return None
    return real


def leaving_links(root: str | os.PathLike[str], files: Sequence[str]) -> dict[str, str]:
    """Of ``files`` (relative to ``root``), those a symbolic link leads out of ``root``, each
    with where it leads: the sync copies none of them."""
    out = {}
    for rel in files:
        where = leaving_link(root, rel)
        if where is not None:
            out[rel] = where
    return out


def shared_files(root: str | os.PathLike[str]) -> list[str]:
    """What every host must hold: the tracked files and the local profiles files beside them,
    less those a symbolic link leads out of the project (:func:`leaving_links`)."""
    tracked = tracked_files(root)
    files = tracked + local_profile_files(root, tracked)
    leaving = leaving_links(root, files)
    return sorted(rel for rel in files if rel not in leaving)


def code_files(root: str | os.PathLike[str]) -> list[str]:
    """The shared files whose content every host must share (see ``CODE_SUFFIXES``)."""
    return [p for p in shared_files(root) if p.endswith(CODE_SUFFIXES)]


@dataclass(frozen=True)
class SyncStats:
    """What one host's sync did.

    Args:
        host: the host, as the hosts file names it.
        copied: files written.
        unchanged: files skipped because size and modification time matched.
        bytes_copied: bytes written.
        kept: files whose previous, different copy on the host was kept as ``NAME.bak``.
        skipped: symbolic links that lead out of the project, not copied, each as
            ``NAME -> where it leads``.
        shared_from: the host whose sync filled this host's project folder, when the two
            share it (this host copied nothing itself); None when it was synced itself.
    """

    host: str
    copied: int
    unchanged: int
    bytes_copied: int
    kept: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    shared_from: str | None = None


class NoSFTPError(RuntimeError):
    """Hosts whose sshd offers no SFTP subsystem: no file can be copied to them.

    Args:
        hosts: the hosts, as the hosts file names them.
    """

    def __init__(self, hosts: Sequence[str]) -> None:
        self.hosts = tuple(hosts)
        super().__init__("; ".join(
            f"host {host}: its sshd offers no SFTP subsystem (Subsystem sftp in sshd_config), "
            "so no file can be copied there; add the line `Subsystem sftp internal-sftp` to "
            f"{host}'s /etc/ssh/sshd_config, restart its sshd, and run again"
            for host in self.hosts))


def open_sftp(client: Any, host: str) -> Any:
    """An SFTP session on ``client``'s connection to ``host``.

    Raises:
        NoSFTPError: when the connection is up but the host's sshd refuses or drops the
            SFTP channel (no ``Subsystem sftp`` line, or a missing ``sftp-server``).
    """
    import paramiko

    try:
        return client.open_sftp()
    except (paramiko.SSHException, EOFError):
        transport = client.get_transport()
        if transport is None or not transport.is_active():
            raise  # the connection itself is gone: not a missing subsystem
        raise NoSFTPError([host]) from None


def sftp_path(path: str) -> str:
    """SFTP paths start in the login's home directory, where ``~/x`` is just ``x``."""
    if path == "~":
        return "."
    return path.removeprefix("~/")


def sync_files(client: Any, host: str, local_root: str | os.PathLike[str], remote_root: str,
               files: Sequence[str], keep_previous: Collection[str] = ()) -> SyncStats:
    """Copy ``files`` (relative to ``local_root``) to ``remote_root`` on ``client``'s host.

    Args:
        client: a connected ``paramiko.SSHClient``.
        host: the host's name, for the stats.
        local_root: the local checkout.
        remote_root: the host's ``project_path``.
        files: relative paths to copy; a symbolic link among them is made a link on the
            host when it names something inside ``local_root``, and skipped (named in
            the stats) when it leads out of it.
        keep_previous: of ``files``, those whose different copy on the host is kept as
            ``NAME.bak`` before it is replaced (files git does not hold for the host).
    """
    local_root = Path(local_root)
    base = sftp_path(remote_root)
    copied = unchanged = sent = 0
    kept: list[str] = []
    skipped: list[str] = []
    made: set[str] = set()
    sftp = open_sftp(client, host)
    try:
        makedirs_remote(sftp, base, made)
        _claim_folder(sftp, base, files)
        for rel in files:
            source = local_root / rel
            leads = leaving_link(local_root, rel)
            if leads is not None:
                skipped.append(f"{rel} -> {leads}")
                continue
            if source.is_symlink():
                if _link_remote(sftp, source, posixpath.join(base, rel), made):
                    copied += 1
                else:
                    unchanged += 1
                continue
            info = source.stat()
            target = posixpath.join(base, rel)
            exists = True
            try:
                remote = sftp.stat(target)
                if remote.st_size == info.st_size and int(remote.st_mtime or 0) == int(
                        info.st_mtime):
                    unchanged += 1
                    continue
            except FileNotFoundError:
                exists = False  # not there yet
            makedirs_remote(sftp, posixpath.dirname(target), made)
            temp = remote_temp(target)
            sftp.put(str(source), temp)
            sftp.chmod(temp, stat.S_IMODE(info.st_mode))
            sftp.utime(temp, (info.st_atime, info.st_mtime))
            if exists and rel in keep_previous and not _same_content(sftp, target, source):
                replace_remote(sftp, target, f"{target}.bak")
                kept.append(rel)
            replace_remote(sftp, temp, target)
            copied += 1
            sent += info.st_size
    finally:
        sftp.close()
    return SyncStats(host=host, copied=copied, unchanged=unchanged, bytes_copied=sent,
                     kept=tuple(kept), skipped=tuple(skipped))


def put_files(client: Any, host: str, remote_root: str, files: dict[str, bytes],
              in_place: dict[str, str] | None = None) -> bool:
    """Write ``files`` (a relative path under ``remote_root`` each, and its bytes) on
    ``client``'s host, each atomically (a temporary name of its own, then a rename); a
    file already holding those bytes is left as it is.

    Args:
        in_place: for each of ``files``, the absolute path it has here: when the host
            holds every one of them there with the same bytes (a disk it shares with this
            machine), nothing is written.

    Returns:
        True when the files were found in place and nothing was written.
    """
    base = sftp_path(remote_root)
    made: set[str] = set()
    sftp = open_sftp(client, host)
    try:
        if in_place and all(_holds(sftp, sftp_path(in_place[rel]), data)
                            for rel, data in files.items()):
            return True
        for rel, data in files.items():
            target = posixpath.join(base, rel)
            if _holds(sftp, target, data):
                continue
            makedirs_remote(sftp, posixpath.dirname(target), made)
            temp = remote_temp(target)
            with sftp.open(temp, "wb") as handle:
                handle.write(data)
            replace_remote(sftp, temp, target)
    finally:
        sftp.close()
    return False


def _holds(sftp: Any, path: str, data: bytes) -> bool:
    """Whether the host's file ``path`` holds exactly ``data``."""
    try:
        if sftp.stat(path).st_size != len(data):
            return False
        with sftp.open(path, "rb") as handle:
            return bytes(handle.read()) == data
    except OSError:
        return False


class ForeignFolderError(OSError):
    """A host's ``project_path`` holds files that are not the project's (no sync or
    checkout of it put them there): nothing is copied into it.

    Args:
        folder: the folder on the host.
        names: some of what the folder holds.
    """

    def __init__(self, folder: str, names: Sequence[str]) -> None:
        self.folder = folder
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        super().__init__(f"{folder} holds files that are not the project's ({shown}): "
                         "nothing was copied; point project_path to a new or empty folder, "
                         "or to a checkout of the project")


#: What a sync leaves in a host's project folder that is not a checkout, before it copies
#: anything: a later sync (after one that was cut short, too) knows the folder as its own.
PROJECT_MARK = ".exogym-project"


def _claim_folder(sftp: Any, base: str, files: Sequence[str]) -> None:
    """Take ``base`` for the project's copy, or raise :class:`ForeignFolderError`: it must
    hold nothing but what the sync brings (a host's own ``config.local.ini``, say), be a
    folder a sync or ``setup-hosts`` filled before (:data:`PROJECT_MARK`, or setup's
    ``.exogym``), or a checkout of the project, so that a person's folder named by
    mistake loses nothing."""
    names = [n for n in sftp.listdir(base) if not n.startswith(".exogym-share.")]
    if PROJECT_MARK in names or ".exogym" in names:
        return
    if {"pyproject.toml", "exogym"} <= set(names):
        return  # a checkout of the project: nothing to mark
    foreign = set(names) - {rel.split("/", 1)[0] for rel in files}
    if foreign:
        raise ForeignFolderError(base, sorted(foreign))
    target = posixpath.join(base, PROJECT_MARK)
    temp = remote_temp(target)
    with sftp.open(temp, "wb") as handle:
        handle.write(b"A copy of the exogym project, made and kept up to date by its sync.\n")
    replace_remote(sftp, temp, target)


def _link_remote(sftp: Any, source: Path, target: str, made: set[str]) -> bool:
    """Make ``target`` on the host a link to what the link ``source`` names (inside the
    project), written relative to its folder; False when it already is that link."""
    named = os.path.relpath(os.path.realpath(source), os.path.realpath(source.parent))
    named = named.replace(os.sep, "/")
    if _is_link_to(sftp, target, named):
        return False
    try:
        sftp.remove(target)  # a file or another link: the link replaces it
    except FileNotFoundError:
        makedirs_remote(sftp, posixpath.dirname(target), made)
    try:
        sftp.symlink(named, target)
    except OSError:
        if not _is_link_to(sftp, target, named):
            raise
        # else another writer into this folder made the same link a moment ago
    return True


def _is_link_to(sftp: Any, target: str, named: str) -> bool:
    try:
        return stat.S_ISLNK(sftp.lstat(target).st_mode or 0) and sftp.readlink(target) == named
    except FileNotFoundError:
        return False


def _same_content(sftp: Any, remote: str, local: Path) -> bool:
    """Whether the host's file ``remote`` holds the bytes of ``local`` (a small file)."""
    return _holds(sftp, remote, local.read_bytes())


def remote_temp(target: str) -> str:
    """A temporary name beside ``target`` that no other writer uses: one name shared by
    two writers into one folder (two hosts with one home) let the first rename take the
    second's file away, which failed with ``[Errno 2] No such file``."""
    return f"{target}.{secrets.token_hex(6)}.exogym-sync.tmp"


def replace_remote(sftp: Any, source: str, target: str) -> None:
    """Rename ``source`` to ``target`` on the host, replacing ``target``."""
    try:
        sftp.posix_rename(source, target)
    except FileNotFoundError:
        raise  # no source: removing the target would only lose it too
    except OSError:  # a server without the posix-rename extension
        try:
            sftp.remove(target)
        except FileNotFoundError:
            pass  # nothing to replace
        sftp.rename(source, target)


def makedirs_remote(sftp: Any, path: str, made: set[str]) -> None:
    """``mkdir -p`` over SFTP, remembering what already exists."""
    if not path or path in (".", "/") or path in made:
        return
    try:
        if stat.S_ISDIR(sftp.stat(path).st_mode or 0):
            made.add(path)
            return
        raise NotADirectoryError(f"{path} exists on the host and is not a directory")
    except FileNotFoundError:
        pass  # create it below, after its parent
    makedirs_remote(sftp, posixpath.dirname(path), made)
    try:
        sftp.mkdir(path)
    except OSError:
        if not _is_remote_dir(sftp, path):
            raise
        # else another writer (a host sharing this folder) made it a moment ago
    made.add(path)


def _is_remote_dir(sftp: Any, path: str) -> bool:
    try:
        return stat.S_ISDIR(sftp.stat(path).st_mode or 0)
    except FileNotFoundError:
        return False
