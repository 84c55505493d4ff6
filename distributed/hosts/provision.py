"""Make a host ready to train: a Python environment with the lock's versions, made over SSH.

A host needs the project's code (copied by :mod:`.sync`) and an interpreter with the
packages the code imports, at the versions this project is tested with: the lock
(``constraints.txt``). :class:`HostProvisioner` makes that environment with the host's
own ``python3``:

1. It asks the host's system interpreter what it is (:mod:`.onhost.platform_facts`):
   Python version, machine, C library or macOS version, and what the environment
   already holds (a marker written at the end of a setup, keyed by the lock, the
   requirements and the interpreter).
2. When the marker matches, nothing is done. Otherwise it makes a virtual environment
   (``python3 -m venv``; where ``ensurepip`` is missing, ``--without-pip`` and pip from
   a wheel this machine sends) and installs the requirements under the lock:
   - from the host's own package index when the host reaches one;
   - else from wheels this machine downloads for the host's platform
     (``pip download --platform ...``), sends over SFTP and installs with
     ``--no-index``: machines on a LAN without internet.
   A host whose platform has no wheel of a package gets an error naming the package
   and the platform.
3. It writes the marker, so a second run with nothing changed takes a second.

Every command on the host has a deadline; its error names the host and the step.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .onhost import platform_facts
from .remote import LOADER, Shell, interpreter_word, module_source, shell_path
from .shared import FolderBusyError, FolderLock
from .sync import (
    PACKAGE_DIR,
    PROJECT_ROOT,
    is_checkout,
    makedirs_remote,
    remote_temp,
    replace_remote,
    sftp_path,
)

#: The marker a finished setup leaves in the environment's folder.
MARKER = "exogym-setup.json"
#: The extras a host gets unless told otherwise: what the workers of the built-in
#: profiles import (the digits task needs scikit-learn).
DEFAULT_EXTRAS = ("distributed", "examples")
#: The index a host's reach is probed with.
DEFAULT_INDEX = "https://pypi.org/simple/pip/"
#: Where this machine keeps wheels it downloaded for hosts, one folder per platform and lock.
WHEEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "exogym" / "wheels"
#: Seconds each step may take on a host (an install of torch takes the longest).
FACTS_TIMEOUT_S = 60.0
VENV_TIMEOUT_S = 180.0
INSTALL_TIMEOUT_S = 1800.0
DOWNLOAD_TIMEOUT_S = 1800.0
#: After how long a setup's lock on an environment was left by a setup that died: longer
#: than every step of one together (an install from the index that fails, then wheels
#: downloaded, sent and installed). A setup waits for another's lock as long, at most.
LOCK_STALE_S = 2 * 3600.0
#: How the wheel installs choose: the host's index when it answers, else sent wheels.
WHEEL_MODES = ("auto", "always", "never")
#: The installer sent with the wheels (a static binary in a wheel; pip where it has none).
UV_REQUIREMENT = "uv>=0.5,<1"

FACTS_SOURCE = module_source(platform_facts)


class ProvisionError(RuntimeError):
    """A host could not be made ready; the message names the host, the step and the fix."""


class NoWheelError(ProvisionError):
    """No wheel of a required package exists for a host's platform.

    Args:
        package: the requirement that has no wheel (``torch==2.13.0``).
        platform: the host's platform, in words.
        detail: pip's own last lines.
    """

    def __init__(self, package: str, platform: str, detail: str = "") -> None:
        self.package = package
        self.platform = platform
        super().__init__(f"no wheel of {package} for {platform}: this platform cannot get it "
                         "from the wheels this machine sends; give the host a package index "
                         "it can reach (it then builds or fetches it itself), or leave it out"
                         + (f"\n{detail}" if detail else ""))


# --------------------------------------------------------------------------- what to install


def lock_path() -> Path:
    """The lock: ``constraints.txt`` of the checkout, or the copy an installed wheel holds."""
    if is_checkout(PROJECT_ROOT):
        return PROJECT_ROOT / "constraints.txt"
    return PACKAGE_DIR / "constraints.txt"


def declared_requirements(extras: Sequence[str]) -> list[str]:
    """The requirements of exogym itself and of ``extras``, as ``pyproject.toml`` declares
    them (an installed wheel: its metadata), without markers for extras.

    Raises:
        ValueError: for an extra that is not declared.
    """
    core, optional = _declared()
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise ValueError(f"unknown extra {', '.join(map(repr, unknown))}: the extras are "
                         f"{', '.join(sorted(optional))}")
    found = list(core)
    for extra in extras:
        found += [r for r in optional[extra] if not r.replace(" ", "").startswith("exogym[")]
    return sorted(set(found), key=found.index)


def _declared() -> tuple[list[str], dict[str, list[str]]]:
    """(core requirements, {extra: requirements}) of this project."""
    pyproject = PROJECT_ROOT / "pyproject.toml"
    if is_checkout(PROJECT_ROOT) and pyproject.is_file():
        try:
            import tomllib
        except ImportError:  # Python 3.10: the installed metadata says the same
            tomllib = None
        if tomllib is not None:
            project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
            return (list(project.get("dependencies", [])),
                    {k: list(v) for k, v in project.get("optional-dependencies", {}).items()})
    from importlib import metadata

    core: list[str] = []
    optional: dict[str, list[str]] = {e: [] for e in metadata.metadata("exogym").get_all(
        "Provides-Extra") or []}
    for line in metadata.requires("exogym") or []:
        requirement, _, marker = line.partition(";")
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if extra:
            optional.setdefault(extra.group(1), []).append(requirement.strip())
        else:
            core.append(line.strip())
    return core, optional


# --------------------------------------------------------------------------- the host's platform


#: The newest glibc and macOS versions a host is believed to report (major, minor): far
#: past today's (glibc 2.41, macOS 26), and the wheel tags of each version below them
#: are listed one by one, so a version reported as 2.999999999 is refused, not listed.
MAX_GLIBC = (2, 199)
MAX_MACOS = (99, 99)


def _version(text: str, what: str, most: tuple[int, int], platform: HostPlatform
             ) -> tuple[int, int]:
    """``(major, minor)`` of a version a host reported (``2.36``, ``14``), each at most
    ``most``'s.

    Raises:
        ProvisionError: naming the host's platform, the version and what is believed.
    """
    parts = (str(text).split(".") + ["0"])[:2]
    if not all(part.isascii() and part.isdigit() for part in parts):
        raise ProvisionError(f"{platform.system} {platform.machine}: its Python reports "
                             f"{what} {str(text)[:40]!r}, not a version such as "
                             f"{most[0] if what == 'glibc' else 14}.x; check that host's "
                             "python3, or give it a package index it can reach")
    major, minor = (int(part) if len(part) <= 12 else 10**12 for part in parts)
    if major > most[0] or minor > most[1] or (what == "glibc" and major != 2):
        raise ProvisionError(f"{platform.system} {platform.machine}: its Python reports "
                             f"{what} {str(text)[:40]!r}, past any {what} there is (at most "
                             f"{most[0]}.{most[1]} is believed); check that host's python3, "
                             "or give it a package index it can reach")
    return major, minor


@dataclass(frozen=True)
class HostPlatform:
    """What a host's system Python reported (:mod:`.onhost.platform_facts`).

    Args:
        python: the interpreter's version (``3.11.2``).
        implementation: ``cpython``, ``pypy``, ...
        system: ``Linux`` or ``Darwin``.
        machine: ``x86_64``, ``aarch64``, ``arm64``.
        libc: ``glibc`` or None.
        libc_version: the C library's version (``2.36``), or None.
        mac_version: macOS's version (``14.2``), or None.
        venv_module: whether ``python3 -m venv`` exists.
        ensurepip: whether ``venv`` can install pip by itself.
    """

    python: str
    implementation: str
    system: str
    machine: str
    libc: str | None = None
    libc_version: str | None = None
    mac_version: str | None = None
    venv_module: bool = True
    ensurepip: bool = True

    @classmethod
    def from_facts(cls, facts: dict[str, Any]) -> HostPlatform:
        """The platform part of the facts a host printed."""
        return cls(python=str(facts["python"]), implementation=str(facts["implementation"]),
                   system=str(facts["system"]), machine=str(facts["machine"]),
                   libc=facts.get("libc"), libc_version=facts.get("libc_version"),
                   mac_version=facts.get("mac_version"),
                   venv_module=bool(facts.get("venv_module", True)),
                   ensurepip=bool(facts.get("ensurepip", True)))

    @property
    def python_tag(self) -> str:
        """``3.11`` from ``3.11.2``."""
        return ".".join(self.python.split(".")[:2])

    def describe(self) -> str:
        """``Linux x86_64 (glibc 2.36), CPython 3.11``."""
        where = ""
        if self.system == "Linux" and self.libc_version:
            where = f" ({self.libc} {self.libc_version})"
        elif self.system == "Darwin" and self.mac_version:
            where = f" (macOS {self.mac_version})"
        impl = {"cpython": "CPython", "pypy": "PyPy"}.get(self.implementation, self.implementation)
        return f"{self.system} {self.machine}{where}, {impl} {self.python_tag}"

    def wheel_platforms(self) -> list[str]:
        """The wheel platform tags this host accepts, most specific first, for
        ``pip download --platform`` (pip matches them exactly).

        Raises:
            ProvisionError: for a platform whose tags cannot be told (another system, a
                C library that is not glibc).
        """
        arch = self.machine.lower()
        if self.system == "Linux":
            if self.libc != "glibc" or not self.libc_version:
                raise ProvisionError(f"{self.describe()}: only glibc Linux hosts can be sent "
                                     "wheels (this one's C library is not glibc); give it a "
                                     "package index it can reach")
            major, minor = _version(self.libc_version, "glibc", MAX_GLIBC, self)
            tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
            legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
            tags += [f"{name}_{arch}" for m, name in legacy.items() if m <= minor and major == 2]
            return [*tags, f"linux_{arch}"]
        if self.system == "Darwin" and self.mac_version:
            arch = "arm64" if arch in ("arm64", "aarch64") else "x86_64"
            major, minor = _version(self.mac_version, "macOS", MAX_MACOS, self)
            versions = [(v, 0) for v in range(major, 10, -1)] if major >= 11 else []
            versions += [(10, m) for m in range(15 if major >= 11 else minor, 8, -1)]
            tags = []
            for v, m in versions:
                tags += [f"macosx_{v}_{m}_{arch}", f"macosx_{v}_{m}_universal2"]
            return tags
        raise ProvisionError(f"{self.describe()}: no wheels can be chosen for this system "
                             "here; give the host a package index it can reach")

    def pip_download_args(self) -> list[str]:
        """``pip download``'s options that choose wheels for this host."""
        args = ["--only-binary=:all:", "--python-version", self.python_tag]
        impl = {"cpython": "cp", "pypy": "pp"}.get(self.implementation)
        if impl:
            args += ["--implementation", impl]
        for tag in self.wheel_platforms():
            args += ["--platform", tag]
        return args


def environment_key(platform: HostPlatform, requirements: Sequence[str], lock_text: str) -> str:
    """What an environment was made from: it is made again when any of it changes."""
    digest = hashlib.sha256()
    for part in (platform.describe(), platform.python, *requirements, "\0", lock_text):
        digest.update(part.encode())
        digest.update(b"\n")
    return digest.hexdigest()[:32]


# --------------------------------------------------------------------------- wheels from here


_download_locks: dict[str, threading.Lock] = {}
_download_locks_guard = threading.Lock()


def download_wheels(platform: HostPlatform, requirements: Sequence[str], lock: Path,
                    cache: Path = WHEEL_CACHE, python: str = sys.executable,
                    timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Download the wheels ``requirements`` need under ``lock`` for ``platform`` into a
    folder of ``cache`` (once: a folder marked complete is reused); that folder.

    Hosts of one platform set up at once share one download.

    Raises:
        NoWheelError: naming the package that has no wheel for the platform.
        ProvisionError: when pip fails otherwise or takes longer than ``timeout``.
    """
    # wheels depend on the Python's minor version and the platform tags, not the patch
    key = hashlib.sha256(json.dumps([platform.python_tag, platform.implementation,
                                     platform.wheel_platforms(), list(requirements),
                                     lock.read_text(encoding="utf-8")]).encode()).hexdigest()[:32]
    folder = cache / key
    with _download_locks_guard:
        guard = _download_locks.setdefault(key, threading.Lock())
    with guard:
        done = folder / ".complete"
        if done.is_file():
            sealed = _read_seal(done)
            if sealed is not None:
                check_wheels(folder, sealed)
                return folder
            # filled by an older version, without its wheels' hashes: nothing there can
            # be vouched for, so it is downloaded again
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        command = [python, "-m", "pip", "download", "--disable-pip-version-check",
                   "--progress-bar", "off", "--dest", str(folder), *platform.pip_download_args(),
                   "-c", str(lock), *requirements, "pip"]
        try:
            done_run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ProvisionError(f"downloading wheels for {platform.describe()} took longer than "
                                 f"{timeout:g} s") from None
        if done_run.returncode != 0:
            raise wheel_error(done_run.stdout + done_run.stderr, platform)
        # uv installs the wheels on the host several times faster than pip; a platform
        # without a uv wheel installs with pip
        subprocess.run([*command[:command.index("-c")], "--no-deps", UV_REQUIREMENT],
                       capture_output=True, text=True, timeout=timeout)
        temp = done.with_name(f".complete.{os.getpid()}.tmp")
        temp.write_text(json.dumps({"requirements": list(requirements),
                                    "wheels": seal_wheels(folder)}))
        temp.replace(done)
        return folder


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def seal_wheels(folder: Path) -> dict[str, str]:
    """The SHA-256 of every wheel in ``folder``, by name, taken as the download fills it:
    what :func:`check_wheels` holds the folder to before any wheel leaves this machine."""
    return {wheel.name: _file_sha256(wheel) for wheel in sorted(folder.glob("*.whl"))}


def _read_seal(done: Path) -> dict[str, str] | None:
    """The wheels' hashes a cache folder's ``.complete`` holds (None: a folder filled by an
    older version, or a marker that is not ours)."""
    try:
        data = json.loads(done.read_text(encoding="utf-8")[:1 << 22])
    except (OSError, ValueError):
        return None
    wheels = data.get("wheels") if isinstance(data, dict) else None
    if not isinstance(wheels, dict) or not wheels or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wheels.items()):
        return None
    return wheels


def check_wheels(folder: Path, sealed: dict[str, str]) -> None:
    """Hold the cached wheels of ``folder`` to the hashes taken when it was filled.

    Raises:
        ProvisionError: naming the wheel that changed, went missing or was added since,
            and the folder to delete so that it is downloaded again.
    """
    now = {wheel.name for wheel in folder.glob("*.whl")}
    again = f"delete {folder} to download its wheels again"
    added = sorted(now - set(sealed))
    if added:
        raise ProvisionError(f"the wheel cache holds {added[0]}, which no download put there"
                             f"{f' (and {len(added) - 1} more)' if len(added) > 1 else ''}: "
                             f"nothing from it is sent to a host; {again}")
    for name, expected in sorted(sealed.items()):
        wheel = folder / name
        if not wheel.is_file() or wheel.is_symlink():
            raise ProvisionError(f"the cached wheel {name} is missing from {folder}; {again}")
        got = _file_sha256(wheel)
        if got != expected:
            raise ProvisionError(f"the cached wheel {wheel} changed since it was downloaded "
                                 f"(sha256 {got[:16]}..., {expected[:16]}... then): nothing "
                                 f"from the cache is sent to a host; {again}")


def wheel_error(output: str, platform: HostPlatform) -> ProvisionError:
    """The error for a failed ``pip download``: :class:`NoWheelError` naming the package
    when pip found no distribution for it."""
    lines = [line for line in output.strip().splitlines()
             if line.strip() and not line.startswith("WARNING: Location")]
    tail = "\n".join(lines[-4:])
    missing = re.search(r"No matching distribution found for (\S+)", output)
    if missing:
        return NoWheelError(missing.group(1), platform.describe(), tail)
    # Under the lock's pins a missing wheel reads as a conflict: "The user requested X"
    # or "Y depends on X" names the requirement no wheel of the platform satisfies.
    if "conflict is caused by" in output:
        cause = output.split("conflict is caused by", 1)[1]
        found = re.search(r"depends on (\S+)", cause) or \
            re.search(r"The user requested (?!\(constraint\))(\S+)", cause)
        if found:
            return NoWheelError(found.group(1), platform.describe())
    return ProvisionError(f"downloading wheels for {platform.describe()} failed:\n{tail}")


# --------------------------------------------------------------------------- on the host


@dataclass
class ProvisionResult:
    """What setting up one host's environment did.

    Args:
        host: the host, as the hosts file names it.
        platform: its platform, in words.
        python_env: the interpreter of the environment.
        action: ``unchanged``, ``index`` (installed from the host's index), ``wheels``
            (installed from wheels sent from here) or ``shared`` (made by another host
            that shares the environment, and checked here).
        seconds: how long it took.
        wheels_sent: wheels copied to the host (their bytes in ``bytes_sent``).
        notes: what else happened, in words.
        steps: seconds each step took (``venv``, ``download``, ``send``, ``install``).
        shared_from: with ``action`` ``shared``, the host that made the environment this
            host shares.
    """

    host: str
    platform: str
    python_env: str
    action: str
    seconds: float
    wheels_sent: int = 0
    bytes_sent: int = 0
    notes: list[str] = field(default_factory=list)
    steps: dict[str, float] = field(default_factory=dict)
    shared_from: str | None = None


def venv_of(python_env: str) -> str:
    """The environment folder of an interpreter path ``VENV/bin/python``.

    Raises:
        ValueError: when ``python_env`` is not an interpreter inside a ``bin`` folder.
    """
    parent = posixpath.dirname(python_env)
    if "/" not in python_env or posixpath.basename(parent) != "bin" or \
            not posixpath.basename(python_env).startswith("python"):
        raise ValueError(f"python_env {python_env!r} is not an environment's interpreter "
                         "(VENV/bin/python): setup makes its own environment there; give "
                         "such a path, or leave python_env out for PROJECT/.venv/bin/python")
    return posixpath.dirname(parent)


class HostProvisioner:
    """Makes one host's environment; see the module docstring.

    Args:
        shell: a connected shell on the host.
        sftp: an open SFTP client on the host (for the files and wheels sent).
        host: the host's name, for messages.
        python_env: the environment's interpreter to make (``VENV/bin/python``).
        project_path: the host's project folder (files setup sends go under ``.exogym``).
        requirements: what to install.
        lock: the lock file.
        base_python: the host's interpreter that makes the environment.
        wheels: ``auto`` (the host's index when it answers, else wheels from here),
            ``always`` or ``never``.
        index: the index URL whose answer says the host is online.
        say: where progress lines go.
        lock_wait: seconds to wait at most for another setup making the same environment.
    """

    def __init__(self, shell: Shell, sftp: Any, host: str, *, python_env: str,
                 project_path: str, requirements: Sequence[str], lock: Path,
                 base_python: str = "python3", wheels: str = "auto",
                 index: str = DEFAULT_INDEX, say: Callable[[str], None] = lambda _: None,
                 lock_wait: float = LOCK_STALE_S) -> None:
        if wheels not in WHEEL_MODES:
            raise ValueError(f"wheels must be one of {', '.join(WHEEL_MODES)}, got {wheels!r}")
        self.shell = shell
        self.sftp = sftp
        self.host = host
        self.python_env = python_env
        self.venv = venv_of(python_env)
        self.project_path = project_path
        self.requirements = list(requirements)
        self.lock = lock
        self.lock_text = lock.read_text(encoding="utf-8")
        self.base_python = base_python
        self.wheels = wheels
        self.index = index
        self.say = say
        self.lock_wait = lock_wait

    def _run(self, command: str, step: str, timeout: float,
             message: dict[str, Any] | None = None) -> str:
        done = self.shell.run(command, message, timeout=timeout)
        if done.returncode is None:
            raise ProvisionError(f"[{self.host}] {step}: no answer within {timeout:g} s "
                                 f"({done.stderr.strip()[-300:] or 'the connection was lost'})")
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-6:])
            raise ProvisionError(f"[{self.host}] {step} failed (exit {done.returncode}):\n{tail}")
        return done.stdout

    def facts(self, probe_index: bool = False) -> dict[str, Any]:
        """What the host's system Python reports (:mod:`.onhost.platform_facts`)."""
        py = interpreter_word(self.base_python)
        command = (f"command -v {py} >/dev/null 2>&1 || {{ echo 'no {self.base_python} on "
                   f"PATH' >&2; exit 91; }}; exec {py} -c {shlex.quote(LOADER)}")
        out = self._run("sh -c " + shlex.quote(command), f"asking {self.base_python} about the "
                        "host", FACTS_TIMEOUT_S,
                        {"code": FACTS_SOURCE, "venv": self.venv, "marker": MARKER,
                         "index": self.index if probe_index else "", "timeout": 5})
        try:
            return json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise ProvisionError(f"[{self.host}] {self.base_python} printed no facts: "
                                 f"{out[-300:]!r}") from None

    def ensure(self) -> ProvisionResult:
        """Make the environment unless its marker says it holds what is asked; what was done.

        The making holds a lock file beside the environment (:class:`.shared.FolderLock`),
        so that two setups (from two terminals or machines, or through two hosts sharing
        the folder) never make one environment at once; a setup that waited for another
        looks again, and finds it made.

        Raises:
            ProvisionError: naming the host and the step that failed, or the setup whose
                lock it waited for longer than ``lock_wait``.
        """
        start = time.monotonic()
        facts = self.facts()
        done = self._made_already(facts, start)
        if done is not None:
            return done
        self._refuse_unmakeable(facts)  # before anything is written there
        parent, name = posixpath.split(self.venv)
        makedirs_remote(self.sftp, sftp_path(parent or "."), set())
        hidden = name if name.startswith(".") else f".{name}"
        lock = FolderLock(self.sftp, posixpath.join(parent, f"{hidden}.exogym-setup.lock"),
                          what=f"the environment {self.venv}", host=self.host,
                          stale_after=LOCK_STALE_S, wait=self.lock_wait, say=self.say)
        try:
            with lock:
                if lock.contended:  # another setup held it: it may have made it meanwhile
                    facts = self.facts()
                    done = self._made_already(facts, start)
                    if done is not None:
                        done.notes.append("another setup made it while this one waited")
                        return done
                return self._make(facts, start)
        except FolderBusyError as exc:
            raise ProvisionError(f"[{self.host}] {exc}") from None

    def _refuse_unmakeable(self, facts: dict[str, Any]) -> None:
        """Raise ProvisionError when ``facts`` show an environment setup may not make: no
        venv module, or a folder there that no virtual environment setup made or can use."""
        platform = HostPlatform.from_facts(facts)
        env = facts.get("env") or {}
        if not platform.venv_module:
            raise ProvisionError(f"[{self.host}] {self.base_python} ({platform.describe()}) has "
                                 "no venv module: install it there (Debian, Ubuntu: apt install "
                                 "python3-venv) and run setup again")
        if env.get("exists") and not env.get("empty") and env.get("marker") is None and \
                not (env.get("is_venv") and env.get("python")):
            raise ProvisionError(f"[{self.host}] {self.venv} exists and is no virtual "
                                 "environment that setup made or can use: point python_env "
                                 "to a new folder (VENV/bin/python) or leave it out")

    def _made_already(self, facts: dict[str, Any], start: float) -> ProvisionResult | None:
        """The result ``unchanged`` when ``facts`` show the environment holds what is asked."""
        platform = HostPlatform.from_facts(facts)
        env = facts.get("env") or {}
        marker = env.get("marker") or {}
        if env.get("python") and marker.get("key") == environment_key(
                platform, self.requirements, self.lock_text):
            return ProvisionResult(self.host, platform.describe(), self.python_env,
                                   "unchanged", time.monotonic() - start)
        return None

    def _make(self, facts: dict[str, Any], start: float) -> ProvisionResult:
        """Make the environment (or install into the one there) as ``facts`` find it."""
        platform = HostPlatform.from_facts(facts)
        key = environment_key(platform, self.requirements, self.lock_text)
        env = facts.get("env") or {}
        result = ProvisionResult(self.host, platform.describe(), self.python_env, "unchanged", 0.0)
        self._refuse_unmakeable(facts)
        online = self.wheels == "never" or bool(
            self.wheels == "auto" and self.facts(probe_index=True).get("index"))
        if env.get("exists") and not env.get("empty") and env.get("marker") is None:
            result.notes.append(f"installing into the existing environment {self.venv}")
            fresh = False
        else:
            fresh = True  # new, or one this setup made before: made again
        files = self._send_requirements()
        if online:
            self.say(f"[{self.host}] installing from its package index ({platform.describe()})")
            try:
                if fresh:
                    self._timed(result, "venv", self._make_venv, platform, result)
                result.action = "index"
                self._timed(result, "install", self._install, files, None)
            except ProvisionError as exc:
                if self.wheels == "never":
                    raise
                result.notes.append(f"its index failed ({str(exc).splitlines()[0]}); "
                                    "sent wheels instead")
                online = False
        if not online:
            folder = self._timed(result, "download", download_wheels, platform,
                                 self.requirements, self.lock)
            remote = self._timed(result, "send", self._send_wheels, folder, result)
            uv = self._unpack_uv(folder, remote)
            if fresh:
                self._timed(result, "venv", self._make_venv, platform, result, uv, folder,
                            remote)
            self.say(f"[{self.host}] installing {result.wheels_sent} wheels sent from here "
                     f"({platform.describe()}{', with uv' if uv else ''})")
            result.action = "wheels"
            self._timed(result, "install", self._install, files, remote, uv)
        self._write_marker(key)
        result.seconds = time.monotonic() - start
        return result

    def check_shared(self, made: ProvisionResult) -> ProvisionResult:
        """Check the environment another host sharing it (``made``) has just made: this
        host's interpreter sees it, and its marker is what this host's own setup would
        write; nothing is made or written.

        Raises:
            ProvisionError: naming both hosts when the environment does not serve this one
                (another platform or Python, or no environment seen there).
        """
        start = time.monotonic()
        facts = self.facts()
        platform = HostPlatform.from_facts(facts)
        key = environment_key(platform, self.requirements, self.lock_text)
        env = facts.get("env") or {}
        marker = env.get("marker") or {}
        if not env.get("python") or marker.get("key") != key:
            seen = ("the environment was made for " + made.platform
                    if env.get("python") else "this host sees no environment there")
            raise ProvisionError(
                f"[{self.host}] shares the environment {self.venv} with {made.host}, which made "
                f"it, but it does not serve {self.host} ({platform.describe()}; {seen}): give "
                f"{self.host} a python_env in a folder only it uses, or make both hosts one "
                "platform and Python")
        return ProvisionResult(self.host, platform.describe(), self.python_env, "shared",
                               time.monotonic() - start, shared_from=made.host,
                               notes=[f"its environment {self.venv} is the one {made.host} made"])

    @staticmethod
    def _timed(result: ProvisionResult, step: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, its seconds added to ``result.steps[step]``."""
        mark = time.monotonic()
        try:
            return call(*args)
        finally:
            result.steps[step] = result.steps.get(step, 0.0) + time.monotonic() - mark

    def _uv_env(self) -> str:
        """``env ...`` before a uv command: no Python downloads, its cache in the project's
        setup folder (beside the environment, so files are linked, not copied)."""
        cache = shell_path(posixpath.join(self._setup_dir(), "uv-cache"))
        return f"env UV_PYTHON_DOWNLOADS=never UV_CACHE_DIR={cache}"

    def _unpack_uv(self, folder: Path, remote: str) -> str | None:
        """The path on the host of uv's binary, taken out of the uv wheel sent (None when
        the platform has no uv wheel, or it does not run there)."""
        wheel = next((p.name for p in sorted(folder.glob("uv-*.whl"))), None)
        if wheel is None:
            return None
        target = posixpath.join(self._setup_dir(), "bin", "uv")
        code = ("import os,sys,zipfile\nz=zipfile.ZipFile(sys.argv[1])\n"
                "name=[n for n in z.namelist() if n.endswith('/scripts/uv')][0]\n"
                "os.makedirs(os.path.dirname(sys.argv[2]),exist_ok=True)\n"
                "t=sys.argv[2]+'.%d.tmp'%os.getpid()\n"
                "open(t,'wb').write(z.read(name))\n"
                "os.chmod(t,0o755);os.replace(t,sys.argv[2])\n")
        py = interpreter_word(self.base_python)
        done = self.shell.run(f"{py} -c {shlex.quote(code)} "
                              f"{shell_path(posixpath.join(remote, wheel))} {shell_path(target)} "
                              f"&& {shell_path(target)} --version", timeout=VENV_TIMEOUT_S)
        return target if done.returncode == 0 else None

    def _make_venv(self, platform: HostPlatform, result: ProvisionResult, uv: str | None = None,
                   folder: Path | None = None, remote: str | None = None) -> None:
        py = interpreter_word(self.base_python)
        venv = shell_path(self.venv)
        if uv is not None:
            self._run(f"{self._uv_env()} {shell_path(uv)} venv --quiet --clear "
                      f"--python {py} {venv}",
                      f"making the environment {self.venv}", VENV_TIMEOUT_S)
            return
        if platform.ensurepip:
            self._run(f"{py} -m venv --clear {venv}", f"making the environment {self.venv}",
                      VENV_TIMEOUT_S)
            return
        # No ensurepip (Debian without python3-venv's wheels): pip comes from a wheel sent.
        self._run(f"{py} -m venv --clear --without-pip {venv}",
                  f"making the environment {self.venv}", VENV_TIMEOUT_S)
        if folder is None or remote is None:
            folder = download_wheels(platform, self.requirements, self.lock)
            remote = self._send_wheels(folder, result)
        pip_wheel = next((p.name for p in folder.glob("pip-*.whl")), None)
        if pip_wheel is None:
            raise ProvisionError(f"[{self.host}] no pip wheel was downloaded for "
                                 f"{platform.describe()}")
        wheel = shell_path(posixpath.join(remote, pip_wheel))
        self._run(f"{shell_path(self.python_env)} {wheel}/pip install --no-index --no-compile "
                  f"--quiet {wheel}", "installing pip into the environment", VENV_TIMEOUT_S)
        result.notes.append("the host has no ensurepip: pip was installed from a wheel sent")

    def _setup_dir(self) -> str:
        return posixpath.join(self.project_path, ".exogym")

    def _send_requirements(self) -> tuple[str, str]:
        """Copy the requirements and the lock to the host; their paths there."""
        base = self._setup_dir()
        makedirs_remote(self.sftp, sftp_path(base), set())
        paths = []
        for name, text in (("requirements.txt", "\n".join(self.requirements) + "\n"),
                           ("constraints.txt", self.lock_text)):
            target = posixpath.join(base, name)
            temp = remote_temp(sftp_path(target))
            with self.sftp.open(temp, "wb") as handle:
                handle.write(text.encode())
            replace_remote(self.sftp, temp, sftp_path(target))
            paths.append(target)
        return paths[0], paths[1]

    def _send_wheels(self, folder: Path, result: ProvisionResult) -> str:
        """Copy the wheels of ``folder`` the host lacks (by name and size); their folder there."""
        remote = posixpath.join(self._setup_dir(), "wheels")
        makedirs_remote(self.sftp, sftp_path(remote), set())
        have = {}
        for entry in self.sftp.listdir_attr(sftp_path(remote)):
            have[entry.filename] = entry.st_size
        for wheel in sorted(folder.glob("*.whl")):
            size = wheel.stat().st_size
            if have.get(wheel.name) == size:
                continue
            target = sftp_path(posixpath.join(remote, wheel.name))
            temp = remote_temp(target)
            self.sftp.put(str(wheel), temp, confirm=True)
            replace_remote(self.sftp, temp, target)
            result.wheels_sent += 1
            result.bytes_sent += size
        return remote

    def _install(self, files: tuple[str, str], wheels_dir: str | None,
                 uv: str | None = None) -> None:
        requirements, lock = (shell_path(f) for f in files)
        if uv is not None and wheels_dir is not None:
            self._run(f"{self._uv_env()} {shell_path(uv)} pip install --quiet --offline "
                      f"--no-index --find-links "
                      f"{shell_path(wheels_dir)} --python {shell_path(self.python_env)} "
                      f"-r {requirements} -c {lock}", "installing the requirements with uv",
                      INSTALL_TIMEOUT_S)
            return
        source = (f"--no-index --find-links {shell_path(wheels_dir)}" if wheels_dir
                  else "--retries 2 --timeout 30")
        self._run(f"{shell_path(self.python_env)} -m pip install --disable-pip-version-check "
                  f"--no-compile --quiet --progress-bar off {source} -r {requirements} "
                  f"-c {lock}", "installing the requirements", INSTALL_TIMEOUT_S)

    def _write_marker(self, key: str) -> None:
        target = sftp_path(posixpath.join(self.venv, MARKER))
        temp = remote_temp(target)
        with self.sftp.open(temp, "wb") as handle:
            handle.write(json.dumps({"key": key, "requirements": self.requirements,
                                     "written": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode())
        replace_remote(self.sftp, temp, target)

