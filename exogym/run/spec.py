"""RunSpec and Placement: what a rank trains, and where this machine runs its ranks.

``make_run_spec`` turns ``fit``'s checked arguments (:class:`exogym.config.fit_args.RunArgs`)
and the model and data into the frozen spec every rank receives (pickled in a
local simulation, rebuilt from a profile on a remote host): it checks the
model and data, and resolves the device on the machine that builds it. What
differs per machine — how many ranks share it, its GPUs, the backend, whether
rank 0's weights are broadcast — travels beside the spec as a
:class:`Placement`, never written into it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset

from exogym.config.fit_args import RunArgs
from exogym.data.loading import is_factory
from exogym.run.devices import default_threads, resolve_devices
from exogym.run.model_loss import LossError, call_arguments, checked_loss
from exogym.strategy.strategy import Strategy


@dataclass(frozen=True, kw_only=True)
class RunSpec(RunArgs):
    """Everything a rank needs to train: ``fit``'s run arguments, the model and data.

    Built by :func:`make_run_spec`. Beyond :class:`RunArgs`, ``minibatch_size``
    is resolved (an integer, or ``'auto'`` until measured) and ``devices`` holds
    the CUDA indices the device resolved to.

    Args:
        model: the model every rank starts from.
        train_dataset, val_dataset: datasets or factories ``f(rank, num_nodes, is_train)``.
        device_type: ``'cpu'``, ``'cuda'`` or ``'mps'``.
    """

    model: torch.nn.Module
    train_dataset: Any
    val_dataset: Any
    device_type: str

    def placement_here(self) -> Placement:
        """Every rank on this machine (a simulation), on ``devices``."""
        return Placement(ranks_per_machine=self.num_nodes, devices=self.devices)

    @property
    def accumulation_steps(self) -> int:
        """Minibatches per optimizer step."""
        return self.batch_size // self.minibatch_size

    def config(self) -> dict[str, Any]:
        """Plain settings of the run, for logs and the saved run config."""
        plain = self.run_values()
        plain["strategy"] = self.strategy.__config__()
        if self.network is not None:
            plain["network"] = {"bandwidth_bits_per_s": self.network.bandwidth,
                                "latency_s": self.network.latency_s,
                                "rank_bandwidth_bits_per_s": self.network.rank_bandwidth,
                                "topology": self.network.topology}
        plain["device_type"] = self.device_type
        plain["model"] = type(self.model).__name__
        plain["trainable_parameters"] = sum(
            p.numel() for p in self.model.parameters() if p.requires_grad
        )
        return plain


@dataclass(frozen=True)
class Placement:
    """Where this machine runs its ranks: what differs per machine, beside the run spec.

    Args:
        ranks_per_machine: ranks sharing this machine's cores (a simulation: all of them).
        devices: the CUDA indices this machine's ranks take, rank r ``devices[r % len]``
            (None off CUDA).
        backend: the process group's backend; None: nccl when every rank has a GPU
            of its own, else gloo.
        broadcast_init: rank 0's initial weights are broadcast to the others before
            the first step (hosts whose seeded initialisation may differ).
        throttle: slows this machine's rank down from outside (an injected ``slow``
            fault, :class:`exogym.run.timing.Throttle`); None: never.
        stacked: the ranks of each packed process are computed as one batched model
            (``fit(stack=...)``, :mod:`exogym.run.stack`).
        processes: the processes a packed simulation runs its ranks in (None: one per
            rank); a process's ranks share its device.
    """

    ranks_per_machine: int
    devices: list[int] | None = None
    backend: str | None = None
    broadcast_init: bool = False
    throttle: Any = field(default=None, compare=False)
    stacked: bool = False
    processes: int | None = None

    def device_of(self, spec: RunSpec, rank: int) -> torch.device:
        """The device rank ``rank`` trains on here."""
        from exogym.comm.packed import process_of
        from exogym.run.devices import rank_device

        process = None if self.processes is None else process_of(spec.num_nodes,
                                                                  self.processes, rank)
        return rank_device(spec.device_type, self.devices, rank, process)

    def threads_per_rank(self, spec: RunSpec) -> int:
        """``spec.num_threads``, or this machine's cores shared by the ranks it runs."""
        return spec.num_threads or default_threads(self.ranks_per_machine)


def _check_dataset(name: str, dataset: Any) -> None:
    if dataset is None:
        raise ValueError(f"{name} is None; pass a Dataset or a factory f(rank, num_nodes, is_train)")
    if is_factory(dataset):
        return
    if not hasattr(dataset, "__getitem__") and not hasattr(dataset, "__iter__"):
        raise TypeError(f"{name} must be a torch Dataset or a factory f(rank, num_nodes, "
                        f"is_train), got {type(dataset).__name__}")
    if hasattr(dataset, "__len__") and len(dataset) == 0:
        raise ValueError(f"{name} is empty")


class DataWarning(UserWarning):
    """The data and the run's settings do not fit as asked: e.g. a batch larger than a
    rank's share of the data. The run goes on; the warning says what it does instead."""


def check_data(train_dataset: Any, num_nodes: int, batch_size: int | None,
               shared_samples: bool = False, partition: str = "iid") -> None:
    """Refuse ranks that would have no sample of their own (unless ``shared_samples``,
    which warns instead), and warn (:class:`DataWarning`) when ``batch_size`` is larger
    than one rank's share. A dataset without a length, or a factory (which builds each
    rank's data itself), is not checked.

    Raises:
        ValueError: fewer training samples than ranks, and ``shared_samples`` not given
            (or given with a split by label, which has no samples to share out).
    """
    if is_factory(train_dataset) or not hasattr(train_dataset, "__len__") or \
            isinstance(train_dataset, IterableDataset):
        return
    total = len(train_dataset)
    if total < num_nodes:
        left = f"rank {total}" if total == num_nodes - 1 else f"ranks {total}..{num_nodes - 1}"
        samples = f"{total} sample{'s' if total != 1 else ''}"
        if not shared_samples:
            raise ValueError(
                f"train_dataset has {samples} for {num_nodes} ranks: {left} would have no "
                f"sample of their own and train on copies of other ranks' samples; give at "
                f"least {num_nodes} samples, use num_nodes={total}, or pass "
                "shared_samples=True to train that way (a dataset factory f(rank, num_nodes, "
                "is_train) gives each rank whatever data it builds)")
        if partition.strip() != "iid":
            raise ValueError(
                f"shared_samples=True shares out an even split; partition={partition!r} "
                f"splits {samples} by label among {num_nodes} ranks and leaves some with none: "
                "use partition='iid' or more samples")
        warnings.warn(f"train_dataset has {samples} for {num_nodes} ranks: {left} train on "
                      "copies of other ranks' samples (shared_samples=True)", DataWarning,
                      stacklevel=4)
    share = -(-total // num_nodes)  # the even split pads the last ranks' shares
    if batch_size is not None and batch_size > share:
        warnings.warn(f"batch_size={batch_size} is larger than one rank's share of the data "
                      f"({share} of {total} training samples over {num_nodes} ranks): a step "
                      f"trains {share} samples a rank, not {batch_size}; lower batch_size or "
                      "the number of ranks", DataWarning, stacklevel=4)  # fit()'s caller


def sample_batch(train_dataset: Any, dataloader_kwargs: dict[str, Any] | None,
                 collate: bool = True) -> Any:
    """A batch of the first two training samples (one if there is one), collated as the
    ranks' loaders collate; None for a factory or a dataset without indexing
    (``collate=False``: whether there is one, True, without collating it)."""
    if is_factory(train_dataset) or isinstance(train_dataset, IterableDataset) or \
            not hasattr(train_dataset, "__len__") or len(train_dataset) == 0:
        return None
    if not collate:
        return True
    from exogym.data.loading import eval_loader

    samples = [0, 1][:len(train_dataset)]  # two: a loss per sample is no scalar then
    return next(iter(eval_loader(train_dataset, samples, len(samples), dataloader_kwargs)))


#: Samples spread over a training set that :func:`check_collates` collates into one batch.
SPREAD_SAMPLES = 16


def check_collates(train_dataset: Any, dataloader_kwargs: dict[str, Any] | None) -> None:
    """Collate samples spread over ``train_dataset`` (the first two, the last, and evenly
    between: about :data:`SPREAD_SAMPLES` in all) into one batch as the ranks' loaders
    do, so that samples of different lengths are refused before any rank starts.

    Raises:
        ValueError: the samples do not collate (``train_dataset:`` and the loader's reason).
    """
    from exogym.data.loading import eval_loader

    n = len(train_dataset)
    picked = sorted({*range(min(2, n)),
                     *(round(i * (n - 1) / (SPREAD_SAMPLES - 1)) for i in range(SPREAD_SAMPLES))})
    try:
        next(iter(eval_loader(train_dataset, picked, len(picked), dataloader_kwargs)))
    except ValueError as exc:
        raise ValueError(f"train_dataset: {exc} (checked before any rank started)") from None


def check_forward(model: torch.nn.Module, train_dataset: Any,
                  dataloader_kwargs: dict[str, Any] | None) -> None:
    """Call ``model`` on a batch of two training samples (one if there is one), as the ranks
    will (:mod:`exogym.run.model_loss`), and refuse an output that holds no scalar loss:
    before any process starts, in one line.

    The model is in eval mode and no gradient is kept, so nothing of it changes (no
    running statistics, no dropout draw). A dataset without indexing, or a factory, is
    not checked here, nor a forward that fails outside a rank (one that asks
    ``torch.distributed`` its rank, say): the ranks check each step.

    Raises:
        LossError: (a TypeError) naming what ``forward`` returned.
    """
    if sample_batch(train_dataset, dataloader_kwargs, collate=False) is None:
        return
    check_collates(train_dataset, dataloader_kwargs)
    batch = sample_batch(train_dataset, dataloader_kwargs)
    samples = [0, 1][:len(train_dataset)]
    training = model.training
    model.eval()
    args, kwargs = call_arguments(model, batch)
    try:
        with torch.no_grad():
            output = model(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a forward that needs a rank (its process group,
        return  # its device, ...) is checked by the ranks, which report its own error
    finally:
        model.train(training)
    where = f" on a batch of {len(samples)} training sample{'s' if len(samples) > 1 else ''}"
    try:
        checked_loss(output, batch, "model.forward(**batch)" if kwargs else "model.forward(batch)",
                     where)
    except LossError as exc:
        raise LossError(f"checked before any rank started: {exc}") from None


def make_run_spec(model: torch.nn.Module, train_dataset: Any, val_dataset: Any,
                  args: RunArgs) -> RunSpec:
    """Check the model and data against ``args`` and return the spec.

    The device is resolved here (it must exist on this machine);
    ``minibatch_size`` may stay ``'auto'`` until measured.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (none has requires_grad=True)")
    if not isinstance(args.strategy, Strategy):
        raise TypeError(
            "strategy must be a Strategy instance such as DiLoCoStrategy(H=100) or "
            f"SimpleReduceStrategy(), got {args.strategy!r}"
        )
    args.strategy.validate(model, args.num_nodes)  # the strategy's own checks, before any rank
    _check_dataset("train_dataset", train_dataset)
    if args.partition != "iid" and is_factory(train_dataset):
        raise ValueError(f"partition={args.partition!r} splits a training dataset across the "
                         "ranks, but train_dataset is a factory f(rank, num_nodes, is_train) "
                         "that builds each rank's data itself: pass the whole dataset, or "
                         "leave partition='iid'")
    if args.balance == "batch" and isinstance(train_dataset, IterableDataset):
        raise ValueError("balance='batch' gives each rank its own number of samples per step, "
                         "which needs a training dataset with len() and indexing: an "
                         "IterableDataset streams fixed minibatches; use a map-style Dataset "
                         "or balance='none'")
    if args.val_size:
        _check_dataset("val_dataset", val_dataset)
    device_type, device_ids = resolve_devices(args.device, args.devices)
    if args.autocast and device_type == "mps" and not hasattr(torch, "mps"):
        raise ValueError("autocast on MPS needs a newer torch; set autocast=False")
    values = {**args.run_values(), "minibatch_size": args.minibatch(), "devices": device_ids}
    return RunSpec(**values, model=model, train_dataset=train_dataset, val_dataset=val_dataset,
                   device_type=device_type)
