"""Faults made on a host: signals to a rank, its throttle, a cut of the host's traffic.

The launcher's fault injector (:mod:`distributed.launch.injector`) ships this file to a
host and runs it with the stdin loader (``main(message)`` prints one JSON object),
in the host's ``project_path``. Actions:

- ``signal``: send ``KILL``, ``STOP`` or ``CONT`` to a process, or to its whole group;
- ``freeze``: ``STOP`` a rank's group now and ``CONT`` it after ``seconds``, from a
  process of its own on the host (the thaw comes even if the launcher is gone);
- ``throttle``: write a rank's throttle file (its speed factor, 1 for full speed),
  which the rank reads at every step (:mod:`distributed.worker.throttle`);
- ``cut_check``: whether this host lets a cut be made (root, ``nft`` or ``iptables``),
  and which network stack it is (its network namespace and boot), so that the
  launcher can tell hosts that share one apart;
- ``cut``: from a process of its own, a moment after answering (the answer must get
  out first), drop every packet in and out of the host except on loopback, for
  ``seconds``, then remove the rules; what happened goes to a status file;
- ``cut_status``: that status file, read back;
- ``uncut``: remove a cut's rules now (a run that ends early).

Standard library only, Python 3.8+.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

#: Seconds between answering a ``cut`` and the rules taking effect.
CUT_DELAY_S = 1.0
_SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "CONT": signal.SIGCONT}


def _status_path(tag: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"exogym-cut-{tag}.json")


def _write_json(path: str, data: dict[str, Any]) -> None:
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".inject-", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _detach(work: Callable[[], None]) -> None:
    """Run ``work`` in a process of its own session, away from this command's streams
    (the SSH channel closes as soon as this command ends), and return at once."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        work()
    finally:
        os._exit(0)


def send(pid: int, name: str, group: bool) -> dict[str, Any]:
    """Signal ``name`` to process ``pid`` (its group when ``group``)."""
    try:
        (os.killpg if group else os.kill)(pid, _SIGNALS[name])
    except ProcessLookupError:
        return {"error": f"no process {'group ' if group else ''}{pid} on this host"}
    except PermissionError as exc:
        return {"error": f"not allowed to signal {pid}: {exc}"}
    return {"ok": True}


def freeze(pgid: int, seconds: float) -> dict[str, Any]:
    """``STOP`` group ``pgid`` and ``CONT`` it after ``seconds`` from a detached process."""
    done = send(pgid, "STOP", True)
    if "error" in done:
        return done

    def thaw() -> None:
        time.sleep(seconds)
        try:
            os.killpg(pgid, signal.SIGCONT)
        except OSError:
            pass

    _detach(thaw)
    return {"ok": True}


def throttle(path: str, factor: float, fault: int) -> dict[str, Any]:
    """Write a rank's throttle file: ``{"factor": F, "fault": k}`` (1.0: full speed)."""
    _write_json(path, {"factor": float(factor), "fault": int(fault), "written": time.time()})
    return {"ok": True, "path": os.path.abspath(path)}


def cut_tool() -> str | None:
    """``nft`` or ``iptables``, whichever is installed (nft first); None without either."""
    for tool in ("nft", "iptables"):
        found = shutil.which(tool) or next(
            (p for p in (f"/usr/sbin/{tool}", f"/sbin/{tool}") if os.access(p, os.X_OK)), None)
        if found:
            return found
    return None


def cut_check() -> dict[str, Any]:
    """Whether a cut may be made here, and which network stack this is."""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = None
    return {"uid": os.geteuid(), "tool": cut_tool(), "netns": netns, "boot_id": boot}


def _nft_rules(table: str) -> str:
    return (f"table inet {table} {{\n"
            "  chain input { type filter hook input priority -300; policy accept; "
            "iifname \"lo\" accept; drop; }\n"
            "  chain output { type filter hook output priority -300; policy accept; "
            "oifname \"lo\" accept; drop; }\n"
            "}\n")


def _iptables_rules(tag: str) -> list[list[str]]:
    mark = ["-m", "comment", "--comment", f"exogym-cut-{tag}", "-j", "DROP"]
    return [["INPUT", "!", "-i", "lo", *mark], ["OUTPUT", "!", "-o", "lo", *mark]]


def _apply(tool: str, tag: str) -> str | None:
    """Put the cut's rules in place; the error, if any."""
    if os.path.basename(tool) == "nft":
        done = subprocess.run([tool, "-f", "-"], input=_nft_rules(f"exogym_cut_{tag}"),
                              capture_output=True, text=True, timeout=20)
    else:
        for rule in _iptables_rules(tag):
            done = subprocess.run([tool, "-w", "-I", rule[0], "1", *rule[1:]],
                                  capture_output=True, text=True, timeout=20)
            if done.returncode != 0:
                break
    return None if done.returncode == 0 else (done.stderr or done.stdout).strip()


def _remove(tool: str, tag: str) -> str | None:
    """Take the cut's rules away; the error, if any (none when they were not there)."""
    if os.path.basename(tool) == "nft":
        table = f"exogym_cut_{tag}"
        listed = subprocess.run([tool, "list", "table", "inet", table], capture_output=True,
                                text=True, timeout=20)
        if listed.returncode != 0:
            return None
        done = subprocess.run([tool, "delete", "table", "inet", table], capture_output=True,
                              text=True, timeout=20)
        return None if done.returncode == 0 else (done.stderr or done.stdout).strip()
    error = None
    for rule in _iptables_rules(tag):
        while subprocess.run([tool, "-w", "-C", *rule], capture_output=True,
                             timeout=20).returncode == 0:
            done = subprocess.run([tool, "-w", "-D", *rule], capture_output=True, text=True,
                                  timeout=20)
            if done.returncode != 0:
                error = (done.stderr or done.stdout).strip()
                break
    return error


def cut(seconds: float, tag: str) -> dict[str, Any]:
    """Cut this host off for ``seconds``, from a detached process, starting
    :data:`CUT_DELAY_S` after this answer; its progress goes to the status file."""
    check = cut_check()
    tool = check["tool"]
    if check["uid"] != 0 or tool is None:
        return {"error": "a cut needs root and nft or iptables here "
                         f"(uid {check['uid']}, tool {tool or 'none'})"}
    status = _status_path(tag)
    _write_json(status, {"state": "scheduled", "tool": tool})

    def work() -> None:
        time.sleep(CUT_DELAY_S)
        error = _apply(tool, tag)
        if error is not None:
            _write_json(status, {"state": "failed", "error": error, "tool": tool})
            return
        applied = time.time()
        _write_json(status, {"state": "cut", "tool": tool, "applied": applied})
        time.sleep(seconds)
        error = _remove(tool, tag)
        _write_json(status, {"state": "restored" if error is None else "failed",
                             "error": error, "tool": tool, "applied": applied,
                             "restored": time.time()})

    _detach(work)
    return {"ok": True, "tool": tool, "delay_s": CUT_DELAY_S}


def cut_status(tag: str) -> dict[str, Any]:
    """The status file of cut ``tag`` (``{"state": "missing"}`` when there is none); once
    the cut is over (restored or failed) the file is removed."""
    path = _status_path(tag)
    try:
        with open(path) as f:
            status = json.load(f)
    except (OSError, ValueError):
        return {"state": "missing"}
    if status.get("state") in ("restored", "failed"):
        try:
            os.unlink(path)
        except OSError:
            pass
    return status


def uncut(tag: str) -> dict[str, Any]:
    """Remove cut ``tag``'s rules now, if they are there."""
    tool = cut_tool()
    if tool is None:
        return {"ok": True}
    error = _remove(tool, tag)
    return {"ok": True} if error is None else {"error": error}


def handle(message: dict[str, Any]) -> dict[str, Any]:
    """Do one action; its answer."""
    action = message.get("action")
    if action == "signal":
        return send(int(message["pid"]), str(message["signal"]), bool(message.get("group")))
    if action == "freeze":
        return freeze(int(message["pgid"]), float(message["seconds"]))
    if action == "throttle":
        return throttle(str(message["path"]), float(message["factor"]), int(message["fault"]))
    if action == "cut_check":
        return cut_check()
    if action == "cut":
        return cut(float(message["seconds"]), str(message["tag"]))
    if action == "cut_status":
        return cut_status(str(message["tag"]))
    if action == "uncut":
        return uncut(str(message["tag"]))
    return {"error": f"unknown action {action!r}"}


def main(message: dict[str, Any]) -> None:
    """Entry point called by the loader with the message read from stdin."""
    print(json.dumps(handle(message)), flush=True)
