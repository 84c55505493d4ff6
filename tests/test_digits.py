"""The digits task used by the examples and benchmarks."""

from __future__ import annotations

import pytest
import torch

from exogym.data.digits import DigitsCNN, DigitsMLP, digits_datasets, evaluate


def test_digits_split_is_seeded_disjoint_and_complete():
    train, val = digits_datasets(val_fraction=0.2, seed=0)
    assert len(train) + len(val) == 1797 and len(val) == 359
    x, y = train.tensors
    assert x.shape[1:] == (64,) and x.dtype == torch.float32 and 0.0 <= x.min() <= x.max() <= 1.0
    assert sorted(torch.unique(y).tolist()) == list(range(10))
    again, _ = digits_datasets(val_fraction=0.2, seed=0)
    assert torch.equal(again.tensors[0], x)
    rows = {tuple(r.tolist()) for r in x}
    assert sum(tuple(r.tolist()) in rows for r in val.tensors[0]) < 0.05 * len(val)  # few duplicates
    other, _ = digits_datasets(val_fraction=0.2, seed=1)
    assert not torch.equal(other.tensors[0], x)
    with pytest.raises(ValueError, match="val_fraction"):
        digits_datasets(val_fraction=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [DigitsMLP, DigitsCNN])
def test_digits_models_return_a_loss_and_learn(cls):
    train, val = digits_datasets()
    torch.manual_seed(0)
    model = cls()
    loss, acc = evaluate(model, val)
    assert loss == pytest.approx(torch.log(torch.tensor(10.0)).item(), abs=0.3) and acc < 0.3
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(train, batch_size=64, shuffle=True)
    for batch in loader:
        opt.zero_grad()
        out = model(batch)
        assert out.dim() == 0
        out.backward()
        opt.step()
    assert model.training
    assert evaluate(model, val)[1] > 0.6
    assert model.training  # evaluate puts it back


@pytest.mark.slow
def test_the_digits_are_read_from_scikit_learns_file_without_importing_it():
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from exogym.data.digits import load_digits_tensors

    x, y = load_digits_tensors()
    data = load_digits()
    assert torch.equal(x, torch.tensor(data.data, dtype=torch.float32) / 16.0)
    assert torch.equal(y, torch.tensor(data.target, dtype=torch.long))
    probe = ("import sys; from exogym.data.digits import load_digits_tensors; "
             "load_digits_tensors(); print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
