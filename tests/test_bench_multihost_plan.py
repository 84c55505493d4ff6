"""``python -m bench.multihost --plan``: the share every host is held to, and the strategies as
the bench writes them, settled and printed without building a host (no root, no namespaces).

The bench is run as a command: no test imports a bench (tests/test_bench_package.py)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORES = os.cpu_count() or 1


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.multihost", "--plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_default_share_is_the_largest_equal_share_that_leaves_the_launcher_a_quarter_core():
    done = plan("--hosts", "2")
    assert done.returncode == 0, done.stderr
    share = math.floor(min(1.0, (CORES - 0.25) / 2) / 0.05 + 1e-9) * 0.05
    assert done.stdout.startswith(f"2 hosts, each held to {round(share, 2):g} of a core")


def test_a_given_share_is_used_for_every_host():
    done = plan("--hosts", "2", "--share", "0.3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("2 hosts, each held to 0.3 of a core (0.6 of this machine's")


def test_shares_under_a_quarter_core_are_refused_with_the_hosts_that_fit():
    hosts = 4 * CORES + 1  # (cores - 0.25) / hosts < 0.25 on any machine
    done = plan("--hosts", str(hosts))
    assert done.returncode == 2 and done.stdout == ""
    fits = int((CORES - 0.25) // 0.25)
    assert "under the 0.25 core a host needs here" in done.stderr
    assert f"use {fits} hosts or fewer" in done.stderr
    assert plan("--hosts", "2", "--share", "0.2").returncode == 2


def test_hosts_that_would_need_more_cores_than_the_machine_has_are_refused():
    done = plan("--hosts", str(CORES + 1), "--share", "1")
    assert done.returncode == 2
    assert f"need {CORES + 1:g} cores, more than this machine's {CORES}" in done.stderr


def test_every_recommended_strategy_parses_to_its_settings_and_period():
    done = plan("--hosts", "2", "--share", "0.3", "--strategies",
                "ddp,diloco,streaming_diloco:100:4,sparseloco,sparseloco:20,diloco:10")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()[1:]
    assert [line.split(";")[:2] for line in lines] == [
        ["DDP: strategy=ddp", " period 1"],
        ["DiLoCo H=100: strategy=diloco H=100", " period 100"],
        ["Streaming DiLoCo H=100 F=4: strategy=streaming_diloco H=100 num_fragments=4",
         " period 100"],
        ["SparseLoCo H=30: strategy=sparseloco H=30", " period 30"],
        ["SparseLoCo H=20: strategy=sparseloco H=20", " period 20"],
        ["DiLoCo H=10: strategy=diloco H=10", " period 10"],
    ]
    # a window of whole periods: DiLoCo H=100 from its first round
    assert "steps 100..300 timed of 301" in lines[1]


@pytest.mark.slow
def test_impossible_strategy_specs_are_refused_with_how_to_write_them():
    for spec in ("streaming_diloco:4:8", "sparseloco:0", "diloco:x", "ddp:3", "fedavg"):
        done = plan("--hosts", "2", "--share", "0.3", "--strategies", spec)
        assert done.returncode == 2, spec
        assert f"strategy {spec!r} is not understood" in done.stderr
        assert "streaming_diloco[:H[:FRAGMENTS]]" in done.stderr
