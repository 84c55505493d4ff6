"""A real one-node SLURM cluster on this machine: munged, slurmctld and slurmd in a temp folder.

The node is ``localhost`` (127.0.0.1) with this machine's CPUs. The daemons run
as root (through ``sudo -n`` for another user: a node starts job steps as the
user who submitted them) and are stopped by PID when the test ends; jobs run
as the current user. Skips, saying why, when SLURM or munge is not installed
(``tests/setup_system.sh`` installs them), root is out of reach, or the daemons
do not come up.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ranks import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")


def slurm_missing() -> str | None:
    """Why no cluster can be started here, or None."""
    for name in (*DAEMONS, "srun", "sbatch", "sinfo"):
        if not (shutil.which(name) or Path("/usr/sbin", name).exists()):
            return f"{name} is not installed (tests/setup_system.sh installs slurm and munge)"
    return None


def as_root() -> list[str] | None:
    """The prefix that runs a command as root: [] for root, sudo for others, None if neither."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"],
                                               capture_output=True).returncode == 0:
        return ["sudo", "-n", "--preserve-env=SLURM_CONF"]
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


CONF = """\
ClusterName=exogymtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
"""


@contextmanager
def slurm_cluster() -> Iterator[dict[str, str]]:
    """Start the cluster; yields the environment (``SLURM_CONF``) its clients need."""
    import pytest

    root = as_root()
    if root is None:
        pytest.skip("a SLURM node needs root to start job steps; run as root or with "
                    "passwordless sudo")
    # Short path: munge's socket path must fit a Unix socket name.
    folder = Path(tempfile.mkdtemp(prefix="exoslurm"))
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = folder / "slurm.conf"
    conf.write_text(CONF.format(ctld_port=free_port(), d_port=free_port(), dir=folder,
                                cpus=os.cpu_count() or 1))
    env = dict(os.environ, SLURM_CONF=str(conf))
    for key_name in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(key_name)
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen(
            [*root, _exe("munged"), "--foreground", "--force", "-S", str(folder / "munge.sock"),
             "--key-file", str(key), "--pid-file", str(folder / "munged.pid"),
             "--log-file", str(folder / "munged.log"), "--seed-file", str(folder / "seed")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        _wait_for(lambda: (folder / "munge.sock").exists(), 20, folder, "munged")
        log = open(folder / "daemons.out", "wb")
        procs.append(subprocess.Popen([*root, _exe("slurmctld"), "-D", "-i"], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen([*root, _exe("slurmd"), "-D", "-N", "localhost"], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
        log.close()

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                 text=True, timeout=10)
            return out.stdout.strip() == "idle"

        _wait_for(idle, 60, folder, "slurmctld/slurmd")
        yield env
    finally:
        for proc in reversed(procs):
            _signal(proc, root, signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                _signal(proc, root, signal.SIGKILL)
                proc.wait()
        # The daemons' files are root's.
        subprocess.run([*root, "rm", "-rf", str(folder)], check=False)


def _signal(proc: subprocess.Popen, root: list[str], sig: signal.Signals) -> None:
    """Signal one daemon by its PID (through sudo, which passes it on, when it started it)."""
    if proc.poll() is not None:
        return
    if root:
        subprocess.run(["sudo", "-n", "kill", f"-{sig.name}", str(proc.pid)], check=False)
    else:
        proc.send_signal(sig)


def _wait_for(ready, seconds: float, folder: Path, what: str) -> None:
    import pytest

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except (OSError, subprocess.SubprocessError):
            pass
        time.sleep(0.5)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                     for p in sorted(folder.glob("*.log")) + sorted(folder.glob("*.out")))
    pytest.skip(f"{what} did not come up in {seconds:.0f} s here:\n{logs}")
