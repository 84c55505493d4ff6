"""The flake hunt: the suite run several times under load, in two clones side by side, and
each test's failures counted.

A test that fails by chance is a bug: in the test (a race with its own processes, a port
or folder another test also takes, a sleep that is too short on a loaded machine) or in
the product. The hunt makes the conditions under which such bugs show:

- the committed checkout is cloned ``--clones`` times (2), each with its own virtual
  environment (this interpreter's packages, the clone installed editable), so that two
  suites run side by side on one machine, as two developers' or two CI jobs' would;
- ``--busy`` processes (2) spin on the CPU for the whole hunt;
- ``--rounds`` times (3), the tests are shuffled and split between the clones, which run
  their share at once: every test runs ``--rounds`` times in all, each time beside the
  other clone's tests.

A probe (``bench/flake_hunt/probe.py``) notes which tests started processes, opened
sockets or waited on timers. The table lists every test that failed, with its runs,
failures, what it starts and the first line of its failure; the summary says how many
tests of each kind ran and how often. The figures go to ``--out`` as JSON.

    python -m bench.flake_hunt                      # the whole suite, 3 rounds, 2 clones
    python -m bench.flake_hunt --rounds 1 -- -m "not slow"   # after --: pytest's own options
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
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a clone's round may take before it is stopped (and its tests counted as failed).
ROUND_TIMEOUT_S = 3600


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.flake_hunt",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of every test (3)")
    parser.add_argument("--clones", type=int, default=2, help="suites side by side (2)")
    parser.add_argument("--busy", type=int, default=2,
                        help="processes that spin on the CPU meanwhile (2)")
    parser.add_argument("--seed", type=int, default=None, help="the shuffle's seed")
    parser.add_argument("--keep", action="store_true", help="keep the clones and logs")
    parser.add_argument("--out", type=Path, default=Path("runs/flake_hunt.json"),
                        help="the figures, as JSON (runs/flake_hunt.json)")
    parser.add_argument("pytest_args", nargs="*",
                        help="after --: options for pytest (e.g. -m 'not slow')")
    args = parser.parse_args(argv)
    for name in ("rounds", "clones"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.busy < 0:
        parser.error(f"--busy must be 0 or more, got {args.busy}")
    return args


def make_clone(folder: Path) -> Path:
    """A clone of the committed checkout with a virtual environment of its own: this
    interpreter's packages and the clone installed editable (its `exogym` command, its
    `exogym_distributed`)."""
    subprocess.run(["git", "clone", "--quiet", "--local", "--no-hardlinks", str(ROOT),
                    str(folder)], check=True)
    venv = folder / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                    "--no-deps", "-e", str(folder)], check=True, cwd=folder,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return venv / "bin" / "python"


def collect(python: Path, clone: Path, pytest_args: list[str]) -> list[str]:
    done = subprocess.run([str(python), "-m", "pytest", "--collect-only", "-q", "-n", "0",
                           "-p", "no:cacheprovider", *pytest_args], cwd=clone,
                          capture_output=True, text=True, timeout=600)
    # one test id a line (a parametrized id may hold spaces), then a blank line and a count
    ids = [line for line in done.stdout.splitlines()
           if line.startswith("tests/") and "::" in line]
    if not ids:
        raise SystemExit(f"no test was collected in {clone}:\n{done.stdout[-2000:]}"
                         f"{done.stderr[-2000:]}")
    return ids


def run_share(python: Path, clone: Path, ids: list[str], probe: Path,
              log: Path) -> subprocess.Popen:
    args_file = probe.with_suffix(".args")
    args_file.write_text("\n".join(ids) + "\n")
    env = {**os.environ, "CI": "true", "EXOGYM_FLAKE_PROBE": str(probe)}
    env.pop("PYTHONPATH", None)
    with open(log, "wb") as out:
        return subprocess.Popen([str(python), "-m", "pytest", "-p", "no:cacheprovider",
                                 "-p", "bench.flake_hunt.probe", "-q", f"@{args_file}"],
                                cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def outcomes(probe: Path) -> tuple[dict[str, str | None], dict[str, list[str]]]:
    """Each test the probe saw: None if it passed or was skipped, else its failure's first
    line; and what each started."""
    ended: dict[str, str | None] = {}
    started: dict[str, list[str]] = {}
    if probe.exists():
        for line in probe.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            ended[record["test"]] = record["failure"]
            started[record["test"]] = record["starts"]
    return ended, started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    work = Path(tempfile.mkdtemp(prefix="exogym-flake-hunt-"))
    busy: list[subprocess.Popen] = []
    running: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        print(f"cloning the checkout {args.clones} times into {work} ...", flush=True)
        clones = [work / f"clone{i}" for i in range(args.clones)]
        pythons = [make_clone(c) for c in clones]
        ids = collect(pythons[0], clones[0], args.pytest_args)
        print(f"{len(ids)} tests; {args.rounds} rounds, {args.clones} clones side by side, "
              f"{args.busy} busy processes; seed {seed}", flush=True)
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                 start_new_session=True) for _ in range(args.busy)]
        runs: dict[str, int] = defaultdict(int)
        failures: dict[str, list[str]] = defaultdict(list)
        starts: dict[str, set[str]] = defaultdict(set)
        shuffle = random.Random(seed)
        rounds_s = []
        for round_ in range(1, args.rounds + 1):
            order = list(ids)
            shuffle.shuffle(order)
            shares = [order[i::args.clones] for i in range(args.clones)]
            round_started = time.monotonic()
            running = []
            for i, (clone, python, share) in enumerate(zip(clones, pythons, shares)):
                stem = work / f"round{round_}-clone{i}"
                running.append(run_share(python, clone, share, stem.with_suffix(".probe"),
                                         stem.with_suffix(".log")))
            for proc in running:
                try:
                    proc.wait(timeout=ROUND_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            rounds_s.append(time.monotonic() - round_started)
            for i, share in enumerate(shares):
                stem = work / f"round{round_}-clone{i}"
                ended, started_ = outcomes(stem.with_suffix(".probe"))
                for nodeid in share:
                    runs[nodeid] += 1
                    if nodeid not in ended:
                        failures[nodeid].append(f"round {round_}: no result (stopped?)")
                    elif ended[nodeid] is not None:
                        failures[nodeid].append(f"round {round_}: {ended[nodeid]}")
                    starts[nodeid].update(started_.get(nodeid, ()))
            failed_now = sum(1 for n in ids if any(f.startswith(f"round {round_}:")
                                                    for f in failures.get(n, ())))
            print(f"round {round_}: {rounds_s[-1] / 60:.1f} min, {failed_now} failed",
                  flush=True)
    finally:
        for proc in [*busy, *running]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    total_s = time.monotonic() - started
    report(ids, runs, failures, starts, rounds_s, total_s, args, seed)
    if args.keep:
        print(f"clones and logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(failures.values()) else 0


def report(ids, runs, failures, starts, rounds_s, total_s, args, seed) -> None:
    from bench.harness.tables import print_table

    kinds = {"processes": 0, "sockets": 0, "timers": 0}
    active = [n for n in ids if starts.get(n)]
    for n in active:
        for kind in starts[n]:
            kinds[kind] += 1
    rows = [(n, runs[n], len(failures[n]), ", ".join(sorted(starts.get(n, ()))) or "-",
             failures[n][0]) for n in sorted(failures) if failures[n]]
    print_table(f"flake hunt: {len(ids)} tests x {args.rounds} rounds, {args.clones} clones "
                f"side by side, {args.busy} busy processes", ["test", "runs", "failed",
                                                              "starts", "first failure"],
                rows or [("(none failed)", "", "", "", "")],
                left=("test", "starts", "first failure"))
    print(f"{len(active)} of {len(ids)} tests started processes, sockets or timers "
          f"(processes {kinds['processes']}, sockets {kinds['sockets']}, timers "
          f"{kinds['timers']}); each ran {args.rounds} times; "
          f"{sum(1 for n in active if failures.get(n))} of them failed at least once")
    print(f"rounds: {', '.join(f'{s / 60:.1f}' for s in rounds_s)} min; "
          f"{total_s / 60:.1f} min in all; seed {seed}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"tests": len(ids), "rounds": args.rounds, "clones": args.clones,
              "busy": args.busy, "seed": seed, "rounds_s": rounds_s, "total_s": total_s,
              "starting": len(active), "kinds": kinds,
              "failures": {n: failures[n] for n in sorted(failures) if failures[n]},
              "runs": {n: runs[n] for n in ids}}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"figures in {args.out}")


if __name__ == "__main__":
    sys.exit(main())
