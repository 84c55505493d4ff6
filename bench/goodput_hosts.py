"""Goodput under churn on real hosts: three namespace hosts, each failing once per ``--mtbf``.

Run as root from the project root::

    python -m bench.goodput_hosts                          # DDP, DiLoCo, AsyncDiLoCo
    python -m bench.goodput_hosts --minutes 4 --strategies DiLoCo
    python -m bench.goodput_hosts --task digits            # steps of about a millisecond

Three hosts, each a network namespace with an sshd of its own (:mod:`tests.netbed`),
the launcher in the first (the master: ``min_nodes=2`` keeps the run's store in
the launcher). Each profile of ``config.ini`` (``chargpt-bench`` with each strategy,
H=20 for both DiLoCos, AsyncDiLoCo's workers training on while they wait for a merge
(``keep_training``); with ``--task digits``, ``digits-ddp``, ``digits-diloco`` and
``digits-async``) is started as a person would::

    python cli_typer.py distributed-train PROFILE --hosts ... --min-nodes 2 \\
        --inject-random SEED --mtbf 2m --down 30s --failures kill

so every host fails on average once every two minutes: its rank is killed and
started again 30 s later, and rejoins with the run's state
(:class:`distributed.launch.faults.RandomFaults`; ``--failures freeze,cut``: frozen
or cut off for 30 s instead). Every host is held to an equal share of a core
(``--share``, a cgroup of its own as in :mod:`bench.multihost`; rank 0, which the
launcher starts itself, is moved into the first host's), so that a host trains
alone at the same rate whether the others are up or down. A short fault-free run of
each profile first measures its steps per second, so that the run under
failures lasts about ``--minutes``. Prints the goodput the launcher measured
(``summary.json``'s ``goodput``: :mod:`exogym.report.goodput`), with its parts:
the failures that fired, the time down, samples dropped, the time the hosts
waited in collectives and idled. Wall time. Asserts nothing.

Needs root, iproute2, sshd, the cgroup v1 ``cpu`` controller and (for cuts) nftables or
iptables: ``tests/setup_system.sh``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.chaos import steps_per_second, train
from bench.harness.slow_host import GroupKeeper, cgroup_problems, check_share, equal_share, held_hosts
from bench.harness.tables import print_table
from exogym.base.io import atomic_write_text
from tests.netbed import Testbed, check_requirements

#: For each task, the strategies compared: the name the table gives each, its profile of
#: config.ini and the settings given to it.
_OUTER = ["--set", "H=20", "--set", "outer_lr=0.7", "--set", "outer_momentum=0.9"]
TASKS: dict[str, dict[str, tuple[str, list[str]]]] = {
    "digits": {"DDP": ("digits-ddp", []), "DiLoCo": ("digits-diloco", []),
               "AsyncDiLoCo": ("digits-async", [])},
    # steps of some 0.5 s here: what a step costs besides its compute counts for little
    "chargpt": {"DDP": ("chargpt-bench", ["--set", "strategy=ddp"]),
                "DiLoCo": ("chargpt-bench", ["--set", "strategy=diloco", *_OUTER]),
                "AsyncDiLoCo": ("chargpt-bench", ["--set", "strategy=async_diloco", *_OUTER,
                                                  "--set", "quorum=0.5",
                                                  "--set", "keep_training=true"])},
}
#: Hosts of the bed; the launcher and rank 0 share the first.
HOSTS = 3
#: Seconds between a keeper's looks at host 0's processes, and at the other hosts'.
KEEP_S, CHECK_S = 0.25, 3.0
#: Steps of each calibration run, by task.
CALIBRATION_STEPS = {"digits": 2000, "chargpt": 200}


def figures(run: dict[str, Any]) -> dict[str, Any]:
    """A run's goodput and its parts, from its ``summary.json``."""
    summary = run["summary"]
    goodput = summary.get("goodput") or {}
    faults = [f for f in summary.get("faults") or [] if f.get("fired_at_s") is not None]
    ranks = goodput.get("ranks") or []
    return {"exit_code": run["exit_code"], "wall_s": run["wall_s"],
            "goodput": goodput.get("goodput"), "time": goodput.get("time"),
            "failures": len(faults), "down_s": goodput.get("down_s"),
            "up_s": goodput.get("up_s"), "dropped": goodput.get("dropped_samples"),
            "useful": goodput.get("useful_samples"),
            "wait_s": sum(r["wait_s"] for r in ranks), "idle_s": sum(r["idle_s"] for r in ranks),
            "changes": len(goodput.get("changes") or []),
            "val_loss": summary.get("final_val_global_loss")}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput_hosts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=6.0,
                        help="how long each run under failures lasts, about (default 6)")
    parser.add_argument("--mtbf", default="2m", help="each host's mean time between failures")
    parser.add_argument("--down", default="30s", help="how long each failure lasts")
    parser.add_argument("--failures", default="kill",
                        help="what each failure is: a comma list of kill, freeze, cut "
                             "(default kill: the rank killed, started again after --down)")
    parser.add_argument("--seed", type=int, default=1, help="the failures' seed (default 1)")
    parser.add_argument("--task", default="chargpt", choices=list(TASKS),
                        help="chargpt (the 3.3M chargpt-bench GPT, steps of some 0.7 s at "
                             "0.55 of a core) or digits (steps of about a millisecond); "
                             "default chargpt")
    parser.add_argument("--strategies", nargs="+", default=["DDP", "DiLoCo", "AsyncDiLoCo"],
                        choices=["DDP", "DiLoCo", "AsyncDiLoCo"])
    parser.add_argument("--share", type=float, default=None,
                        help="fraction of a core every host is held to (default: the largest "
                             "equal share of this machine's cores that leaves a quarter core "
                             "to the launcher; 0.55 on two cores)")
    parser.add_argument("--subnet", default="10.213.98",
                        help="the bed's /24, three octets (default 10.213.98)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a profile setting for every run, after the strategy's own "
                        "(e.g. keep_training=false: AsyncDiLoCo's workers idle while they "
                        "wait for a merge)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the runs and goodput.json are kept (default: a new "
                             "folder in the temporary directory)")
    args = parser.parse_args()
    share = equal_share(HOSTS) if args.share is None else args.share
    try:
        check_share(share, HOSTS)
    except ValueError as exc:
        parser.error(str(exc))
    missing = check_requirements(pin=False) + cgroup_problems()
    if missing:
        sys.exit("cannot build the test bed:\n  " + "\n  ".join(missing))
    folder = (args.out or Path(tempfile.mkdtemp(prefix="exogym-goodput-"))).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    seconds = args.minutes * 60
    timeout = 4 * seconds + 600
    results: dict[str, dict[str, Any]] = {}
    with Testbed(HOSTS, subnet=args.subnet, pin=False) as bed, held_hosts(bed, share) as groups:
        print(f"{HOSTS} hosts, each held to {share:g} of a core (cgroup cpu quota)", flush=True)

        def held_run(name: str, steps: int, extra: list[str], profile: str) -> dict[str, Any]:
            # rank 0 is the launcher's child, born outside host 0's group: a keeper moves it
            # (and its restarts) in; the other hosts' ranks are born in theirs, which a
            # keeper looking seldom only checks (each look starts a process)
            with ExitStack() as stack:
                keepers = [stack.enter_context(GroupKeeper(bed, host, group,
                                                           KEEP_S if i == 0 else CHECK_S))
                           for i, (host, group) in enumerate(zip(bed.hosts, groups))]
                run = train(bed, folder, name, steps, extra, timeout, profile=profile)
            escaped = sum(k.moved for k in keepers[1:])
            if escaped:
                print(f"  {name}: {escaped} rank process(es) of hosts 1-{HOSTS - 1} started "
                      "outside their host's group (moved in)", flush=True)
            return run

        for name in args.strategies:
            profile, settings = TASKS[args.task][name]
            settings = [*settings, *(part for given in args.set for part in ("--set", given))]
            label = f"{args.task}-{name.lower()}"
            calibration = held_run(f"{label}-calibration", CALIBRATION_STEPS[args.task],
                                   settings, profile)
            if calibration["exit_code"] != 0:
                sys.exit(f"the calibration run of {profile} failed (exit "
                         f"{calibration['exit_code']}):\n{calibration['output'][-3000:]}")
            rate = steps_per_second(calibration)
            steps = max(CALIBRATION_STEPS[args.task], int(rate * seconds))
            free = figures(calibration)["goodput"]
            print(f"{name}: {rate:.3g} steps/s fault-free (goodput "
                  f"{'-' if free is None else format(free, '.3f')}); {steps} steps under "
                  "failures", flush=True)
            run = held_run(label, steps,
                           [*settings, "--inject-random", str(args.seed), "--mtbf", args.mtbf,
                            "--down", args.down, "--failures", args.failures], profile)
            results[name] = {"steps": steps, "steps_per_s": rate,
                             "fault_free": figures(calibration), **figures(run)}
            if run["exit_code"] != 0:
                sys.stderr.write(run["output"][-4000:])

    def cell(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = []
    for name, r in results.items():
        down = r["down_s"] / (r["up_s"] + r["down_s"]) if r["up_s"] else None
        rows.append([name, str(r["exit_code"]), str(r["steps"]), f"{r['wall_s']:.0f} s",
                     str(r["failures"]), cell(down, ".1%"),
                     cell(r["fault_free"]["goodput"], ".3f"), cell(r["goodput"], ".3f"),
                     cell(r["dropped"], ""), f"{r['wait_s']:.0f} s", f"{r['idle_s']:.0f} s",
                     cell(r["val_loss"], ".4f")])
    print_table(f"Goodput on {HOSTS} namespace hosts ({args.task}), each held to {share:g} of "
                f"a core and failing ({args.failures}) once per {args.mtbf}, down {args.down} "
                f"(seed {args.seed}, min_nodes=2, wall time)",
                ["strategy", "exit", "steps", "wall", "failures", "time down",
                 "goodput fault-free", "goodput", "samples dropped", "in collectives", "idle",
                 "val loss"], rows, left=("strategy",), width=200)
    settings = {"task": args.task, "hosts": HOSTS, "share": share, "mtbf": args.mtbf,
                "down": args.down, "failures": args.failures, "seed": args.seed,
                "minutes": args.minutes}
    atomic_write_text(folder / "goodput.json",
                      json.dumps({"settings": settings, "runs": results}, indent=2) + "\n")
    print(f"kept in {folder} (goodput.json, each run's folder and trace)")


if __name__ == "__main__":
    main()
