"""The ``hosts`` part of ``bench.real_size``: three hosts at a shaped rate (this machine and
two of the bed's), DiLoCo on the 124M model, one host killed and back."""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from io import StringIO
from pathlib import Path
from typing import Any

from bench.harness.tables import print_table
from bench.harness.timing import bench_command, timed_run
from bench.real_size import HOSTS, MODELS
from tests.netbed import Events, Testbed, check_requirements, free_port, rate_bits, worker_pid


def host_run(bed: Testbed, model: str, rate: str, min_nodes: int | None, kill: bool,
             away: float, work: Path, max_steps: int) -> dict[str, Any]:
    """One DiLoCo run on the bed's hosts, rank 0 here; with ``kill``, rank 2's host is killed
    after two rounds and answers again ``away`` seconds later."""
    from rich.console import Console

    from distributed.hosts.ssh import SSHOptions
    from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram

    label = ("kill" if kill else "min_nodes") if min_nodes else "no min_nodes"
    out = work / label.replace(" ", "-")
    events = Events()
    h = HOSTS["H"]
    hosts = bed.hosts_config(free_port(), launcher_is_master=True)
    ssh = SSHOptions(**bed.ssh_settings(connect_timeout=5))
    overrides = [f"{k}={v}" for k, v in MODELS[model].items()] + [
        f"block_size={HOSTS['block_size']}", f"batch_size={HOSTS['batch_size']}",
        f"tokens={HOSTS['tokens']}", f"H={h}", f"max_steps={max_steps}", "val_size=0",
        "num_threads=1", "checkpoint_interval=None", "num_nodes=3", "warmup_steps=0",
        f"output_dir={out / 'run'}"]
    program = RankProgram.from_profile("gpt-diloco", overrides=overrides)
    job = Launcher(hosts, program, options=LaunchOptions(run_dir=out / "launch", grace_period=2,
                                                         min_nodes=min_nodes),
                   ssh=ssh, console=Console(file=StringIO()), on_output=lambda line: None,
                   on_event=events)
    result: dict[str, Any] = {}
    back = None
    with job:
        runner = threading.Thread(target=lambda: result.setdefault("r", job.run()))
        runner.start()
        if kill:
            events.wait(lambda e: e.get("event") == "step" and e["rank"] == 2
                        and e["step"] >= 2 * h, 900)
            cut = bed.hosts[1]
            bed.stop_sshd(cut)
            os.kill(worker_pid(2, str(out)), signal.SIGKILL)
            events.wait(lambda e: e.get("event") == "membership" and e["ranks"] == [0, 1], 300)
            time.sleep(away)
            bed.start_sshd(cut)
            back = time.monotonic()
        runner.join(timeout=3600)
    launch = result["r"]
    rounds = [(t, e) for t, e in events.of("step", 0) if e["step"] % h == 0]
    gaps = sorted(b[0] - a[0] for a, b in zip(rounds, rounds[1:]))
    comm = sorted(e["comm_s"] for _, e in rounds if e.get("comm_s"))
    bytes_round = rounds[-1][1]["comm_bytes"] / len(rounds) if rounds else 0
    n = 3
    bound = 2 * (n - 1) / n * bytes_round * 8 / rate_bits(rate)
    row = {"run": label, "ok": launch.ok, "rounds": len(rounds),
           "round_s": statistics.median(gaps) if gaps else None,
           "allreduce_s": statistics.median(comm) if comm else None,
           "bytes_per_round": bytes_round, "ring_bound_s": bound,
           "efficiency": bound / statistics.median(comm) if comm else None,
           "describe": launch.describe().splitlines()[0],
           "peak_rss_bytes": {e["rank"]: e.get("peak_rss_bytes") for _, e in events.of("done")}}
    if kill:
        t_join, joined = events.wait(lambda e: e.get("event") == "membership"
                                     and e["ranks"] == [0, 1, 2], 1, after=back)
        # Back to work: the returning rank's first trained step (it joins the round under
        # way), from the host answering and from the rank saying it was ready to come back.
        t_first, first = events.wait(lambda e: e.get("event") == "step" and e["rank"] == 2
                                     and e["step"] >= joined["step"], 1, after=t_join)
        # When that step began: its event comes at its end, after its compute and, at a
        # round's last step, the round's all-reduce.
        t_began = t_first - (first.get("compute_s") or 0.0) - (first.get("comm_s") or 0.0)
        t_ready = max((t for t, e in events.of("host", 2) if e["state"] == "rejoining"
                       and t >= back), default=None)
        handed = [e for _, e in events.of("hand_over", 2)]
        transfer = handed[-1]["bytes"] * 8 / rate_bits(rate) if handed else 0.0
        row.update(back_s=t_first - back, joined_s=t_join - back,
                   ready_to_work_s=None if t_ready is None else t_first - t_ready,
                   ready_to_first_step_s=None if t_ready is None else t_began - t_ready,
                   first_step_s=t_first - t_began,
                   joined_step=joined["step"],
                   during_round=bool(handed and handed[-1].get("during_round")),
                   rounds_caught_up=handed[-1].get("rounds_caught_up") if handed else None,
                   handed_bytes=handed[-1]["bytes"] if handed else None,
                   handed_s=handed[-1]["seconds"] if handed else None,
                   handed_from=handed[-1].get("from") if handed else None,
                   # Where the hand-over's time went, on the joiner and on its source.
                   joiner_timing=handed[-1].get("timing") if handed else None,
                   source_timing=next((e.get("timing") for _, e in
                                       reversed(events.of("hand_over", 0))
                                       if e.get("during_round")), None),
                   transfer_at_rate_s=transfer,
                   target_s=transfer + 5,
                   membership=[len(e["ranks"]) for _, e in events.of("membership")])
    return row


RUNS = {"plain": (None, False), "min_nodes": (2, False), "kill": (2, True)}


def hosts_part(model: str, rate: str, away: float, work: Path, max_steps: int,
               runs: list[str]) -> list[dict]:
    missing = check_requirements(pin=False)
    if missing:
        raise SystemExit("cannot build the test bed:\n  " + "\n  ".join(missing))
    budget_file = work / "budget.json"
    timed_run(bench_command("bench.real_size.child", "budget", "--model", model,
                            "--result", str(budget_file)))
    budget = json.loads(budget_file.read_text())
    print(json.dumps({"accounted_per_rank": budget}), flush=True)
    rows = []
    with Testbed(2, subnet="10.213.95", pin=False) as bed:
        bed.shape(rate)
        bed.shape_uplink(rate)
        for name in runs:
            min_nodes, kill = RUNS[name]
            # A killed host must have rounds left to come back to: three times the steps.
            steps = 3 * max_steps if kill else max_steps
            row = host_run(bed, model, rate, min_nodes, kill, away, work, steps)
            row["accounted"] = budget
            row["peak_over_accounted"] = {
                rank: peak / budget["budget_bytes"]
                for rank, peak in row["peak_rss_bytes"].items() if peak}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def hosts_table(rows: list[dict], model: str, rate: str) -> None:
    """Each run's round, all-reduce and sync efficiency; the kill run's time back to work."""
    base = next((r["round_s"] for r in rows if r["run"] == "no min_nodes"), None)
    print_table(
        f"3 hosts at {rate}: DiLoCo H={HOSTS['H']} on the {model} model",
        ("run", "round", "vs without min_nodes", "all-reduce", "MiB per round", "ring bound",
         "sync efficiency", "back to work: host / rank ready", "target",
         "peak RSS / accounted (rank 0, 1, 2)",
         "finished"),
        [(r["run"], f"{r['round_s']:.2f} s" if r["round_s"] else "-",
          f"{r['round_s'] / base:.2f}x" if base and r["round_s"] else "-",
          f"{r['allreduce_s']:.2f} s" if r["allreduce_s"] else "-",
          f"{r['bytes_per_round'] / 2**20:.0f}", f"{r['ring_bound_s']:.2f} s",
          f"{r['efficiency']:.2f}" if r["efficiency"] else "-",
          (f"{r['back_s']:.1f} s / " + (f"{r['ready_to_work_s']:.1f} s (step began "
                                          f"{r['ready_to_first_step_s']:.1f} s)"
                                          if r.get("ready_to_work_s") is not None else "-"))
          if "back_s" in r else "-",
          f"{r['target_s']:.1f} s" if "target_s" in r else "-",
          ", ".join(f"{r['peak_over_accounted'][k]:.2f}x"
                    for k in sorted(r.get("peak_over_accounted", {}))) or "-",
          r["ok"]) for r in rows], width=180)
