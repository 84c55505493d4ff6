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
for pinning. :func:`netbed.check_requirements` says what is missing and how to fix it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .apart import enter_host, hidden_paths, host_folders
from .lan import Member, build_lan, delete_namespaces
from .links import Counters, LinkMeasurement, measure_ring, tbf_burst
from .sshd import sshd_config, wait_for_greeting
from .stale import OWNER_FILE, PREFIX
from .system import TestbedError, pid_alive, run, sshd_binary, stop_process

#: The checkout the bed's hosts run: every host sees this machine's files.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


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


class Testbed:
    """``hosts`` namespaces with shaped links and an sshd each; see the module docstring.

    Args:
        hosts: how many hosts.
        subnet: the first three octets of the /24 the hosts live in (``10.213.77``).
        pin: start host ``i``'s sshd (and so everything it starts) on core ``i``.
        queue: how long each link's tbf queue takes to drain (tc's ``latency``):
            a burst beyond it is dropped, as by a router with that much buffer.
        apart: give every host a mount namespace of its own too: its own empty home and
            ``/tmp``, no checkout of the project and no Python environment of this machine,
            only the system's ``python3`` (see :mod:`netbed.apart`).
        shared_home: with ``apart``, the hosts share one home folder (as an NFS home is
            shared) and each keeps its own ``/tmp``.
    """

    __test__ = False  # a name pytest would otherwise try to collect as a test class

    def __init__(self, hosts: int, subnet: str = "10.213.77", pin: bool = True,
                 queue: str = "100ms", apart: bool = False, shared_home: bool = False) -> None:
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
        if shared_home and not apart:
            raise ValueError("shared_home is a layout of hosts that are apart: give apart=True")
        self.apart = apart
        self.shared_home = shared_home
        self._hidden = hidden_paths(PROJECT_ROOT) if apart else []

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
        routes = json.loads(run("ip", "-j", "route", "show").stdout or "[]")
        addrs = json.loads(run("ip", "-j", "addr", "show").stdout or "[]")
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
        build_lan(self.bridge_ns, [Member(h.namespace, h.interface, h.address)
                                   for h in self.hosts], self.namespaces)
        # The uplink's root end disappears with its peer when the bridge namespace is deleted.
        run("ip", "link", "add", self.uplink, "type", "veth", "peer", "name", "xbu", "netns",
            self.bridge_ns)
        run("ip", "-n", self.bridge_ns, "link", "set", "xbu", "master", "br0")
        run("ip", "-n", self.bridge_ns, "link", "set", "xbu", "up")
        run("ip", "addr", "add", f"{self.uplink_address}/24", "dev", self.uplink)
        run("ip", "link", "set", self.uplink, "up")
        self._start_sshds()

    def _start_sshds(self) -> None:
        binary = sshd_binary()
        assert binary is not None
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation directory
        host_key = self.workdir / "host_key"
        for key in (host_key, self.key_path):
            run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{PREFIX}-{self.tag}",
                "-f", str(key))
        authorized = self.workdir / "authorized_keys"
        authorized.write_text((self.workdir / "user_key.pub").read_text())
        public = (self.workdir / "host_key.pub").read_text().split()
        self.known_hosts.write_text("".join(f"{h.address} {public[0]} {public[1]}\n"
                                            for h in self.hosts))
        self.ssh_config.write_text("")
        for host in self.hosts:
            config = self.workdir / f"sshd_config.{host.index}"
            config.write_text(sshd_config([f"{host.address}:22"], host_key, authorized))
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
            stop_process(host.sshd)

    def _wait_for_sshd(self, host: Host) -> None:
        assert host.sshd is not None and host.sshd_log is not None
        wait_for_greeting(host.sshd, [host.address], 22, host.sshd_log,
                          name=f"sshd of host {host.index}")

    def in_host(self, host: Host, *command: str) -> list[str]:
        """``command`` run inside ``host``'s namespace (and, apart, its mounts), on its core
        when pinned."""
        pin = ["taskset", "-c", str(host.cpu)] if host.cpu is not None else []
        inner = list(command)
        if self.apart:
            home, tmp = self.host_folders(host)
            inner = enter_host(self.workdir, home, tmp, self._hidden, inner)
        return [*pin, "ip", "netns", "exec", host.namespace, *inner]

    def host_folders(self, host: Host) -> tuple[Path, Path]:
        """Where ``host``'s home and ``/tmp`` lie on this machine (apart beds only)."""
        if not self.apart:
            raise TestbedError("the hosts of this bed are not apart: they share this "
                               "machine's home and /tmp")
        return host_folders(self.workdir, host.index, self.shared_home)

    def home(self, host: Host) -> Path:
        """``host``'s home folder as this machine sees it (``/root`` inside the host)."""
        return self.host_folders(host)[0]

    # ------------------------------------------------------------------ use

    def hosts_config(self, port: int, *, launcher_is_master: bool = False,
                     count: int | None = None) -> dict[str, Any]:
        """A hosts file's content for a job on the bed: every rank over SSH as root, in
        this checkout with this Python (apart: with neither, for ``setup-hosts`` to fill).

        Args:
            port: the master port.
            launcher_is_master: rank 0 runs on this machine (the uplink's address) and
                every host is a worker; otherwise host 0 is the master.
            count: use the first ``count`` hosts only (default: all).
        """
        chosen = self.hosts[:count]
        master = self.uplink_address if launcher_is_master else chosen[0].address
        workers = chosen if launcher_is_master else chosen[1:]
        config: dict[str, Any] = {"master": master, "workers": [h.address for h in workers],
                                  "ssh_user": "root", "ssh_key_path": str(self.key_path),
                                  "master_port": port}
        if not self.apart:  # apart hosts have neither until setup-hosts gives them theirs
            config.update(python_env=sys.executable, project_path=str(PROJECT_ROOT))
        return config

    def ssh_settings(self, **extra: Any) -> dict[str, Any]:
        """Keyword arguments for ``distributed.hosts.ssh.SSHOptions`` that reach the bed's
        hosts with its key and host keys alone (no agent, no other key), plus ``extra``."""
        return {"known_hosts_path": self.known_hosts, "ssh_config_path": self.ssh_config,
                "allow_agent": False, "look_for_keys": False, **extra}

    def set_link(self, host: Host, up: bool) -> None:
        """Take ``host``'s link down (it drops off the network, its processes live on) or
        bring it up again."""
        run("ip", "-n", host.namespace, "link", "set", host.interface, "up" if up else "down")

    def shape(self, rate: str) -> None:
        """Shape every host's outgoing link to ``rate`` (a tc rate such as ``100mbit``)."""
        burst = tbf_burst(rate)
        for host in self.hosts:
            run("ip", "netns", "exec", host.namespace, "tc", "qdisc", "replace", "dev",
                host.interface, "root", "tbf", "rate", rate, "burst", str(burst),
                "latency", self.queue)
        self.rate = rate

    def shape_uplink(self, rate: str) -> None:
        """Shape what this machine (the launcher's host) sends into the bed to ``rate``."""
        burst = tbf_burst(rate)
        run("tc", "qdisc", "replace", "dev", self.uplink, "root", "tbf", "rate", rate, "burst",
            str(burst), "latency", self.queue)

    def counters(self) -> Counters:
        """Bytes sent so far by every host's veth and received by the root uplink."""
        host_tx = []
        for host in self.hosts:
            out = run("ip", "-n", host.namespace, "-j", "-s", "link", "show", "dev",
                      host.interface).stdout
            host_tx.append(int(json.loads(out)[0]["stats64"]["tx"]["bytes"]))
        rx = int(Path(f"/sys/class/net/{self.uplink}/statistics/rx_bytes").read_text())
        return Counters(host_tx, rx)

    def pids(self, host: Host) -> list[int]:
        """Processes living in ``host``'s namespace (its sshd and whatever it started)."""
        done = run("ip", "netns", "pids", host.namespace, check=False)
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
        """The links at the current rate, measured by a ring transfer
        (:func:`netbed.links.measure_ring`)."""
        return measure_ring(self, seconds, timeout)

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
                alive = [pid for pid in alive if pid_alive(pid)]
                time.sleep(0.05)
            if not alive:
                break
        for host in self.hosts:
            if host.sshd is not None:
                stop_process(host.sshd)
        delete_namespaces(self.namespaces)
        if Path(f"/sys/class/net/{self.uplink}").exists():
            run("ip", "link", "delete", self.uplink, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Anything of this bed still present: namespaces, the uplink, the folder."""
        names = run("ip", "netns", "list", check=False).stdout.split()
        left = [n for n in names if n.startswith(f"{PREFIX}-{self.tag}")]
        if Path(f"/sys/class/net/{self.uplink}").exists():
            left.append(f"link {self.uplink}")
        if self.workdir.exists():
            left.append(str(self.workdir))
        left += [f"sshd pid {h.sshd.pid}" for h in self.hosts
                 if h.sshd is not None and pid_alive(h.sshd.pid)]
        return left


