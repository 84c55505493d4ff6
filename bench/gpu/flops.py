"""Model FLOPs of a GPT step and the accelerator's peak, for MFU (model FLOPs utilization).

Model FLOPs per token: 6 x trainable parameters (forward and backward of every
weight) + 12 x n_layer x block_size x n_embd (attention's scores and weighted
sums, forward and backward). Standard library only: the command line imports it.
"""

from __future__ import annotations

import os
import re

from bench.gpu import PEAK_TFLOPS


def flops_per_token(params: int, n_layer: int, block_size: int, n_embd: int) -> int:
    """Model FLOPs of one token trained (forward and backward)."""
    return 6 * params + 12 * n_layer * block_size * n_embd


def compute_dtype(autocast: bool) -> str:
    """The dtype a run's matrix products compute in: ``bf16`` under ``autocast``; ``tf32``
    when ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` (the ranks inherit it); else ``fp32``
    (torch's default for float32 matrix products)."""
    if autocast:
        return "bf16"
    return "tf32" if os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1" else "fp32"


def known_device(device_name: str) -> str | None:
    """The name :data:`bench.gpu.PEAK_TFLOPS` knows ``device_name`` by (None: not in it)."""
    for pattern, name, _ in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return name
    return None


def peak_flops(device_name: str, dtype: str) -> float | None:
    """The device's peak FLOPs per second in ``dtype`` (None: the device is not known)."""
    for pattern, _, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peaks[dtype] * 1e12 if dtype in peaks else None
    return None


def mfu(samples_per_s: float, tokens_per_sample: int, flops_token: int,
        peak: float | None) -> float | None:
    """Model FLOPs per second over ``peak`` (None where the peak is not known)."""
    if peak is None:
        return None
    return samples_per_s * tokens_per_sample * flops_token / peak
