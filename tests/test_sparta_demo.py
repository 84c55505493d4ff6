"""SPARTA, DeMo and SPARTA-DiLoCo do what their algorithms say, and send what their formulas say."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from toys import TinyCNN, assert_models_close, assert_models_differ, tiny_model, toy_dataset, toy_images

from exogym import Trainer, comm
from exogym.strategy import (
    CommunicateOptimizeStrategy,
    CommunicationModule,
    DeMoStrategy,
    FedAvgStrategy,
    OptimSpec,
    SPARTADiLoCoStrategy,
    SPARTAStrategy,
)
from exogym.strategy.demo import average_coefficients
from exogym.strategy.sparta import (
    PartitionedIndexSelector,
    RandomIndexSelector,
    ShuffledSequentialIndexSelector,
    SparseCommunicator,
    sample_distinct,
)

FIT = dict(batch_size=16, val_size=0, shuffle=False, logger=None, progress=False)


def sgd(lr=0.1):
    return OptimSpec(torch.optim.SGD, lr=lr)


def sizes(model):
    return [p.numel() for p in model.parameters() if p.requires_grad]


def window_count(p: float, n: int, r: int) -> int:
    """Entries the random/shuffled selectors average in round r (p given as an exact fraction)."""
    return math.floor((r + 1) * p * n + 1e-9) - math.floor(r * p * n + 1e-9)


def shard_batches(ds, rank, num_nodes, step, batch_size=16):
    x, y = ds.tensors
    xs, ys = x[rank::num_nodes], y[rank::num_nodes]
    lo = step * batch_size
    return xs[lo:lo + batch_size], ys[lo:lo + batch_size]


# -- SPARTA: equivalences ---------------------------------------------------------------


def test_sparta_p1_sgd_matches_fedavg_h1():
    ds = toy_dataset()
    sparta = Trainer(tiny_model(), ds, ds).fit(
        strategy=SPARTAStrategy(optim_spec=sgd(), p_sparta=1.0), num_nodes=3, max_steps=5, **FIT)
    fedavg = Trainer(tiny_model(), ds, ds).fit(
        strategy=FedAvgStrategy(optim_spec=sgd(), H=1), num_nodes=3, max_steps=5, **FIT)
    assert_models_close(sparta, fedavg, atol=1e-6)
    assert_models_differ(sparta, tiny_model())


def sgd_on_shard(start, ds, rank, num_nodes, steps, lr, batch_size=16):
    """Plain SGD on the shard a rank reads (a DistributedSampler without shuffling)."""
    model = copy.deepcopy(start)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        model(shard_batches(ds, rank, num_nodes, step, batch_size)).backward()
        opt.step()
    return model


@pytest.mark.slow
def test_sparta_p0_is_independent_training_and_sends_nothing():
    ds = toy_dataset()
    start = tiny_model()
    trainer = Trainer(start, ds, ds)
    sparta = trainer.fit(strategy=SPARTAStrategy(optim_spec=sgd(0.5), p_sparta=0.0), num_nodes=2,
                         max_steps=6, **FIT)
    assert all(row["comm_bytes"] == 0 for row in trainer.history)
    ranks = [sgd_on_shard(start, ds, rank, 2, 6, 0.5) for rank in range(2)]
    for name, p in sparta.named_parameters():
        expected = sum(dict(m.named_parameters())[name] for m in ranks) / 2
        assert torch.allclose(p, expected, atol=1e-6), name
    # Independent ranks really differ, so an accidental average would show.
    assert_models_differ(ranks[0], ranks[1], atol=1e-3)


# -- SPARTA: every rank holds the same selected entries ------------------------------------


class SelectionCheck(CommunicationModule):
    """After the SPARTA module, gather this round's selected entries from every rank and compare.

    Uses the comm module's side channel (uncounted), and writes one line per step
    to ``out_dir/rank{r}.txt``: the number of selected entries, and how many
    unselected entries differ between ranks.
    """

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def communicate(self, model, rank, num_nodes, local_step):
        sparse = self.strategy.communication_modules[0]
        params = [p for p in model.parameters() if p.requires_grad]
        selected, differing = 0, 0
        for param, idx in zip(params, sparse.selection(local_step)):
            flat = param.detach().reshape(-1)
            gathered = [torch.empty_like(flat) for _ in range(num_nodes)]
            comm.side_all_gather(gathered, flat)
            mask = torch.zeros(flat.numel(), dtype=torch.bool)
            mask[idx] = True
            for other in gathered[1:]:
                assert torch.equal(other[mask], gathered[0][mask]), f"step {local_step}"
                differing += int((other[~mask] != gathered[0][~mask]).sum())
            # The sums travelled in bfloat16: a mean times the ranks is a bfloat16 number.
            summed = flat[mask] * num_nodes
            assert torch.allclose(summed, summed.to(torch.bfloat16).float(), rtol=1e-6, atol=0)
            selected += int(mask.sum())
        with open(Path(self.out_dir) / f"rank{rank}.txt", "a") as f:
            f.write(f"{selected} {differing}\n")


def test_sparta_selected_entries_are_identical_on_every_rank_with_bfloat16(tmp_path):
    ds = toy_dataset()
    start = tiny_model()
    selector = PartitionedIndexSelector(0.25)
    strategy = CommunicateOptimizeStrategy(
        [SparseCommunicator(selector, comm_dtype="bfloat16"), SelectionCheck(str(tmp_path))],
        optim_spec=sgd(0.5))
    trainer = Trainer(start, ds, ds)
    trainer.fit(strategy=strategy, num_nodes=3, max_steps=6, **{**FIT, "shuffle": True})
    n = sizes(start)
    per_round = [sum((r % 4 + 1) * k // 4 - (r % 4) * k // 4 for k in n) for r in range(6)]
    for rank in range(3):
        lines = (tmp_path / f"rank{rank}.txt").read_text().split("\n")[:-1]
        assert [int(line.split()[0]) for line in lines] == per_round
        # The rest of each tensor is each rank's own: local training drifts it apart.
        assert all(int(line.split()[1]) > 0 for line in lines)
    for row in trainer.history:  # 2 bytes per selected entry in bfloat16
        assert row["comm_bytes"] == 2 * sum(per_round[:row["step"]])


@pytest.mark.slow
def test_sparta_sends_4_bytes_per_entry_and_a_resumed_run_selects_the_same(in_tmp):
    ds = toy_dataset()
    strategy = SPARTAStrategy(optim_spec=sgd(0.3), p_sparta=0.3, index_selector="partitioned")
    trainer = Trainer(tiny_model(), ds, ds)
    whole = trainer.fit(strategy=strategy, num_nodes=2, max_steps=6, **FIT)
    # 4 bytes per selected float32 entry; ceil(1/0.3) = 4 parts, so round r sends part r % 4.
    n = sizes(tiny_model())
    per_round = [sum((r % 4 + 1) * k // 4 - (r % 4) * k // 4 for k in n) for r in range(6)]
    for row in trainer.history:
        assert row["comm_bytes"] == 4 * sum(per_round[:row["step"]])
    Trainer(tiny_model(), ds, ds).fit(strategy=strategy, num_nodes=2, max_steps=3,
                                      checkpoint_interval=3, run_name="r", **FIT)
    resumed = Trainer(tiny_model(), ds, ds).fit(strategy=strategy, num_nodes=2, max_steps=6,
                                                resume_from="auto", run_name="r", **FIT)
    assert_models_close(whole, resumed, atol=1e-6)


# -- SPARTA: index selectors ----------------------------------------------------------------

SELECTORS = [RandomIndexSelector, ShuffledSequentialIndexSelector, PartitionedIndexSelector]


@pytest.mark.parametrize("cls", SELECTORS)
def test_selections_are_a_pure_function_of_seed_tensor_and_round(cls):
    a, b = cls(0.2), cls(0.2)
    assert torch.equal(a.indices(7, 1, 100, 3), b.indices(7, 1, 100, 3))
    assert not torch.equal(a.indices(7, 1, 100, 3), a.indices(8, 1, 100, 3))
    assert not torch.equal(a.indices(7, 1, 100, 3), a.indices(7, 2, 100, 3))
    assert not torch.equal(a.indices(7, 1, 100, 3), a.indices(7, 1, 100, 4))


@pytest.mark.parametrize("cls", [RandomIndexSelector, ShuffledSequentialIndexSelector])
@pytest.mark.parametrize("p, n", [(0.005, 1000), (0.1, 37), (0.3, 5), (1.0, 9), (0.0, 50)])
def test_random_and_shuffled_selectors_average_a_fraction_p_exactly(cls, p, n):
    selector = cls(p)
    total = 0
    for r in range(40):
        idx = selector.indices(0, 0, n, r)
        assert idx.dtype == torch.long
        assert idx.numel() == len(set(idx.tolist())) == window_count(p, n, r)
        assert all(0 <= i < n for i in idx.tolist())
        total += idx.numel()
    assert total == math.floor(40 * p * n + 1e-9)


def test_partitioned_selector_parts_are_disjoint_and_cover_everything_each_cycle():
    selector = PartitionedIndexSelector(0.3)  # ceil(1/0.3) = 4 parts
    n = 10
    cycles = []
    for cycle in range(3):
        parts = [selector.indices(5, 0, n, cycle * 4 + j).tolist() for j in range(4)]
        assert sorted(i for part in parts for i in part) == list(range(n))
        assert [len(part) for part in parts] == [2, 3, 2, 3]
        cycles.append(parts)
    assert cycles[0] != cycles[1] != cycles[2]  # reshuffled every cycle


def test_shuffled_selector_walks_one_permutation():
    selector = ShuffledSequentialIndexSelector(0.1)
    first_pass = [selector.indices(3, 0, 50, r).tolist() for r in range(10)]
    assert sorted(i for w in first_pass for i in w) == list(range(50))
    second_pass = [selector.indices(3, 0, 50, r).tolist() for r in range(10, 20)]
    assert first_pass == second_pass


def test_random_selector_picks_every_entry_equally_often():
    selector = RandomIndexSelector(0.25)
    counts = torch.zeros(20)
    for r in range(2000):
        counts[selector.indices(1, 0, 20, r)] += 1
    # Each entry: Binomial(2000, 0.25) -> mean 500, sd 19.4.
    assert (counts - 500).abs().max() < 100, counts


def test_sample_distinct_draws_a_uniform_subset_without_a_permutation():
    g = torch.Generator().manual_seed(0)
    hits = torch.zeros(1000)
    for _ in range(300):
        idx = sample_distinct(1000, 50, g)
        assert idx.unique().numel() == 50
        hits[idx] += 1
    assert hits.min() > 0 and hits.max() < 45  # mean 15


def test_sparta_arguments_are_checked():
    with pytest.raises(TypeError, match="'p'"):
        SPARTAStrategy(p=0.1)
    with pytest.raises(ValueError, match="index_selector must be one of"):
        SPARTAStrategy(index_selector="everything")
    with pytest.raises(ValueError, match=r"p_sparta must be a number in \[0, 1\], got 1.5"):
        SPARTAStrategy(p_sparta=1.5)
    with pytest.raises(ValueError, match="disagrees"):
        SPARTAStrategy(p_sparta=0.1, index_selector=RandomIndexSelector(0.2))
    with pytest.raises(ValueError, match="comm_dtype"):
        SPARTAStrategy(comm_dtype="int3")  # int4 is a quantized type now
    assert SPARTAStrategy(index_selector=PartitionedIndexSelector(0.2)).p_sparta == 0.2
    with pytest.raises(TypeError, match="get_indices"):
        type("MaskSelector", (RandomIndexSelector,), {"get_indices": lambda self, p, i: None})
    adam = SPARTADiLoCoStrategy(inner_optim_spec="adam")
    assert adam.optim_spec.cls is torch.optim.Adam
    assert SPARTAStrategy().p_sparta == 0.005


# -- DeMo -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_sending_every_coefficient_is_sign_sgd_on_the_mean_gradient():
    ds = toy_dataset()
    start = tiny_model()
    lr, steps, k = 0.01, 3, 2
    trained = Trainer(start, ds, ds).fit(
        strategy=DeMoStrategy(lr=lr, compression_decay=0.0, compression_topk=10_000,
                              compression_chunk=64),
        num_nodes=k, max_steps=steps, **FIT)
    reference = copy.deepcopy(start)
    clear = [torch.ones_like(p, dtype=torch.bool) for p in reference.parameters()]
    for step in range(steps):
        grads = []
        for rank in range(k):
            reference.zero_grad()
            reference(shard_batches(ds, rank, k, step)).backward()
            grads.append([p.grad.clone() for p in reference.parameters()])
        with torch.no_grad():
            for i, p in enumerate(reference.parameters()):
                mean = sum(g[i] for g in grads) / k
                clear[i] &= mean.abs() > 1e-5 * mean.abs().max()
                p -= lr * mean.sign()
    compared = 0
    for p_demo, p_ref, mask in zip(trained.parameters(), reference.parameters(), clear):
        assert torch.allclose(p_demo[mask], p_ref[mask], atol=1e-6)
        compared += int(mask.sum())
    assert compared > 0.95 * sum(sizes(start))
    assert_models_differ(trained, start)


def same_data(rank, num_nodes, is_train):
    return toy_dataset()


@pytest.mark.slow
def test_demo_with_the_same_data_on_every_rank_equals_one_rank():
    strategy = DeMoStrategy(lr=0.01, compression_decay=0.9, compression_topk=3,
                            compression_chunk=8, weight_decay=0.1)
    one = Trainer(tiny_model(), same_data, same_data).fit(strategy=strategy, num_nodes=1,
                                                          max_steps=6, **FIT)
    two = Trainer(tiny_model(), same_data, same_data).fit(strategy=strategy, num_nodes=2,
                                                          max_steps=6, **FIT)
    assert_models_close(one, two, atol=1e-6)
    assert_models_differ(one, tiny_model())


def demo_bytes_per_step(model, topk, chunk, value_bytes=4):
    """sum over parameters of chunks * min(topk, area) * (value bytes + index bytes)."""
    total = 0
    for p in model.parameters():
        shape = list(p.shape)
        rows, cols = (1, max(p.numel(), 1)) if len(shape) < 2 else (shape[0], p.numel() // shape[0])
        cr = max(d for d in range(1, min(rows, chunk) + 1) if rows % d == 0)
        cc = max(d for d in range(1, min(cols, chunk) + 1) if cols % d == 0)
        area = cr * cc
        index_bytes = 1 if area <= 256 else 2 if area <= 65536 else 4
        total += (rows // cr) * (cols // cc) * min(topk, area) * (value_bytes + index_bytes)
    return total


@pytest.mark.slow
def test_demo_trains_a_cnn_and_sends_what_the_formula_says():
    ds = toy_images(512)
    torch.manual_seed(0)
    model = TinyCNN()
    assert model.conv.weight.dim() == 4 and model.fc1.weight.numel() > 256  # 1- and 2-byte indices
    trainer = Trainer(model, ds, ds)
    trainer.fit(strategy=DeMoStrategy(lr=0.01, compression_topk=8), num_nodes=2, max_steps=40,
                batch_size=32, val_size=0, logger=None, progress=False)
    per_step = demo_bytes_per_step(model, topk=8, chunk=64)
    for row in trainer.history:
        assert row["comm_bytes"] == per_step * row["step"]
    losses = [sum(r["train_loss"] for r in trainer.history if r["step"] == s) / 2
              for s in range(1, 41)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)


def test_demo_coefficients_are_averaged_over_the_ranks_that_sent_them():
    # Chunk of 4 coefficients, k = 2: rank 0 sends {0: 1.0, 1: 0.6}, rank 1 {1: -0.2, 3: 2.0}.
    dense = average_coefficients(
        [torch.tensor([[0, 1]]), torch.tensor([[1, 3]])],
        [torch.tensor([[1.0, 0.6]]), torch.tensor([[-0.2, 2.0]])], area=4)
    assert torch.allclose(dense, torch.tensor([[1.0, 0.2, 0.0, 2.0]]))


def test_demo_arguments_are_checked():
    with pytest.raises(TypeError, match="cannot honour betas"):
        DeMoStrategy(optim_spec=OptimSpec(torch.optim.Adam, lr=0.01, betas=(0.8, 0.9)))
    with pytest.warns(UserWarning, match="replaces SGD with DeMo"):
        taken = DeMoStrategy(optim_spec=OptimSpec(torch.optim.SGD, lr=0.01, weight_decay=0.1))
    assert (taken.lr, taken.weight_decay) == (0.01, 0.1)
    assert (DeMoStrategy().lr, DeMoStrategy(lr=0.2).lr) == (1e-3, 0.2)
    with pytest.raises(TypeError, match="compression_top"):
        DeMoStrategy(compression_top_k=4)
    with pytest.raises(ValueError, match="compression_topk must be"):
        DeMoStrategy(compression_topk=0)
    with pytest.raises(ValueError, match="compression_decay must be"):
        DeMoStrategy(compression_decay=1.5)


def test_demo_skips_parameters_without_a_gradient():
    from exogym.strategy.demo import DeMo

    used, unused = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))
    opt = DeMo([used, unused], lr=0.1, weight_decay=0.5)
    (used * torch.tensor([1.0, -2.0, 3.0, -4.0])).sum().backward()
    opt.step()
    assert torch.equal(unused.detach(), torch.ones(3)) and unused not in opt.state
    # decoupled decay, then a sign step: 1 * (1 - 0.05) -/+ 0.1
    assert torch.allclose(used.detach(), torch.tensor([0.85, 1.05, 0.85, 1.05]))


# -- SPARTA-DiLoCo ----------------------------------------------------------------------------


@pytest.mark.slow
def test_sparta_diloco_honours_sparta_interval_and_trains():
    ds = toy_dataset(512)
    start = tiny_model()
    trainer = Trainer(start, ds, ds)
    trainer.fit(strategy=SPARTADiLoCoStrategy(inner_optim="adam", lr=0.02, H=6, p_sparta=0.1,
                                              sparta_interval=2),
                num_nodes=2, max_steps=12, batch_size=16, val_size=128, val_interval=12,
                logger=None, progress=False)
    n = sizes(start)
    expected, total = {}, 0
    for step in range(1, 13):
        if step % 2 == 0 and step % 6 != 0:  # a SPARTA round (left out where DiLoCo runs)
            total += 4 * sum(window_count(0.1, k, step // 2 - 1) for k in n)
        if step % 6 == 0:
            total += 4 * sum(n)
        expected[step] = total
    for row in trainer.history:
        assert row["comm_bytes"] == expected[row["step"]], row["step"]
    first = [r["train_loss"] for r in trainer.history if r["step"] == 1]
    final = [r["val_global_loss"] for r in trainer.history if r["step"] == 12]
    assert sum(final) / 2 < 0.9 * sum(first) / 2


def test_demo_keeps_what_it_did_not_send_in_the_momentum():
    from exogym.strategy.demo import DeMo, dct_matrix

    param = torch.nn.Parameter(torch.zeros(4))
    opt = DeMo([param], lr=1.0, compression_decay=0.5, compression_topk=1)
    grad = torch.tensor([1.0, 2.0, -3.0, 0.5])
    param.grad = grad.clone()
    opt.step()
    d = dct_matrix(4)
    coeffs = d @ grad
    sent = coeffs.abs().argmax()
    residual = d @ opt.state[param]["delta"]
    expected = coeffs.clone()
    expected[sent] = 0.0
    assert torch.allclose(residual, expected, atol=1e-6)
    # The step is the sign of the one coefficient sent, transformed back.
    only = torch.zeros(4)
    only[sent] = coeffs[sent]
    assert torch.equal(param.detach(), -(d.T @ only).sign())
    # Next step: delta = decay * residual + lr * grad.
    param.grad = grad.clone()
    before = opt.state[param]["delta"].clone()
    opt.step()
    after = d @ opt.state[param]["delta"]
    full = d @ (0.5 * before + grad)
    full[full.abs().argmax()] = 0.0
    assert torch.allclose(after, full, atol=1e-6)


def test_demo_payload_round_trips_every_wire_type_through_one_byte_buffer():
    from exogym.strategy.demo import ChunkPlan, _pack, _unpack

    values = [torch.randn(3, 5).to(torch.bfloat16), torch.randn(2, 4)]
    plans = [ChunkPlan.for_shape((16, 16), 16, 4), ChunkPlan.for_shape((64, 64), 64, 4),
             ChunkPlan.for_shape((300, 300), 300, 4)]
    assert [p.index_bytes for p in plans] == [1, 2, 4]
    indices = [torch.tensor([[0, 255]]), torch.tensor([[0, 4095]]), torch.tensor([[0, 89_999]])]
    wires = [plan.pack_indices(idx) for plan, idx in zip(plans, indices)]
    payload = [values[0], wires[0], values[1], wires[1], wires[2]]
    buffer, layout = _pack(payload)
    assert buffer.dtype == torch.uint8
    assert buffer.numel() == 15 * 2 + 2 * 1 + 8 * 4 + 2 * 2 + 2 * 4
    back = _unpack(buffer.clone(), layout, payload)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back, payload))
    for plan, wire, idx in zip(plans, back[1::2] + [back[4]], indices):
        assert torch.equal(plan.unpack_indices(wire), idx)


@pytest.mark.slow
def test_demo_momentum_survives_a_checkpoint():
    from exogym.strategy.demo import DeMo

    torch.manual_seed(0)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))

    def train(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            model((x, y)).backward()
            opt.step()

    a = tiny_model()
    opt_a = DeMo(a.parameters(), lr=0.01, compression_topk=2, compression_chunk=4)
    train(a, opt_a, 3)
    b = copy.deepcopy(a)
    opt_b = DeMo(b.parameters(), lr=0.01, compression_topk=2, compression_chunk=4)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    train(a, opt_a, 3)
    train(b, opt_b, 3)
    assert_models_close(a, b, atol=0)
    fresh = copy.deepcopy(b)
    train(fresh, DeMo(fresh.parameters(), lr=0.01, compression_topk=2, compression_chunk=4), 1)
    train(b, opt_b, 1)
    assert_models_differ(fresh, b, atol=1e-6)  # the restored momentum mattered
