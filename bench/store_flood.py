"""What a stranger's flood costs the process that hosts a run's store, with and without its front.

A run across hosts hosts its store in the launcher (or rank 0), where anyone on the
LAN can reach it. This starts such a store (``open_store(..., key=...)`` on loopback,
in a process of its own, standing in for the launcher) and floods it as the security
review did:

1. **values**: ``--values`` values of 7 MiB, each on a connection of its own that
   completed torch's client handshake, as fast as the store takes them;
2. **idle connections**: ``--addresses`` processes (2; each under its own descriptor
   limit) that open ``--idle`` connections each from an address of their own
   (``127.0.0.2``, ``127.0.0.3``, ...) and hold them, sending nothing; with
   ``--handshake``, nothing after torch's client handshake (the front then closes them
   once its proof time has passed: they never write what the run signed).

After each it prints the store process's resident memory, open descriptors and
threads, and whether a client of the run (a new connection, with the run's key, as
a rank restarted after a loss makes) still sets and reads a value, and in how long.
Then the idle connections are held until the front's handshake time has passed, and
the figures printed again. Last, the round trip of one store call (a signed read)
from a client of the run, through the front and to the server directly.

A holder stops at the first connection that cannot be made within 5 s (a server
that no longer accepts fills its backlog); it says how many it made.

Twice: with the front (``exogym/comm/store_front.py``) as shipped, and without it
(torch's server on the public address, as before; ``--only`` picks one). Figures
are printed, nothing is asserted. Without the front, torch's server accepts
thousands of connections slowly on a busy machine: ``--idle 2000`` gives its
figures in minutes.

Run from the project root::

    python -m bench.store_flood
    python -m bench.store_flood --values 300 --idle 10200 --only front
    python -m bench.store_flood --values 300 --idle 2000 --only none
    python -m bench.store_flood --values 0 --idle 256 --addresses 8 --handshake --only front
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from bench.harness.tables import print_table

ROOT = Path(__file__).resolve().parents[1]
#: A store across hosts in a process of its own; prints its port, serves until stdin closes.
HOST = """
import sys
from exogym.comm.store import open_store
store = open_store("127.0.0.1", 0, is_master=True, timeout_s=30, key=bytes.fromhex(sys.argv[1]),
                   front=sys.argv[2] == "front")
print(store.port, flush=True)
sys.stdin.read()
"""
#: Holds idle connections from one address; prints how many it opened, holds them until
#: stdin closes.
HOLDER = """
import socket, struct, sys
port, count, source, handshake = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
held = []
for _ in range(count):
    sock = socket.socket()
    sock.settimeout(5)
    sock.bind((source, 0))
    try:
        sock.connect(("127.0.0.1", port))
        if handshake == "yes":  # torch's client handshake: validate, then ping
            sock.sendall(b"\\x00" + struct.pack("<I", 0x3C85F7CE) + b"\\x0d" + struct.pack("<I", 1))
            if len(sock.recv(4)) != 4:
                raise OSError("closed")
    except OSError:
        sock.close()
        break
    held.append(sock)
print(len(held), flush=True)
sys.stdin.read()
"""
MAGIC = 0x3C85F7CE
MIB = 1024 * 1024


def process_figures(pid: int) -> tuple[float, int, int]:
    """Resident MiB, open descriptors and threads of process ``pid`` (Linux ``/proc``)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return (int(fields["VmRSS"].split()[0]) / 1024, len(os.listdir(f"/proc/{pid}/fd")),
            int(fields["Threads"]))


def send_values(port: int, count: int, size: int) -> tuple[int, float]:
    """``count`` values of ``size`` bytes, each on a fresh connection past the handshake:
    (how many the store took whole, seconds)."""
    payload = b"x" * size
    taken = 0
    began = time.perf_counter()
    for i in range(count):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(b"\x00" + struct.pack("<I", MAGIC) + b"\x0d" + struct.pack("<I", 1))
                sock.recv(4)
                key = f"/flood/{i}".encode()
                sock.sendall(b"\x01" + struct.pack("<Q", len(key)) + key
                             + struct.pack("<Q", size) + payload + b"\x07")
                if len(sock.recv(8)) == 8:
                    taken += 1
        except OSError:
            pass
    return taken, time.perf_counter() - began


def client_check(port: int, key: bytes, timeout_s: float = 20) -> str:
    """Whether a new client of the run sets and reads a value, and in how long."""
    began = time.perf_counter()
    try:
        from exogym.comm.store import open_store

        store = open_store("127.0.0.1", port, timeout_s=timeout_s, key=key)
        store.set("exogym/bench/probe", "1")
        assert store.get("exogym/bench/probe") == b"1"
        return f"yes, in {(time.perf_counter() - began) * 1e3:.0f} ms"
    except Exception as exc:  # noqa: BLE001 - reported
        return f"no, after {time.perf_counter() - began:.1f} s ({str(exc).splitlines()[0][:60]})"


def round_trip_us(port: int, key: bytes, calls: int = 3000) -> float:
    from exogym.comm.store import open_store

    store = open_store("127.0.0.1", port, timeout_s=10, key=key)
    store.set("exogym/bench/rt", "1")
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        for _ in range(calls):
            store.get_if_set("exogym/bench/rt")
        best = min(best, (time.perf_counter() - began) / calls * 1e6)
    return best


def measure(front: bool, values: int, idle: int, settle_s: float, addresses: int = 2,
            handshake: bool = False) -> tuple[list[list], float]:
    key = os.urandom(32)
    host = subprocess.Popen([sys.executable, "-c", HOST, key.hex(),
                             "front" if front else "none"], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows: list[list] = []
    holders: list[subprocess.Popen] = []

    def row(what: str, extra: str = "-") -> None:
        rss, fds, threads = process_figures(host.pid)
        rows.append([what, extra, f"{rss:.0f}", fds, threads, client_check(port, key)])

    try:
        port = int(host.stdout.readline())
        trip = round_trip_us(port, key)
        row("none")
        taken, seconds = send_values(port, values, 7 * MIB)
        row(f"{values} values of 7 MiB", f"{taken} stored, in {seconds:.1f} s")
        opened = []
        for source in range(2, 2 + addresses):
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(port), str(idle),
                                       f"127.0.0.{source}", "yes" if handshake else "no"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            holders.append(holder)
            opened.append(holder.stdout.readline().strip())
        time.sleep(0.5)
        past = " past the handshake" if handshake else ""
        row(f"{addresses} x {idle} idle connections{past}", f"{' + '.join(opened)} connected")
        time.sleep(settle_s)
        row(f"  ... {settle_s:g} s later, still held")
    finally:
        for holder in holders:
            holder.stdin.close()
            holder.wait(timeout=60)
        host.stdin.close()
        host.wait(timeout=60)
    return rows, trip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=300, help="values of 7 MiB sent")
    parser.add_argument("--idle", type=int, default=10200,
                        help="idle connections from each of two addresses")
    parser.add_argument("--addresses", type=int, default=2,
                        help="addresses the idle connections come from (127.0.0.2 and up)")
    parser.add_argument("--handshake", action="store_true",
                        help="the idle connections complete torch's client handshake first "
                             "(they are then held until the front's proof time has passed)")
    parser.add_argument("--only", choices=["front", "none"],
                        help="measure the store with its front alone, or without it alone")
    args = parser.parse_args()
    from exogym.comm.store_front import FrontLimits

    limits = FrontLimits()
    settle_s = (limits.proof_s if args.handshake else limits.handshake_s) + 1.0
    trips = []
    for title, front in (("with its front", True), ("without a front (as before)", False)):
        if args.only is not None and front != (args.only == "front"):
            continue
        rows, trip = measure(front, args.values, args.idle, settle_s, args.addresses,
                             args.handshake)
        trips.append([title, f"{trip:.0f}"])
        print_table(f"the store's process under a stranger's flood: {title}",
                    ["flood", "result", "RSS MiB", "descriptors", "threads",
                     "a new client of the run is served"], rows,
                    left=["flood", "result", "a new client of the run is served"],
                    width=140)
    print_table("one store call (a signed read) from a client of the run, best of 3",
                ["store", "round trip µs"], trips, left=["store"])


if __name__ == "__main__":
    main()
