"""``python -m bench.gpu`` runs: its CPU part here (``--quick``), and its GPU part where CUDA is.

The bench runs as a command (no test imports a bench): the printed table must
hold the three modes (one process per rank, packed, stacked) with a number of
samples per second each, the figures in ``--json`` must agree with it and with
the model-FLOPs formula, and without an accelerator the output must say that
the GPU part did not run and why.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
import warm
from ranks import ROOT

MODES = ("process per rank", "packed", "stacked")
ACCELERATOR = torch.cuda.is_available() or (
    hasattr(torch.backends, "mps") and torch.backends.mps.is_available())


def run_bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONIOENCODING="utf-8")
    done = subprocess.run([*warm.python(), "-m", "bench.gpu", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def table_rows(stdout: str) -> list[dict[str, str]]:
    """The printed table's rows (rich's box lines), each cell by its column; a row that
    wraps onto more lines is its first line."""
    header = next(line for line in stdout.splitlines() if line.startswith("┃"))
    columns = [c.strip() for c in header.strip("┃").split("┃")]
    rows = []
    for line in stdout.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            if cells[0]:  # a wrapped row's next lines have an empty first cell
                rows.append(dict(zip(columns, cells)))
    return rows


@pytest.mark.slow
def test_cpu_part_prints_every_mode_with_samples_per_second_and_why_the_gpu_part_did_not_run(
        tmp_path):
    figures = tmp_path / "gpu.json"
    # With an accelerator the CPU part runs only when asked for.
    args = ("--quick", "--json", str(figures), "--logs", str(tmp_path / "logs"),
            *(("--device", "cpu") if ACCELERATOR else ()))
    done = run_bench(*args, timeout=240)

    rows = table_rows(done.stdout)
    assert [r["mode"] for r in rows] == list(MODES), done.stdout
    for row in rows:
        assert float(row["samples/s"]) > 0, row
        assert row["workload"] == "chargpt-bench" and row["MFU"] == "unknown", row
    assert "GPU part: did not run: " in done.stdout
    if not ACCELERATOR:
        assert "no CUDA or MPS device" in done.stdout

    report = json.loads(figures.read_text())
    assert report["gpu_part"]["ran"] is False and report["device"] == "cpu"
    assert report["device_name"] in " ".join(done.stdout.split())  # the table's heading
    by_mode = {r["mode"]: r for r in report["rows"]}
    assert list(by_mode) == list(MODES)
    for mode, row in by_mode.items():
        assert row["samples_per_s"] == pytest.approx(row["samples"] / row["fit_s"])
        assert row["samples"] == row["nodes"] * row["steps"] * row["batch_size"]
        assert f"{row['samples_per_s']:.1f}" == next(
            r["samples/s"] for r in rows if r["mode"] == mode)
        assert row["flops_per_token"] == (6 * row["params"] + 12 * row["n_layer"]
                                          * row["block_size"] * row["n_embd"])
        assert row["pss_bytes"] > 0 and row["mfu"] is None
    assert by_mode["process per rank"]["processes"] == by_mode["process per rank"]["nodes"]
    assert by_mode["packed"]["processes"] < by_mode["packed"]["nodes"]
    assert by_mode["stacked"]["stacked"] is True and by_mode["packed"]["stacked"] is False


def test_gpu_part_prints_every_row_measured_or_refused_with_the_device_in_the_heading(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here (torch.cuda.is_available() is False): the GPU part "
                    "of bench.gpu is not run")
    figures = tmp_path / "gpu.json"
    done = run_bench("--quick", "--json", str(figures), "--logs", str(tmp_path / "logs"),
                     timeout=600)

    report = json.loads(figures.read_text())
    assert report["gpu_part"]["ran"] is True
    assert torch.cuda.get_device_name(0) in " ".join(done.stdout.split())
    rows = table_rows(done.stdout)
    assert {r["mode"] for r in rows} == {"alone", *MODES}, done.stdout
    for row in rows:
        assert row["note"].startswith("refused:") or float(row["samples/s"]) > 0, row
    for row in report["rows"]:
        if "samples_per_s" in row:
            # every rank process noted its peak: the sum is at least the model's parameters
            assert row["peak_allocated_bytes"] >= 4 * row["params"], row
        else:
            assert "refused" in row, row
    assert "MFU at K=4 over one rank's MFU alone" in done.stdout
