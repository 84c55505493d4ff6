"""The simulator on an accelerator: samples per second, peak memory and MFU of K ranks on one GPU.

Workloads, each trained with DiLoCo (AdamW inside, H=20, or every step of a
run shorter than that), one evaluation at the end:

- ``chargpt-bench``: ``chargpt_task(block_size=64, n_layer=4, n_head=4,
  n_embd=256)`` (3.3M parameters), batch 16 per rank, 100 steps, at K=8 and K=64;
- ``gpt-124m``: ``gpt_task`` at :data:`bench.real_size.MODELS` ``["124m"]`` with
  real_size's ``block_size`` (64), batch 16 per rank, 40 steps, at K=8 and at
  K=1 (one rank alone), so that "MFU at K=8 over one rank's MFU alone" can be
  printed (the same model on the same device: the ratio of samples per second).

Each workload at K > 1 runs in three modes, each a ``Trainer(...).fit(...)``
with ``device=`` the accelerator: one process per rank (``processes=K``),
packed (``processes=P``: 1 on an accelerator, ``--packed`` to change it) and
stacked (``processes=P, stack=True``: the ranks of a process computed as one
batched model, :mod:`exogym.run.stack`). A mode ``fit`` refuses with a
``ValueError`` (a model that cannot be stacked, say) prints as ``refused:`` and
the first line of the refusal. With ``--gym PATH`` exo-explore/gym runs the same
workloads as :mod:`bench.real_size` runs it (one process per rank; on Linux in
a network namespace with a ``lo0``, so as root); a run of it that fails or
passes ``--deadline`` prints what happened.

Every run is a child process of its own (:mod:`bench.gpu.child`). Its figures:

- **samples/s**: the samples all ranks trained (K x steps x batch) over the
  wall time of ``fit`` (process start-up and the evaluation included);
- **peak memory**: on CUDA, the sum over the run's processes of
  ``torch.cuda.max_memory_allocated`` (tensors allocated by torch's caching
  allocator, at their peak; not the CUDA contexts nor the allocator's unused
  reserve), as each process last noted it after a training step
  (:mod:`bench.gpu.peak`); on the CPU, the peak of the summed proportional set
  size of the run's processes, sampled every 0.2 s
  (:class:`bench.harness.machine.PeakPss`); on MPS, not measured;
- **MFU**: model FLOPs per second over the device's peak FLOPs for the dtype
  the run computes in (fp32; bf16 with ``--autocast``; tf32 when
  ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``), from :data:`PEAK_TFLOPS` ("unknown"
  for a device not in it). Model FLOPs per token: 6 x trainable parameters +
  12 x n_layer x block_size x n_embd (attention).

Without a CUDA or MPS device (or with ``--device cpu``) it runs the CPU part
instead: chargpt-bench at K=8 for 3 steps in the three modes (about a minute on
2 cores), and says that the GPU part did not run and why. ``--quick`` makes
every workload tiny (a model of 1 layer, 32 wide, at most 4 ranks, 2 steps).

    python -m bench.gpu
    python -m bench.gpu --autocast --json gpu.json
    sudo python -m bench.gpu --gym ../gym
    python -m bench.gpu --quick --device cpu

Its parts: :mod:`bench.gpu.child` one measured run, :mod:`bench.gpu.peak` the
strategy that notes each rank process's peak, :mod:`bench.gpu.flops` the model
FLOPs and the device table, :mod:`bench.gpu.runs` the rows and the table,
``__main__`` the command line.
"""

from bench.real_size import MODELS, SIM

#: The workloads: the task (``chargpt`` or ``gpt``), its settings, the ranks, batch and steps.
WORKLOADS: dict[str, dict] = {
    "chargpt-bench": {"task": "chargpt",
                      "settings": {"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 256},
                      "nodes": [8, 64], "batch_size": 16, "max_steps": 100},
    "gpt-124m": {"task": "gpt",
                 "settings": {**MODELS["124m"], "block_size": SIM["block_size"],
                              "tokens": 400_000},
                 "nodes": [1, 8], "batch_size": 16, "max_steps": 40},
}
#: The CPU part: a workload, its ranks and steps.
CPU_PART = {"workload": "chargpt-bench", "nodes": [8], "max_steps": 3}
#: The strategy of every run: DiLoCo with AdamW inside (H is capped at the run's steps).
STRATEGY = {"H": 20, "lr": 6e-4}
#: ``--quick``: the model's settings replaced, at most this many ranks, batch and steps.
QUICK = {"settings": {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32},
         "gpt_settings": {"vocab_size": 256, "tokens": 20_000},
         "max_nodes": 4, "batch_size": 4, "max_steps": 2}
#: The folder the ranks note their processes' peak CUDA memory in (:mod:`bench.gpu.peak`).
PEAK_DIR_ENV = "BENCH_GPU_PEAK_DIR"
#: The modes of a run of K > 1 ranks, in the order they print.
MODES = ("process per rank", "packed", "stacked")

#: Peak TFLOPS by dtype from NVIDIA's datasheets: fp32 on the CUDA cores, tf32 and bf16 on
#: the tensor cores, dense (the datasheets' figures "with sparsity" are twice these). Each
#: entry: a pattern searched in ``torch.cuda.get_device_name()`` (the first that matches
#: wins: PCIe and NVL before the SXM part), the name shown, the peaks by dtype.
PEAK_TFLOPS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"H100.*PCIe", "H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5}),
    (r"H100.*NVL", "H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5}),
    (r"H100", "H100 SXM", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5}),
    (r"H200.*NVL", "H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5}),
    (r"H200", "H200 SXM", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5}),
    (r"A100", "A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0}),
    (r"L40S", "L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0}),
    (r"\bL4\b", "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0}),
)
