"""The interrupt hunt: a local run stopped at a random moment, many times, and its trace checked.

A run of ``digits-diloco`` on two simulated nodes (a checkpoint every 5 steps, DiLoCo's
round every 5 steps) is started as a person starts it,
``python cli_typer.py distributed-train digits-diloco ...``, in a folder of its own,
and stopped at a random moment after its first checkpoint: a random delay
(``--max-delay``), then in turn Ctrl-C (SIGINT to its process group), SIGTERM to its
process group (as systemd or SLURM stop a job) and SIGTERM to the command alone (as
``kill PID`` does).

Each run passes when:

- the command exits with 128 + the signal's number and without a traceback, and its
  trace ends with an ``interrupted`` line, with no temporary file left beside it;
- every rank's steps in the trace cover every step up to the newest checkpoint every
  rank holds: the step a ``--resume`` starts after. A step missing there is lost for
  good, since the resumed run starts past it;
- every ``--resume-every``-th run (and every run whose trace lacks a step) is resumed
  to a few steps past that checkpoint, and the resumed timeline
  (:func:`distributed.app.replay.timeline`, as ``replay`` reads it) holds each step from
  1 to its end once, with no gap.

It prints one row per run (signal, delay, checkpoint, last step traced, what was
missing) and a summary line, writes the rows to ``--out`` as JSON, and exits 1 when a
run failed.

    python -m bench.interrupt_hunt --runs 50
    python -m bench.interrupt_hunt --runs 10 --seed 3 --max-delay 0.5 --keep
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.tables import print_table
from exogym.base.io import atomic_write_json

ROOT = Path(__file__).resolve().parents[1]
PROFILE = "digits-diloco"
#: The run's settings: endless unless stopped, short steps, frequent checkpoints.
SETTINGS = ("max_steps=100000", "num_nodes=2", "checkpoint_interval=5", "num_threads=1",
            "val_size=16", "H=5")
#: How each run is stopped, in turn: (signal, to the process group).
STOPS = ((signal.SIGINT, True), (signal.SIGTERM, True), (signal.SIGTERM, False))
#: Steps a resumed run trains past the checkpoint it resumes from.
RESUMED_STEPS = 5
#: Seconds a run may take to write its first checkpoint, and then to stop.
START_TIMEOUT_S, STOP_TIMEOUT_S = 240, 120


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.interrupt_hunt",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs to interrupt (50)")
    parser.add_argument("--seed", type=int, default=None, help="the delays' seed")
    parser.add_argument("--max-delay", type=float, default=1.5,
                        help="longest wait after the first checkpoint, in seconds (1.5)")
    parser.add_argument("--resume-every", type=int, default=5,
                        help="resume every N-th run and check its timeline (5; 0: only "
                             "runs whose trace lacks a step)")
    parser.add_argument("--keep", action="store_true", help="keep each run's folder")
    parser.add_argument("--out", type=Path, default=Path("runs/interrupt_hunt.json"),
                        help="the rows, as JSON (runs/interrupt_hunt.json)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.max_delay < 0 or args.resume_every < 0:
        parser.error("--max-delay and --resume-every must be 0 or more")
    return args


def command(max_steps: int | None = None, resume: bool = False) -> list[str]:
    """The command line of the run (``max_steps`` in place of the endless one)."""
    line = [sys.executable, str(ROOT / "cli_typer.py"), "distributed-train", PROFILE]
    for pair in SETTINGS:
        if max_steps is not None and pair.startswith("max_steps="):
            pair = f"max_steps={max_steps}"
        line += ["--set", pair]
    return line + ["--logger", "none"] + (["--resume"] if resume else [])


def environment() -> dict[str, str]:
    """This process's environment, with this checkout first on the module search path."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "COLUMNS": "400",
            "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def common_checkpoint(folder: Path, ranks: int) -> int:
    """The newest checkpoint step every rank holds (0: none), as ``--resume`` finds it."""
    from exogym.run.checkpoint import list_steps

    root = folder / "checkpoints" / PROFILE
    held = [set(list_steps(root, rank)) for rank in range(ranks)]
    return max(set.intersection(*held), default=0)


def traced_steps(lines: list[dict[str, Any]]) -> dict[int, set[int]]:
    """Each rank's steps in a trace (``steps`` blocks opened)."""
    steps: dict[int, set[int]] = {}
    for line in lines:
        if line.get("kind") == "step":
            steps.setdefault(line["rank"], set()).add(line["step"])
        elif line.get("kind") == "steps":
            steps.setdefault(line["rank"], set()).update(range(line["first"], line["last"] + 1))
    return steps


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in path.read_text().splitlines() if text.strip()] \
        if path.is_file() else []


def interrupt(cwd: Path, signum: int, group: bool, delay: float) -> tuple[int | None, str]:
    """Start the run in ``cwd``, stop it ``delay`` seconds after its first checkpoint;
    its exit code (None: it did not stop) and stderr."""
    checkpoints = cwd / "runs" / PROFILE / "checkpoints" / PROFILE / "rank0"
    log = cwd / "stderr.txt"  # a file, not a pipe: nothing waits on a reader
    with open(log, "w") as err:
        proc = subprocess.Popen(command(), cwd=cwd, env=environment(), stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any(checkpoints.glob("*.ckpt")):
            if proc.poll() is not None:
                return proc.returncode, log.read_text() + "\n(ended before a checkpoint)"
            if time.monotonic() > deadline:
                return None, f"no checkpoint in {START_TIMEOUT_S} s"
            time.sleep(0.02)
        time.sleep(delay)
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        try:
            return proc.wait(STOP_TIMEOUT_S), log.read_text()
        except subprocess.TimeoutExpired:
            return None, f"still running {STOP_TIMEOUT_S} s after the signal"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def resumed_gaps(cwd: Path, checkpoint: int) -> str:
    """Resume the run to a few steps past ``checkpoint``; what its timeline lacks or has
    twice ('' when each step is there once)."""
    from distributed.app.replay import load_recording, timeline

    end = checkpoint + RESUMED_STEPS
    done = subprocess.run(command(max_steps=end, resume=True), cwd=cwd, env=environment(),
                          capture_output=True, text=True, timeout=START_TIMEOUT_S)
    if done.returncode != 0:
        return f"resume exit {done.returncode}: {done.stderr.strip()[-300:]}"
    recording = load_recording(cwd / "runs" / PROFILE)
    real = timeline(recording.lines, recording.round_steps, recording.num_nodes)
    steps = sorted(real.times)
    gaps = sorted(set(range(1, end + 1)) - set(steps))
    if gaps or steps != list(range(1, end + 1)):
        return f"resumed timeline lacks {gaps}" if gaps else "resumed timeline has extra steps"
    return ""


def one_run(index: int, signum: int, group: bool, delay: float, resume: bool,
            keep: bool) -> dict[str, Any]:
    """Interrupt one run and check what it left; its row."""
    cwd = Path(tempfile.mkdtemp(prefix=f"interrupt-hunt{index}-"))
    folder = cwd / "runs" / PROFILE
    problems: list[str] = []
    missing: list[str] = []
    started = time.monotonic()
    code, err = interrupt(cwd, signum, group, delay)
    if code != 128 + signum:
        problems.append(f"exit {code}: {err.strip()[-300:]}")
    elif "Traceback" in err:
        problems.append("a traceback: " + err.strip()[-300:])
    lines = read_lines(folder / "trace.jsonl")
    if not lines or lines[-1].get("kind") != "end" or lines[-1].get("error") != "interrupted":
        problems.append(f"trace ends with {lines[-1] if lines else 'nothing'}")
    left = [p.name for p in cwd.rglob("*.tmp")]
    if left:
        problems.append(f"left {left}")
    checkpoint = common_checkpoint(folder, 2)
    steps = traced_steps(lines)
    for rank in range(2):
        lacking = sorted(set(range(1, checkpoint + 1)) - steps.get(rank, set()))
        if lacking:
            missing.append(f"rank {rank}: {lacking[:5]}{'...' if len(lacking) > 5 else ''}")
    if (resume or missing) and not problems and checkpoint:
        gap = resumed_gaps(cwd, checkpoint)
        if gap:
            problems.append(gap)
    if not keep:
        shutil.rmtree(cwd, ignore_errors=True)
    last = max((max(s) for s in steps.values() if s), default=0)
    return {"run": index, "signal": signal.Signals(signum).name,
            "to": "group" if group else "process", "delay_s": round(delay, 3),
            "checkpoint": checkpoint, "last_traced": last, "resumed": bool(resume or missing),
            "missing": missing, "problems": problems, "seconds": round(time.monotonic() - started, 1),
            "folder": str(cwd) if keep else None}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Started in the background (``&``), a shell sets SIGINT to be ignored, and the runs
    # would inherit that: Ctrl-C would never reach them. A handler of this process's own
    # becomes the default in theirs.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    draw = random.Random(seed)
    rows = []
    for index in range(args.runs):
        signum, group = STOPS[index % len(STOPS)]
        resume = args.resume_every > 0 and index % args.resume_every == 0
        row = one_run(index, signum, group, draw.uniform(0, args.max_delay), resume, args.keep)
        rows.append(row)
        verdict = "FAIL" if row["missing"] or row["problems"] else "ok"
        print(f"run {index}: {row['signal']} to the {row['to']} after {row['delay_s']} s, "
              f"checkpoint {row['checkpoint']}, last step traced {row['last_traced']}: "
              f"{verdict} ({row['seconds']} s)", flush=True)
    failed = [r for r in rows if r["missing"] or r["problems"]]
    print_table(f"interrupt hunt: {len(rows)} runs, seed {seed}",
                ["run", "signal", "to", "delay s", "checkpoint", "last traced", "resumed",
                 "missing", "problem"],
                [(r["run"], r["signal"], r["to"], r["delay_s"], r["checkpoint"],
                  r["last_traced"], "yes" if r["resumed"] else "", "; ".join(r["missing"]),
                  "; ".join(r["problems"])[:120]) for r in rows],
                left={"signal", "to", "missing", "problem"}, width=200)
    by_signal = {}
    for r in rows:
        key = f"{r['signal']} to the {r['to']}"
        runs, fails = by_signal.get(key, (0, 0))
        by_signal[key] = (runs + 1, fails + (r in failed))
    print_table("by signal", ["stop", "runs", "failed", "lost a step"],
                [(k, n, f, sum(1 for r in rows if f"{r['signal']} to the {r['to']}" == k
                               and r["missing"])) for k, (n, f) in by_signal.items()],
                left={"stop"}, width=200)
    print(f"{len(rows)} runs, {len(failed)} failed, "
          f"{sum(1 for r in rows if r['missing'])} lost a step to the trace, "
          f"{sum(1 for r in rows if r['resumed'])} resumed; seed {seed}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, {"seed": seed, "max_delay_s": args.max_delay, "rows": rows})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
