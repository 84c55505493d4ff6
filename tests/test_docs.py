"""The documentation site builds, its examples run as written, and the README's links hold.

``mkdocs build --strict`` fails on a broken link or anchor, a page left out of the
navigation, or an API reference entry (``::: exogym.Trainer``) that no longer resolves,
so a renamed class or a moved page fails here rather than on the published site.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess

import pytest
import torch
import warm
from doc_blocks import ROOT, code_block
from toys import tiny_model, toy_dataset

from exogym import Trainer

WRITING = "docs/writing-a-strategy.md"
FIT = dict(batch_size=16, val_size=0, shuffle=False, logger=None, progress=False)


@pytest.mark.slow
def test_the_site_builds_with_no_broken_link_or_reference(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]'), so the site is not built")
    site = tmp_path / "site"
    done = subprocess.run(
        [*warm.python(), "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(site)],
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    # fit's arguments are built at run time: the reference must show them, not *args.
    trainer_page = (site / "reference" / "trainer" / "index.html").read_text()
    for argument in ("num_nodes", "rank_failures", "balance"):
        assert f"<code>{argument}</code>" in trainer_page, argument
    strategies_page = (site / "reference" / "strategies" / "index.html").read_text()
    for name in ("SimpleReduceStrategy", "DiLoCoStrategy", "SPARTAStrategy", "FedAvgStrategy",
                 "DeMoStrategy", "SPARTADiLoCoStrategy", "StreamingDiLoCoStrategy",
                 "SparseLoCoStrategy", "CommunicateOptimizeStrategy", "OptimSpec"):
        assert f'id="exogym.strategy.{name}"' in strategies_page, name
    assert ":class:`" not in strategies_page  # Sphinx roles are shown as code


def test_the_readme_links_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\((?!https?://)([^)#\s]+)(?:#[^)\s]*)?\)", readme)
    assert any(t.startswith("docs/") for t in targets), targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_overview_page_gives_the_readmes_quick_start():
    """The two commands are the same on both pages (CI runs the README's first one)."""
    readme = code_block("README.md", "## Quick start", "bash")
    assert len(readme.splitlines()) == 2, readme
    assert code_block("docs/index.md", "## Quick start", "bash") == readme


def test_the_strategies_of_writing_a_strategy_train_and_send_what_they_say():
    scope: dict = {"__name__": "writing_a_strategy"}
    for heading in ("## A strategy in a few lines", "## Checking settings", "## Stating its traffic",
                    "## Composing"):
        exec(compile(code_block(WRITING, heading, "python"), WRITING, "exec"), scope)
    data = toy_dataset()
    model = tiny_model()
    values = sum(p.numel() for p in model.parameters())
    steps = 10

    trainer = Trainer(model, data, data)
    trainer.fit(strategy=scope["SignAverage"](inner_optim="sgd", lr=0.01), num_nodes=2,
                max_steps=steps, **FIT)
    # Every step all-reduces every float32 gradient once.
    assert max(row["comm_bytes"] for row in trainer.history) == steps * 4 * values

    trainer = Trainer(model, data, data)
    trainer.fit(strategy=scope["strategy"], num_nodes=2, max_steps=steps, **FIT)
    # AverageEvery(H=10): one round of the whole model in 10 steps.
    assert max(row["comm_bytes"] for row in trainer.history) == 4 * values

    # The stated traffic: what the planner estimates is what the counters count.
    planned = scope["step_traffic"](scope["PlannedSignAverage"](), values, 2)
    assert planned.payload == 4 * values
    assert scope["planned"].payload == 4 * 1_000_000 and scope["seconds"] > 0.2

    with pytest.raises(ValueError, match="num_nodes must be at least 2, got 1"):
        Trainer(model, data, data).fit(strategy=scope["CheckedSignAverage"](), num_nodes=1,
                                       max_steps=1, **FIT)


def test_the_lifecycle_examples_of_writing_a_strategy_train():
    """The strategy set up from its context, and the one written for exo gym (packed
    ranks asking torch.distributed who they are) train as the page says."""
    from exogym.strategy import SimpleReduceStrategy

    scope: dict = {"__name__": "writing_a_strategy"}
    for heading in ("## Its lifecycle, and what it knows of its rank",
                    "### Strategies written for exo gym"):
        exec(compile(code_block(WRITING, heading, "python"), WRITING, "exec"), scope)
    data = toy_dataset()
    trainer = Trainer(tiny_model(), data, data)
    trainer.fit(strategy=scope["MomentumAverage"](inner_optim="sgd", lr=0.01), num_nodes=2,
                max_steps=4, **FIT)
    values = sum(p.numel() for p in tiny_model().parameters())
    assert max(row["comm_bytes"] for row in trainer.history) == 4 * 4 * values

    def fit(strategy):
        return Trainer(tiny_model(), data, data).fit(strategy=strategy, num_nodes=4,
                                                     max_steps=4, processes=1, **FIT)

    gym = fit(scope["GymStyleAverage"](inner_optim="sgd", lr=0.1))
    ddp = fit(SimpleReduceStrategy(inner_optim="sgd", lr=0.1))
    for a, b in zip(gym.parameters(), ddp.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_the_map_names_every_strategy_and_the_examples_count():
    """docs/index.md's list of strategies holds every registered one, and what it says
    examples/compare_strategies.py runs is what the example's table holds."""
    from examples.compare_strategies import STRATEGIES
    from exogym.strategy import registry

    text = (ROOT / "docs/index.md").read_text()
    intro = text[:text.index("Two things share one training core")]
    shown = {"ddp": "AllReduce (DDP)", "diloco": "DiLoCo", "sparta": "SPARTA",
             "fedavg": "FedAvg", "demo": "DeMo", "sparta_diloco": "SPARTA-DiLoCo",
             "streaming_diloco": "Streaming DiLoCo", "sparseloco": "SparseLoCo",
             "desloc": "DES-LOC", "muloco": "MuLoCo", "async_diloco": "asynchronous DiLoCo"}
    for name in registry.KNOWN:
        if name != "none":
            assert name in shown, f"{name}: say how docs/index.md names it"
            assert shown[name] in " ".join(intro.split()), name
    example = text[text.index("`examples/compare_strategies.py`"):]
    example = " ".join(example[:example.index("\n- ")].split())
    counted = re.search(r": (\w+) strategies \(([^)]*)\)", example)
    words = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    assert counted and words.index(counted.group(1)) + 2 == len(STRATEGIES), example
    assert counted.group(2).split(", ") == list(STRATEGIES), example


@pytest.mark.slow
def test_the_compare_page_runs_as_written_and_returns_its_rows(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    scope: dict = {"__name__": "compare_page"}
    exec(compile(code_block("docs/compare.md", "## An example", "python"), "compare.md",
                 "exec"), scope)
    rows = scope["rows"]
    assert [r["strategy"] for r in rows] == ["DDP", "DiLoCo H=10", "SPARTA"]
    for row in rows:
        assert row["steps"] == 60 and row["sim_time_s"] > 0 and row["final_val_loss"] > 0
    by = {r["strategy"]: r for r in rows}
    assert by["DiLoCo H=10"]["bytes_per_node"] < by["DDP"]["bytes_per_node"]
    assert (tmp_path / "runs/compare.png").stat().st_size > 10_000
    shown = capsys.readouterr()
    assert "lowest validation loss" in shown.out and "simulated (s)" in shown.out
    # the model given is left as it was: a second call from the same seed gives the same rows
    model = scope["Classifier"]()
    before = [p.clone() for p in model.parameters()]
    scope["compare"](model, scope["data"], scope["data"], ["ddp"], num_nodes=2, max_steps=2,
                     batch_size=8, val_size=16, show=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("strategies, kwargs, message", [
    (["nope"], {}, "'nope'"),
    (["ddp", "ddp"], {}, "given twice"),
    ("ddp", {}, "must be a list"),
    ([], {}, "at least one strategy"),
    (["ddp"], {"strategy": "x"}, "compare sets each run's strategy"),
    (["ddp"], {"max_steps": -3}, "max_steps"),
])
def test_compare_refuses_what_it_cannot_run_before_any_run(strategies, kwargs, message,
                                                            monkeypatch):
    from exogym import compare
    from exogym.run.trainer import Trainer

    runs = []
    monkeypatch.setattr(Trainer, "fit", lambda self, **kw: runs.append(kw))
    with pytest.raises((ValueError, TypeError), match=message):
        compare(tiny_model(), toy_dataset(), toy_dataset(), strategies, show=False,
                num_nodes=2, **{"max_steps": 2, **kwargs})
    assert runs == []


@pytest.mark.slow(
    reason="the page's causal LM trained with DiLoCo twice, from a list and from a dataset")
def test_the_hugging_face_pages_causal_lm_learns_with_diloco_from_a_list_and_a_datasets_dataset(
        tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    page = "docs/huggingface.md"
    scope: dict = {"__name__": "huggingface_page"}
    exec(compile(code_block(page, "## A small causal language model", "python"), page, "exec"),
         scope)
    trainer, final = scope["trainer"], scope["final"]
    # from ln 64 = 4.16, a guess among 64 tokens
    assert scope["trainer"].summary["final_val_global_loss"] < 1.0, trainer.summary
    saved = type(final).from_pretrained(tmp_path / "runs" / "tiny-lm")
    assert torch.equal(saved.lm_head.weight, final.lm_head.weight)
    if importlib.util.find_spec("datasets") is None:
        return  # the page's datasets.Dataset needs the package (the dev extra)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    exec(compile(code_block(page, "## A `datasets.Dataset`", "python"), page, "exec"), scope)
    assert scope["trainer"].summary["final_val_global_loss"] < 1.0
