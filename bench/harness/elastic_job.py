"""A job whose hosts come and go (``min_nodes``) with every rank in a bed host's namespace.

``min_nodes`` needs the launcher on the master host (the run's rendezvous
store lives in the launcher's process), so the launcher cannot run in the root
namespace with the master in host 0's. :class:`ElasticJob` therefore starts it
as a child process inside host 0's namespace (``ip netns exec``, then
``python -m bench.harness.elastic_job SPEC``): rank 0 runs there beside it,
every other rank on its own host over SSH, and every rank's link is shaped
alike. The child writes each launcher event as one JSON line; the bench reads
them as they come into a :class:`tests.netbed.Events` (stamped with the time
they were read) and, at the end, the child's result file.

The child lives in host 0's namespace, so taking the bed down stops it too;
:meth:`ElasticJob.stop` stops it by its PID first (TERM: the launcher stops its
ranks; KILL after ``grace`` seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import ROOT
from bench.harness.jobs import BenchError
from tests.netbed import Events, Testbed


class ElasticJob:
    """A profile launched on every host of ``bed`` with ``min_nodes``, the launcher in host 0.

    Args:
        bed: the built bed; host 0 is the master (rank 0 and the launcher).
        profile: the profile in ``config.ini``.
        overrides: its ``key=value`` overrides.
        folder: where the job's files go (spec, events, the launcher's log and result,
            the ranks' logs under ``launch/``).
        min_nodes: the fewest ranks the job goes on with.
        port: the master's port.
        env: variables for every rank's environment.
    """

    def __init__(self, bed: Testbed, profile: str, overrides: list[str], folder: Path,
                 min_nodes: int, port: int, env: dict[str, str] | None = None) -> None:
        self.bed = bed
        self.folder = folder
        self.events = Events()
        self.events_path = folder / "events.jsonl"
        self.result_path = folder / "result.json"
        self.log_path = folder / "launcher.log"
        self.spec = {
            "hosts": bed.hosts_config(port),
            "ssh": {k: str(v) if isinstance(v, Path) else v
                    for k, v in bed.ssh_settings(connect_timeout=3).items()},
            "profile": profile, "overrides": overrides, "min_nodes": min_nodes,
            "run_dir": str(folder / "launch"), "events": str(self.events_path),
            "result": str(self.result_path), "log": str(self.log_path),
            "env": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})},
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self._done = threading.Event()
        self._reader = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the launcher in host 0's namespace; its events arrive in :attr:`events`."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.events_path.write_text("")
        spec = self.folder / "spec.json"
        spec.write_text(json.dumps(self.spec, indent=1))
        command = self.bed.in_host(self.bed.hosts[0], sys.executable, "-m",
                                   "bench.harness.elastic_job", str(spec))
        with open(self.folder / "launcher.out", "wb") as out:
            self.proc = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONPATH": str(ROOT)})
        self._reader.start()

    def _follow(self) -> None:
        with open(self.events_path) as source:
            pending = ""
            while True:
                chunk = source.readline()
                if chunk:
                    pending += chunk
                    if pending.endswith("\n"):
                        self.events(json.loads(pending))
                        pending = ""
                    continue
                if self._done.is_set():
                    return
                time.sleep(0.05)

    def wait(self, timeout: float) -> dict[str, Any]:
        """Wait up to ``timeout`` seconds for the launcher to end; its result (``ok``,
        ``describe``, ``membership``). Raises BenchError when it does not end in time or
        leaves no result."""
        assert self.proc is not None, "start() first"
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"the launcher of {self.folder.name} did not end within "
                             f"{timeout:.0f} s; its log: {self.log_path}") from None
        self._done.set()
        self._reader.join(timeout=10)
        if not self.result_path.exists():
            said = (self.folder / "launcher.out").read_text(errors="replace")[-3000:]
            raise BenchError(f"the launcher of {self.folder.name} exited with {code} and no "
                             f"result:\n{said}")
        return json.loads(self.result_path.read_text())

    def stop(self, grace: float = 15.0) -> None:
        """Stop the launcher (and so its ranks) by its PID if it still runs."""
        self._done.set()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _child(spec_path: str) -> int:
    """The launcher's side: run the job in this namespace, write its events and result."""
    from rich.console import Console

    from distributed.hosts.ssh import SSHOptions
    from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram
    from exogym.base.io import atomic_write_json

    spec = json.loads(Path(spec_path).read_text())
    program = RankProgram.from_profile(spec["profile"], overrides=spec["overrides"], quiet=True)
    lock = threading.Lock()
    with open(spec["events"], "a", buffering=1) as events, open(spec["log"], "w") as log:
        def on_event(event: dict[str, Any]) -> None:
            with lock:
                events.write(json.dumps(event, default=str) + "\n")

        def on_output(line: object) -> None:
            with lock:
                log.write(f"{time.strftime('%H:%M:%S')} {line}\n")
                log.flush()

        options = LaunchOptions(run_dir=spec["run_dir"], master_local=True, grace_period=2,
                                min_nodes=spec["min_nodes"], env=spec["env"])
        with Launcher(spec["hosts"], program, options=options, ssh=SSHOptions(**spec["ssh"]),
                      console=Console(file=log, width=160), on_output=on_output,
                      on_event=on_event) as job:
            result = job.run()
            membership = list(job.membership)
    atomic_write_json(Path(spec["result"]), {
        "ok": result.ok, "describe": result.describe(), "interrupted": result.interrupted,
        "membership": membership})
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
