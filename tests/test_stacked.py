"""Stacked ranks (fit(stack=...)): the ranks of a packed process computed as one batched model."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from exogym import Trainer
from exogym.run.stack import StackError, probe_model
from exogym.strategy import (
    AsyncDiLoCoStrategy,
    DESLOCStrategy,
    DiLoCoStrategy,
    FedAvgStrategy,
    MuLoCoStrategy,
    SimpleReduceStrategy,
    SparseLoCoStrategy,
    SPARTAStrategy,
    StreamingDiLoCoStrategy,
)
from exogym.strategy.strategy import Strategy
from tests.toys import BNNet, TinyNet, assert_models_close, tiny_model, toy_dataset

QUIET = dict(logger=None, progress=False)

STRATEGIES = {
    "ddp": lambda: SimpleReduceStrategy(optim_spec="adamw", lr=0.01),
    "diloco": lambda: DiLoCoStrategy(H=2, inner_optim="adamw", lr=0.01),
    "fedavg-islands": lambda: FedAvgStrategy(H=2, island_size=2, inner_optim="sgd", lr=0.1),
    "sparta": lambda: SPARTAStrategy(p_sparta=0.1, inner_optim="sgd", lr=0.1),
    "streaming-diloco": lambda: StreamingDiLoCoStrategy(H=2, num_fragments=2, inner_optim="sgd",
                                                        lr=0.1),
    "sparseloco": lambda: SparseLoCoStrategy(H=2),
    "desloc": lambda: DESLOCStrategy(inner_optim="adamw", lr=0.01),
    "muloco": lambda: MuLoCoStrategy(H=2),
}


def run(strategy, stack, processes, num_nodes=4, max_steps=6, model=None, **kwargs):
    ds = toy_dataset()
    trainer = Trainer(model or tiny_model(), ds, ds)
    final = trainer.fit(strategy=strategy, num_nodes=num_nodes, max_steps=max_steps,
                        batch_size=8, val_size=32, val_interval=3, processes=processes,
                        stack=stack, **QUIET, **kwargs)
    return trainer, final


def assert_same_run(a: list[dict], b: list[dict]) -> None:
    """Two runs' histories: the same rows, bytes and losses (within 1e-5)."""
    rows = lambda history: [(r["rank"], r["step"], r["train_loss"], r["comm_bytes"])  # noqa: E731
                            for r in history]
    assert len(a) == len(b)
    for x, y in zip(rows(a), rows(b)):
        assert x[:2] == y[:2] and x[3] == y[3]  # the same rows, the same bytes counted
        assert math.isclose(x[2], y[2], rel_tol=1e-5, abs_tol=1e-6), (x, y)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_stacked_ranks_train_as_one_process_per_rank(name):
    separate, separate_model = run(STRATEGIES[name](), False, processes=4)
    stacked, stacked_model = run(STRATEGIES[name](), True, processes=2)
    assert stacked.summary["stacked"] is True and stacked.summary["processes"] == 2
    assert "stacked" not in separate.summary
    assert_same_run(separate.history, stacked.history)
    assert_models_close(separate_model, stacked_model, atol=1e-5)


@pytest.mark.slow
def test_stacked_ranks_follow_rank_failures_and_rank_speeds():
    kwargs = dict(rank_failures=[(1, 2, 5)], rank_speeds=[1.0, 0.5, 1.0, 0.8],
                  network="100mbit", compute_time_s=0.01, max_steps=8)
    packed, packed_model = run(DiLoCoStrategy(H=2, inner_optim="sgd", lr=0.1), False,
                               processes=2, **kwargs)
    stacked, stacked_model = run(DiLoCoStrategy(H=2, inner_optim="sgd", lr=0.1), True,
                                 processes=2, **kwargs)
    assert_same_run(packed.history, stacked.history)
    assert [r["step"] for r in stacked.history if r["rank"] == 1] == [1, 5, 6, 7, 8]
    for a, b in zip(packed.history, stacked.history):  # the clock runs as it does packed
        assert a["sim_time_s"] == pytest.approx(b["sim_time_s"])
    assert_models_close(packed_model, stacked_model, atol=1e-5)


@pytest.mark.slow
def test_accumulated_minibatches_stack_too():
    separate, separate_model = run(STRATEGIES["diloco"](), False, processes=4,
                                   minibatch_size=4)
    stacked, stacked_model = run(STRATEGIES["diloco"](), True, processes=2, minibatch_size=4)
    assert_same_run(separate.history, stacked.history)
    assert_models_close(separate_model, stacked_model, atol=1e-5)


class BurnNet(TinyNet):
    """Spends :data:`BURN_S` of its thread's CPU time in each call of its forward: a
    stacked step calls it once for all its ranks, a rank of its own once for itself."""

    def forward(self, batch):
        start = time.thread_time()
        while time.thread_time() - start < BURN_S:
            pass
        return super().forward(batch)


BURN_S = 0.08


@pytest.mark.slow
def test_a_stacked_step_charges_each_rank_its_share_of_the_compute():
    """One rank's thread computes the stacked step for all: each of the 4 ranks is charged
    a quarter of it, as if it had computed its own, not the whole (the computing rank, or
    the others, who wait through it), nor nothing. The forward's CPU time is fixed, so the
    bounds hold however busy the machine is."""
    # One thread a rank, on a simulated clock: the clock charges each rank its measured CPU
    # time, which the machine's load does not stretch as it stretches wall time.
    trainer, _ = run(STRATEGIES["ddp"](), True, processes=1, max_steps=4, model=BurnNet(),
                     num_threads=1, network="1gbit")
    assert trainer.summary["stacked"] is True
    later = [(r["rank"], r["step"], r["compute_s"]) for r in trainer.history if r["step"] > 1]
    assert len(later) == 12
    # A quarter of the forward, plus the rank's own small work (a tiny model's optimizer
    # step), is far below half of it; charged the whole, a rank would show at least BURN_S.
    assert all(BURN_S / 4 <= c < BURN_S / 2 for _, _, c in later), later


# -- what cannot be stacked is refused, before any rank starts ------------------------


class ItemNet(TinyNet):
    """Reads a value out of a tensor inside forward."""

    def forward(self, batch):
        x, y = batch
        scale = float(x.abs().max().item())
        return F.cross_entropy(self.fc2(torch.tanh(self.fc1(x / scale))), y)


class Branchy(nn.Module):
    """Takes a branch by the value of its input."""

    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.out = nn.Linear(8, 3)

    def forward(self, batch):
        x, y = batch
        return F.cross_entropy(self.out(self.gate(x)), y)


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


class Counter(TinyNet):
    """Counts its forward passes in a buffer, in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, batch):
        self.calls.add_(1)
        return super().forward(batch)


class OwnStrategy(Strategy):
    """A strategy written outside exogym, which has not declared itself stackable."""

    def step(self) -> None:
        self.optim.step()
        super().step()


@pytest.mark.slow
@pytest.mark.parametrize("model, where, why", [
    (BNNet(), "module bn (BatchNorm1d)", "running statistics"),
    (ItemNet(), "module (the model) (ItemNet)", "item()"),
    (Branchy(), "module gate (Gate)", "data-dependent control flow"),
    (Counter(), "module (the model) (Counter)", "buffer calls"),
], ids=["batchnorm", "item", "control-flow", "buffer-update"])
def test_a_model_that_cannot_be_vmapped_is_refused_naming_the_module(model, where, why):
    ds = toy_dataset()
    with pytest.raises(StackError) as refused:
        Trainer(model, ds, ds).check(strategy=STRATEGIES["diloco"](), num_nodes=4,
                                     max_steps=2, processes=2, stack=True, **QUIET)
    message = str(refused.value)
    assert message.startswith("stack=True: ") and where in message and why in message, message
    # 'auto' runs such a model packed, as without stacking
    trainer = Trainer(model, ds, ds)
    if not isinstance(model, BNNet):  # (BatchNorm trains packed too; quicker left out here)
        trainer.fit(strategy=STRATEGIES["ddp"](), num_nodes=4, max_steps=1, batch_size=8,
                    val_size=0, processes=2, stack="auto", **QUIET)
        assert "stacked" not in trainer.summary


@pytest.mark.parametrize("strategy, why", [
    (AsyncDiLoCoStrategy(H=2), "paces each rank at its own speed"),
    (OwnStrategy(optim_spec="sgd", lr=0.1), "OwnStrategy does not declare itself stackable"),
], ids=["async-diloco", "user-strategy"])
def test_a_strategy_that_cannot_be_stacked_is_refused_and_auto_packs_it(strategy, why):
    with pytest.raises(StackError, match=why):
        run(strategy, True, processes=2)
    trainer, _ = run(strategy, "auto", processes=2, max_steps=2)
    assert "stacked" not in trainer.summary and trainer.summary["processes"] == 2


@pytest.mark.slow
def test_stack_auto_leaves_cpu_ranks_as_they_would_run():
    """On the CPU a batched model computes no faster than its ranks in turn (bench.sim_scale
    --stack): 'auto' packs or separates CPU ranks as it would without stack."""
    packed, _ = run(STRATEGIES["ddp"](), "auto", processes=2, max_steps=2)
    assert "stacked" not in packed.summary and packed.summary["processes"] == 2
    separate, _ = run(STRATEGIES["ddp"](), "auto", processes=None, num_nodes=2, max_steps=2)
    assert "stacked" not in separate.summary and "processes" not in separate.summary


def test_stack_is_checked_and_needs_a_simulation():
    ds = toy_dataset()
    with pytest.raises(ValueError, match="stack must be True, False or 'auto', got 'yes'"):
        Trainer(tiny_model(), ds, ds).check(strategy=STRATEGIES["ddp"](), num_nodes=2,
                                            stack="yes", **QUIET)
    with pytest.raises(ValueError, match="stack must be True, False or 'auto', got 1"):
        Trainer(tiny_model(), ds, ds).check(strategy=STRATEGIES["ddp"](), num_nodes=2,
                                            stack=1, **QUIET)
    with pytest.raises(StackError, match="one rank has nothing to stack"):
        Trainer(tiny_model(), ds, ds).check(strategy=STRATEGIES["ddp"](), num_nodes=1,
                                            stack=True, **QUIET)


@pytest.mark.slow
def test_a_batch_of_other_shapes_per_rank_still_computes_each_ranks_own_loss():
    """An epoch's short last batch: ranks whose batches differ in shape are computed
    one by one on their slices of the stack, with the same result."""
    ds = toy_dataset(n=42)  # 11, 11, 10, 10 samples a rank: batches of 8, then of 3 or 2
    trainers = {}
    for stack, processes in ((False, 4), (True, 1)):
        trainer = Trainer(tiny_model(), ds, ds)
        final = trainer.fit(strategy=STRATEGIES["diloco"](), num_nodes=4, max_steps=4,
                            batch_size=8, val_size=0, processes=processes, stack=stack,
                            shuffle=False, **QUIET)
        trainers[stack] = (trainer, final)
    assert_same_run(trainers[False][0].history, trainers[True][0].history)
    assert_models_close(trainers[False][1], trainers[True][1], atol=1e-5)


def test_each_ranks_gradient_is_its_own_loss_gradient_whatever_its_batch_shape():
    import copy

    from exogym.run.stack import RankStack

    ds = toy_dataset()
    models = [tiny_model(seed) for seed in range(3)]
    batches = [(ds.tensors[0][:8], ds.tensors[1][:8]), (ds.tensors[0][8:16], ds.tensors[1][8:16]),
               (ds.tensors[0][16:21], ds.tensors[1][16:21])]
    for sizes in ((0, 1), (0, 1, 2)):  # equal shapes: vmapped; one short batch: one by one
        own = [copy.deepcopy(models[i]) for i in sizes]
        expected = []
        for model, i in zip(own, sizes):
            loss = model(batches[i])
            (0.5 * loss).backward()
            expected.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        stack = RankStack(lambda part, complete: None, list(sizes))
        stacked = [copy.deepcopy(models[i]) for i in sizes]
        for rank, model in zip(sizes, stacked):
            stack.join(rank, model)
        out = stack._compute({r: (batches[r], 0.5) for r in sizes}, None)
        for rank, model, (loss, grads) in zip(sizes, stacked, expected):
            torch.testing.assert_close(out[rank][0], loss, atol=1e-6, rtol=0)
            for p, g in zip(model.parameters(), grads):
                assert p.grad.is_contiguous()
                torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=0)


def test_the_probe_leaves_the_model_as_it_was():
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ds = toy_dataset()
    assert probe_model(model, (ds.tensors[0][:2], ds.tensors[1][:2])) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow(reason="a 23M-parameter model trained stacked and packed")
def test_a_stacked_23m_model_ends_with_the_packed_model():
    from distributed.tasks.tokens import gpt_task
    from tests.test_real_size import assert_real_size, assert_states_equal

    model, train, val = gpt_task(block_size=32, tokens=30000)
    assert_real_size(model)
    ends = {}
    for stack in (False, True):
        trainer = Trainer(model, train, val)
        final = trainer.fit(strategy=DiLoCoStrategy(H=2, inner_optim="sgd", lr=0.05),
                            num_nodes=4, max_steps=4, batch_size=2, val_size=8,
                            val_interval=4, num_threads=1, processes=2, stack=stack, **QUIET)
        assert trainer.summary.get("stacked") is (True if stack else None)
        ends[stack] = (final.state_dict(), trainer.history)
    assert_same_run(ends[False][1], ends[True][1])
    assert_states_equal(ends[False][0], ends[True][0], atol=1e-5)


@pytest.mark.slow
def test_a_stacked_checkpoint_holds_its_own_rank_and_resumes(tmp_path):
    """A stacked rank's parameters are views of its process's stack: its checkpoint holds
    its own model, no larger than an unstacked rank's, and a resumed stacked run ends
    with the model of an uninterrupted one."""
    from exogym.run.checkpoint import checkpoint_path, load_checkpoint

    def fit(run, steps, stack, **kwargs):
        return run_in(tmp_path, run, steps, stack, **kwargs)

    _, whole = fit("whole", 8, True)
    fit("plain", 4, False, checkpoint_interval=4)
    fit("part", 4, True, checkpoint_interval=4)
    plain = checkpoint_path(tmp_path / "plain", 1, 4).stat().st_size
    stacked = checkpoint_path(tmp_path / "part", 1, 4).stat().st_size
    assert stacked <= 1.05 * plain, (stacked, plain)
    state = load_checkpoint(checkpoint_path(tmp_path / "part", 1, 4))
    for value in state["model"].values():
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size()
    _, resumed = fit("part", 8, True, checkpoint_interval=4, resume_from="auto")
    assert_models_close(whole, resumed, atol=1e-6)


def run_in(tmp_path, run, steps, stack, **kwargs):
    ds = toy_dataset()
    trainer = Trainer(tiny_model(), ds, ds)
    final = trainer.fit(strategy=STRATEGIES["diloco"](), num_nodes=4, max_steps=steps,
                        batch_size=8, val_size=0, processes=2, stack=stack,
                        save_dir=str(tmp_path), run_name=run, **QUIET, **kwargs)
    return trainer, final


def test_stacked_ranks_are_accounted_each_with_its_gradients(monkeypatch):
    import exogym.run.memory
    from exogym.run.memory import account_state

    model = _wide_model()
    state = account_state(model, STRATEGIES["diloco"](), 8)
    # Packed ranks step in turn, holding one set of gradients a process; stacked ranks
    # compute together, each holding its own.
    assert state.on_machine(8, 2, stacked=True) == state.on_machine(8, 2) + 6 * state.gradients
    limit = (state.on_machine(8, 2) + state.on_machine(8, 2, stacked=True)) // 2
    monkeypatch.setattr(exogym.run.memory, "available_memory", lambda: limit)
    ds = toy_dataset()
    Trainer(model, ds, ds).check(strategy=STRATEGIES["diloco"](), num_nodes=8, processes=2,
                                 **QUIET)  # fits packed
    with pytest.raises(ValueError, match=r"8 ranks in 2 processes \(stacked: each holds its "
                                         r"gradients\)"):
        Trainer(model, ds, ds).check(strategy=STRATEGIES["diloco"](), num_nodes=8,
                                     processes=2, stack=True, **QUIET)


def _wide_model() -> nn.Module:
    """Gradients large beside the runtime each process is accounted."""
    return TinyNet(hidden=500_000)


class Attends(nn.Module):
    """Attention in the shapes stacked ranks meet: per-rank batches of 3-D or 4-D
    queries, causal, a float mask held per rank (a buffer), a boolean mask (for every
    sample, or one per sample of the batch), fewer key
    heads than query heads (grouped-query), and nn.MultiheadAttention."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        grouped = kind == "grouped"
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True) if kind == "module" else None
        if self.mha is None:
            self.q = nn.Linear(16, 16)
            self.kv = nn.Linear(16, 16 if grouped else 32)
        self.register_buffer("bias", torch.randn(5, 5) if kind == "float-mask" else None)

    def forward(self, x):
        if self.mha is not None:
            return self.mha(x, x, x, need_weights=False)[0].square().mean()
        q, (k, v) = self.q(x), self.kv(x).chunk(2, dim=-1)
        if self.kind != "3d":
            q, k, v = (t.unflatten(-1, (-1, 4)).transpose(-2, -3) for t in (q, k, v))
        options: dict = {"is_causal": True}
        if self.kind == "float-mask":
            options = {"attn_mask": self.bias}
        elif self.kind == "bool-mask":
            options = {"attn_mask": torch.ones(5, 5, dtype=torch.bool).tril()}
        elif self.kind == "batch-mask":  # one mask for every rank, a row per sample
            options = {"attn_mask": torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
                       .logical_or(torch.tensor([0, 1]).bool().view(2, 1, 1, 1))}
        elif self.kind == "grouped":
            options["enable_gqa"] = True
        return F.scaled_dot_product_attention(q, k, v, **options).square().mean()


def _stacked_losses_and_gradients(model: nn.Module, ranks: int, how: str,
                                  autocast: bool = False):
    """Every rank's loss on its own batch and the gradients of their sum, ``how``: each
    rank on its own (the reference), ``vmap`` alone, or vmap with ``batched_attention``."""
    from torch.func import functional_call, vmap

    from exogym.run.stack_attention import batched_attention

    gen = torch.Generator().manual_seed(0)
    params = {n: torch.stack([p.detach() + 0.1 * torch.randn(p.shape, generator=gen)
                              for _ in range(ranks)]).requires_grad_()
              for n, p in model.named_parameters()}
    buffers = {n: torch.stack([b + r for r in range(ranks)]) for n, b in model.named_buffers()}
    x = torch.randn(ranks, 2, 5, 16, generator=gen)

    def one(p, b, batch):
        return functional_call(model, (p, b), (batch,))

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if how == "each":
            losses = torch.stack([one({n: t[r] for n, t in params.items()},
                                      {n: t[r] for n, t in buffers.items()}, x[r])
                                  for r in range(ranks)])
        elif how == "vmap":
            losses = vmap(one, randomness="different")(params, buffers, x)
        else:
            with batched_attention():
                losses = vmap(one, randomness="different")(params, buffers, x)
    return losses, torch.autograd.grad(losses.sum(), list(params.values()))


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("kind", ["4d", "3d", "float-mask", "bool-mask", "batch-mask",
                                  "grouped", "module"])
def test_stacked_attention_gives_each_rank_the_loss_and_gradients_of_its_own(kind):
    torch.manual_seed(0)
    model = Attends(kind)
    own, own_grads = _stacked_losses_and_gradients(model, 3, "each")
    once, once_grads = _stacked_losses_and_gradients(model, 3, "batched")
    torch.testing.assert_close(once, own, atol=1e-6, rtol=0)
    for a, b in zip(once_grads, own_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_stacked_attention_under_autocast_computes_as_each_rank_would_alone():
    """In bfloat16, as a rank alone computes it (vmap alone hands attention back in
    float32), and its backward pass recomputes it in bfloat16 too."""
    torch.manual_seed(0)
    model = Attends("4d")
    own, own_grads = _stacked_losses_and_gradients(model, 3, "each", autocast=True)
    once, once_grads = _stacked_losses_and_gradients(model, 3, "batched", autocast=True)
    fp32, _ = _stacked_losses_and_gradients(model, 3, "batched")
    assert once.dtype == own.dtype
    assert not torch.allclose(once.float(), fp32, atol=1e-5, rtol=0)  # bfloat16 it was
    torch.testing.assert_close(once, own, atol=1e-3, rtol=1e-2)
    for a, b in zip(once_grads, own_grads):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-2)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_stacked_attention_calls_its_kernel_once_for_every_rank_not_once_per_rank():
    """vmap alone runs attention's fused kernel rank by rank, forward and backward; the
    stacked ranks' attention runs it once (and once more to recompute it for the
    backward pass), whatever the number of ranks."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in str(func):
                self.seen["backward" if "backward" in str(func) else "forward"] += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for batched in (False, True):
        with Calls() as calls:
            _stacked_losses_and_gradients(Attends("4d"), 6, "batched" if batched else "vmap")
        counts[batched] = dict(calls.seen)
    assert counts[False] == {"forward": 6, "backward": 6}
    assert counts[True] == {"forward": 2, "backward": 1}
