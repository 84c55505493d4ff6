"""The rows of ``bench.gpu``: which runs, each measured in a child process, and their table."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.gpu import CPU_PART, MODES, PEAK_DIR_ENV, QUICK, WORKLOADS
from bench.gpu.flops import flops_per_token, mfu
from bench.harness import ROOT
from bench.harness.machine import PeakPss, tree_pss_bytes
from bench.harness.tables import print_table
from bench.harness.timing import bench_command, timed_run


@dataclass(frozen=True)
class Run:
    """One row: a workload at K ranks in a mode, by this project (``ours``) or exo-explore/gym."""

    workload: str
    nodes: int
    mode: str
    processes: int
    steps: int
    batch_size: int
    which: str = "ours"

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", f"{self.which} {self.workload} {self.nodes} {self.mode}")


def packed_processes(device_type: str, nodes: int, asked: int | None) -> int:
    """Processes of the packed and stacked modes: ``asked``, else 1 on an accelerator (its
    ranks share one device), else the cores up to half the ranks."""
    if asked is not None:
        return min(asked, nodes)
    if device_type != "cpu":
        return 1
    from exogym.run.devices import available_cores

    return max(1, min(available_cores(), nodes // 2))


def plan(device_type: str, quick: bool, packed: int | None, gym: bool) -> list[Run]:
    """The runs: the GPU part's workloads on an accelerator, else the CPU part's."""
    if device_type == "cpu":
        name = CPU_PART["workload"]
        parts = {name: {**WORKLOADS[name], "nodes": CPU_PART["nodes"],
                        "max_steps": CPU_PART["max_steps"]}}
    else:
        parts = WORKLOADS
    runs = []
    for name, spec in parts.items():
        steps, batch = spec["max_steps"], spec["batch_size"]
        nodes = spec["nodes"]
        if quick:
            steps, batch = QUICK["max_steps"], QUICK["batch_size"]
            nodes = list(dict.fromkeys(min(k, QUICK["max_nodes"]) for k in nodes))
        for k in nodes:
            if k == 1:
                runs.append(Run(name, 1, "alone", 1, steps, batch))
            else:
                p = packed_processes(device_type, k, packed)
                runs += [Run(name, k, mode, k if mode == MODES[0] else p, steps, batch)
                         for mode in MODES]
            if gym:
                runs.append(Run(name, k, "alone" if k == 1 else MODES[0], k, steps, batch, "gym"))
    return runs


class Deadline:
    """A :func:`timed_run` sampler that kills the run's processes (``SIGKILL``, each by its
    id, the root last) once ``seconds`` have passed since it was made."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.monotonic()
        self.fired = False

    def __call__(self, root: int) -> None:
        if self.fired or time.monotonic() - self.started < self.seconds:
            return
        self.fired = True
        _, each = tree_pss_bytes(root)
        for pid in sorted(each, key=lambda p: p == root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def measure(run: Run, device: str, quick: bool, autocast: bool, work: Path,
            gym: Path | None, prefix: list[str], deadline_s: float,
            peak_flops: float | None) -> dict[str, Any]:
    """Run ``run`` in a child process; its figures (see the package's docstring), or why it
    was refused or failed.

    Args:
        gym: the checkout of exo-explore/gym (a gym run's ``PYTHONPATH`` puts it first).
        prefix: what a gym run's command runs under (its network namespace).
        peak_flops: the device's peak for the run's dtype (None: unknown, no MFU).
    """
    peaks = work / f"peak-{run.slug}"
    peaks.mkdir(parents=True, exist_ok=True)
    log, result = work / f"{run.slug}.log", work / f"{run.slug}.json"
    command = bench_command("bench.gpu.child", "--which", run.which, "--workload", run.workload,
                            "--nodes", str(run.nodes), "--mode", run.mode, "--processes",
                            str(run.processes), "--device", device, "--steps", str(run.steps),
                            "--batch-size", str(run.batch_size), "--result", str(result),
                            *(["--quick"] if quick else []), *(["--autocast"] if autocast else []))
    path = f"{gym}{os.pathsep}{ROOT}" if run.which == "gym" else str(ROOT)
    env = dict(os.environ, PYTHONPATH=path, **{PEAK_DIR_ENV: str(peaks)})
    row: dict[str, Any] = asdict(run)
    pss, deadline = PeakPss(), Deadline(deadline_s)

    def sample(pid: int) -> None:
        pss(pid)
        deadline(pid)

    try:
        # gym from the work folder: its exogym must come before this project's.
        timed = timed_run([*(prefix if run.which == "gym" else []), *command], env=env,
                          cwd=work if run.which == "gym" else ROOT, log=log, sample=sample)
    except RuntimeError:
        said = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        why = said[-1].strip() if said else "no output"
        if deadline.fired:
            why = f"stopped at the deadline of {deadline_s:.0f} s (--deadline); last: {why}"
        row["failed"] = f"{why} (log: {log})"
        return row
    row.update(json.loads(result.read_text()), wall_s=timed.wall_s, pss_bytes=pss.summed)
    if "refused" not in row:
        row["samples_per_s"] = row["samples"] / row["fit_s"]
        row["flops_per_token"] = flops_per_token(row["params"], row["n_layer"],
                                                 row["block_size"], row["n_embd"])
        row["mfu"] = mfu(row["samples_per_s"], row["block_size"], row["flops_per_token"],
                         peak_flops)
    return row


def say_row(row: dict[str, Any]) -> str:
    """A row in one line, as it is measured."""
    head = f"{row['which']} {row['workload']} K={row['nodes']} {row['mode']}"
    if "samples_per_s" in row:
        return f"{head}: {row['samples_per_s']:.1f} samples/s in {row['fit_s']:.1f} s"
    return f"{head}: " + (f"refused: {row['refused']}" if "refused" in row
                          else f"failed: {row['failed']}")


def table(rows: list[dict[str, Any]], device_type: str, heading: str) -> None:
    """The rows' figures, and for a workload with one rank alone, MFU at K over MFU alone."""
    from rich.console import Console

    console = Console(width=200)
    memory = {"cuda": "peak allocated (sum)", "cpu": "peak PSS (sum)"}.get(device_type,
                                                                           "peak memory")
    cells = []
    for r in rows:
        mode = r["mode"] if r["which"] == "ours" else f"gym, {r['mode']}"
        shape = f"{r['steps']} x {r['batch_size']}"
        if "samples_per_s" not in r:
            note = f"refused: {r['refused']}" if "refused" in r else f"failed: {r['failed']}"
            cells.append((r["workload"], r["nodes"], mode, shape, r["processes"], "-", "-", "-",
                          "-", note))
            continue
        held = r["peak_allocated_bytes"] if device_type == "cuda" else \
            r["pss_bytes"] if device_type == "cpu" else None
        cells.append((r["workload"], r["nodes"], mode, shape, r["processes"],
                      f"{r['samples_per_s']:.1f}",
                      f"{held / 2**30:.2f} GiB" if held else "-",
                      f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "unknown",
                      f"{r['fit_s']:.1f} s", ""))
    print_table(heading, ("workload", "K", "mode", "steps x batch", "processes", "samples/s",
                          memory, "MFU", "fit", "note"), cells, left=("workload", "mode", "note"),
                console=console)
    for line in ratio_lines(rows):
        console.print(line)


def ratio_lines(rows: list[dict[str, Any]]) -> list[str]:
    """For each workload and project with a run of one rank alone: each run's MFU over that
    one's (the same model on the same device: the ratio of samples per second)."""
    lines = []
    for (workload, which) in dict.fromkeys((r["workload"], r["which"]) for r in rows):
        mine = [r for r in rows if r["workload"] == workload and r["which"] == which]
        alone = next((r for r in mine if r["nodes"] == 1 and "samples_per_s" in r), None)
        if alone is None:
            continue
        for k in dict.fromkeys(r["nodes"] for r in mine if r["nodes"] > 1):
            parts = []
            for r in (r for r in mine if r["nodes"] == k):
                if "samples_per_s" in r:
                    parts.append(f"{r['mode']} {r['samples_per_s'] / alone['samples_per_s']:.2f}x")
                else:
                    parts.append(f"{r['mode']} {'refused' if 'refused' in r else 'failed'}")
            who = "exo-explore/gym" if which == "gym" else "this project"
            lines.append(f"{workload} ({who}): MFU at K={k} over one rank's MFU alone: "
                         + ", ".join(parts))
    return lines
