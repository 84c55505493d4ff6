"""Browse for exogym agents and print one JSON line per change: {"event", "name", "t"}.

Run inside a network namespace by tests/test_discovery.py, with the project on PYTHONPATH;
runs until killed.
"""

import json
import threading
import time

from distributed.hosts.mdns import Browser


def report(event: str, advert) -> None:
    print(json.dumps({"event": event, "name": advert.name, "t": time.time()}), flush=True)


with Browser(on_change=report):
    print(json.dumps({"event": "ready", "t": time.time()}), flush=True)
    threading.Event().wait()
