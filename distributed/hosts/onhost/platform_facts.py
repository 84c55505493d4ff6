"""What a host's own Python says about its platform, before any environment exists there.

Run with the host's system interpreter (``python3``) by the launcher's loader; prints
one JSON object: the interpreter's version and implementation, the machine, the C
library (glibc or musl) or the macOS version, the home folder, whether ``venv`` can
install pip by itself (``ensurepip``), whether the package index answers, and what
the environment at ``venv`` holds already (the marker setup wrote there). Standard
library only; imports nothing from this project.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import urllib.request


def index_answers(url: str, timeout: float) -> bool:
    """Whether ``url`` (a package index) answers within ``timeout`` seconds."""
    if not url:
        return False
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310
            return 200 <= response.status < 400
    except Exception:  # any failure means: not reachable from here
        return False


def venv_facts(venv: str, marker: str) -> dict:
    """Whether ``venv`` exists, is empty, is a virtual environment (``pyvenv.cfg``), has an
    interpreter, and the marker setup left in it (or None)."""
    venv = os.path.expanduser(venv)
    python = os.path.join(venv, "bin", "python")
    found = None
    try:
        with open(os.path.join(venv, marker), encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        found = None
    exists = os.path.isdir(venv)
    return {"python": os.access(python, os.X_OK), "marker": found, "exists": exists,
            "empty": exists and not os.listdir(venv),
            "is_venv": os.path.isfile(os.path.join(venv, "pyvenv.cfg"))}


def main(message: dict) -> None:
    """Print the facts as one JSON line; ``message`` has ``venv``, ``marker``, ``index``
    and ``timeout``."""
    try:
        import ensurepip  # noqa: F401

        ensurepip_ok = True
    except ImportError:
        ensurepip_ok = False
    try:
        import venv  # noqa: F401

        venv_ok = True
    except ImportError:
        venv_ok = False
    libc, libc_version = platform.libc_ver()
    facts = {
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "executable": sys.executable,
        "system": platform.system(),
        "machine": platform.machine(),
        "libc": libc or None,
        "libc_version": libc_version or None,
        "mac_version": platform.mac_ver()[0] or None,
        "home": os.path.expanduser("~"),
        "venv_module": venv_ok,
        "ensurepip": ensurepip_ok,
        "index": index_answers(message.get("index", ""), float(message.get("timeout", 5))),
        "env": venv_facts(message["venv"], message["marker"]) if message.get("venv") else None,
    }
    print(json.dumps(facts))
