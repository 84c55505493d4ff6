"""How long `setup-hosts` takes to make fresh hosts ready, and to check them again.

Hosts are the network-namespace bed's (each its own network, sshd and an empty
project folder; only the system's python3 there). This machine is the master. Three
runs of `python cli_typer.py setup-hosts`:

1. fresh: each host gets the project and a new environment (no index reaches the
   namespaces, so the wheels are downloaded here once and sent);
2. again with nothing changed;
3. after a code change (one file's time stamp moved): only that file travels.

`--cold` also empties this machine's wheel and pip caches for the first run (a fresh
machine: everything downloaded again). Run from the project root:

    python -m bench.setup_hosts
    python -m bench.setup_hosts --hosts 3 --cold
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from bench.harness import ROOT
from bench.harness.session import on_bed
from bench.harness.tables import print_table

TOUCHED = "distributed/hosts/provision.py"


def setup_once(bed, hosts_file: Path, env: dict[str, str]) -> tuple[float, dict]:
    """One `setup-hosts` run: its wall seconds and its JSON outcome."""
    command = [sys.executable, "cli_typer.py", "setup-hosts", str(hosts_file), "--python",
               "/usr/bin/python3", "--known-hosts", str(bed.known_hosts), "--ssh-config",
               str(bed.ssh_config), "--json"]
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(f"setup-hosts failed (exit {done.returncode}):\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return wall, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.setup_hosts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=3, help="namespace hosts (default 3)")
    parser.add_argument("--cold", action="store_true",
                        help="empty this machine's wheel and pip caches for the first run")
    args = parser.parse_args()
    console = Console(width=150)

    def body(bed) -> int:
        folder = Path(tempfile.mkdtemp(prefix="bench-setup-"))
        try:
            return measure(bed, folder)
        finally:  # each host's environment holds a torch: gigabytes
            shutil.rmtree(folder, ignore_errors=True)

    def measure(bed, folder: Path) -> int:
        env = {**os.environ, "CI": "true"}
        if args.cold:
            env["XDG_CACHE_HOME"] = str(folder / "cache")
        master = bed.uplink_address
        config = {"master": {"host": master, "python_env": sys.executable,
                             "project_path": str(ROOT)},
                  "workers": [{"host": h.address, "project_path": str(folder / f"host{i}")}
                              for i, h in enumerate(bed.hosts)],
                  "ssh_user": "root", "ssh_key_path": str(bed.key_path), "master_port": 29581}
        hosts_file = folder / "hosts.json"
        hosts_file.write_text(json.dumps(config, indent=2))
        rows = []
        first_wall, first = setup_once(bed, hosts_file, env)
        rows.append(("fresh hosts", first_wall, first))
        env.pop("XDG_CACHE_HOME", None)
        again_wall, again = setup_once(bed, hosts_file, env)
        rows.append(("nothing changed", again_wall, again))
        touched = ROOT / TOUCHED
        os.utime(touched)
        change_wall, change = setup_once(bed, hosts_file, env)
        rows.append((f"{TOUCHED} changed", change_wall, change))
        table = []
        for name, wall, outcome in rows:
            hosts = outcome["hosts"]
            per_host = wall / max(1, len(hosts))
            steps: dict[str, float] = {}
            for h in hosts:
                for k, v in h["steps"].items():
                    steps[k] = max(steps.get(k, 0.0), v)
            table.append((name, f"{wall:.1f} s", f"{per_host:.1f} s",
                          str(max((h["files_copied"] for h in hosts), default=0)),
                          ", ".join(sorted({h["environment"] for h in hosts})),
                          ", ".join(f"{k} {v:.1f}" for k, v in steps.items()) or "-"))
        print_table(f"setup-hosts on {len(bed.hosts)} namespace hosts"
                    + (" (cold caches first)" if args.cold else ""),
                    ["run", "wall", "per host", "files copied (max)", "environment",
                     "slowest host's steps (s)"], table, console=console)
        return 0

    return on_bed("python -m bench.setup_hosts", body, hosts=args.hosts, subnet="10.213.43",
                  pin=False)


if __name__ == "__main__":
    sys.exit(main())
