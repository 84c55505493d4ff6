"""Screenshot of the browser dashboard during a real run, for the README (docs/dashboard.png).

Starts ``cli_typer.py distributed-train PROFILE --web`` (a local simulation),
opens the printed URL in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by tests/setup_system.sh; selenium from the dev
extra), waits until the ranks are well into the run, and writes the PNG.

    python -m bench.web_screenshot                      # -> docs/dashboard.png
    python -m bench.web_screenshot --out /tmp/page.png --fraction 0.9
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.harness import ROOT
from exogym.base.io import atomic_write_bytes

CHROMEDRIVER = "/usr/bin/chromedriver"
#: A small digits run (three ranks, DiLoCo) long enough to watch for a while.
RUN = ["digits-diloco", *(f"--set={kv}" for kv in (
    "num_nodes=3", "hidden=128", "batch_size=32", "max_steps=2000", "lr=0.001",
    "val_interval=50", "H=50", "checkpoint_interval=None"))]


def browser(width: int = 1400, height: int = 980):
    """Headless Chromium driven by selenium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.web_screenshot",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="take the picture once rank 0 has done this share of its steps")
    args = parser.parse_args()
    command = [sys.executable, str(ROOT / "cli_typer.py"), "distributed-train", *RUN, "--web"]
    env = {**os.environ, "COLUMNS": "120", "PYTHONPATH": str(ROOT)}  # this checkout's code
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, cwd="/tmp", env=env)
    try:
        url = None
        for line in proc.stdout:
            found = re.search(r"dashboard: (http://\S+)", line)
            if found:
                url = found.group(1)
                break
        if url is None:
            print("the command printed no dashboard URL", file=sys.stderr)
            return 1
        # keep reading its output, so that a full pipe never stalls the run
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        driver = browser()
        try:
            driver.get(url)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                row = driver.execute_script(
                    "const r = document.querySelector('tr.rank-row');"
                    "return r ? [Number(r.dataset.step), r.querySelector('.step').textContent]"
                    " : null;")
                if row and "/" in row[1]:
                    total = int(row[1].split("/")[1])
                    if row[0] >= args.fraction * total:
                        break
                time.sleep(0.3)
            time.sleep(0.6)  # one more redraw of the charts
            written = atomic_write_bytes(args.out, driver.get_screenshot_as_png())
            print(f"screenshot written to {written}")
        finally:
            driver.quit()
    finally:
        proc.wait(timeout=600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
