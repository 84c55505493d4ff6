"""The supervisor that starts one rank on its host, sent there by the launcher.

The launcher runs ``python -u -c LOADER <rank args...>`` on each host (see
``distributed.remote.LOADER``) and writes one JSON line to its stdin carrying
this file's source and the rank's secret variables. ``main`` then:

1. starts the rank, ``python <rank args...>``, in a new session and process
   group of its own, with the secrets added to the rank's environment only:
   they never appear on a command line, and the supervisor keeps no copy. The
   run's store key is not put in the environment at all: the rank reads it
   from a pipe whose descriptor ``EXOGYM_STORE_KEY_FD`` names;
2. reports that group's id on stdout, so the launcher can stop the rank and
   everything it started with one ``kill -- -PGID``;
3. watches its stdin: end-of-file means the launcher or its SSH connection is
   gone, and then it stops the rank's whole group (TERM, then KILL after a
   grace period), so no rank outlives its launcher;
4. when the rank ends, stops whatever the rank left behind in its group,
   reports the exit on stdout (SSH servers report a death by signal in a way
   paramiko does not read) and exits with the rank's exit code, 128 + N when
   signal N killed it.

With ``"action": "kill"`` the same file stops a rank's process group instead
(``stop_group``); the launcher uses that to stop a rank on another host.

Runs on any Python 3.8+ with the standard library only.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

#: Lines the launcher reads back from the supervisor start with this.
MARK = "@@exogym-launch "
#: Names the descriptor of the pipe a rank reads the run's store key from. The one name of
#: the rank environment spelled outside ``distributed.worker.environment`` (which imports it):
#: this file runs on hosts from its own source and cannot import that module.
STORE_KEY_FD_VARIABLE = "EXOGYM_STORE_KEY_FD"


def _say(payload: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie.

    Zombies are left out: an orphan's zombie lasts until init reaps it, which
    some inits do only every second or two, and it holds nothing.
    """
    if not os.path.isdir("/proc/self"):  # no /proc (macOS): ask the kernel, zombies and all
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # it ended while we looked
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def stop_group(pgid: int, grace: float, reap: Callable[[], object] | None = None) -> None:
    """TERM process group ``pgid``, then KILL it if anything is left after ``grace`` s.

    ``reap`` is called while waiting, so a parent can collect its child's exit.
    """
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while True:
        if reap is not None:
            reap()
        if not group_alive(pgid):
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(message: dict[str, Any]) -> None:
    """Entry point called by the loader with the message read from stdin."""
    if message.get("action") == "kill":
        stop_group(int(message["pgid"]), float(message.get("grace", 5.0)))
        return
    supervise(message)


def _die_with_parent() -> None:
    """In the rank, before exec: on Linux, be killed if the supervisor dies (even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def supervise(message: dict[str, Any]) -> None:
    """Start the rank, watch it and the launcher, and report how it ended."""
    grace = float(message.get("grace", 5.0))
    env = dict(os.environ)
    env.update(message.get("env", {}))
    argv = [sys.executable] + sys.argv[1:]
    keep: tuple[int, ...] = ()
    if message.get("store_key"):
        # The key waits in a pipe the rank inherits: out of its argv and environment.
        read_end, write_end = os.pipe()
        os.write(write_end, str(message["store_key"]).encode() + b"\n")
        os.close(write_end)
        env[STORE_KEY_FD_VARIABLE] = str(read_end)
        keep = (read_end,)
    try:
        child = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, pass_fds=keep,
                                 start_new_session=True, preexec_fn=_die_with_parent)
    except OSError as exc:
        sys.stderr.write(f"exogym: cannot start {' '.join(argv)}: {exc}\n")
        _say({"exit": 127})
        sys.exit(127)
    finally:
        for fd in keep:
            os.close(fd)
    del env
    message.clear()
    _say({"pgid": child.pid, "supervisor": os.getpid()})

    def forward(signum: int, frame: object) -> None:
        # a signal meant for the rank (an admin's TERM, a hangup): pass it on to its group
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)

    stdin = sys.stdin.fileno()
    launcher_gone = False
    while child.poll() is None:
        if launcher_gone:
            stop_group(child.pid, grace, reap=child.poll)
            continue
        try:
            ready, _, _ = select.select([stdin], [], [], 0.2)
        except InterruptedError:
            continue
        if ready:
            try:
                data = os.read(stdin, 4096)
            except OSError:
                data = b""
            if not data:  # end of file: the launcher is gone, take the rank down with it
                launcher_gone = True

    code = child.returncode
    stop_group(child.pid, min(grace, 2.0))  # what the rank left behind, not the rank itself
    report = {"exit": code if code >= 0 else 128 - code}
    if code < 0:
        report["signal"] = -code
        try:
            report["name"] = signal.Signals(-code).name
        except ValueError:
            report["name"] = f"signal {-code}"
    _say(report)
    sys.exit(report["exit"])
