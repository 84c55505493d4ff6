"""What hosts that may come and go cost a run while none does: the same run with and without
``--min-nodes``, side by side.

Three hosts on this machine: rank 0 beside the launcher (127.0.0.1, the master)
and two loopback addresses (127.0.0.2, 127.0.0.3) served by a private sshd
started here, as the tests start theirs. Each repeat launches the ``digits-diloco``
profile (DiLoCo, H=20) across them twice, once as a static run (one process
group, the store on rank 0) and once with ``min_nodes=2`` (the launcher's store,
heartbeats judged by the launcher, gloo groups formed per membership, every
collective voted), the order alternating between repeats. No host is lost.

It prints, for each run, rank 0's steps per second over the steps after the
first ``--skip`` (its own clock: the step events' ``wall_s``), the median time of
a step inside a round (neither a round's first nor its last, no evaluation), and for the
``min_nodes`` runs the store round trips each rank's training thread made (the
step events' ``store_trips``): per step inside a round (target: none), and per
round. Last, the ratio of the medians, and the median of each repeat's ratio (its two
runs ran next to each other: on a shared machine whose load drifts, the steadier
figure) (target: at least 0.9). With ``--before PATH``
the ranks of every repeat also run from another checkout of the project (e.g. a
worktree of an earlier commit), the launcher still this one's: before and after,
side by side in one run.

    python -m bench.elastic_overhead
    python -m bench.elastic_overhead --repeat 3 --steps 3000 --before ../main

Needs sshd and ssh-keygen (``tests/setup_system.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

from bench.harness import ROOT
from bench.harness.tables import print_table
from tests.netbed import Events, free_port
from tests.netbed.ports import free_port as free_port_on
from tests.netbed.sshd import sshd_config, wait_for_greeting
from tests.netbed.system import sshd_binary, stop_process

#: The two worker hosts: loopback addresses a private sshd listens on.
WORKERS = ("127.0.0.2", "127.0.0.3")
#: DiLoCo's round, as the profile sets it.
H = 20


@contextlib.contextmanager
def loopback_sshd(folder: Path) -> Iterator[dict[str, Any]]:
    """An sshd on :data:`WORKERS` at a free port, letting in this user with a key made here;
    yields the hosts file's SSH settings for it, and stops it by its PID."""
    binary = sshd_binary()
    if binary is None or shutil.which("ssh-keygen") is None:
        sys.exit("sshd and ssh-keygen are needed (tests/setup_system.sh installs them)")
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "exogym-bench",
                        "-f", str(folder / name)], check=True)
    authorized = folder / "authorized_keys"
    authorized.write_text((folder / "user_key.pub").read_text())
    port = free_port_on(*WORKERS)
    config = folder / "sshd_config"
    config.write_text(sshd_config([f"{a}:{port}" for a in WORKERS], folder / "host_key",
                                  authorized))
    log = folder / "sshd.log"
    proc = subprocess.Popen([binary, "-D", "-f", str(config), "-E", str(log)],
                            stdin=subprocess.DEVNULL)
    try:
        wait_for_greeting(proc, WORKERS, port, log)
        public = (folder / "host_key.pub").read_text().split()
        known = folder / "known_hosts"
        known.write_text("".join(f"[{a}]:{port} {public[0]} {public[1]}\n" for a in WORKERS))
        (folder / "ssh_config").write_text("")
        yield {"port": port, "user": getpass.getuser(), "key": folder / "user_key",
               "known_hosts": known, "ssh_config": folder / "ssh_config"}
    finally:
        stop_process(proc)


def launch(sshd: dict[str, Any], out: Path, steps: int, min_nodes: int | None,
           settings: list[str], project: Path) -> tuple[Events, Any]:
    """One run of ``digits-diloco`` across the three hosts, the ranks started in the
    checkout ``project``; its events and result."""
    from rich.console import Console

    from distributed.hosts.ssh import SSHOptions
    from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram

    worker = {"ssh_port": sshd["port"]}
    hosts = {"master": "127.0.0.1", "workers": [{"host": a, **worker} for a in WORKERS],
             "ssh_user": sshd["user"], "ssh_key_path": str(sshd["key"]),
             "python_env": sys.executable, "project_path": str(project),
             "master_port": free_port()}
    program = RankProgram.from_profile("digits-diloco", overrides=[
        f"max_steps={steps}", f"H={H}", "num_nodes=3", "num_threads=1",
        "checkpoint_interval=None", f"output_dir={out / 'run'}", *settings])
    ssh = SSHOptions(known_hosts_path=sshd["known_hosts"], ssh_config_path=sshd["ssh_config"],
                     allow_agent=False, look_for_keys=False, connect_timeout=3)
    events = Events()
    job = Launcher(hosts, program,
                   options=LaunchOptions(run_dir=out / "launch", grace_period=2,
                                         min_nodes=min_nodes),
                   ssh=ssh, console=Console(file=StringIO(), width=200),
                   on_output=lambda line: None, on_event=events)
    result: dict[str, Any] = {}
    with job:
        runner = threading.Thread(target=lambda: result.setdefault("r", job.run()))
        runner.start()
        runner.join(timeout=1800)
        if runner.is_alive():
            raise RuntimeError(f"the run in {out} did not end within 1800 s")
    return events, result["r"]


def figures(events: Events, skip: int) -> dict[str, Any]:
    """Rank 0's steps per second after step ``skip``, and the store round trips of every
    rank's training thread: per step inside a round, and per round (steps that evaluate
    left out of both)."""
    steps = {e["step"]: e for _, e in events.of("step", 0)}
    last = max(steps)
    rate = (last - skip) / (steps[last]["wall_s"] - steps[skip]["wall_s"])
    # A step inside a round, alone: from the step event before it (no evaluation between).
    alone = [steps[k]["wall_s"] - steps[k - 1]["wall_s"] for k in range(skip + 1, last)
             if k % H not in (0, 1) and "val_loss" not in steps[k] and
             "val_loss" not in steps[k - 1]]
    inside, boundary = [], []
    for _, e in events.of("step"):
        if "store_trips" not in e or e["step"] <= H:
            continue  # the first round forms the group: a start's cost, not a step's
        if "val_loss" in e:
            continue  # an evaluation's average, voted as every collective is
        edge = e["step"] % H in (0, 1)  # a round's last step (its collective), or first
        (boundary if edge else inside).append(e["store_trips"])
    # A rank's round has two edges: what both cost, a round's share of the control plane.
    return {"rate": rate, "step_ms": 1000 * statistics.median(alone),
            "inside": statistics.mean(inside) if inside else None,
            "per_round": 2 * sum(boundary) / len(boundary) if boundary else None}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.elastic_overhead",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="steps of each run")
    parser.add_argument("--skip", type=int, default=400,
                        help="steps left out of the timing at the start (default 400)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="rounds of runs, the order alternating (default 2)")
    parser.add_argument("--before", type=Path, default=None, metavar="PATH",
                        help="also run the ranks from the project's checkout at PATH")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a profile setting for every run (e.g. batch_size=256)")
    args = parser.parse_args()
    if args.skip >= args.steps:
        parser.error(f"--skip {args.skip} leaves none of --steps {args.steps} to time")
    checkouts = {"": ROOT}
    if args.before is not None:
        before = args.before.resolve()
        if not (before / "distributed" / "worker").is_dir():
            parser.error(f"--before {before}: not a checkout of this project")
        checkouts = {"before ": before, "": ROOT}
    kinds = [(f"{tag}{mode}", path, min_nodes) for tag, path in checkouts.items()
             for mode, min_nodes in (("static", None), ("min_nodes=2", 2))]
    rows, rates = [], {label: [] for label, _, _ in kinds}
    ratios: dict[str, list[float]] = {tag: [] for tag in checkouts}
    with tempfile.TemporaryDirectory(prefix="exogym-elastic-overhead-") as tmp:
        folder = Path(tmp)
        with loopback_sshd(folder) as sshd:
            for i in range(args.repeat):
                for label, project, min_nodes in (kinds if i % 2 == 0 else kinds[::-1]):
                    events, result = launch(sshd, folder / f"{i}-{label.replace(' ', '-')}",
                                            args.steps, min_nodes, args.set, project)
                    if not result.ok:
                        sys.exit(f"{label} run {i + 1} failed: {result.describe()}")
                    found = figures(events, args.skip)
                    rates[label].append(found["rate"])
                    trips = "-" if found["inside"] is None else f"{found['inside']:.2f}"
                    per_round = "-" if found["per_round"] is None else \
                        f"{found['per_round']:.1f}"
                    print(f"run {i + 1} {label}: {found['rate']:.1f} steps/s, a step inside "
                          f"a round {found['step_ms']:.2f} ms, store round trips {trips} a "
                          f"step inside a round, {per_round} a round", flush=True)
                    rows.append([str(i + 1), label, f"{found['rate']:.1f}",
                                 f"{found['step_ms']:.2f}", trips, per_round])
                for tag in checkouts:  # this repeat's pair, run next to each other
                    ratios[tag].append(rates[f"{tag}min_nodes=2"][-1] / rates[f"{tag}static"][-1])
    print_table(f"digits-diloco (H={H}) across 3 hosts on this machine, {args.steps} steps, "
                "no host lost",
                ["repeat", "run", "steps/s (rank 0)", "ms a step inside a round (median)",
                 "store trips a step inside a round", "store trips a round (a rank)"], rows,
                left=("run",))
    for tag in checkouts:
        static = statistics.median(rates[f"{tag}static"])
        elastic = statistics.median(rates[f"{tag}min_nodes=2"])
        print(f"{tag or 'this checkout'}: median steps/s static {static:.1f}, min_nodes=2 "
              f"{elastic:.1f}: {elastic / static:.2f}x; median of each repeat's ratio "
              f"{statistics.median(ratios[tag]):.2f}x (target 0.9x)")


if __name__ == "__main__":
    main()
