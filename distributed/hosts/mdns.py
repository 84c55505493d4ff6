"""Find the machines of a LAN with mDNS/DNS-SD: an agent advertises, a browser lists.

A machine that runs ``cli_typer.py agent`` registers one ``_exogym._tcp.local.``
service. Its A records carry the machine's IPv4 addresses and its TXT record
what a hosts file needs (SSH port and user, the Python interpreter, the
project's checkout) and what a person chooses by (code hash, torch version,
device, cores, memory). TXT values are limited to 255 bytes each, so the
fields are short keys with short values; a path longer than that is refused
when the agent starts, not cut.

Names are unique on the LAN as Bonjour and Avahi keep them: an agent whose name is taken
(cloned VMs and Raspberry Pis share a host name) advertises the next free one, ``vm-2``,
``vm-3``..., with its own ``vm-2.local.`` host record, and keeps the real host name in its TXT
record. Addresses are ordered by use: an agent announces the address its multicast leaves from
first (the LAN's, not a docker or VPN bridge's), and a browser puts an advert's addresses on its
own subnets first, so the first address is the one to reach the machine at.

On exit the agent unregisters, which multicasts a goodbye (TTL 0): browsers
drop the machine at once instead of when its records expire.

``zeroconf`` is an optional extra (``distributed``) and is imported inside the
functions that need it, as is nothing heavier: torch is never imported here,
its version is read from package metadata.
"""

from __future__ import annotations

import getpass
import ipaddress
import itertools
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from exogym.base.escapes import printable
from exogym.base.install_mode import install_extra

from .onhost.probe import hash_files, torch_version
from .sync import PROJECT_ROOT, WORK_ROOT, code_files

SERVICE_TYPE = "_exogym._tcp.local."
TXT_LIMIT = 255  # bytes of one "key=value" string of a TXT record
LABEL_LIMIT = 63  # bytes of one DNS label: an instance name and its host record's name
NAME_TRIES = 100  # names tried when the advertised one is taken: vm, vm-2 ... vm-100
MDNS_GROUP = "224.0.0.251"
MDNS_PORT = 5353


class DiscoveryError(Exception):
    """Discovery cannot run here; ``str()`` says why and what to do."""


def require_zeroconf() -> Any:
    """The ``zeroconf`` module, or a ``DiscoveryError`` naming the extra to install."""
    try:
        import zeroconf
    except ImportError:
        raise DiscoveryError(
            "LAN discovery needs the zeroconf package, which is not installed; install the "
            f"distributed extra: {install_extra('distributed')} (or pip install zeroconf)"
        ) from None
    return zeroconf


@dataclass(frozen=True)
class MachineAdvert:
    """What one machine says about itself on the LAN.

    Args:
        name: the service instance name (default: the short host name); unique on the LAN,
            so ``vm-2`` when another machine advertises ``vm``.
        host: the machine's real host name, whatever name it advertises.
        addresses: its IPv4 addresses, the one to reach it at first.
        ssh_port: the port its SSH server listens on.
        ssh_user: the user to log in as.
        python: the Python interpreter that runs the project there.
        project_path: the project's checkout there.
        code_hash: the first 12 hex digits of the project's code hash (as pre-flight
            computes it over the tracked code files).
        torch: the installed torch version, or "" when torch is not installed.
        device: ``cuda``, ``mps`` or ``cpu``.
        device_name: the accelerator's (or CPU's) model name.
        cores: CPU cores.
        memory_bytes: physical memory.
    """

    name: str
    host: str
    addresses: tuple[str, ...]
    ssh_port: int
    ssh_user: str
    python: str
    project_path: str
    code_hash: str
    torch: str
    device: str
    device_name: str
    cores: int
    memory_bytes: int

    @property
    def memory_gb(self) -> float:
        """Physical memory in GB (10^9 bytes), one decimal."""
        return round(self.memory_bytes / 1e9, 1)

    @property
    def summary(self) -> str:
        """``mini (mps, 16 GB)``: how a person recognises the machine."""
        return f"{self.name} ({self.device}, {self.memory_gb:g} GB)"

    @property
    def ssh_command(self) -> str:
        """``ssh -p 2222 alice@192.168.1.7``: how to log in to the machine at its first
        address (its host name when it announced none; ``-p`` only for a port other than 22)."""
        where = self.addresses[0] if self.addresses else self.host
        port = f"-p {self.ssh_port} " if self.ssh_port != 22 else ""
        user = f"{self.ssh_user}@" if self.ssh_user else ""
        return f"ssh {port}{user}{where}"

    def to_dict(self) -> dict[str, Any]:
        """Every field, plus ``memory_gb``; JSON-ready."""
        out = asdict(self)
        out["addresses"] = list(self.addresses)
        out["memory_gb"] = self.memory_gb
        return out

    def properties(self) -> dict[str, str]:
        """The TXT record: short keys, each ``key=value`` within 255 bytes."""
        props = {"host": self.host, "user": self.ssh_user, "py": self.python,
                 "path": self.project_path, "code": self.code_hash, "torch": self.torch,
                 "dev": self.device, "devname": self.device_name, "cores": str(self.cores),
                 "mem": str(self.memory_bytes)}
        for key, value in props.items():
            size = len(f"{key}={value}".encode())
            if size > TXT_LIMIT:
                raise DiscoveryError(
                    f"the advert's {key!r} field is {size} bytes, over DNS-SD's {TXT_LIMIT}-byte "
                    f"limit: {value!r}; use a shorter path (a symlink will do)")
        return props

    @classmethod
    def from_service(cls, name: str, addresses: list[str], port: int,
                     properties: Mapping[bytes, bytes | None]) -> MachineAdvert:
        """Rebuild an advert from a resolved service (its TXT record decoded)."""
        # Whatever a machine on the LAN says is shown as text: a control character (an
        # escape sequence that rewrites the terminal) or a bidirectional override appears
        # as its escape.
        props = {printable(k.decode(errors="replace")):
                 printable((v or b"").decode(errors="replace")) for k, v in properties.items()}
        name = printable(name)
        instance = name[:-len(SERVICE_TYPE) - 1] if name.endswith("." + SERVICE_TYPE) else name

        def number(key: str) -> int:
            try:
                return int(props.get(key, "0"))
            except ValueError:
                return 0

        return cls(name=instance, host=props.get("host", instance), addresses=tuple(addresses),
                   ssh_port=port, ssh_user=props.get("user", ""), python=props.get("py", ""),
                   project_path=props.get("path", ""), code_hash=props.get("code", ""),
                   torch=props.get("torch", ""), device=props.get("dev", "cpu"),
                   device_name=props.get("devname", ""), cores=number("cores"),
                   memory_bytes=number("mem"))


# --------------------------------------------------------------------------- this machine


def _run(argv: list[str]) -> str:
    """``argv``'s stdout, stripped, or "" when it cannot run or fails."""
    if shutil.which(argv[0]) is None:
        return ""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _cpu_name() -> str:
    if sys.platform == "darwin":
        return _run(["sysctl", "-n", "machdep.cpu.brand_string"]) or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_device() -> tuple[str, str]:
    """``(kind, name)`` of this machine's accelerator without importing torch:
    ``cuda`` from nvidia-smi, ``mps`` on Apple silicon, else ``cpu`` and the CPU model."""
    gpus = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]).splitlines()
    if gpus:
        names = sorted(set(gpus))
        label = names[0] if len(gpus) == 1 else f"{len(gpus)}x {', '.join(names)}"
        return "cuda", label
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "mps", _cpu_name()
    return "cpu", _cpu_name()


def memory_bytes() -> int:
    """Physical memory of this machine, or 0 when it cannot be read."""
    if sys.platform == "darwin":
        found = _run(["sysctl", "-n", "hw.memsize"])
        return int(found) if found.isdigit() else 0
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def multicast_source_address() -> str | None:
    """The IPv4 address this machine's mDNS multicast leaves from (the source address of its
    route to 224.0.0.251: usually the LAN interface's), or None where there is no such route.
    Connecting a UDP socket only looks the route up; nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((MDNS_GROUP, MDNS_PORT))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address == "0.0.0.0" else address


def ipv4_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (read with ``ifaddr``, zeroconf's own
    dependency), the one its multicast leaves from first: its LAN address before a docker,
    VM or VPN bridge's that happens to come first in the interface list."""
    require_zeroconf()
    import ifaddr

    found = [ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips
             if isinstance(ip.ip, str) and not ip.ip.startswith("127.")]
    primary = multicast_source_address()
    return sorted(found, key=lambda address: address != primary)


def local_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this machine's interfaces are on (loopback's included)."""
    require_zeroconf()
    import ifaddr

    return [ipaddress.IPv4Network(f"{ip.ip}/{ip.network_prefix}", strict=False)
            for adapter in ifaddr.get_adapters() for ip in adapter.ips if isinstance(ip.ip, str)]


def reachable_first(addresses: Sequence[str],
                    networks: Sequence[ipaddress.IPv4Network]) -> list[str]:
    """``addresses`` with those on one of ``networks`` first (reachable without a router),
    each group in its given order."""

    def on_a_network(address: str) -> bool:
        try:
            ip = ipaddress.IPv4Address(address)
        except ValueError:
            return False
        return any(ip in network for network in networks)

    return sorted(addresses, key=lambda address: not on_a_network(address))


def this_machine(name: str | None = None, ssh_port: int = 22, ssh_user: str | None = None,
                 addresses: list[str] | None = None) -> MachineAdvert:
    """The advert of this machine.

    Args:
        name: the instance name (default: the short host name).
        ssh_port: the port this machine's SSH server listens on.
        ssh_user: the login user (default: the current user).
        addresses: the IPv4 addresses to announce (default: every non-loopback one).
    """
    host = socket.gethostname()
    name = name or host.split(".")[0]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}", name):
        raise DiscoveryError(f"the advertised name must be 1-63 letters, digits or hyphens "
                             f"(a DNS label), got {name!r}; pass one with --name")
    kind, device_name = probe_device()
    digest, _ = hash_files(PROJECT_ROOT, code_files(PROJECT_ROOT))
    return MachineAdvert(
        name=name, host=host,
        addresses=tuple(addresses if addresses is not None else ipv4_addresses()),
        ssh_port=ssh_port, ssh_user=ssh_user or getpass.getuser(), python=sys.executable,
        project_path=str(WORK_ROOT), code_hash=digest[:12], torch=torch_version() or "",
        device=kind, device_name=device_name, cores=os.cpu_count() or 1,
        memory_bytes=memory_bytes())


# --------------------------------------------------------------------------- advertise


def instance_names(name: str, count: int = NAME_TRIES) -> Iterator[str]:
    """``name``, then ``name-2``, ``name-3``... (``count`` names in all): the names an agent
    tries in turn, as Bonjour and Avahi rename, each cut to fit one DNS label."""
    yield name[:LABEL_LIMIT]
    for number in itertools.islice(itertools.count(2), count - 1):
        suffix = f"-{number}"
        yield name[:LABEL_LIMIT - len(suffix)] + suffix


class Advertiser:
    """This machine's advert, registered on the LAN until ``close()`` says goodbye.

    When another machine already advertises ``advert.name``, the next free name of
    ``instance_names`` is taken; ``advert`` is then the advert under that name.

    Args:
        advert: what to announce.

    Raises:
        DiscoveryError: there is no address to announce, a TXT field is too long, or every
            name from ``advert.name`` to ``advert.name-100`` is taken.
    """

    def __init__(self, advert: MachineAdvert) -> None:
        require_zeroconf()
        from zeroconf import IPVersion, Zeroconf

        if not advert.addresses:
            raise DiscoveryError("this machine has no IPv4 address other than loopback to "
                                 "announce; connect it to the LAN first")
        properties = advert.properties()
        self.advert = advert
        self._zc = Zeroconf(ip_version=IPVersion.V4Only)
        try:
            self._info = self._register_first_free_name(advert, properties)
        except BaseException:
            self._zc.close()
            raise

    def _register_first_free_name(self, advert: MachineAdvert,
                                  properties: dict[str, str]) -> Any:
        from zeroconf import NonUniqueNameException, ServiceInfo

        for name in instance_names(advert.name):
            # The host record is renamed with the service: two machines answering for one
            # vm.local. would merge their addresses in every browser's cache.
            info = ServiceInfo(
                SERVICE_TYPE, f"{name}.{SERVICE_TYPE}",
                addresses=[socket.inet_aton(a) for a in advert.addresses],
                port=advert.ssh_port, properties=properties, server=f"{name}.local.")
            try:
                self._zc.register_service(info)
            except NonUniqueNameException:
                continue
            self.advert = replace(advert, name=name)
            return info
        raise DiscoveryError(
            f"every name from {advert.name!r} to {name!r} is already advertised on this LAN; "
            "give this machine its own with --name")

    def close(self) -> None:
        """Unregister (a goodbye every browser hears) and stop answering queries."""
        try:
            self._zc.unregister_service(self._info)
        finally:
            self._zc.close()

    def __enter__(self) -> Advertiser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- browse


class Browser:
    """Machines advertising on the LAN, kept current while it runs.

    Args:
        on_change: called with ``("added" | "removed", advert)`` from the browser's
            thread whenever a machine appears or says goodbye.
    """

    def __init__(self, on_change: Callable[[str, MachineAdvert], None] | None = None) -> None:
        require_zeroconf()
        from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf

        self._lock = threading.Lock()
        self._found: dict[str, MachineAdvert] = {}
        self._on_change = on_change
        self._zc = Zeroconf(ip_version=IPVersion.V4Only)

        def handler(zeroconf: Any, service_type: str, name: str,
                    state_change: Any) -> None:
            if state_change is ServiceStateChange.Removed:
                with self._lock:
                    gone = self._found.pop(name, None)
                if gone is not None and self._on_change:
                    self._on_change("removed", gone)
                return
            info = zeroconf.get_service_info(service_type, name, timeout=2000)
            if info is None:
                return
            addresses = reachable_first(info.parsed_addresses(), local_networks())
            advert = MachineAdvert.from_service(name, addresses, info.port or 22, info.properties)
            with self._lock:
                self._found[name] = advert
            if self._on_change:
                self._on_change("added", advert)

        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[handler])

    def machines(self) -> list[MachineAdvert]:
        """The machines advertising now, by name."""
        with self._lock:
            return sorted(self._found.values(), key=lambda a: a.name)

    def close(self) -> None:
        """Stop browsing."""
        self._browser.cancel()
        self._zc.close()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def discover(timeout: float = 3.0) -> list[MachineAdvert]:
    """The machines that answer within ``timeout`` seconds, by name."""
    if timeout <= 0:
        raise DiscoveryError(f"the discovery timeout must be more than 0 seconds, got {timeout}")
    with Browser() as browser:
        threading.Event().wait(timeout)
        return browser.machines()
