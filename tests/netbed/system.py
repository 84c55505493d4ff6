"""What the bed needs of this machine: commands that must succeed, tools, processes by PID."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .ports import free_port as claimed_port

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")


class TestbedError(RuntimeError):
    """The test bed cannot be built or used; the message says why and what to do."""


def run(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``args`` (``ip``, ``tc``, ...); with ``check``, raise :class:`TestbedError` with its
    output when it fails."""
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(args)}` failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")
    return done


def sshd_binary() -> str | None:
    """The sshd executable, or None."""
    found = shutil.which("sshd")
    if found:
        return found
    return next((p for p in SSHD_CANDIDATES if os.access(p, os.X_OK)), None)


def check_requirements(pin: bool) -> list[str]:
    """Every missing requirement, each as a sentence with its fix (empty: all present)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("network namespaces, tc and a second sshd need root: run it as root "
                        "(sudo -E env PATH=$PATH python -m bench.multihost ...)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("ssh-keygen", "openssh-client")):
        if shutil.which(tool) is None:
            problems.append(f"{tool} is not installed: apt-get install {package}")
    if sshd_binary() is None:
        problems.append("sshd is not installed: apt-get install openssh-server "
                        "(tests/setup_system.sh does it)")
    if pin and shutil.which("taskset") is None:
        problems.append("taskset is not installed (apt-get install util-linux), or pass --no-pin")
    return problems


def free_port() -> int:
    """A TCP port free on every address of this machine (a job's master port), claimed for
    this process as the tests' ports are (:mod:`netbed.ports`)."""
    return claimed_port("")


def stop_process(proc: subprocess.Popen) -> None:
    """Stop ``proc`` by its PID: TERM, then KILL after 5 s."""
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def worker_pid(rank: int, marker: str) -> int | None:
    """The process of ``rank`` (``python -m distributed.worker``, not its supervisor) whose
    command line holds ``marker`` (e.g. its output folder), on this machine or in a bed's host."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            environ = (entry / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[1:3] == ["-m", "distributed.worker"] and any(marker in a for a in argv) \
                and f"RANK={rank}" in environ:
            return int(entry.name)
    return None
