"""Start real rank processes with the rank variables set, as a launcher would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def rank_env(rank: int, world: int, port: int, addr: str = "127.0.0.1", **extra: str) -> dict:
    env = dict(os.environ)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR=addr,
               MASTER_PORT=str(port), PYTHONPATH=str(ROOT), **extra)
    env.pop("GLOO_SOCKET_IFNAME", None)
    return env


def start_ranks(profile: str, world: int, overrides: list[str], log_dir: Path,
                prefix: list[str] | None = None, addr: str = "127.0.0.1",
                port: int | None = None) -> list[subprocess.Popen]:
    """Start ``world`` worker processes for ``profile``; their output goes to log_dir.
    Without a ``prefix`` (a namespace to run in) they start warm (tests/warm.py)."""
    import warm

    port = port or free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    python = [sys.executable] if prefix else warm.python()
    for rank in range(world):
        args = [*python, "-m", "distributed.worker", "--profile", profile, "--quiet"]
        for pair in overrides:
            args += ["--set", pair]
        log = open(log_dir / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen((prefix[rank] if prefix else []) + args, cwd=ROOT,
                                      env=rank_env(rank, world, port, addr), stdout=log,
                                      stderr=subprocess.STDOUT))
        log.close()
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(-9)
    return codes


def interrupt_after_checkpoints(args: list[str], cwd: Path, checkpoints: Path,
                                count: int = 1, signum: int = signal.SIGINT
                                ) -> tuple[int, str, str]:
    """Run ``cli_typer.py ARGS`` in ``cwd``, press Ctrl-C (SIGINT to its process group) once
    ``checkpoints`` holds ``count`` checkpoint files; its exit code, stdout and stderr.
    ``signum=SIGTERM`` stops it as ``kill``, systemd or SLURM would instead."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli_typer.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            start_new_session=True, env={**os.environ, "COLUMNS": "400"})
    try:
        deadline = time.monotonic() + 240
        while len(list(checkpoints.glob("*.ckpt"))) < count:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"no checkpoint was written in {checkpoints}"
            time.sleep(0.1)
        os.killpg(proc.pid, signum)  # SIGINT: what Ctrl-C in a terminal does
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


class Throttle:
    """Every rank's speed, through one throttle file all of them read (the product's own
    :mod:`distributed.worker.throttle`; the test hosts, SSH or namespaces, share this
    machine's disk): a test that must act while a run is still going slows the run down
    for as long as it acts, instead of making the run long in steps, whatever else the
    machine runs.

    Args:
        tmp_path: the test's folder, where the file goes.
    """

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "throttle.json"

    @property
    def env(self) -> dict[str, str]:
        """The variable that points every rank at the file (``LaunchOptions.env``)."""
        return {"EXOGYM_THROTTLE_FILE": str(self.path)}

    def set(self, factor: float) -> None:
        """Every rank at ``factor`` of its speed from its next look at the file."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"factor": factor, "fault": "test"}))
        tmp.replace(self.path)
