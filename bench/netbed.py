"""A test bed of N "hosts" on one machine: network namespaces, shaped links, one sshd each.

Layout (``tag`` is random per bed, so two beds never collide)::

    root namespace  --uplink veth (xu<tag>, SUBNET.254)--+
                                                        |   bridge namespace
    host 0 namespace: xh0-<tag> (SUBNET.1) --veth--  br0  (exobench-<tag>-br)
    host 1 namespace: xh1-<tag> (SUBNET.2) --veth--+
    ...

- Every host's outgoing traffic on its veth is shaped by ``tc qdisc ... tbf``
  to one rate (:meth:`Testbed.shape`). A host's download is limited by its
  peers' uploads. The kernel here has no ``netem``, so latency is not
  emulated: what the links add is bandwidth, not delay.
- Every host runs its own ``sshd`` on its address, port 22, with a host key,
  an authorized key and a config in a private temporary folder. With
  ``pin=True`` host ``i``'s sshd is started under ``taskset -c i``, and every
  process started over SSH in that host (a rank, its supervisor, gloo's
  threads) inherits that one core.
- The launcher in the root namespace reaches the hosts through the uplink;
  what the hosts send to it (SSH output) can be told apart from what they send
  each other: :meth:`Testbed.counters` returns both.
- :meth:`Testbed.close` stops every process in the hosts' namespaces by PID
  (TERM, then KILL), deletes the namespaces (and with them every veth and the
  bridge), and removes the temporary folder. It runs on ``with`` exit, on
  exceptions, and is safe to call twice.

Needs root, ``ip`` (iproute2), ``tc``, ``sshd`` and ``ssh-keygen``; ``taskset``
for pinning. :func:`check_requirements` says what is missing and how to fix it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "exobench"
OWNER_FILE = "owner.pid"
SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
LINK_PROBE = Path(__file__).resolve().parent / "linkprobe.py"


class TestbedError(RuntimeError):
    """The test bed cannot be built or used; the message says why and what to do."""


def _run(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(args)}` failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")
    return done


def sshd_binary() -> str | None:
    """The sshd executable, or None."""
    found = shutil.which("sshd")
    if found:
        return found
    return next((p for p in SSHD_CANDIDATES if os.access(p, os.X_OK)), None)


def check_requirements(pin: bool) -> list[str]:
    """Every missing requirement, each as a sentence with its fix (empty: all present)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("network namespaces, tc and a second sshd need root: run it as root "
                        "(sudo -E env PATH=$PATH python bench/multihost.py ...)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("ssh-keygen", "openssh-client")):
        if shutil.which(tool) is None:
            problems.append(f"{tool} is not installed: apt-get install {package}")
    if sshd_binary() is None:
        problems.append("sshd is not installed: apt-get install openssh-server "
                        "(tests/setup_system.sh does it)")
    if pin and shutil.which("taskset") is None:
        problems.append("taskset is not installed (apt-get install util-linux), or pass --no-pin")
    return problems


def rate_bits(rate: str) -> float:
    """``'100mbit'`` -> 1e8: a tc rate in bits per second (bit, kbit, mbit, gbit; k/m/g = 1000)."""
    text = rate.strip().lower()
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(unit):
            number = text[: -len(unit)]
            try:
                value = float(number)
            except ValueError:
                break
            if value > 0:
                return value * factor
            break
    raise ValueError(f"rate {rate!r} is not a tc rate: write it like 1gbit, 100mbit, 20mbit "
                     "or 512kbit")


@dataclass
class Host:
    """One emulated host: its namespace, interface, address, core and sshd."""

    index: int
    namespace: str
    interface: str
    address: str
    cpu: int | None
    sshd: subprocess.Popen[bytes] | None = None
    sshd_log: Path | None = None


@dataclass
class Counters:
    """Interface byte counters at one moment.

    Args:
        host_tx: bytes each host's veth has sent (everything that host put on its link).
        to_launcher: bytes the root namespace has received through the uplink
            (what the hosts sent to the launcher: SSH output, acknowledgements).
        at: ``time.monotonic()`` when read.
    """

    host_tx: list[int]
    to_launcher: int
    at: float = field(default_factory=time.monotonic)

    def between_hosts(self, later: Counters) -> int:
        """Bytes the hosts sent each other between ``self`` and ``later``."""
        sent = sum(b - a for a, b in zip(self.host_tx, later.host_tx))
        return sent - (later.to_launcher - self.to_launcher)

    def launcher_bytes(self, later: Counters) -> int:
        """Bytes the hosts sent the launcher between ``self`` and ``later``."""
        return later.to_launcher - self.to_launcher


@dataclass(frozen=True)
class LinkMeasurement:
    """What a link probe found at one shaping rate.

    Args:
        rate: the tc rate (``100mbit``).
        goodput_bytes_per_s: payload bytes per second each host achieved while
            sending to its ring neighbour and receiving from the other at once
            (the slowest host's figure).
        rtt_s: median TCP round trip of a 1-byte message between hosts 1 and 0.
        seconds: how long the transfer took.
        overhead: wire bytes over payload bytes, minus 1: TCP/IP headers and
            acknowledgements, as the veth counters saw them.
    """

    rate: str
    goodput_bytes_per_s: float
    rtt_s: float
    seconds: float
    overhead: float


class Testbed:
    """``hosts`` namespaces with shaped links and an sshd each; see the module docstring.

    Args:
        hosts: how many hosts.
        subnet: the first three octets of the /24 the hosts live in (``10.213.77``).
        pin: start host ``i``'s sshd (and so everything it starts) on core ``i``.
        queue: how long each link's tbf queue takes to drain (tc's ``latency``):
            a burst beyond it is dropped, as by a router with that much buffer.
    """

    def __init__(self, hosts: int, subnet: str = "10.213.77", pin: bool = True,
                 queue: str = "100ms") -> None:
        if hosts < 1 or hosts > 250:
            raise ValueError(f"hosts must be within 1..250, got {hosts}")
        try:
            self.network = ipaddress.ip_network(f"{subnet}.0/24")
        except ValueError:
            raise ValueError(f"subnet must be three octets such as 10.213.77, got {subnet!r}") \
                from None
        cores = os.cpu_count() or 1
        if pin and hosts > cores:
            raise TestbedError(f"{hosts} hosts cannot each have a core of their own on this "
                               f"machine's {cores} cores: use --hosts {cores} or fewer, or "
                               "--no-pin (then hosts share cores and speedups mean little)")
        self.tag = uuid.uuid4().hex[:5]
        self.pin = pin
        self.queue = queue
        self.bridge_ns = f"{PREFIX}-{self.tag}-br"
        self.uplink = f"xu{self.tag}"
        self.uplink_address = f"{subnet}.254"
        self.hosts = [Host(i, f"{PREFIX}-{self.tag}-h{i}", f"xh{i}-{self.tag}",
                           f"{subnet}.{i + 1}", i if pin else None) for i in range(hosts)]
        self.namespaces: list[str] = []
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{self.tag}-"))
        # Who owns this bed: a later benchmark removes the bed of an owner that died unclean.
        (self.workdir / OWNER_FILE).write_text(str(os.getpid()))
        self.key_path = self.workdir / "user_key"
        self.known_hosts = self.workdir / "known_hosts"
        self.ssh_config = self.workdir / "ssh_config"
        self.rate: str | None = None
        self._closed = False

    # ------------------------------------------------------------------ build

    def __enter__(self) -> Testbed:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_subnet_free(self) -> None:
        routes = json.loads(_run("ip", "-j", "route", "show").stdout or "[]")
        addrs = json.loads(_run("ip", "-j", "addr", "show").stdout or "[]")
        taken = [r.get("dst", "") for r in routes] + [
            f"{a['local']}/{a['prefixlen']}" for link in addrs for a in link.get("addr_info", [])
            if a.get("family") == "inet"]
        for entry in taken:
            if entry in ("", "default"):
                continue
            try:
                other = ipaddress.ip_network(entry, strict=False)
            except ValueError:
                continue
            if other.version == 4 and other.overlaps(self.network):
                raise TestbedError(f"subnet {self.network} is already in use here ({entry}): "
                                   "pick another with --subnet")

    def build(self) -> None:
        """Create the namespaces, the bridge, the veths, the uplink and every sshd."""
        self._check_subnet_free()
        for ns in [self.bridge_ns, *(h.namespace for h in self.hosts)]:
            _run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        for host in self.hosts:
            port = f"xb{host.index}"
            _run("ip", "-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name",
                 host.interface, "netns", host.namespace)
            _run("ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.bridge_ns, "link", "set", port, "up")
            _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev",
                 host.interface)
            _run("ip", "-n", host.namespace, "link", "set", host.interface, "up")
        # The uplink's root end disappears with its peer when the bridge namespace is deleted.
        _run("ip", "link", "add", self.uplink, "type", "veth", "peer", "name", "xbu", "netns",
             self.bridge_ns)
        _run("ip", "-n", self.bridge_ns, "link", "set", "xbu", "master", "br0")
        _run("ip", "-n", self.bridge_ns, "link", "set", "xbu", "up")
        _run("ip", "addr", "add", f"{self.uplink_address}/24", "dev", self.uplink)
        _run("ip", "link", "set", self.uplink, "up")
        self._start_sshds()

    def _start_sshds(self) -> None:
        binary = sshd_binary()
        assert binary is not None
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation directory
        host_key = self.workdir / "host_key"
        for key in (host_key, self.key_path):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{PREFIX}-{self.tag}",
                 "-f", str(key))
        authorized = self.workdir / "authorized_keys"
        authorized.write_text((self.workdir / "user_key.pub").read_text())
        public = (self.workdir / "host_key.pub").read_text().split()
        self.known_hosts.write_text("".join(f"{h.address} {public[0]} {public[1]}\n"
                                            for h in self.hosts))
        self.ssh_config.write_text("")
        for host in self.hosts:
            config = self.workdir / f"sshd_config.{host.index}"
            config.write_text("\n".join([
                f"ListenAddress {host.address}:22",
                f"HostKey {host_key}",
                f"AuthorizedKeysFile {authorized}",
                "PidFile none",
                "StrictModes no",  # the files sit in a world-writable temporary folder
                "UsePAM no",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PubkeyAuthentication yes",
                "PermitRootLogin prohibit-password",
                "UseDNS no",
                "PrintMotd no",
                "MaxStartups 100",
                "MaxSessions 100",
                "Subsystem sftp internal-sftp",
                "",
            ]))
            host.sshd_log = self.workdir / f"sshd.{host.index}.log"
            self.start_sshd(host, wait=False)
        for host in self.hosts:
            self._wait_for_sshd(host)

    def start_sshd(self, host: Host, wait: bool = True) -> None:
        """Start ``host``'s sshd (again, after :meth:`stop_sshd`): the host answers SSH."""
        binary = sshd_binary()
        assert binary is not None and host.sshd_log is not None
        config = self.workdir / f"sshd_config.{host.index}"
        command = self.in_host(host, binary, "-D", "-f", str(config), "-E", str(host.sshd_log))
        host.sshd = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if wait:
            self._wait_for_sshd(host)

    def stop_sshd(self, host: Host) -> None:
        """Stop ``host``'s sshd by its PID: no new SSH connection reaches the host (those
        it already serves stay up, as with a real sshd)."""
        if host.sshd is not None:
            host.sshd.terminate()
            try:
                host.sshd.wait(timeout=5)
            except subprocess.TimeoutExpired:
                host.sshd.kill()
                host.sshd.wait()

    def _wait_for_sshd(self, host: Host) -> None:
        deadline = time.monotonic() + 15
        while True:
            assert host.sshd is not None and host.sshd_log is not None
            if host.sshd.poll() is not None:
                raise TestbedError(f"sshd of host {host.index} exited with {host.sshd.returncode}:"
                                   f" {host.sshd_log.read_text()[-1500:]}")
            try:
                with socket.create_connection((host.address, 22), timeout=1) as s:
                    if s.recv(64).startswith(b"SSH-"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TestbedError(f"sshd of host {host.index} does not answer on "
                                   f"{host.address}:22: {host.sshd_log.read_text()[-1500:]}")
            time.sleep(0.1)

    def in_host(self, host: Host, *command: str) -> list[str]:
        """``command`` run inside ``host``'s namespace, on its core when pinned."""
        pin = ["taskset", "-c", str(host.cpu)] if host.cpu is not None else []
        return [*pin, "ip", "netns", "exec", host.namespace, *command]

    # ------------------------------------------------------------------ use

    def shape(self, rate: str) -> None:
        """Shape every host's outgoing link to ``rate`` (a tc rate such as ``100mbit``)."""
        bits = rate_bits(rate)
        # The bucket must hold what the rate sends in a few timer ticks, or tbf falls
        # short of its rate on fast links: 4 ms worth, and never under 32 KiB.
        burst = max(32 * 1024, int(bits / 8 * 0.004))
        for host in self.hosts:
            _run("ip", "netns", "exec", host.namespace, "tc", "qdisc", "replace", "dev",
                 host.interface, "root", "tbf", "rate", rate, "burst", str(burst),
                 "latency", self.queue)
        self.rate = rate

    def shape_uplink(self, rate: str) -> None:
        """Shape what this machine (the launcher's host) sends into the bed to ``rate``."""
        bits = rate_bits(rate)
        burst = max(32 * 1024, int(bits / 8 * 0.004))
        _run("tc", "qdisc", "replace", "dev", self.uplink, "root", "tbf", "rate", rate, "burst",
             str(burst), "latency", self.queue)

    def counters(self) -> Counters:
        """Bytes sent so far by every host's veth and received by the root uplink."""
        host_tx = []
        for host in self.hosts:
            out = _run("ip", "-n", host.namespace, "-j", "-s", "link", "show", "dev",
                       host.interface).stdout
            host_tx.append(int(json.loads(out)[0]["stats64"]["tx"]["bytes"]))
        rx = int(Path(f"/sys/class/net/{self.uplink}/statistics/rx_bytes").read_text())
        return Counters(host_tx, rx)

    def pids(self, host: Host) -> list[int]:
        """Processes living in ``host``'s namespace (its sshd and whatever it started)."""
        done = _run("ip", "netns", "pids", host.namespace, check=False)
        return [int(p) for p in done.stdout.split() if p.strip().isdigit()]

    def worker_affinity(self) -> dict[int, list[int]]:
        """For each host running a ``distributed.worker`` process, the cores it may use."""
        found: dict[int, list[int]] = {}
        for host in self.hosts:
            for pid in self.pids(host):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if b"distributed.worker" in cmdline:
                        found[host.index] = sorted(os.sched_getaffinity(pid))
                except (OSError, ValueError):
                    continue
        return found

    def measure_link(self, seconds: float = 3.0, timeout: float = 120) -> LinkMeasurement:
        """Ring transfer at the current rate: host ``i`` sends to ``i+1`` while receiving.

        Every host sends ``seconds`` worth of the nominal rate; the goodput is
        the slowest host's payload rate. Hosts 1 and 0 then measure the round
        trip of a 1-byte message.
        """
        if self.rate is None:
            raise TestbedError("shape the links (Testbed.shape) before measuring them")
        if len(self.hosts) < 2:
            raise TestbedError("a link probe needs two hosts or more")
        nbytes = max(1 << 20, int(rate_bits(self.rate) / 8 * seconds))
        start_at = time.time() + 1.5
        procs = []
        before = self.counters()
        try:
            for host in self.hosts:
                peer = self.hosts[(host.index + 1) % len(self.hosts)]
                args = [sys.executable, str(LINK_PROBE), "--listen", host.address, "--peer",
                        peer.address, "--bytes", str(nbytes), "--start-at", f"{start_at:.3f}"]
                if host.index == 0:
                    args.append("--echo")
                if host.index == 1:
                    args += ["--ping", "200"]
                procs.append(subprocess.Popen(self.in_host(host, *args), stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True))
            results = []
            for host, proc in zip(self.hosts, procs):
                out, err = proc.communicate(timeout=timeout)
                if proc.returncode != 0:
                    raise TestbedError(f"link probe on host {host.index} failed "
                                       f"({proc.returncode}): {err.strip()[-1500:]}")
                results.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        wire = before.between_hosts(self.counters())
        slowest = max(r["receive_s"] for r in results)
        rtt = next(r["rtt_s"] for r in results if r.get("rtt_s") is not None)
        return LinkMeasurement(self.rate, nbytes / slowest, rtt, slowest,
                               wire / (nbytes * len(self.hosts)) - 1)

    # ------------------------------------------------------------------ clean up

    def close(self) -> None:
        """Stop every process in the hosts' namespaces, delete the namespaces and files."""
        if self._closed:
            return
        self._closed = True
        host_namespaces = set(self.namespaces) - {self.bridge_ns}
        alive = [pid for host in self.hosts if host.namespace in host_namespaces
                 for pid in self.pids(host)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in alive:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 3
            while alive and time.monotonic() < deadline:
                alive = [pid for pid in alive if _exists(pid)]
                time.sleep(0.05)
            if not alive:
                break
        for host in self.hosts:
            if host.sshd is not None:
                try:
                    host.sshd.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    host.sshd.kill()
                    host.sshd.wait()
        for ns in reversed(self.namespaces):
            _run("ip", "netns", "delete", ns, check=False)
        self.namespaces.clear()
        if Path(f"/sys/class/net/{self.uplink}").exists():
            _run("ip", "link", "delete", self.uplink, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Anything of this bed still present: namespaces, the uplink, the folder."""
        names = _run("ip", "netns", "list", check=False).stdout.split()
        left = [n for n in names if n.startswith(f"{PREFIX}-{self.tag}")]
        if Path(f"/sys/class/net/{self.uplink}").exists():
            left.append(f"link {self.uplink}")
        if self.workdir.exists():
            left.append(str(self.workdir))
        left += [f"sshd pid {h.sshd.pid}" for h in self.hosts
                 if h.sshd is not None and _exists(h.sshd.pid)]
        return left


def worker_pid(rank: int, marker: str) -> int | None:
    """The process of ``rank`` (``python -m distributed.worker``, not its supervisor) whose
    command line holds ``marker`` (e.g. its output folder), on this machine or in a bed's host."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            environ = (entry / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[1:3] == ["-m", "distributed.worker"] and any(marker in a for a in argv) \
                and f"RANK={rank}" in environ:
            return int(entry.name)
    return None


def reap_stale_beds() -> list[str]:
    """Remove the beds of earlier benchmarks whose process died without cleaning up.

    A bed belongs to the process named in its folder's ``owner.pid``; one whose
    owner is gone (killed with SIGKILL, the machine's session ended) leaves its
    namespaces, uplink, sshds and folder behind. Returns what was removed. Beds
    of a benchmark still running are left alone.
    """
    names = _run("ip", "netns", "list", check=False).stdout.split()
    tags = sorted({n.split("-")[1] for n in names
                   if n.startswith(f"{PREFIX}-") and n.count("-") >= 2})
    removed: list[str] = []
    for tag in tags:
        folders = list(Path(tempfile.gettempdir()).glob(f"{PREFIX}-{tag}-*"))
        owners = [int(f.joinpath(OWNER_FILE).read_text() or 0) for f in folders
                  if f.joinpath(OWNER_FILE).is_file()]
        if any(_exists(pid) for pid in owners if pid):
            continue
        spaces = [n for n in names if n.startswith(f"{PREFIX}-{tag}-")]
        for ns in spaces:
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    removed.append(f"process {pid} in {ns}")
                except (ProcessLookupError, ValueError):
                    pass
        for ns in spaces:
            _run("ip", "netns", "delete", ns, check=False)
            removed.append(f"namespace {ns}")
        if Path(f"/sys/class/net/xu{tag}").exists():
            _run("ip", "link", "delete", f"xu{tag}", check=False)
            removed.append(f"link xu{tag}")
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


def _exists(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Events:
    """Every event the launcher hands over, stamped with its time of arrival."""

    def __init__(self) -> None:
        self.items: list[tuple[float, dict]] = []
        self.cond = threading.Condition()

    def __call__(self, event: dict) -> None:
        with self.cond:
            self.items.append((time.monotonic(), event))
            self.cond.notify_all()

    def wait(self, test, timeout: float, after: float = 0.0) -> tuple[float, dict]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for t, e in self.items:
                    if t >= after and test(e):
                        return t, e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no such event within {timeout:.0f} s; the last: "
                                       f"{[e for _, e in self.items[-3:]]}")
                self.cond.wait(left)

    def of(self, kind: str, rank: int | None = None) -> list[tuple[float, dict]]:
        return [(t, e) for t, e in self.items if e.get("event") == kind
                and (rank is None or e.get("rank") == rank)]
