"""Accelerators: CUDA (nccl or gloo with CPU staging) and MPS; skipped where absent."""

from __future__ import annotations

import pytest
import torch
from toys import assert_models_close, tiny_model, toy_dataset

from exogym import Trainer
from exogym.strategy import DiLoCoStrategy, OptimSpec, SimpleReduceStrategy

QUIET = dict(batch_size=16, val_size=16, val_interval=2, shuffle=False, logger=None,
             progress=False)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
mps = pytest.mark.skipif(not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()),
                         reason="no Apple MPS device on this machine")


def sgd():
    return OptimSpec(torch.optim.SGD, lr=0.1)


def cpu_reference(strategy, nodes):
    ds = toy_dataset()
    return Trainer(tiny_model(), ds, ds).fit(strategy=strategy, num_nodes=nodes, max_steps=4,
                                             device="cpu", **QUIET)


@cuda
def test_two_ranks_sharing_one_gpu_use_gloo_with_staging_and_match_cpu():
    ds = toy_dataset()
    gpu = Trainer(tiny_model(), ds, ds).fit(strategy=DiLoCoStrategy(optim_spec=sgd(), H=2),
                                            num_nodes=2, max_steps=4, device="cuda",
                                            devices=[0, 0], **QUIET)
    assert_models_close(gpu, cpu_reference(DiLoCoStrategy(optim_spec=sgd(), H=2), 2), atol=1e-4)


@cuda
def test_one_rank_per_gpu_uses_nccl_and_trains():
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    gpu = trainer.fit(strategy=SimpleReduceStrategy(optim_spec=sgd()), num_nodes=1, max_steps=4,
                      device="cuda", **QUIET)
    assert_models_close(gpu, cpu_reference(SimpleReduceStrategy(optim_spec=sgd()), 1), atol=1e-4)


@cuda
def test_autocast_on_cuda_trains():
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=1, max_steps=3, device="cuda",
                autocast=True, **QUIET)
    assert len(trainer.history) == 3


@mps
def test_mps_ranks_stage_through_the_cpu_and_match_cpu():
    ds = toy_dataset()
    got = Trainer(tiny_model(), ds, ds).fit(strategy=DiLoCoStrategy(optim_spec=sgd(), H=2),
                                            num_nodes=2, max_steps=4, device="mps", **QUIET)
    assert_models_close(got, cpu_reference(DiLoCoStrategy(optim_spec=sgd(), H=2), 2), atol=1e-4)


def test_device_none_picks_the_best_available():
    from exogym.run.devices import best_device_type, resolve_devices

    kind, _ = resolve_devices(None, None)
    assert kind == best_device_type()
    with pytest.raises(ValueError, match="devices= lists GPU indices"):
        resolve_devices("cpu", [0])
