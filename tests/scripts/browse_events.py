"""Browse for exogym agents and print one JSON line per change: {"event", "name", "t"}.

Run inside a network namespace by tests/test_discovery.py; runs until killed.
"""

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distributed.hosts.mdns import Browser  # noqa: E402


def report(event: str, advert) -> None:
    print(json.dumps({"event": event, "name": advert.name, "t": time.time()}), flush=True)


with Browser(on_change=report):
    print(json.dumps({"event": "ready", "t": time.time()}), flush=True)
    threading.Event().wait()
