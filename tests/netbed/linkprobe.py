"""One host's side of a link probe (run inside a host namespace by ``netbed.links.measure_ring``).

At ``--start-at`` (a ``time.time()`` value shared by every host) the host
sends ``--bytes`` bytes to ``--peer`` while receiving as many from whichever
host sends to it, as a ring all-reduce does. It prints one JSON line:
``receive_s``, the seconds from the start until the last byte arrived, and,
with ``--ping K``, ``rtt_s``, the median round trip of a 1-byte message over
K exchanges with the peer (which must run with ``--echo``).

Standard library only: it runs under any Python, with nothing imported from
the project.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time

PORT = 47011
CHUNK = 1 << 20


def _receive(server: socket.socket, nbytes: int, start_at: float, echo: bool,
             out: dict[str, float]) -> None:
    conn, _ = server.accept()
    with conn:
        left = nbytes
        while left > 0:
            data = conn.recv(min(CHUNK, left))
            if not data:
                raise ConnectionError(f"the sender closed with {left} bytes still to come")
            left -= len(data)
        out["receive_s"] = time.time() - start_at
    if echo:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                data = conn.recv(1)
                if not data:
                    break
                conn.sendall(data)


def _connect(address: str, deadline: float) -> socket.socket:
    while True:
        try:
            return socket.create_connection((address, PORT), timeout=5)
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="this host's address")
    parser.add_argument("--peer", required=True, help="the address to send to")
    parser.add_argument("--bytes", type=int, required=True, help="bytes to send and to receive")
    parser.add_argument("--start-at", type=float, required=True, help="time.time() to start at")
    parser.add_argument("--echo", action="store_true", help="answer one ping connection")
    parser.add_argument("--ping", type=int, default=0, help="round trips to time with the peer")
    args = parser.parse_args(argv)

    server = socket.create_server((args.listen, PORT), reuse_port=False)
    server.settimeout(max(30.0, args.start_at - time.time() + 60))
    received: dict[str, float] = {}
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            _receive(server, args.bytes, args.start_at, args.echo, received)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    time.sleep(max(0.0, args.start_at - time.time()))
    block = memoryview(bytes(CHUNK))
    with _connect(args.peer, args.start_at + 10) as conn:
        left = args.bytes
        while left > 0:
            n = min(CHUNK, left)
            conn.sendall(block[:n])
            left -= n
    result: dict[str, float | None] = {"rtt_s": None}
    if args.ping:
        thread.join(timeout=120)  # the peer's echo starts after its own transfer
        with _connect(args.peer, time.time() + 10) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(args.ping):
                t0 = time.perf_counter()
                conn.sendall(b"x")
                if conn.recv(1) != b"x":
                    raise ConnectionError("the echo peer answered something else")
                times.append(time.perf_counter() - t0)
        result["rtt_s"] = statistics.median(times)
    thread.join(timeout=120)
    server.close()
    if errors:
        raise errors[0]
    if "receive_s" not in received:
        print("the transfer from the other host did not finish in time", file=sys.stderr)
        return 1
    result["receive_s"] = received["receive_s"]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
