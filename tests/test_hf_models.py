"""Hugging Face models and datasets as they are: a ``PreTrainedModel`` called by name on a
dict batch, its output's loss trained on, a ``datasets.Dataset`` (or a list of dicts) as the
data, with every strategy, packed and stacked ranks, ``compare``, and a profile naming
``module:function`` through ``distributed-train`` and real rank processes at 20M parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from doc_blocks import code_block
from ranks import free_port, rank_env, wait_all

from exogym import Trainer, compare
from exogym.data.loading import collate_samples
from exogym.run.model_loss import LossError, by_name, model_loss
from exogym.run.stack import StackError
from exogym.strategy import DiLoCoStrategy, SimpleReduceStrategy
from exogym.strategy.registry import KNOWN

transformers = pytest.importorskip("transformers")  # the whisper extra brings it
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_outputs import CausalLMOutput  # noqa: E402

PAGE = "docs/huggingface.md"
QUIET = dict(logger=None, progress=False)


def tiny_lm(vocab: int = 32, hidden: int = 32, layers: int = 2) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=32)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def counting(count: int, vocab: int = 32, length: int = 16, labels: bool = True) -> list[dict]:
    """``count`` sequences that count up modulo ``vocab`` from seeded starts."""
    starts = torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(1))
    out = []
    for start in starts.tolist():
        ids = [(start + i) % vocab for i in range(length)]
        out.append({"input_ids": ids, "labels": ids} if labels else {"input_ids": ids})
    return out


# -- what a forward may return, and how a batch is given ---------------------------------


class Returns(torch.nn.Module):
    """A model whose forward(batch) returns its loss in the shape ``kind`` names."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.w = torch.nn.Linear(4, 1)

    def forward(self, batch):
        per_sample = self.w(batch).squeeze(1) ** 2
        loss = per_sample.mean()
        return {"tensor": loss, "output": CausalLMOutput(loss=loss, logits=per_sample),
                "dict": {"loss": loss, "logits": per_sample}, "tuple": (loss, per_sample),
                "list": [loss], "no loss": CausalLMOutput(logits=per_sample),
                "logits dict": {"logits": per_sample}, "per sample": per_sample,
                "tuple of logits": (per_sample, loss)}[self.kind]


@pytest.mark.parametrize("kind", ["tensor", "output", "dict", "tuple", "list"])
def test_a_loss_counts_as_a_tensor_an_output_field_a_dict_entry_or_a_first_item(kind):
    torch.manual_seed(0)
    model, batch = Returns(kind), torch.randn(3, 4)
    loss = model_loss(model, batch)
    assert loss.shape == () and loss.requires_grad
    assert torch.equal(loss, (model.w(batch).squeeze(1) ** 2).mean())


@pytest.mark.parametrize("kind, said", [
    ("no loss", "returned a CausalLMOutput whose loss is None"),
    ("logits dict", 'returned a dict without a "loss" entry; return the loss itself'),
    ("per sample", "returned a tensor of shape (3,): reduce it to one number"),
    ("tuple of logits", "returned a tuple whose first item is a tensor of shape (3,)"),
])
def test_an_output_without_a_scalar_loss_is_refused_naming_what_it_holds(kind, said):
    with pytest.raises(LossError, match="must return the loss as a scalar tensor") as caught:
        model_loss(Returns(kind), torch.randn(3, 4))
    assert said in str(caught.value), str(caught.value)


class ByName(torch.nn.Module):
    def forward(self, input_ids, labels=None):
        return input_ids.float().mean()


class Whole(torch.nn.Module):
    def forward(self, batch):
        return batch["x"].float().mean()


class NamedX(torch.nn.Module):
    def forward(self, x):
        return x["x"].float().mean()


class AnyKeywords(torch.nn.Module):
    def forward(self, **kwargs):
        return kwargs["x"].float().mean()


def test_a_dict_batch_goes_by_name_only_to_a_forward_that_takes_its_keys():
    ids = torch.ones(2, 3)
    assert by_name(tiny_lm(), {"input_ids": ids, "labels": ids, "text": ["a", "b"]})  # **kwargs
    assert by_name(ByName(), {"input_ids": ids, "labels": ids})
    assert by_name(ByName(), {"input_ids": ids})  # labels has a default
    assert not by_name(ByName(), {"labels": ids})  # input_ids is required
    assert not by_name(ByName(), {"input_ids": ids, "mask": ids})  # no **kwargs for mask
    assert not by_name(Whole(), {"x": ids, "y": ids})  # forward(batch): given whole
    assert not by_name(NamedX(), {"x": ids, "y": ids})  # y has no place: given whole
    assert not by_name(AnyKeywords(), {"x": ids})  # names no key: given whole
    assert not by_name(ByName(), (ids, ids))
    assert float(model_loss(Whole(), {"x": ids, "y": ids})) == 1.0


def test_samples_that_are_dicts_collate_into_a_dict_of_tensors():
    batch = collate_samples([{"input_ids": [1, 2, 3], "score": 0.5, "text": "a"},
                             {"input_ids": [4, 5, 6], "score": 1.5, "text": "b"}])
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert batch["score"].dtype == torch.float64 and batch["text"] == ["a", "b"]
    with pytest.raises(ValueError, match=r"the samples' 'input_ids' have different lengths "
                                         r"\(2, 3\).*DataCollatorWithPadding"):
        collate_samples([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    with pytest.raises(ValueError, match="the samples of one batch differ"):
        collate_samples([{"input_ids": [1]}, {"ids": [2]}])
    pair = collate_samples([(torch.zeros(2), 1), (torch.ones(2), 0)])  # torch's own, as before
    assert torch.equal(pair[0], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


# -- fit, packed and stacked, and what it refuses before any rank starts --------------------


@pytest.mark.slow
def test_a_causal_lm_trains_on_a_list_of_dicts_alike_in_processes_packed_and_stacked():
    data = counting(64)
    losses = {}
    for name, mode in (("processes", {}), ("packed", {"processes": 1}),
                       ("stacked", {"processes": 1, "stack": True})):
        trainer = Trainer(tiny_lm(), data)
        trainer.fit(strategy=SimpleReduceStrategy(), num_nodes=2, max_steps=4, batch_size=8,
                    val_size=0, shuffle=False, **mode, **QUIET)
        assert trainer.summary.get("stacked", False) is (name == "stacked")
        losses[name] = [r["train_loss"] for r in trainer.history]
    assert len(losses["processes"]) == 8
    assert losses["packed"] == losses["processes"]
    assert losses["stacked"] == pytest.approx(losses["processes"], abs=1e-5)
    assert losses["processes"][-1] < losses["processes"][0]


def test_without_labels_or_with_samples_of_different_lengths_fit_refuses_before_any_rank():
    started = time.monotonic()
    trainer = Trainer(tiny_lm(), counting(16, labels=False))
    with pytest.raises(LossError, match=r'checked before any rank started: model\.forward'
                                        r'\(\*\*batch\) must return the loss as a scalar tensor'
                                        r'.*whose loss is None; the batch has no "labels" '
                                        r'\(its keys: input_ids\)'):
        trainer.fit(strategy=DiLoCoStrategy(H=2), num_nodes=2, max_steps=2, batch_size=4,
                    val_size=0, **QUIET)
    ragged = [{"input_ids": list(range(n % 5 + 3)), "labels": list(range(n % 5 + 3))}
              for n in range(40)]
    with pytest.raises(ValueError, match=r"train_dataset: the samples' 'input_ids' have "
                                         r"different lengths .*before any rank started"):
        Trainer(tiny_lm(), ragged).fit(strategy=DiLoCoStrategy(H=2), num_nodes=2, max_steps=2,
                                       batch_size=4, val_size=0, **QUIET)
    assert trainer.history == [] and time.monotonic() - started < 20


@pytest.fixture(scope="module")
def datasets_module():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing here may reach the hub
    return pytest.importorskip("datasets")  # the dev extra brings it


@pytest.mark.slow
def test_a_datasets_dataset_trains_as_given_and_stacking_its_strings_is_refused(
        datasets_module):
    rows = [{**row, "text": "counting"} for row in counting(96)]
    train = datasets_module.Dataset.from_list(rows[16:])
    val = datasets_module.Dataset.from_list(rows[:16])
    trainer = Trainer(tiny_lm(), train, val)
    trainer.fit(strategy=DiLoCoStrategy(H=2), num_nodes=2, max_steps=6, batch_size=8,
                val_size=16, val_interval=6, **QUIET)
    assert trainer.summary["final_val_global_loss"] < trainer.history[0]["train_loss"]
    assert {r["step_samples"] for r in trainer.history} == {8}  # a batch counts its rows
    started = time.monotonic()
    with pytest.raises(StackError, match="a batch holds str beside tensors"):
        Trainer(tiny_lm(), train).fit(strategy=SimpleReduceStrategy(), num_nodes=2,
                                      max_steps=2, batch_size=4, val_size=0, stack=True,
                                      **QUIET)
    assert time.monotonic() - started < 10


@pytest.mark.slow(reason="eleven strategies, each a two-rank fit of its own")
def test_every_strategy_trains_a_causal_lm_on_dict_batches_in_compare():
    names = [name for name in KNOWN if name != "none"]  # 'none' trains nothing together
    data = counting(96)
    rows = compare(tiny_lm(), data[16:], data[:16], names, num_nodes=2, max_steps=4,
                   batch_size=8, val_size=16, val_interval=4, show=False)
    assert [row["strategy"] for row in rows] == names
    untrained = float(torch.log(torch.tensor(32.0)))  # a guess among 32 tokens
    for row in rows:
        assert row["steps"] == 4 and row["final_val_loss"] < untrained, row
    # those that meet within 4 steps sent the model's updates (H=100 and the like: at the end)
    assert all(row["bytes_per_node"] > 0 for row in rows if row["strategy"] in
               ("ddp", "sparta", "demo")), rows


# -- a profile naming module:function -------------------------------------------------------


@pytest.fixture(scope="module")
def profile_folder(tmp_path_factory):
    """The docs page's task module and profile, written as a person would, in a folder of
    their own that is not on the import path."""
    folder = tmp_path_factory.mktemp("tiny-lm")
    (folder / "tiny_lm_tasks.py").write_text(code_block(PAGE, "## In a profile", "python"))
    (folder / "tiny-lm.ini").write_text(code_block(PAGE, "and the profile, in", "ini"))
    return folder


@pytest.mark.slow(
    reason="the page's profile trained, then compared across strategies, each run "
           "importing transformers")
def test_distributed_train_and_compare_run_the_pages_profile_from_its_folder(
        profile_folder, monkeypatch):
    import importlib.util

    from typer.testing import CliRunner

    from distributed.faces.cli import app

    commands = code_block(PAGE, "Then, from the folder that holds both", "bash").splitlines()
    monkeypatch.setattr(sys, "path", list(sys.path))  # the task's folder is added to it
    monkeypatch.chdir(profile_folder)
    assert importlib.util.find_spec("tiny_lm_tasks") is None  # found beside the profile
    runner = CliRunner()
    quick = ["--set", "max_steps=20", "--set", "samples=256"]
    train = runner.invoke(app, [*commands[0].split()[1:], *quick])
    assert train.exit_code == 0, train.output
    written = profile_folder / "runs" / "tiny-lm"
    summary = json.loads((written / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["final_val_global_loss"] < 2.5, summary
    from safetensors.torch import load_file

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, max_position_embeddings=32))
    model.load_state_dict(load_file(written / "model.safetensors"))
    compared = runner.invoke(app, [*commands[1].replace("ddp,diloco,sparta", "ddp,diloco")
                                   .split()[1:], *quick,
                                   "--out", str(profile_folder / "compare.png")])
    assert compared.exit_code == 0, compared.output
    table = compared.output[compared.output.index("2 strategies"):]
    assert "ddp" in table and "diloco" in table


@pytest.mark.slow(reason="two rank processes import torch and transformers and train a "
                         "20M-parameter causal LM over a real process group")
def test_a_20m_parameter_causal_lm_trains_across_two_rank_processes_from_its_profile(
        profile_folder, tmp_path):
    vocab, hidden = 32000, 320  # the embedding and the output layer: 32000 x 320, 39 MiB each
    settings = [f"vocab_size={vocab}", f"hidden_size={hidden}", "max_steps=4", "H=2",
                "samples=96", "length=8", "batch_size=4", "val_size=8", "val_interval=4",
                f"output_dir={tmp_path / 'run'}"]
    port = free_port()
    procs = []
    for rank in range(2):
        args = [sys.executable, "-m", "distributed.worker", "--profile", "tiny-lm", "--config",
                str(profile_folder / "tiny-lm.ini"), "--quiet"]
        for pair in settings:
            args += ["--set", pair]
        log = open(tmp_path / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen(args, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                      env=rank_env(rank, 2, port)))
        log.close()
    codes = wait_all(procs, timeout=400)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], logs
    from safetensors.torch import load_file

    state = load_file(tmp_path / "run" / "model.safetensors")
    assert sum(t.numel() for t in state.values()) >= 20_000_000
    largest = max(state.values(), key=lambda t: t.numel())
    assert largest.numel() * largest.element_size() >= 16 * 2**20
    import importlib.util

    # the task's initial model, its module read from the file (not left importable)
    found = importlib.util.spec_from_file_location("page_tasks", profile_folder / "tiny_lm_tasks.py")
    tasks = importlib.util.module_from_spec(found)
    found.loader.exec_module(tasks)
    model, _, _ = tasks.tiny_lm(vocab_size=vocab, hidden_size=hidden, length=8, samples=96)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    model.load_state_dict(state)  # the final model is the task's class, whole
    assert not torch.equal(before["model.embed_tokens.weight"],
                           state["model.embed_tokens.weight"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_val_global_loss"] > 0, summary
    # DiLoCo all-reduced the whole model change at each of the two rounds' ends (its float
    # buffers too: the rotary frequencies), 4 bytes a value
    values = sum(t.numel() for t in [*model.parameters(), *model.buffers()]
                 if t.is_floating_point())
    assert summary["bytes_per_node"] == 2 * 4 * values
