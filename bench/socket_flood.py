"""What a flood of idle connections costs a dashboard's process: threads, descriptors, memory.

A dashboard (``--web``) serves from inside the process that trains. This starts
one (a :class:`distributed.app.web.WebDashboard` on loopback, in a process of its
own), opens idle connections to it that never send a byte, from one address
(``127.0.0.2``) and then from many (``127.0.0.2`` upwards, a few each), and prints
the server process's threads, open descriptors and resident memory after each
wave, and again once the server's request time has passed. Then whether a
request from another address (``127.0.0.1``) is still answered, and in how long.

Twice: with the server's bounds (``distributed/app/web/connection_limits.py``) as shipped,
and with them lifted (as the server was before them: a thread for every
connection, waiting for ever). Figures are printed, nothing is asserted.

Run from the project root::

    python -m bench.socket_flood
    python -m bench.socket_flood --connections 500 1000 3000
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.harness.tables import print_table

ROOT = Path(__file__).resolve().parents[1]
#: A dashboard in a process of its own; prints its port, then serves until stdin closes.
SERVER = """
import json, sys
from distributed.app.web.connection_limits import Limits
from distributed.app.web.server import WebDashboard
limits = Limits(**json.loads(sys.argv[1]))
with WebDashboard("127.0.0.1", 0, limits=limits) as web:
    print(web.port, flush=True)
    sys.stdin.read()
"""
LIFTED = {"per_address": 10**9, "total": 10**9, "request_s": 1e6, "idle_s": 1e6}


def process_figures(pid: int) -> tuple[int, int, float]:
    """Threads, open descriptors and resident MiB of process ``pid`` (Linux ``/proc``)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    threads = int(fields["Threads"])
    rss_mib = int(fields["VmRSS"].split()[0]) / 1024
    return threads, len(os.listdir(f"/proc/{pid}/fd")), rss_mib


def flood(port: int, count: int, sources: list[str]) -> list[socket.socket]:
    """``count`` idle connections to ``port``, spread over ``sources`` in turn."""
    held = []
    for i in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.bind((sources[i % len(sources)], 0))
        try:
            sock.connect(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        held.append(sock)
    return held


def timed_get(port: int) -> str:
    began = time.perf_counter()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/state", timeout=10) as answer:
            answer.read()
            return f"{answer.status} in {(time.perf_counter() - began) * 1e3:.0f} ms"
    except OSError as exc:
        return f"failed after {time.perf_counter() - began:.1f} s: {exc}"


def measure(bounds: dict, counts: list[int], addresses: int, settle_s: float) -> list[list]:
    server = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(bounds)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = []
    held: list[socket.socket] = []
    try:
        port = int(server.stdout.readline())
        threads, fds, rss = process_figures(server.pid)
        rows.append(["none", 0, "-", threads, fds, f"{rss:.1f}", timed_get(port)])
        many = [f"127.0.0.{2 + i}" for i in range(addresses)]
        for count in counts:
            for label, sources in (("one address", many[:1]), (f"{addresses} addresses", many)):
                began = time.perf_counter()
                held += flood(port, count, sources)
                opened_s = time.perf_counter() - began
                time.sleep(0.3)
                threads, fds, rss = process_figures(server.pid)
                rows.append([label, count, f"{opened_s:.1f}", threads, fds, f"{rss:.1f}",
                             timed_get(port)])
                for sock in held:
                    sock.close()
                held.clear()
                time.sleep(0.5)
        held += flood(port, counts[-1], many)
        time.sleep(settle_s)
        threads, fds, rss = process_figures(server.pid)
        rows.append([f"{addresses} addresses, {settle_s:g} s later", counts[-1], "-", threads,
                     fds, f"{rss:.1f}", timed_get(port)])
    finally:
        for sock in held:
            sock.close()
        server.stdin.close()
        server.wait(timeout=30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, nargs="+", default=[500, 3000],
                        help="idle connections of each wave")
    parser.add_argument("--addresses", type=int, default=100,
                        help="source addresses of the many-address waves (127.0.0.2 up)")
    args = parser.parse_args()
    shipped = {}
    from distributed.app.web.connection_limits import Limits

    settle_s = Limits().request_s + 1.0
    for title, bounds in (("bounds as shipped", shipped), ("bounds lifted (as before)", LIFTED)):
        rows = measure(bounds, args.connections, args.addresses, settle_s)
        print_table(f"a dashboard under idle connections: {title}",
                    ["from", "connections", "s to open", "threads", "descriptors", "RSS MiB",
                     "a request from 127.0.0.1"], rows, left=["from", "a request from 127.0.0.1"],
                    width=120)


if __name__ == "__main__":
    main()
