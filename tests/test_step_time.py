"""The step time the planner starts from is a real step: optimizer and the strategy's own work in it."""

from __future__ import annotations

import time

import torch

from distributed.planning.estimate import measure_model
from distributed.profiles.profile import load_profile
from exogym import comm
from exogym.strategy import demo
from exogym.strategy.demo import DeMo


def test_measured_demo_step_includes_its_compression_and_decodes_every_planned_host(monkeypatch):
    compressed = []
    peers = []
    real_extract = DeMo._extract
    real_average = demo.average_coefficients

    def slow_extract(self, p, group, plan):
        compressed.append(p.shape)
        time.sleep(0.01)
        return real_extract(self, p, group, plan)

    def counting_average(indices, values, area):
        peers.append(len(values))
        return real_average(indices, values, area)

    monkeypatch.setattr(DeMo, "_extract", slow_extract)
    monkeypatch.setattr(demo, "average_coefficients", counting_average)
    threads = torch.get_num_threads()
    facts = measure_model(load_profile("digits-demo"), steps=3, warmup=1, num_nodes=4)

    tensors = len(facts.shapes)
    assert len(compressed) == 4 * tensors  # every step compressed every parameter
    assert set(peers) == {4}  # and decoded the payload of each of the 4 planned hosts
    assert facts.compute_s_per_step >= 0.01 * tensors  # the compression's time is in the step
    # The process is left as it was: no process group, nothing mirrored, its threads.
    assert not comm.is_initialized() and comm.group_size() == 1
    assert torch.get_num_threads() == threads


def test_measured_ddp_step_runs_the_optimizer(monkeypatch):
    steps = []
    real_step = torch.optim.AdamW.step

    def counting_step(self, *args, **kwargs):
        steps.append(1)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counting_step)
    facts = measure_model(load_profile("digits-ddp"), steps=2, warmup=1, num_nodes=3)
    assert len(steps) == 3 and facts.compute_s_per_step > 0
    assert facts.num_params == sum(torch.Size(s).numel() for s in facts.shapes)
