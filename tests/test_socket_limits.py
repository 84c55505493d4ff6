"""What one peer can cost a dashboard's server: connections, time and bytes are bounded.

The dashboards (``--web``, ``replay --web``) serve from inside the process that trains.
Each test makes a peer do what a stranger on the LAN could (hold idle connections from
one address or many, trickle a request in, send oversized headers or a body) against a
real server on loopback, and checks that the server refuses it within its bounds
(``distributed/app/web/connection_limits.py``), says so once, and keeps answering everyone else.

Peers take addresses of their own on loopback (``127.0.0.2`` and up), so one address's
flood and another's request are told apart as they would be on a LAN.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import wait_for

pytest.importorskip("plotly")

from distributed.app.web.connection_limits import CLOSING_MAX, Limits  # noqa: E402
from distributed.app.web.replay_page import PageServer  # noqa: E402
from distributed.app.web.server import WebDashboard  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: A LAN dashboard in a process of its own, so that its threads and descriptors are its
#: own; prints its port and token, then serves until stdin closes.
SERVER = """
import json, sys
from distributed.app.web.connection_limits import Limits
from distributed.app.web.server import WebDashboard
with WebDashboard("0.0.0.0", 0, limits=Limits(**json.loads(sys.argv[1]))) as web:
    print(web.port, web.token, flush=True)
    sys.stdin.read()
"""


def connect(port: int, source: str = "127.0.0.1", timeout: float = 10) -> socket.socket:
    """A connection to the server on ``port`` from ``source``, sending nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def ask(port: int, path: str, source: str = "127.0.0.1", extra: str = "") -> bytes:
    """The whole answer to one request from ``source``."""
    with connect(port, source) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}"
                     f"Connection: close\r\n\r\n".encode())
        return read_to_end(sock)


def read_to_end(sock: socket.socket) -> bytes:
    """What ``sock`` receives until the server closes it (a reset counts as closed)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def figures(pid: int) -> tuple[int, int]:
    """Threads and open descriptors of process ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(status.split("Threads:", 1)[1].split()[0])
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow(reason="opens 600 connections to a server in a process of its own, then "
                         "waits for its request time to close them")
def test_a_flood_of_idle_connections_leaves_threads_and_descriptors_bounded_and_serves_the_token():
    limits = Limits(request_s=2.0, idle_s=2.0)
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, json.dumps({"request_s": 2.0, "idle_s": 2.0})],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    held: list[socket.socket] = []
    try:
        port, token = server.stdout.readline().split()
        port = int(port)
        base_threads, base_fds = figures(server.pid)
        bound = limits.total + CLOSING_MAX
        many = [f"127.0.0.{i}" for i in range(3, 33)]
        for sources in (["127.0.0.2"], many):  # one peer, then thirty
            held += [connect(port, sources[i % len(sources)]) for i in range(300)]
            threads, fds = figures(server.pid)
            assert threads <= base_threads + bound and fds <= base_fds + bound, (threads, fds)
            # Another address, with the token, as the page asks: again after a 503 (its
            # Retry-After), which a busy machine gives while the server still closes the
            # idle connections it pushed out to make room.
            answer = ask(port, f"/state?token={token}")
            deadline = time.monotonic() + 20
            while answer.startswith(b"HTTP/1.1 503") and time.monotonic() < deadline:
                time.sleep(0.5)
                answer = ask(port, f"/state?token={token}")
            assert answer.startswith(b"HTTP/1.1 200") and b'"version"' in answer, answer[:200]
            assert ask(port, "/state").startswith(b"HTTP/1.1 403")  # the token still counts
        # The idle ones are closed after the request time, and the server is as it was.
        wait_for(lambda: figures(server.pid)[0] <= base_threads, limits.request_s + 5,
                 "the idle connections' threads ending")
        for sock in held:
            answer = read_to_end(sock)
            assert answer in (b"",) or answer.startswith(b"HTTP/1.1 503"), answer[:80]
        assert figures(server.pid)[1] <= base_fds
    finally:
        for sock in held:
            sock.close()
        server.stdin.close()
        server.wait(timeout=30)
    err = server.stderr.read()
    said = err.splitlines()
    assert sum("the most one address may" in line for line in said) == 1, err
    assert "refused a connection from 127.0.0.2: it holds 16 connections" in err
    assert "Traceback" not in err


def test_one_address_past_its_share_is_answered_503_at_once_while_others_are_served(capfd):
    with WebDashboard(limits=Limits(per_address=3, total=8, request_s=30)) as web:
        held = [connect(web.port, "127.0.0.2") for _ in range(3)]
        for _ in range(3):
            with connect(web.port, "127.0.0.2") as refused:
                assert read_to_end(refused).startswith(b"HTTP/1.1 503")
        assert ask(web.port, "/state", "127.0.0.3").startswith(b"HTTP/1.1 200")
        assert web._server.refusals["per_address"] == 3
        for sock in held:
            sock.close()
    err = capfd.readouterr().err
    assert err.count("dashboard: refused a connection from 127.0.0.2: it holds 3 connections, "
                     "the most one address may (further ones are counted, not shown)") == 1, err


def test_when_every_place_is_taken_the_connection_idle_longest_makes_room(capfd):
    with WebDashboard(limits=Limits(per_address=2, total=4, request_s=30)) as web:
        held = [connect(web.port, f"127.0.0.{i}") for i in range(2, 6)]
        wait_for(lambda: web._server.idle_connections == 4, 5, "four idle connections")
        assert ask(web.port, "/state", "127.0.0.9").startswith(b"HTTP/1.1 200")
        assert read_to_end(held[0]) == b""  # the first to come, idle longest: closed
        for sock in held:
            sock.close()
    assert "made room for a connection from 127.0.0.9: 4 connections are open, the most " \
           "this server takes: the one idle longest (from 127.0.0.2) was closed" \
           in capfd.readouterr().err


def test_when_every_place_holds_a_request_under_way_a_newcomer_is_refused(capfd):
    with WebDashboard(limits=Limits(per_address=2, total=2, request_s=30)) as web:
        held = [connect(web.port, f"127.0.0.{i}") for i in (2, 3)]
        for sock in held:
            sock.sendall(b"GET /state HTTP/1.1\r\n")  # begun, never ended
        wait_for(lambda: web._server.open_connections == 2, 5, "two connections open")
        wait_for(lambda: web._server.idle_connections == 0, 5, "their first bytes read")
        with connect(web.port, "127.0.0.4") as refused:
            assert read_to_end(refused).startswith(b"HTTP/1.1 503")
        for sock in held:
            sock.close()
    assert "refused a connection from 127.0.0.4: 2 connections are open, the most this " \
           "server takes, and none of them can be closed to make room" in capfd.readouterr().err


def test_a_request_that_trickles_in_is_closed_at_its_deadline_and_said_once(capfd):
    with WebDashboard(limits=Limits(request_s=0.6)) as web:
        for _ in range(2):
            with connect(web.port) as sock:
                sock.sendall(b"GET /state HTTP/1.1\r\n")
                began = time.monotonic()
                closed = False
                while time.monotonic() - began < 5 and not closed:
                    try:
                        sock.sendall(b"X-Slow: 1\r\n")
                        sock.settimeout(0.1)
                        closed = sock.recv(1) == b""
                    except TimeoutError:
                        pass
                    except (BrokenPipeError, ConnectionResetError):
                        closed = True
                assert closed, "a trickling request was still open after 5 s"
        assert web._server.refusals["request_s"] == 2
    err = capfd.readouterr().err
    assert err.count("refused a connection from 127.0.0.1: its request did not arrive whole "
                     "within 0.6 s") == 1, err


def test_a_kept_alive_connection_is_closed_after_its_idle_time():
    with WebDashboard(limits=Limits(idle_s=0.5)) as web, connect(web.port) as sock:
        sock.sendall(f"GET /state HTTP/1.1\r\nHost: 127.0.0.1:{web.port}\r\n\r\n".encode())
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        assert b"Connection: close" not in first  # kept alive, then closed for idling
        rest = read_to_end(sock)
        assert not rest.startswith(b"HTTP"), rest[:80]


@pytest.mark.parametrize("extra, status, said", [
    ("X-Big: " + "a" * 2000 + "\r\n", b"431", "its request line and headers passed 1024 bytes"),
    ("Content-Length: 10\r\n\r\n0123456789", b"413",
     "it sent a body (Content-Length 10); this server takes at most 0 bytes"),
    ("Transfer-Encoding: chunked\r\n", b"413", "it sent a body (chunked)"),
], ids=["headers", "body", "chunked body"])
def test_a_request_past_its_size_bounds_is_refused_and_said_once(capfd, extra, status, said):
    with WebDashboard(limits=Limits(header_bytes=1024)) as web:
        for _ in range(2):
            assert ask(web.port, "/state", extra=extra).split(b" ", 2)[1] == status
        assert ask(web.port, "/state").startswith(b"HTTP/1.1 200")
    assert capfd.readouterr().err.count(said) == 1


def test_a_request_line_past_the_bound_is_refused_with_431():
    with WebDashboard(limits=Limits(header_bytes=1024)) as web:
        assert b" 431 " in ask(web.port, "/state?" + "a" * 2000).split(b"\r\n", 1)[0]
        assert web._server.refusals["header_bytes"] == 1


def test_stopping_a_dashboard_closes_its_idle_connections_at_once():
    web = WebDashboard(limits=Limits(request_s=60, idle_s=60))
    held = [connect(web.port, f"127.0.0.{i}") for i in (2, 3, 4)]
    wait_for(lambda: web._server.open_connections == 3, 5, "three connections open")
    began = time.monotonic()
    web.stop()
    assert time.monotonic() - began < 30  # not the 60 s their requests may take
    for sock in held:
        assert read_to_end(sock) == b""
        sock.close()


def test_the_replay_page_server_holds_each_peer_to_the_same_bounds():
    page = PageServer("<p>figures</p>", limits=Limits(per_address=1, request_s=30))
    port = int(page.url.rsplit(":", 1)[1].strip("/"))
    try:
        with connect(port, "127.0.0.2"):
            with connect(port, "127.0.0.2") as refused:
                assert read_to_end(refused).startswith(b"HTTP/1.1 503")
            assert b"figures" in ask(port, "/", "127.0.0.3")
    finally:
        page.stop()
