"""``python -m bench.gpu``: the command line (see the package's docstring)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import bench.gpu
from bench.gpu import CPU_PART, STRATEGY, WORKLOADS


def resolve_device(asked: str) -> tuple[str, str | None]:
    """The device the runs use, and why the GPU part does not run (None: it does).

    Raises:
        SystemExit: the device asked for is not here, saying what torch sees.
    """
    import torch

    if asked not in ("auto", "cpu", "mps") and not re.fullmatch(r"cuda(:\d+)?", asked):
        raise SystemExit(f"--device must be auto, cpu, cuda, cuda:N or mps, got {asked!r}")
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if asked == "cpu":
        return "cpu", "--device cpu was given"
    if asked.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {asked}: torch {torch.__version__} sees no CUDA device "
                             "(torch.cuda.is_available() is False)")
        return asked, None
    if asked == "mps":
        if not mps:
            raise SystemExit("--device mps: torch.backends.mps.is_available() is False here")
        return "mps", None
    if torch.cuda.is_available():
        return "cuda", None
    if mps:
        return "mps", None
    cuda = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
            else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
    return "cpu", f"no CUDA or MPS device: {cuda}, and torch.backends.mps.is_available() is False"


def device_name(device: str) -> str:
    """The accelerator's name (``torch.cuda.get_device_name``), or the CPU's."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device).index or 0)
    if device == "mps":
        return f"Apple GPU (MPS, {platform.machine()})"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def check_gym(gym: Path) -> None:
    """Refuse a ``--gym`` that is no checkout of exo-explore/gym, or whose exogym does not
    import here, saying what to do."""
    if not (gym / "exogym" / "trainer.py").is_file():
        raise SystemExit(f"--gym {gym}: no exogym/trainer.py there; clone "
                         "https://github.com/exo-explore/gym and give its folder")
    tried = subprocess.run([sys.executable, "-c", "import exogym.trainer"], cwd=gym,
                           env=dict(os.environ, PYTHONPATH=str(gym)), capture_output=True,
                           text=True)
    if tried.returncode != 0:
        last = (tried.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"--gym {gym}: its exogym does not import here ({last}); install what "
                         "it needs (einops, at least: pip install einops)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu",
                                     description=bench.gpu.__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA, else MPS, else the CPU part), cuda, cuda:N, mps, cpu")
    parser.add_argument("--packed", type=int, default=None, metavar="P",
                        help="processes of the packed and stacked modes (default: 1 on an "
                             "accelerator, on the CPU its cores up to half the ranks)")
    parser.add_argument("--autocast", action="store_true",
                        help="forward passes in bfloat16 autocast (MFU against the bf16 peak)")
    parser.add_argument("--quick", action="store_true", help="every workload tiny")
    parser.add_argument("--gym", type=Path, default=None,
                        help="a checkout of https://github.com/exo-explore/gym to run too")
    parser.add_argument("--deadline", type=float, default=600.0,
                        help="seconds a run may take before it is stopped (default 600)")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--logs", type=Path, default=None,
                        help="folder for every run's log and figures (default: a new "
                             "temporary folder, printed)")
    args = parser.parse_args(argv)
    if args.packed is not None and args.packed < 1:
        raise SystemExit(f"--packed must be 1 or more, got {args.packed}")
    if args.deadline <= 0:
        raise SystemExit(f"--deadline must be seconds above 0, got {args.deadline}")
    if args.gym is not None:
        check_gym(args.gym)

    from bench.gpu.flops import compute_dtype, known_device, peak_flops
    from bench.gpu.runs import measure, plan, say_row, table
    from bench.real_size.sim import GymNamespace

    device, why_not = resolve_device(args.device)
    device_type = device.split(":")[0]
    name = device_name(device)
    dtype = compute_dtype(args.autocast)
    peak = peak_flops(name, dtype) if device_type == "cuda" else None
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
    work = args.logs or Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    print(f"{name} ({device}); logs in {work}", flush=True)
    runs = plan(device_type, args.quick, args.packed, args.gym is not None)
    rows: list[dict[str, Any]] = []
    with GymNamespace() if args.gym is not None else contextlib.nullcontext() as space:
        prefix = space.prefix() if space is not None else []
        for run in runs:
            rows.append(measure(run, device, args.quick, args.autocast, work, args.gym, prefix,
                                args.deadline, peak))
            print(say_row(rows[-1]), flush=True)
    known = known_device(name) if device_type == "cuda" else None
    peak_text = (f"peak {peak / 1e12:.1f} TFLOPS {dtype} ({known})" if peak is not None
                 else f"peak FLOPs unknown for this device in {dtype}")
    part = "GPU part" if why_not is None else "CPU part"
    table(rows, device_type, f"bench.gpu, {part}{' (--quick)' if args.quick else ''}: {name} "
          f"({device}), {dtype}, {peak_text}; DiLoCo H={STRATEGY['H']} (at most the run's "
          "steps), AdamW lr " + str(STRATEGY["lr"]))
    if why_not is not None:
        print(f"GPU part: did not run: {why_not}", flush=True)
    if args.json:
        report = {"device": device, "device_name": name, "dtype": dtype,
                  "peak_flops": peak, "cores": os.cpu_count(), "quick": args.quick,
                  "strategy": STRATEGY, "workloads": WORKLOADS, "cpu_part": CPU_PART,
                  "gpu_part": {"ran": why_not is None, "why_not": why_not}, "rows": rows}
        args.json.write_text(json.dumps(report, indent=2))
        print(f"figures in {args.json}")


if __name__ == "__main__":
    main()
