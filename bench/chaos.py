"""A chaos soak: a real run across hosts under random faults, checked from the outside.

Three hosts, each a network namespace with an sshd of its own (:mod:`tests.netbed`);
the launcher runs in the first one, the master (``min_nodes`` keeps the run's store
in the launcher, on the master). DiLoCo on digits with ``min_nodes=2``, started as a
person would, ``python cli_typer.py distributed-train ... --inject-random SEED --every
30s``: a fault every 20-40 s, drawn from the seed (kill, freeze, slow, and cut where the
hosts permit it: here both workers, with nftables or iptables installed).

It checks and prints:

- that the run exits 0;
- that no process is left in any host's namespace but its sshd, no rank process
  anywhere, no cut's firewall table, and, once the bed is taken down, no namespace,
  link or folder of it;
- the faults that fired (kind, host, step, time) and the membership changes;
- the final validation loss against a fault-free run of the same samples (same
  steps, same seed, same hosts), run first.

The duration (``--seconds``, default 300) sets the run's steps: a short calibration
run measures the steps per second of the three hosts, and both runs get that rate
times the duration.

Then the soak is replayed in the simulator (``python cli_typer.py replay RUN_DIR
--json``, :mod:`distributed.app.replay`) from its trace (every fault marked
``"injected": true``), and the replay's total time is compared with the real
one (target: within 15%). The trace and ``chaos.json``, the figures printed
here, are kept in the output folder (``--out``).

    python -m bench.chaos                      # 5 minutes
    python -m bench.chaos --seconds 90 --seed 3

Needs root, iproute2, sshd and (for cuts) nftables or iptables: ``tests/setup_system.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.harness.tables import print_table
from exogym.base.io import atomic_write_text
from tests.netbed import Testbed, check_requirements, free_port, worker_pid

PROJECT_ROOT = Path(__file__).resolve().parents[1]
#: The run's settings, beside max_steps and output_dir.
SETTINGS = ("val_interval=1000", "val_size=512", "num_threads=1", "checkpoint_interval=None",
            "num_nodes=3", "lr_scheduler=cosine", "seed=1")
#: Steps of the calibration run.
CALIBRATION_STEPS = 3000


def train(bed: Testbed, folder: Path, name: str, max_steps: int, extra: list[str],
          timeout: float, min_nodes: int = 2, profile: str = "digits-diloco") -> dict[str, Any]:
    """One run of the command line in the master's namespace (``profile`` of config.ini);
    its exit code, wall time, summary, trace lines and output."""
    config = bed.hosts_config(free_port())
    hosts = folder / f"{name}-hosts.json"
    hosts.write_text(json.dumps(config))
    out = folder / name
    command = [sys.executable, "cli_typer.py", "distributed-train", profile,
               "--hosts", str(hosts), "--min-nodes", str(min_nodes), "--lost-after", "5",
               "--known-hosts", str(bed.known_hosts), "--ssh-config", str(bed.ssh_config),
               "--run-dir", str(folder / f"{name}-logs"), *extra]
    for pair in (f"max_steps={max_steps}", *SETTINGS, f"output_dir={out}"):
        command += ["--set", pair]
    master = bed.hosts[0]
    started = time.monotonic()
    try:
        done = subprocess.run(bed.in_host(master, *command), cwd=PROJECT_ROOT,
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "CI": "true"})
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        output = f"{exc.stdout or ''}{exc.stderr or ''}\n(stopped after {timeout:.0f} s)"
    wall = time.monotonic() - started
    summary_path, trace_path = out / "summary.json", out / "trace.jsonl"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    trace = [json.loads(line) for line in trace_path.read_text().splitlines()] \
        if trace_path.is_file() else []
    if os.environ.get("BENCH_DEBUG"):
        sys.stderr.write(output[-20000:])
    return {"name": name, "exit_code": code, "wall_s": wall, "summary": summary,
            "trace": trace, "trace_path": str(trace_path), "output": output}


def steps_per_second(run: dict[str, Any]) -> float:
    """Rank 0's steady rate in a run, from its trace's step lines (the first tenth left out)."""
    lines = [(x["step"], x["wall_s"]) for x in run["trace"]
             if x["kind"] == "step" and x["rank"] == 0 and "wall_s" in x]
    if len(lines) < 20:
        raise RuntimeError(f"the calibration run reported {len(lines)} steps: "
                           f"{run['output'][-2000:]}")
    (s0, t0), (s1, t1) = lines[len(lines) // 10], lines[-1]
    return (s1 - s0) / max(1e-6, t1 - t0)


def leftovers(bed: Testbed, marker: str) -> list[str]:
    """What the run left on the bed: processes in the hosts' namespaces other than their
    sshds, rank processes anywhere, firewall tables of cuts."""
    found = []
    for host in bed.hosts:
        for pid in bed.pids(host):
            if host.sshd is not None and pid == host.sshd.pid:
                continue
            try:
                what = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            found.append(f"process {pid} in {host.namespace}: {what.decode()[:100]}")
        tables = subprocess.run(bed.in_host(host, "nft", "list", "tables"), capture_output=True,
                                text=True).stdout if _has("nft") else ""
        found += [f"firewall {line.strip()} in {host.namespace}" for line in tables.splitlines()
                  if "exogym_cut" in line]
    found += [f"rank {rank} process {pid}" for rank in range(3)
              if (pid := worker_pid(rank, marker)) is not None]
    return found


def replay(run_dir: Path, timeout: float) -> dict[str, Any]:
    """``cli_typer.py replay RUN_DIR --json`` of a run: the simulator's account of it, with
    the recorded one (its ``real`` and ``replay`` entries), or ``{"error": ...}``."""
    try:
        done = subprocess.run([sys.executable, "cli_typer.py", "replay", str(run_dir), "--json"],
                              cwd=PROJECT_ROOT, capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "CI": "true"})
    except subprocess.TimeoutExpired:
        return {"error": f"the replay did not finish in {timeout:.0f} s"}
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-3000:]}
    return json.loads(done.stdout)


def _has(tool: str) -> bool:
    from shutil import which

    return which(tool) is not None


def fault_rows(run: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per injected fault of a run's summary."""
    rows = []
    for f in run["summary"].get("faults") or []:
        what = f["what"] + (f" x{f['factor']:g}" if f.get("factor") else "") + (
            f" +{f['duration_s']:g}s" if f.get("duration_s") is not None else "")
        fired = "-" if f.get("fired_at_s") is None else \
            f"step {f['fired_step']}, {f['fired_at_s']:.1f} s"
        rows.append((str(f["id"]), what, f["host"], fired, f.get("outcome", "")))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0,
                        help="how long the soak runs, about (default 300)")
    parser.add_argument("--seed", type=int, default=1, help="the faults' seed (default 1)")
    parser.add_argument("--every", default="30s",
                        help="the mean time between faults (default 30s: every 20-40 s)")
    parser.add_argument("--subnet", default="10.213.99",
                        help="the bed's /24, three octets (default 10.213.99)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the runs, the chaos trace and chaos.json are kept "
                             "(default: a new folder in the temporary directory)")
    args = parser.parse_args()
    if args.seconds < 30:
        parser.error(f"--seconds {args.seconds:g}: at least 30 (a fault comes every "
                     f"{args.every})")
    missing = check_requirements(pin=False)
    if missing:
        sys.exit("cannot build the test bed:\n  " + "\n  ".join(missing))
    folder = (args.out or Path(tempfile.mkdtemp(prefix="exogym-chaos-"))).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    marker = str(folder)
    timeout = 4 * args.seconds + 600

    with Testbed(3, subnet=args.subnet, pin=False) as bed:
        calibration = train(bed, folder, "calibration", CALIBRATION_STEPS, [], timeout)
        if calibration["exit_code"] != 0:
            sys.exit(f"the calibration run failed (exit {calibration['exit_code']}):\n"
                     f"{calibration['output'][-3000:]}")
        rate = steps_per_second(calibration)
        max_steps = max(2000, int(rate * args.seconds))
        print(f"calibration: {rate:.0f} steps/s on 3 hosts; both runs take {max_steps} steps",
              flush=True)
        baseline = train(bed, folder, "fault-free", max_steps, [], timeout)
        left_baseline = leftovers(bed, marker)
        chaos = train(bed, folder, "chaos", max_steps,
                      ["--inject-random", str(args.seed), "--every", args.every], timeout)
        left_chaos = leftovers(bed, marker)
        tag = bed.tag
    from tests.netbed.stale import bed_stands

    after = [f"namespace of bed {tag}"] if bed_stands(tag) else []
    after += [x for x in (f"link xu{tag}",) if Path(f"/sys/class/net/xu{tag}").exists()]

    twin = replay(Path(chaos["trace_path"]).parent, timeout)
    base_loss = baseline["summary"].get("final_val_global_loss")
    chaos_loss = chaos["summary"].get("final_val_global_loss")
    faults = chaos["summary"].get("faults") or []
    fired = [f for f in faults if f.get("fired_at_s") is not None]
    kinds = Counter(f["what"] for f in fired)
    changes = [x for x in chaos["trace"] if x["kind"] == "membership" and x["reason"] != "start"]
    marked = sum(1 for x in chaos["trace"] if x["kind"] == "fault" and x.get("injected"))
    ratio = chaos_loss / base_loss if base_loss and chaos_loss is not None else None

    print_table(f"chaos soak: seed {args.seed}, a fault every {args.every} (20-40 s for 30s), "
                f"3 namespace hosts, min_nodes=2", ("#", "fault", "host", "fired", "outcome"),
                fault_rows(chaos))
    print(f"chaos run: exit code {chaos['exit_code']}, {chaos['wall_s']:.0f} s, "
          f"{len(fired)} faults fired ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), "
          f"{len(changes)} membership changes, {marked} fault lines marked injected in its trace")
    print(f"fault-free run: exit code {baseline['exit_code']}, {baseline['wall_s']:.0f} s")
    print(f"final validation loss: fault-free {base_loss}, chaos {chaos_loss}" + (
        f", ratio {ratio:.3f}" if ratio is not None else ""))
    replay_ratio = None
    if "error" in twin:
        print(f"replay of the soak: FAILED: {twin['error']}")
    else:
        real_s, replay_s = twin["real"]["wall_s"], twin["replay"]["wall_s"]
        replay_ratio = replay_s / real_s if real_s else None
        print(f"replay of the soak in the simulator: {replay_s:.1f} s against the real "
              f"{real_s:.1f} s" + (f", ratio {replay_ratio:.3f} (target within 15%)"
                                    if replay_ratio is not None else ""))
    problems = left_baseline + left_chaos + after
    print("left behind: " + ("; ".join(problems) if problems else
                             "nothing (no process, no rank, no cut's table, no namespace)"))
    result = {
        "seed": args.seed, "every": args.every, "seconds": args.seconds,
        "steps_per_s": rate, "max_steps": max_steps,
        "fault_free": {"exit_code": baseline["exit_code"], "wall_s": baseline["wall_s"],
                       "val_loss": base_loss, "trace": baseline["trace_path"]},
        "chaos": {"exit_code": chaos["exit_code"], "wall_s": chaos["wall_s"],
                  "val_loss": chaos_loss, "trace": chaos["trace_path"], "faults": faults,
                  "membership": changes},
        "val_loss_ratio": ratio, "left_behind": problems,
        "replay": ({"error": twin["error"]} if "error" in twin else
                   {"real_wall_s": twin["real"]["wall_s"],
                    "replay_wall_s": twin["replay"]["wall_s"], "ratio": replay_ratio}),
    }
    atomic_write_text(folder / "chaos.json", json.dumps(result, indent=2) + "\n")
    print(f"kept in {folder} (chaos.json; the chaos run's trace: {chaos['trace_path']})")
    ok = (chaos["exit_code"] == 0 and baseline["exit_code"] == 0 and not problems and fired
          and "error" not in twin)
    if not ok:
        if chaos["exit_code"] != 0:
            sys.stderr.write(chaos["output"][-4000:])
        sys.exit("chaos soak: FAILED (see above)")
    print("chaos soak: passed")


if __name__ == "__main__":
    main()
