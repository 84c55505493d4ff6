"""``python -m bench.real_size``: the command line (see the package's docstring)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import bench.real_size
from bench.real_size import HOSTS, MODELS, SIM
from bench.real_size.hosts import RUNS, hosts_part, hosts_table
from bench.real_size.sim import sim, sim_tables


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.real_size",
                                     description=bench.real_size.__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", choices=["sim", "hosts"])
    parser.add_argument("--models", nargs="+", default=["23m"], choices=sorted(MODELS),
                        help="models simulated (default 23m)")
    parser.add_argument("--nodes", nargs="+", type=int, default=[2, 4, 8],
                        help="ranks simulated (default 2 4 8)")
    parser.add_argument("--gym", type=Path, default=None,
                        help="a checkout of https://github.com/exo-explore/gym to compare with")
    parser.add_argument("--host-model", default="124m", choices=sorted(MODELS))
    parser.add_argument("--rate", default="1gbit", help="every host's link (default 1gbit)")
    parser.add_argument("--away", type=float, default=10.0,
                        help="seconds the killed host stays away (default 10)")
    parser.add_argument("--host-steps", type=int, default=HOSTS["max_steps"],
                        help="steps of a run across hosts (the kill run: three times as many)")
    parser.add_argument("--host-runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                        help="runs across hosts: plain (without min_nodes), min_nodes, kill")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args(argv)
    if args.gym is not None:
        if not (args.gym / "exogym" / "trainer.py").is_file():
            raise SystemExit(f"--gym {args.gym}: no exogym/run/trainer.py there; clone "
                             "https://github.com/exo-explore/gym and give its folder")
        tried = subprocess.run([sys.executable, "-c", "import exogym.run.trainer"], cwd=args.gym,
                               env=dict(os.environ, PYTHONPATH=str(args.gym)),
                               capture_output=True, text=True)
        if tried.returncode != 0:
            raise SystemExit(f"--gym {args.gym}: its exogym does not import here "
                             f"({tried.stderr.strip().splitlines()[-1]}); install what it "
                             "needs (einops, at least: pip install einops)")
    work = Path(tempfile.mkdtemp(prefix="real-size-"))
    print(f"logs in {work}", flush=True)
    report: dict[str, Any] = {"cores": os.cpu_count(), "sim_workload": SIM,
                              "host_workload": HOSTS}
    if "sim" in args.parts:
        report["sim"] = sim(args.models, args.nodes, args.gym, work)
        sim_tables(report["sim"])
    if "hosts" in args.parts:
        report["hosts"] = hosts_part(args.host_model, args.rate, args.away, work,
                                     args.host_steps, args.host_runs)
        hosts_table(report["hosts"], args.host_model, args.rate)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"figures in {args.json}")


if __name__ == "__main__":
    main()
