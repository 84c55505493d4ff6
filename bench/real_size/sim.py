"""The ``sim`` part of ``bench.real_size``: the DiLoCo workload simulated by this project and
by exo-explore/gym, each run a child process whose time and memory are measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness import ROOT
from bench.harness.machine import PeakPss
from bench.harness.tables import print_table
from bench.harness.timing import bench_command, timed_run
from bench.real_size import SIM


class GymNamespace:
    """A network namespace where exo-explore/gym can run on Linux.

    gym sets ``GLOO_SOCKET_IFNAME=lo0``, macOS's loopback, before it joins its ranks;
    Linux has no such interface. Inside this namespace ``lo`` is up and a dummy
    interface named ``lo0`` (one end of a veth pair) carries an address of its own.
    Needs root; removed on exit.
    """

    def __init__(self) -> None:
        self.name = f"exogym-gym-{os.getpid()}"

    def __enter__(self) -> GymNamespace:
        if sys.platform != "linux":
            self.name = ""
            return self
        if os.geteuid() != 0:
            raise SystemExit("exo-explore/gym binds gloo to an interface named lo0 (macOS's "
                             "loopback); on Linux this bench runs it in a network namespace "
                             "that has one, which needs root (sudo)")
        for command in (["ip", "netns", "add", self.name],
                        ["ip", "-n", self.name, "link", "set", "lo", "up"],
                        ["ip", "-n", self.name, "link", "add", "lo0", "type", "veth", "peer",
                         "name", "lo0peer"],
                        ["ip", "-n", self.name, "addr", "add", "10.250.0.1/24", "dev", "lo0"],
                        ["ip", "-n", self.name, "link", "set", "lo0peer", "up"],
                        ["ip", "-n", self.name, "link", "set", "lo0", "up"]):
            subprocess.run(command, check=True, capture_output=True)
        return self

    def prefix(self) -> list[str]:
        """What a command runs under to be inside the namespace."""
        return ["ip", "netns", "exec", self.name] if self.name else []

    def __exit__(self, *exc: object) -> None:
        if self.name:
            subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)


def sim(models: list[str], nodes: list[int], gym: Path | None, work: Path) -> list[dict]:
    with GymNamespace() as space:
        return _sim(models, nodes, gym, work, space)


def measured(command: list[str], env: dict[str, str], log: Path, cwd: Path) -> dict[str, Any]:
    """Run ``command``; its wall time, the peak summed PSS of its processes (sampled every
    0.2 s), the largest process's peak, and the figures it wrote."""
    result = log.with_suffix(".json")
    peak = PeakPss()
    run = timed_run([*command, "--result", str(result)], env=env, cwd=cwd, log=log, sample=peak)
    return {"wall_s": run.wall_s, "pss_bytes": peak.summed,
            "worker_pss_bytes": peak.largest_below_root(), **json.loads(result.read_text())}


def _sim(models: list[str], nodes: list[int], gym: Path | None, work: Path,
         space: GymNamespace) -> list[dict]:
    rows = []
    base = dict(os.environ)
    for name in models:
        for k in nodes:
            row: dict[str, Any] = {"model": name, "nodes": k}
            command = bench_command("bench.real_size.child", "sim", "--model", name,
                                    "--nodes", str(k))
            env = dict(base, PYTHONPATH=str(ROOT))
            row["ours"] = measured([*command, "--which", "ours"], env,
                                   work / f"ours-{name}-{k}.log", ROOT)
            print(f"{name} K={k} ours: {row['ours']['wall_s']:.1f} s, "
                  f"{row['ours']['pss_bytes'] / 2**30:.2f} GiB", flush=True)
            if gym is not None:
                env = dict(base, PYTHONPATH=f"{gym}{os.pathsep}{ROOT}")
                # From the work folder: gym's exogym must come before this project's.
                row["gym"] = measured([*space.prefix(), *command, "--which", "gym"], env,
                                      work / f"gym-{name}-{k}.log", work)
                print(f"{name} K={k} gym: {row['gym']['wall_s']:.1f} s, "
                      f"{row['gym']['pss_bytes'] / 2**30:.2f} GiB", flush=True)
            rows.append(row)
    return rows


def sim_tables(rows: list[dict]) -> None:
    """The runs' time and memory, against gym's where it ran, and the memory accounted."""
    from rich.console import Console

    console = Console(width=180)
    gib = 2**30
    times = []
    for r in rows:
        ours, gym = r["ours"], r.get("gym")
        times.append((r["model"], r["nodes"], ours["processes"], f"{ours['wall_s']:.1f} s",
                      f"{ours['pss_bytes'] / gib:.2f} GiB",
                      f"{gym['wall_s']:.1f} s" if gym else "-",
                      f"{gym['pss_bytes'] / gib:.2f} GiB" if gym else "-",
                      f"{ours['wall_s'] / gym['wall_s']:.2f}x" if gym else "-",
                      f"{ours['pss_bytes'] / gym['pss_bytes']:.2f}x" if gym else "-"))
    print_table(f"simulation: DiLoCo H={SIM['H']}, {SIM['max_steps']} steps of "
                f"{SIM['batch_size']} x {SIM['block_size']} tokens per rank, this "
                f"machine ({os.cpu_count()} cores)",
                ("model", "K", "processes", "wall", "summed PSS", "gym wall", "gym PSS",
                 "wall vs gym", "PSS vs gym"), times, console=console)
    memory = []
    for r in rows:
        ours = r["ours"]
        memory.append((r["model"], r["nodes"], -(-r["nodes"] // ours["processes"]),
                       f"{ours['state_bytes'] / gib:.2f} GiB",
                       f"{ours['shared_bytes'] / gib:.2f} GiB",
                       f"{ours['activation_bytes'] / gib:.2f} GiB",
                       f"{ours['runtime_bytes'] / gib:.2f} GiB",
                       f"{ours['budget_bytes'] / gib:.2f} GiB",
                       f"{ours['worker_pss_bytes'] / gib:.2f} GiB",
                       f"{ours['worker_pss_bytes'] / ours['budget_bytes']:.2f}x",
                       f"{(ours['peak_rss_bytes'] or 0) / gib:.2f} GiB",
                       f"{ours['pss_bytes'] / gib:.2f} GiB"))
    print_table("memory of this project's runs: accounted before the run (a process's "
                "ranks' training state, one forward and backward's activations, the "
                "runtime) against the peak measured (PSS: shared pages split among "
                "the processes that share them; RSS counts them whole)",
                ("model", "K", "ranks a process", "state per rank (accounted)",
                 "held once a process", "activations", "runtime", "accounted a process",
                 "peak PSS a process", "peak / accounted", "peak RSS a process", "summed PSS"),
                memory, console=console)
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == name), key=lambda r: r["nodes"])
        for a, b in zip(mine, mine[1:]):
            grow = (b["ours"]["pss_bytes"] - a["ours"]["pss_bytes"]) / (b["nodes"] - a["nodes"])
            console.print(f"{name}: from K={a['nodes']} to K={b['nodes']} the summed PSS grows "
                          f"{grow / gib:.2f} GiB a rank, against {b['ours']['state_bytes'] / gib:.2f}"
                          " GiB of training state a rank")
