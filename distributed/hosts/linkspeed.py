"""Measure the link to a worker: a short TCP transfer from this machine, or between two hosts.

Over SSH the worker starts a small receiver (standard library only, sent on
stdin like the pre-flight probe) that listens on a port the system picks and
counts what arrives; this machine connects to it and sends zeros for a
second. The receiver's count over its own clock, first byte to last, is the
bandwidth training traffic from here can expect (TCP, no SSH encryption).

:func:`measure_between` measures the link two hosts train over: the receiver
runs on one, a sender of the same kind on the other, each through a shell of a
host session (SSH, or this machine's own shell for a local master).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

from .hostsfile import HostSpec
from .remote import Shell, SSHShell, probe_command, standalone_command
from .ssh import (
    SSHConnectError,
    SSHOptions,
    connect,
    load_ssh_config,
    resolve_target,
)

RECEIVER_SOURCE = '''
import json, socket, time

def main(message):
    server = socket.socket(socket.AF_INET6 if message.get("ipv6") else socket.AF_INET)
    server.bind(("", 0))
    server.listen(2)
    server.settimeout(message["timeout"])
    print(json.dumps({"port": server.getsockname()[1]}), flush=True)
    total, first, last = 0, None, None
    while True:
        conn, _ = server.accept()
        conn.settimeout(message["timeout"])
        data = conn.recv(1 << 20)
        if data[:1] == b"p":  # a latency probe first: echo every message until it closes
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data:
                conn.sendall(data)
                data = conn.recv(64)
            conn.close()
            continue
        while data:
            last = time.perf_counter()
            if first is None:
                first = last
            total += len(data)
            data = conn.recv(1 << 20)
        conn.close()
        break
    server.close()
    print(json.dumps({"bytes": total, "seconds": (last - first) if first else 0.0}), flush=True)
'''


SENDER_SOURCE = '''
import json, socket, time

def main(message):
    chunk = bytes(256 * 1024)
    sent, rtts = 0, []
    address = (message["host"], message["port"])
    try:
        pings = int(message.get("pings") or 0)
        if pings:  # one-byte round trips on a connection of their own, before the transfer
            with socket.create_connection(address, timeout=message["timeout"]) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for _ in range(pings):
                    began = time.perf_counter()
                    sock.sendall(b"p")
                    if not sock.recv(1):
                        break
                    rtts.append(time.perf_counter() - began)
        with socket.create_connection(address, timeout=message["timeout"]) as sock:
            deadline = time.perf_counter() + message["seconds"]
            while time.perf_counter() < deadline:
                sock.sendall(chunk)
                sent += len(chunk)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)  # the receiver closes once it has counted everything
    except OSError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return
    print(json.dumps({"sent": sent, "rtt_s": rtts}), flush=True)
'''


class LinkError(RuntimeError):
    """The link could not be measured; the message says why."""


@dataclass(frozen=True)
class LinkMeasurement:
    """One transfer to a host.

    Args:
        host: the host measured.
        bytes: bytes the host received.
        seconds: from its first byte to its last.
        latency_s: one-way latency, half the shortest of the one-byte round trips
            before the transfer (None: not measured).
    """

    host: str
    bytes: int
    seconds: float
    latency_s: float | None = None

    @property
    def bytes_per_s(self) -> float:
        """Received bytes per second."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def mbit_per_s(self) -> float:
        """Megabits per second, as links are sold."""
        return self.bytes_per_s * 8 / 1e6


def _read_json_line(stream, timeout: float, what: str) -> dict:
    line: list[bytes] = []
    reader = threading.Thread(target=lambda: line.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    try:
        answer = json.loads(line[0]) if line and line[0] else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise LinkError(f"the receiver on the host gave no {what}")
    return answer


def measure_link(host: HostSpec, options: SSHOptions | None = None, seconds: float = 1.0,
                 timeout: float = 20.0) -> LinkMeasurement:
    """Send zeros to ``host`` over TCP for ``seconds`` and return what it received.

    Args:
        host: a worker of the hosts file (reached over SSH to start the receiver).
        options: SSH settings (known_hosts, config, keys).
        seconds: how long to send.
        timeout: how long any one step may take.

    Raises:
        LinkError: when the host cannot be reached or the transfer fails.
    """
    options = options or SSHOptions()
    target = resolve_target(host, options, load_ssh_config(options))
    try:
        client, _ = connect(target, options)
    except SSHConnectError as exc:
        raise LinkError(str(exc)) from exc
    shell = SSHShell(client, target.label)
    started = None
    try:
        # The receiver needs only the standard library: a host setup-hosts has not made
        # ready yet (no project, no environment) is measured with its own python3.
        started = shell.start(standalone_command(host.python_env),
                              {"code": RECEIVER_SOURCE, "timeout": timeout,
                               "ipv6": ":" in target.hostname})
        port = int(_read_json_line(started.stdout, timeout, "port")["port"])
        chunk = bytes(256 * 1024)
        try:
            with socket.create_connection((target.hostname, port), timeout=timeout) as sock:
                deadline = time.perf_counter() + seconds
                while time.perf_counter() < deadline:
                    sock.sendall(chunk)
                sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            raise LinkError(f"cannot send to {target.hostname}:{port} ({exc}); a firewall on "
                            "the host may block incoming connections") from exc
        result = _read_json_line(started.stdout, timeout, "result")
    finally:
        if started is not None:
            started.close()
        shell.close()
    return LinkMeasurement(host.host, int(result["bytes"]), float(result["seconds"]))


def measure_between(sender: Shell, sender_host: HostSpec, receiver: Shell,
                    receiver_host: HostSpec, address: str, seconds: float = 1.0,
                    timeout: float = 20.0, pings: int = 0) -> LinkMeasurement:
    """Send zeros from one host to another over TCP for ``seconds``; what the receiver got.

    Args:
        sender: a shell on the sending host (a host session's ``shell(rank)``).
        sender_host: the sending host, for its ``project_path`` and ``python_env``.
        receiver: a shell on the receiving host.
        receiver_host: the receiving host.
        address: the address the sender reaches the receiver at.
        seconds: how long to send.
        timeout: how long any one step may take.
        pings: one-byte round trips timed first, on a connection of their own (0: the
            latency is not measured).

    Raises:
        LinkError: when either side fails or gives no answer.
    """
    listening = sending = None
    try:
        listening = receiver.start(
            probe_command(receiver_host.project_path, receiver_host.python_env),
            {"code": RECEIVER_SOURCE, "timeout": timeout, "ipv6": ":" in address})
        port = int(_read_json_line(listening.stdout, timeout, "port")["port"])
        sending = sender.start(
            probe_command(sender_host.project_path, sender_host.python_env),
            {"code": SENDER_SOURCE, "host": address, "port": port, "seconds": seconds,
             "timeout": timeout, "pings": pings})
        sent = _read_json_line(sending.stdout, timeout + seconds, "count of bytes sent")
        if "error" in sent:
            raise LinkError(f"{sender_host.host} cannot send to {address}:{port} "
                            f"({sent['error']}); a firewall on {receiver_host.host} may block "
                            "incoming connections")
        result = _read_json_line(listening.stdout, timeout, "result")
    finally:
        for started in (sending, listening):
            if started is not None:
                started.close()
    rtts = [float(r) for r in sent.get("rtt_s") or []]
    return LinkMeasurement(f"{sender_host.host} -> {receiver_host.host}", int(result["bytes"]),
                           float(result["seconds"]), min(rtts) / 2 if rtts else None)



#: Seconds each host's pre-flight transfer lasts (``LaunchOptions.link_probe_s``).
PROBE_SECONDS = 0.5
#: One-byte round trips each pre-flight probe times for the latency.
PROBE_PINGS = 20


@dataclass(frozen=True)
class HostLink:
    """A host's link as the pre-flight probe measured it: what it sends to a peer.

    Args:
        host: the host, as the hosts file names it.
        peer: the host it sent to (the master; the master itself sends to the first worker).
        rate_bps: bits per second the peer received (None when the probe failed).
        latency_s: one-way latency, half the shortest round trip (None when not measured).
        bytes, seconds: what the peer received, and over how long.
        error: why the probe failed, else None.
    """

    host: str
    peer: str
    rate_bps: float | None
    latency_s: float | None
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    def as_trace(self) -> dict[str, object]:
        """The fields a trace records for the host (:mod:`exogym.report.trace`)."""
        out: dict[str, object] = {
            "link_rate_bps": None if self.rate_bps is None else round(self.rate_bps),
            "latency_s": None if self.latency_s is None else round(self.latency_s, 7),
            "link_peer": self.peer, "probe_bytes": self.bytes,
            "probe_seconds": round(self.seconds, 6)}
        if self.error:
            out["link_error"] = self.error
        return out


def probe_hosts(session, seconds: float = PROBE_SECONDS, pings: int = PROBE_PINGS,
                timeout: float = 10.0) -> dict[int, HostLink]:
    """Measure every host's link before a run, one host after the other (so that no two
    transfers share a link): each worker sends to the master for ``seconds``, the master
    to the first worker, each after ``pings`` one-byte round trips for the latency.

    Bounded: each host's probe gives up after ``timeout`` seconds of silence, and a
    failure is recorded (``HostLink.error``), never raised: the run does not depend on it.

    Args:
        session: the job's connected :class:`distributed.hosts.session.HostSession`.
        seconds: how long each transfer lasts.
        pings: round trips timed before it.
        timeout: how long any one step of a probe may take.

    Returns:
        Per host index (``HostSpec.rank``), its link; empty with a single host.
    """
    config = session.config
    hosts = config.hosts
    if len(hosts) < 2:
        return {}
    found: dict[int, HostLink] = {}
    for host in hosts:
        if host.rank == 0:
            peer = hosts[1]
            address = session.targets[peer.rank].hostname if peer.rank in session.targets \
                else peer.host
        else:
            peer = hosts[0]
            address = session.master_addr
        sender, receiver = session.shell(host.rank), session.shell(peer.rank)
        if sender is None or receiver is None:
            found[host.rank] = HostLink(host.host, peer.host, None, None,
                                        error="not connected")
            continue
        try:
            measured = measure_between(sender, host, receiver, peer, address, seconds=seconds,
                                       timeout=timeout, pings=pings)
        except (LinkError, OSError, ValueError) as exc:
            found[host.rank] = HostLink(host.host, peer.host, None, None, error=str(exc))
            continue
        rate = measured.bytes_per_s * 8 if measured.seconds > 0 else None
        found[host.rank] = HostLink(host.host, peer.host, rate, measured.latency_s,
                                    measured.bytes, measured.seconds,
                                    None if rate else "the peer received nothing")
    return found
