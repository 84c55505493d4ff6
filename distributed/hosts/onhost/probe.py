"""Pre-flight probe: what a host looks like from where its rank will run.

The launcher runs this on every host (the master too) with the host's own
``python_env``, in its ``project_path``, through the same stdin loader as the
rank supervisor (``distributed.remote.LOADER``), so the check uses exactly the
interpreter and directory the rank will. ``main(message)`` prints one JSON
object on stdout. Actions:

- ``"probe"``: Python and torch versions, the project version (from
  ``pyproject.toml``), a hash of the project's code files (the list comes from
  the launcher, so every host hashes the same files the same way), the network
  interfaces, the interface and source address that route to the master, and,
  when asked, whether a TCP connection to the master's port succeeds, and
  how many CPU cores and (when asked) NVIDIA GPUs the host has, so a host's
  ``slots`` can be held to them.
- ``"listen"``: hold the master port open (proving it is free) until stdin
  closes, so the workers' connection tests have something to reach.

Runs on any Python 3.8+ with the standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterable
from typing import Any


def hash_files(root: str | os.PathLike[str],
               paths: Iterable[str]) -> tuple[str, dict[str, str | None]]:
    """Hash ``paths`` (relative to ``root``) in sorted order.

    Returns ``(code_hash, per_file)``: a hex digest over every path and its
    content, and for each path the first 16 hex digits of its content hash
    (``None`` for a file that is missing).
    """
    total = hashlib.sha256()
    per_file = {}
    for rel in sorted(paths):
        try:
            with open(os.path.join(root, rel), "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()[:16]
        except OSError:
            digest = None
        per_file[rel] = digest
        total.update(f"{rel}\0{digest or 'missing'}\n".encode())
    return total.hexdigest(), per_file


def project_version(root: str | os.PathLike[str]) -> str | None:
    """``version`` of the ``[project]`` table of ``root/pyproject.toml``, or ``None``."""
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    section = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.MULTILINE | re.DOTALL)
    if not section:
        return None
    found = re.search(r'^version\s*=\s*["\']([^"\']+)["\']', section.group(1), re.MULTILINE)
    return found.group(1) if found else None


def torch_version() -> str | None:
    """The installed torch version, read from package metadata (no slow import)."""
    try:
        from importlib import metadata

        return metadata.version("torch")
    except Exception:  # noqa: BLE001 - no metadata at all (or Python < 3.8) reads as absent
        return None


def _address(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
    except OSError:
        return host


def route_to(master: str) -> dict[str, Any]:
    """The interface and source address this host uses to reach ``master``."""
    addr = _address(master)
    ip = shutil.which("ip") or next(
        (p for p in ("/sbin/ip", "/usr/sbin/ip", "/bin/ip") if os.path.exists(p)), None)
    if ip:
        try:
            out = subprocess.run([ip, "route", "get", addr], check=False,
                                 capture_output=True, text=True, timeout=5).stdout.split()
            found = {k: out[i + 1] for i, k in enumerate(out[:-1]) if k in ("dev", "src")}
            if "dev" in found:
                return {"interface": found["dev"], "source": found.get("src"), "how": "ip route"}
        except (OSError, subprocess.SubprocessError):
            pass
    route = shutil.which("route") or ("/sbin/route" if os.path.exists("/sbin/route") else None)
    if route and sys.platform == "darwin":
        try:
            out = subprocess.run([route, "-n", "get", addr], check=False,
                                 capture_output=True, text=True, timeout=5).stdout
            found = re.search(r"interface:\s*(\S+)", out)
            if found:
                return {"interface": found.group(1), "source": None, "how": "route get"}
        except (OSError, subprocess.SubprocessError):
            pass
    try:  # a UDP "connect" sends nothing but picks the route's source address
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return {"interface": None, "source": s.getsockname()[0], "how": "udp"}
    except OSError as exc:
        return {"interface": None, "source": None, "how": f"none ({exc})"}


def try_connect(host: str, port: int, timeout: float) -> dict[str, Any]:
    """Open (and close) a TCP connection; report how it went."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return {"ok": True}
    except TimeoutError:
        return {"ok": False, "error": "timeout"}
    except ConnectionRefusedError:
        return {"ok": False, "error": "refused"}
    except OSError as exc:
        return {"ok": False, "error": exc.strerror or str(exc)}


def count_gpus(timeout: float = 20.0) -> int | None:
    """NVIDIA GPUs this host's ranks can use: ``CUDA_VISIBLE_DEVICES`` when set, else the
    lines of ``nvidia-smi -L``; ``None`` when neither tells (no driver on the PATH)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def probe(message: dict[str, Any]) -> dict[str, Any]:
    """Everything pre-flight wants to know about this host, as one JSON-able dict."""
    root = os.getcwd()
    code_hash, per_file = hash_files(root, message.get("files", []))
    try:
        interfaces = sorted(name for _, name in socket.if_nameindex())
    except (AttributeError, OSError):
        interfaces = None
    result = {
        "python": ".".join(str(p) for p in sys.version_info[:3]),
        "executable": sys.executable,
        "cwd": root,
        "torch": torch_version(),
        "project_version": project_version(root),
        "code_hash": code_hash,
        "files": per_file,
        "interfaces": interfaces,
        "route": route_to(message["master"]) if message.get("master") else None,
        "connect": None,
        "cpus": os.cpu_count(),
        "gpus": count_gpus() if message.get("count_gpus") else None,
    }
    if message.get("connect"):
        host, port, timeout = message["connect"]
        result["connect"] = try_connect(host, int(port), float(timeout))
    return result


def bind_master_port(master: str, port: int) -> socket.socket:
    """A socket listening on ``port`` on every address of the master's family.

    Raises:
        OSError: when the port cannot be bound (taken, or not allowed).
    """
    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("", port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def listen(message: dict[str, Any]) -> None:
    """Bind the master port on every address and hold it until stdin closes."""
    try:
        sock = bind_master_port(message.get("master", ""), int(message["port"]))
    except OSError as exc:
        print(json.dumps({"ok": False, "error": exc.strerror or str(exc)}), flush=True)
        return
    print(json.dumps({"ok": True, "port": sock.getsockname()[1]}), flush=True)
    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([sock, stdin], [], [], 1.0)
        if sock in ready:
            conn, _ = sock.accept()
            conn.close()
        if stdin in ready and not os.read(stdin, 4096):
            break
    sock.close()


def main(message: dict[str, Any]) -> None:
    """Entry point called by the loader with the message read from stdin."""
    if message.get("action") == "listen":
        listen(message)
    else:
        print(json.dumps(probe(message)), flush=True)
