"""Running commands on a host: this machine through a subprocess, another over SSH.

Both kinds of host offer the same three things: ``run`` a short command and
collect its output (pre-flight probes), ``start`` a long one and stream it (a
rank), and ``kill_group`` a process group (stopping a rank and all it
started). Commands are shell strings in which every piece is quoted with
``shlex.quote``; data a command needs (code, secrets, file lists) travels as
one JSON line on its stdin, never on its command line.

``LOADER`` is the only Python that appears on a command line: it reads that
JSON line, executes the ``code`` it carries (``distributed/hosts/onhost/bootstrap.py`` for
a rank, ``distributed/hosts/onhost/probe.py`` for pre-flight) and calls its ``main`` with
the rest of the message. This way the remote side needs nothing but a Python
interpreter, and secrets never show in ``/proc/*/cmdline`` or ``ps``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO, Any

from .onhost import bootstrap, probe

LOADER = ('import json,sys;m=json.loads(sys.stdin.readline());g={"__name__":"exogym_remote"};'
          'exec(m.pop("code"),g);g["main"](m)')

#: Exit codes of the probe command for the two things checked before Python runs.
NO_PROJECT_PATH = 90
NO_PYTHON = 91


def module_source(module: ModuleType) -> str:
    """The source text of a stdlib-only module that is sent to hosts and run there."""
    return Path(module.__file__ or "").read_text(encoding="utf-8")


BOOTSTRAP_SOURCE = module_source(bootstrap)
PROBE_SOURCE = module_source(probe)


def shell_path(path: str) -> str:
    """Quote a path for a POSIX shell, keeping a leading ``~/`` meaning the home directory."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def interpreter_word(python: str) -> str:
    """An interpreter as a shell word: a path quoted (``~/`` kept as the home directory),
    a bare command (``python3``) quoted to be found on ``PATH``."""
    return shell_path(python) if "/" in python else shlex.quote(python)


def _in_project(project_path: str, python_env: str, env: Mapping[str, str],
                supervised: bool) -> list[str]:
    """``cd project && [exec] env NAME=value ... python -u``: the words before a rank's
    arguments."""
    assignments = " ".join(shlex.quote(f"{name}={value}") for name, value in env.items())
    parts = [f"cd {shell_path(project_path)} &&"]
    if supervised or assignments:
        parts.append("exec env" if supervised else "env")
    if assignments:
        parts.append(assignments)
    parts.append(interpreter_word(python_env))
    parts.append("-u")
    return parts


def rank_command(project_path: str, python_env: str, env: Mapping[str, str],
                 args: Sequence[str]) -> str:
    """The command that starts one rank's supervisor: ``cd project && exec env ... python``.

    ``env`` holds the rank's non-secret variables; they are set with ``env
    NAME=value`` so they arrive whatever the SSH server's ``AcceptEnv`` says.
    """
    parts = _in_project(project_path, python_env, env, supervised=True)
    parts.append("-c " + shlex.quote(LOADER))
    parts.extend(shlex.quote(a) for a in args)
    return " ".join(parts)


def hand_command(project_path: str, python_env: str, env: Mapping[str, str],
                 args: Sequence[str]) -> str:
    """The command a person types on the host to start one rank by hand: the rank itself,
    ``cd project && env NAME=value ... python -u ARGS``, without the supervisor
    :func:`rank_command` starts (which reads its code from the launcher on stdin), and
    without ``exec`` (the person's shell stays when the rank ends)."""
    parts = _in_project(project_path, python_env, env, supervised=False)
    parts.extend(shlex.quote(a) for a in args)
    return " ".join(parts)


def probe_command(project_path: str, python_env: str) -> str:
    """The command that runs a probe in ``project_path`` with ``python_env``.

    Exits ``NO_PROJECT_PATH`` when the directory is missing and ``NO_PYTHON``
    when the interpreter cannot be found, so each gets its own message.
    """
    py = interpreter_word(python_env)
    script = (f"cd {shell_path(project_path)} 2>/dev/null || exit {NO_PROJECT_PATH}; "
              f"command -v {py} >/dev/null 2>&1 || exit {NO_PYTHON}; "
              f"exec {py} -c {shlex.quote(LOADER)}")
    return "sh -c " + shlex.quote(script)


def standalone_command(python_env: str) -> str:
    """The command that runs a standard-library-only probe (no project needed) with
    ``python_env`` where it exists, else with the host's ``python3``, from the home folder.

    For what is asked of a host before ``setup-hosts`` has made its project and
    environment (the wizard's link measurement): a new host has only its system Python.
    Exits ``NO_PYTHON`` when neither can be found.
    """
    py = interpreter_word(python_env)
    script = (f"cd; if command -v {py} >/dev/null 2>&1; then p={py}; "
              "elif command -v python3 >/dev/null 2>&1; then p=python3; "
              f"else exit {NO_PYTHON}; fi; "
              f'exec "$p" -c {shlex.quote(LOADER)}')
    return "sh -c " + shlex.quote(script)


def kill_group_command(pgid: int, grace: float) -> str:
    """A shell command that TERMs process group ``pgid`` and KILLs it after ``grace`` s."""
    ticks = max(1, int(grace / 0.1))
    script = (f"kill -TERM -{pgid} 2>/dev/null || exit 0; n=0; "
              f"while kill -0 -{pgid} 2>/dev/null; do n=$((n+1)); "
              f"if [ $n -gt {ticks} ]; then kill -KILL -{pgid} 2>/dev/null; exit 0; fi; "
              "sleep 0.1; done")
    return "sh -c " + shlex.quote(script)


@dataclass(frozen=True)
class Completed:
    """Outcome of a short command: ``returncode`` is ``None`` when it timed out or the
    connection was lost before it finished."""

    returncode: int | None
    stdout: str
    stderr: str


class Started(ABC):
    """A long-running command: its output streams and its exit."""

    stdout: IO[bytes]
    stderr: IO[bytes]

    @abstractmethod
    def wait(self) -> int | None:
        """Block until it ends; its exit code, or ``None`` when the connection was lost."""

    @abstractmethod
    def close(self) -> None:
        """Close stdin and the streams; on SSH, the channel."""

    def end(self, timeout: float) -> bool:
        """Close its stdin, wait at most ``timeout`` seconds for it to exit (a command that
        ends at the end of its input, such as a port held for pre-flight, has then given
        back what it held), and close. Whether it exited in time."""
        self.close()
        return False


class Shell(ABC):
    """A host that commands run on."""

    #: True for this machine (subprocesses), False for SSH.
    is_local: bool = False

    @abstractmethod
    def run(self, command: str, message: dict[str, Any] | None = None,
            timeout: float = 30.0) -> Completed:
        """Run ``command``, write ``message`` as one JSON line to its stdin, close stdin,
        and return its exit code and output."""

    @abstractmethod
    def start(self, command: str, message: dict[str, Any] | None = None) -> Started:
        """Start ``command`` with ``message`` written to its stdin, which stays open."""

    @abstractmethod
    def kill_group(self, pgid: int, grace: float, python_env: str) -> None:
        """TERM process group ``pgid``; KILL whatever is left after ``grace`` seconds.

        ``python_env`` runs the stop on the host (it knows zombies from live
        processes); a plain shell loop is the fallback.
        """

    @abstractmethod
    def alive(self) -> bool:
        """Whether commands can still be run (the SSH connection is up)."""

    def close(self) -> None:
        """Release the connection, if any."""


def _line(message: dict[str, Any] | None) -> bytes:
    return b"" if message is None else (json.dumps(message) + "\n").encode()


class _LocalStarted(Started):
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        assert proc.stdout is not None and proc.stderr is not None
        self.stdout = proc.stdout
        self.stderr = proc.stderr

    def wait(self) -> int | None:
        code = self.proc.wait()
        return 128 - code if code < 0 else code

    def end(self, timeout: float) -> bool:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=timeout)
            ended = True
        except subprocess.TimeoutExpired:
            ended = False
        self.close()
        return ended

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass  # a broken pipe on close just means the other side is gone


class LocalShell(Shell):
    """This machine: commands run through ``/bin/sh`` in their own session."""

    is_local = True

    def run(self, command: str, message: dict[str, Any] | None = None,
            timeout: float = 30.0) -> Completed:
        proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(_line(message), timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return Completed(None, out.decode(errors="replace"), err.decode(errors="replace"))
        code = proc.returncode
        return Completed(128 - code if code < 0 else code, out.decode(errors="replace"),
                         err.decode(errors="replace"))

    def start(self, command: str, message: dict[str, Any] | None = None) -> Started:
        proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        assert proc.stdin is not None
        try:
            proc.stdin.write(_line(message))
            proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died at once; its exit code and stderr say why
        return _LocalStarted(proc)

    def kill_group(self, pgid: int, grace: float, python_env: str) -> None:
        bootstrap.stop_group(pgid, grace)

    def alive(self) -> bool:
        return True


class _SSHStarted(Started):
    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.stdout = channel.makefile("rb")
        self.stderr = channel.makefile_stderr("rb")

    def wait(self) -> int | None:
        code = self.channel.recv_exit_status()
        return None if code == -1 else code

    def end(self, timeout: float) -> bool:
        try:
            self.channel.shutdown_write()
        except OSError:
            pass  # the connection is gone: nothing is held there any more
        ended = self.channel.status_event.wait(timeout)
        self.close()
        return bool(ended)

    def close(self) -> None:
        self.channel.close()


class SSHShell(Shell):
    """Another machine, through one authenticated paramiko connection.

    Args:
        client: a connected ``paramiko.SSHClient`` (see ``distributed.ssh.connect``).
        label: how messages name the host.
    """

    def __init__(self, client: Any, label: str) -> None:
        self.client = client
        self.label = label
        self._lock = threading.Lock()

    def _channel(self, timeout: float) -> Any:
        import paramiko

        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise ConnectionError(f"the SSH connection to {self.label} is closed")
        try:
            return transport.open_session(timeout=timeout)
        except (paramiko.SSHException, EOFError) as exc:
            raise ConnectionError(f"cannot open an SSH channel to {self.label}: {exc}") from None

    def run(self, command: str, message: dict[str, Any] | None = None,
            timeout: float = 30.0) -> Completed:
        try:
            channel = self._channel(timeout)
        except OSError as exc:  # ConnectionError included
            return Completed(None, "", str(exc))
        out, err = bytearray(), bytearray()
        try:
            channel.settimeout(timeout)
            channel.exec_command(command)
            channel.sendall(_line(message))
            channel.shutdown_write()
            deadline = time.monotonic() + timeout
            while True:
                while channel.recv_ready():
                    out += channel.recv(65536)
                while channel.recv_stderr_ready():
                    err += channel.recv_stderr(65536)
                # output may follow the exit status; end-of-file comes after all of it
                if (channel.eof_received or channel.closed) and not channel.recv_ready() \
                        and not channel.recv_stderr_ready():
                    break
                if time.monotonic() > deadline:
                    return Completed(None, out.decode(errors="replace"),
                                     err.decode(errors="replace"))
                time.sleep(0.01)
            code = channel.recv_exit_status()
        except (OSError, EOFError) as exc:  # socket timeouts are OSErrors too
            return Completed(None, out.decode(errors="replace"), str(exc))
        finally:
            channel.close()
        return Completed(None if code == -1 else code, out.decode(errors="replace"),
                         err.decode(errors="replace"))

    def start(self, command: str, message: dict[str, Any] | None = None) -> Started:
        channel = self._channel(30.0)
        channel.exec_command(command)
        channel.sendall(_line(message))
        return _SSHStarted(channel)

    def kill_group(self, pgid: int, grace: float, python_env: str) -> None:
        py = interpreter_word(python_env)
        done = self.run(f"exec {py} -c {shlex.quote(LOADER)}",
                        {"code": BOOTSTRAP_SOURCE, "action": "kill", "pgid": pgid,
                         "grace": grace}, timeout=grace + 10.0)
        if done.returncode != 0 and self.alive():
            self.run(kill_group_command(pgid, grace), timeout=grace + 10.0)

    def alive(self) -> bool:
        transport = self.client.get_transport()
        return transport is not None and transport.is_active()

    def close(self) -> None:
        self.client.close()
