"""fit's arguments are defined once: names, signature, docstring, run spec and profile keys follow."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from toys import tiny_model, toy_dataset

from exogym import Trainer
from exogym.config.fit_args import FitArgs, RunArgs, fit_arg_names, profile_keys
from exogym.run.spec import Placement, make_run_spec
from exogym.strategy import SimpleReduceStrategy

ROOT = Path(__file__).resolve().parents[1]
ROOT_ARGS = dict(strategy=SimpleReduceStrategy(), device="cpu", max_steps=2, val_size=0)


def test_fit_signature_shows_every_argument_with_its_default():
    params = inspect.signature(Trainer.fit).parameters
    assert list(params) == ["self", *fit_arg_names()]
    for f in dataclasses.fields(FitArgs):
        assert params[f.name].default == f.default, f.name
    assert params["batch_size"].default == 16 and params["timeout_s"].default == 1800.0
    assert params["logger"].default == "csv" and params["progress"].default is True
    doc = inspect.getdoc(Trainer.fit)
    for name in fit_arg_names():
        assert f"\n    {name}: " in doc, name


def test_an_unknown_fit_argument_is_named_with_the_closest_accepted_one():
    ds = toy_dataset()
    with pytest.raises(TypeError, match="'val_intervall' \\(did you mean 'val_interval'\\?\\)"):
        Trainer(tiny_model(), ds, ds).fit(val_intervall=3, **ROOT_ARGS)


def test_fit_still_takes_its_first_arguments_by_position():
    strategy = SimpleReduceStrategy()
    args = FitArgs.from_call("fit()", (2, strategy, 3), {"batch_size": 8})
    assert (args.num_epochs, args.strategy, args.num_nodes, args.batch_size) == (2, strategy, 3, 8)
    with pytest.raises(TypeError, match="multiple values for argument 'num_nodes'"):
        FitArgs.from_call("fit()", (2, strategy, 3), {"num_nodes": 3})


def test_profile_run_keys_are_the_fit_arguments_a_profile_may_set():
    from distributed.profiles.profile import RUN_KEYS

    assert RUN_KEYS == profile_keys() == {
        "num_nodes", "num_epochs", "max_steps", "batch_size", "minibatch_size",
        "gradient_accumulation", "max_memory_usage", "shuffle", "val_size", "val_interval",
        "autocast", "checkpoint_interval", "keep_checkpoints", "correlation_interval", "device",
        "seed", "log_interval", "num_threads", "timeout_s", "logger", "wandb_project",
        "partition", "shared_samples", "network", "compute_time_s", "rank_speeds", "speed_mode", "balance",
    }


def test_checking_fit_arguments_and_reading_profile_keys_import_no_torch():
    code = ("import sys; from exogym.config.fit_args import FitArgs; "
            "import distributed.profiles.profile as p; "
            "FitArgs(strategy=object(), batch_size=8, device='cuda'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("bad, message", [
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"max_memory_usage": 1.5}, r"max_memory_usage must be in \(0, 1\], got 1.5"),
    ({"timeout_s": -1}, "timeout_s must be a positive number of seconds"),
    ({"device": "gpu"}, "device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got 'gpu'"),
    ({"minibatch_size": 5, "batch_size": 16}, "minibatch_size=5 must divide batch_size=16"),
    ({"dataloader_kwargs": {"shuffle": True}}, r"may not set \['shuffle'\]"),
    ({"logger": "mlflow"}, "logger must be None, 'csv', 'wandb', 'tensorboard' or a Logger"),
])
def test_plain_values_are_checked_without_a_model_or_a_device(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        FitArgs(strategy=object(), **bad)


def test_the_run_spec_is_frozen_and_the_placement_travels_beside_it():
    ds = toy_dataset()
    spec = make_run_spec(tiny_model(), ds, ds, RunArgs(num_nodes=3, batch_size=8,
                                                       gradient_accumulation=2, **ROOT_ARGS))
    assert spec.minibatch_size == 4 and spec.accumulation_steps == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.minibatch_size = 8
    assert not any(f.name in ("ranks_per_machine", "backend", "broadcast_init")
                   for f in dataclasses.fields(spec))
    assert Placement(ranks_per_machine=3).threads_per_rank(spec) >= 1
    assert Placement(ranks_per_machine=3).threads_per_rank(
        dataclasses.replace(spec, num_threads=2)) == 2


def test_run_config_holds_every_run_argument_and_what_was_resolved():
    ds = toy_dataset()
    spec = make_run_spec(tiny_model(), ds, ds, RunArgs(**ROOT_ARGS))
    config = spec.config()
    run_names = {f.name for f in dataclasses.fields(RunArgs)}
    assert set(config) == run_names | {"device_type", "model", "trainable_parameters"}
    assert config["strategy"]["strategy"] == "SimpleReduceStrategy"
    assert config["device_type"] == "cpu"


# --- fit's arguments as editors and type checkers see them ---------------------------------------


def test_the_typed_keywords_of_fit_are_generated_from_the_one_definition():
    from pathlib import Path

    from exogym.config.fit_args import FIT_KWARGS_MODULE, fit_kwargs_source

    written = (Path(__file__).resolve().parents[1] / FIT_KWARGS_MODULE).read_text()
    assert written == fit_kwargs_source(), (
        f"{FIT_KWARGS_MODULE} is out of date: run python -m exogym.config.fit_args")


@pytest.mark.slow(
    reason="mypy type-checks a user's script against the project's types")
def test_a_type_checker_reports_a_misspelled_fit_argument_in_a_user_script(tmp_path):
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it comes with the dev extra)")
    root = Path(__file__).resolve().parents[1]
    # The project's modules are read; the packages they import (torch, wandb, numpy: some
    # 2,000 modules, three quarters of mypy's time) are taken as Any, as fit's keywords
    # are the project's own.
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nfollow_imports = skip\nignore_missing_imports = True\n"
        "[mypy-exogym.*]\nfollow_imports = silent\n")
    script = tmp_path / "user.py"
    script.write_text(
        "from exogym import Trainer\n"
        "from exogym.strategy import DiLoCoStrategy\n\n\n"
        "def main(trainer: Trainer) -> None:\n"
        "    trainer.fit(strategy=DiLoCoStrategy(H=10), num_nodes=2, max_steps=5)\n"
        "    trainer.fit(strategy=DiLoCoStrategy(H=10), num_nodes=2, max_step=5)\n")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"),
         "--cache-dir", str(tmp_path / "cache"), str(script)],
        cwd=root, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, done.stdout + done.stderr
    assert 'user.py:7: error: Unexpected keyword argument "max_step" for "fit"' in errors[0]
    assert 'did you mean "max_steps"' in errors[0]
