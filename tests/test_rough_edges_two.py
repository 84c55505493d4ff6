"""What a new user met in the second round of trials, each fixed as a class.

A run refused at start leaves no trace; every refusal names the setting and its range
(optimizer and outer-optimizer settings are checked by name when the strategy is made,
through ``--set`` or in Python alike); a dry run checks and warns as the run would;
``fit`` checks the data and the model's output before any rank starts and ends an
interruption in one line; replay speaks in words and reads a resumed run as one run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import warm
from ranks import ROOT

from distributed.hosts.onhost import runfolders


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*warm.cli_command(), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


QUICK = ["--set", "max_steps=4", "--set", "H=2", "--set", "val_size=16", "--set",
         "num_threads=1", "--logger", "none"]


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """A folder where one quick run ended: the runs a refused run must leave alone (each
    test refuses a run in a copy of it)."""
    folder = tmp_path_factory.mktemp("earlier")
    earlier = cli("distributed-train", "digits-diloco", *QUICK, cwd=folder)
    assert earlier.returncode == 0, earlier.stderr
    return folder


@pytest.mark.slow
@pytest.mark.xdist_group("rough_edges_two-earlier")  # one worker: they share earlier_run
@pytest.mark.parametrize("setting, named", [
    ("outer_lr=-1", "outer_lr must be a number > 0, got -1"),
    ("outer_lr=abc", "outer_lr must be a number > 0, got 'abc'"),
    ("outer_momentum=1.5", "outer_momentum must be a number in [0, 1), got 1.5"),
    ("nesterov=3", "nesterov must be True or False"),
    ("H=0", "H must be an integer >= 1"),
    ("lr=fast", "lr must be a number > 0"),
    ("device=cuda" if not __import__("torch").cuda.is_available() else "device=mps",
     "was asked for"),
])
def test_a_run_refused_at_start_takes_no_folder_and_leaves_latest_alone(earlier_run, tmp_path,
                                                                        setting, named):
    shutil.copytree(earlier_run / "runs", tmp_path / "runs", symlinks=True)
    runs = tmp_path / "runs"
    before = sorted(p.name for p in runs.iterdir())
    pointed = runfolders.latest(str(runs / "digits-diloco"))
    refused = cli("distributed-train", "digits-diloco", *QUICK, "--set", setting, cwd=tmp_path)
    assert refused.returncode == 2, (refused.returncode, refused.stderr)
    assert named in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert sorted(p.name for p in runs.iterdir()) == before
    assert runfolders.latest(str(runs / "digits-diloco")) == pointed


DRY_REFUSED = [("outer_lr=-1", "outer_lr must be a number > 0"), ("H=0", "H must be an integer"),
               ("lr=fast", "lr must be a number > 0"),
               ("outer_lr=abc", "outer_lr must be a number > 0, got 'abc'")]
if not __import__("torch").cuda.is_available():
    DRY_REFUSED.append(("device=cuda", "no CUDA GPU is available"))


@pytest.mark.slow
@pytest.mark.parametrize("setting, named", DRY_REFUSED)
def test_a_dry_run_refuses_what_the_run_would_refuse(tmp_path, setting, named):
    done = cli("distributed-train", "digits-diloco", "--dry-run", "--set", setting,
               cwd=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert named in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_dry_run_warns_as_the_run_would(tmp_path):
    done = cli("distributed-train", "digits-diloco", "--dry-run", "--set", "batch_size=5000",
               "--set", "max_steps=10", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "batch_size=5000 is larger than one rank's share of the data" in said, said
    assert "H=20 > max_steps=10" in said, said
    assert "nothing is started" in said
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_first_run_refused_leaves_no_runs_folder_behind(tmp_path):
    refused = cli("distributed-train", "digits-diloco", *QUICK, "--set", "outer_lr=-1",
                  cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert not (tmp_path / "runs" / "digits-diloco").exists()
    assert not os.path.lexists(tmp_path / "runs" / "digits-diloco.latest")


def test_a_release_leaves_a_folder_that_holds_more_than_the_claim(tmp_path):
    base = str(tmp_path / "runs" / "p")
    identity = {"fingerprint": "f", "started": "now"}
    first = runfolders.claim_new(base, identity)
    second = runfolders.claim_new(base, {**identity, "started": "later"})
    assert second["previous_latest"] == first["folder"]
    (Path(second["folder"]) / "trace.jsonl").write_text("{}\n")  # the run had started
    assert runfolders.release(base, second["folder"], {**identity, "started": "later"},
                              second["previous_latest"]) == {"released": False}
    assert Path(second["folder"]).is_dir()
    os.unlink(Path(second["folder"]) / "trace.jsonl")
    # another run's claim is never released by this one
    assert runfolders.release(base, second["folder"], identity,
                              second["previous_latest"]) == {"released": False}
    assert runfolders.release(base, second["folder"], {**identity, "started": "later"},
                              second["previous_latest"]) == {"released": True}
    assert not Path(second["folder"]).exists()
    assert runfolders.latest(base) == first["folder"]


@pytest.mark.parametrize("make, message", [
    (lambda s: s.DiLoCoStrategy(outer_lr=-1), "DiLoCoStrategy: outer_lr must be a number > 0"),
    (lambda s: s.DiLoCoStrategy(outer_lr="abc"), "outer_lr must be a number > 0, got 'abc'"),
    (lambda s: s.DiLoCoStrategy(outer_momentum=-0.1), "outer_momentum must be a number in [0, 1)"),
    (lambda s: s.SPARTADiLoCoStrategy(outer_lr=float("inf")), "outer_lr must be a number > 0"),
    (lambda s: s.DiLoCoStrategy(optim_spec=s.OptimSpec("adamw", lr=-3)),
     "AdamW: lr must be a number > 0, got -3"),
    (lambda s: s.DiLoCoStrategy(optim_spec=s.OptimSpec("adamw", betas=(0.9, 1.5))),
     "AdamW: betas[1] must be a number in [0, 1), got 1.5"),
    (lambda s: s.DiLoCoStrategy(optim_spec=s.OptimSpec("sgd", momentum="fast")),
     "SGD: momentum must be a number in [0, 1), got 'fast'"),
    (lambda s: s.DiLoCoStrategy(optim_spec=s.OptimSpec("sgd", lr=0.1, nesterov=True)),
     "SGD(lr=0.1, nesterov=True) is refused by torch: Nesterov momentum requires"),
])
def test_optimizer_settings_are_checked_by_name_when_the_strategy_is_made(make, message):
    from exogym import strategy

    with pytest.raises(ValueError) as caught:
        make(strategy)
    assert message in str(caught.value)


# -- fit() says what the CLI says, before any rank starts --------------------------------

class _Net(__import__("torch").nn.Module):
    def __init__(self, returns: str = "loss"):
        import torch

        super().__init__()
        self.returns = returns
        self.layer = torch.nn.Linear(8, 2)

    def forward(self, batch):
        import torch

        logits = self.layer(batch[0])
        if self.returns == "tuple":
            return logits, torch.nn.functional.cross_entropy(logits, batch[1])
        if self.returns == "logits":
            return logits
        if self.returns == "per-sample":
            return torch.nn.functional.cross_entropy(logits, batch[1], reduction="none")
        return torch.nn.functional.cross_entropy(logits, batch[1])


def _data(n: int):
    import torch
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    return TensorDataset(torch.randn(n, 8), torch.randint(0, 2, (n,)))


QUIET_FIT = dict(logger=None, progress=False, val_size=0)


@pytest.mark.parametrize("returns, shown", [("tuple", "a tuple whose first item is a tensor of "
                                                       "shape (2, 2)"),
                                             ("logits", "a tensor of shape (2, 2)"),
                                             ("per-sample", "a tensor of shape (2,)")])
def test_fit_refuses_a_forward_that_returns_no_scalar_before_any_rank_starts(returns, shown):
    import time

    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy

    trainer = Trainer(_Net(returns), _data(64), _data(64))
    started = time.monotonic()
    with pytest.raises(TypeError, match="must return the loss as a scalar tensor") as caught:
        trainer.fit(strategy=DiLoCoStrategy(H=2), num_nodes=2, max_steps=2, batch_size=8,
                    **QUIET_FIT)
    assert shown in str(caught.value) and "before any rank started" in str(caught.value)
    assert len(str(caught.value)) < 400 and trainer.history == []
    assert time.monotonic() - started < 10


def test_fit_refuses_ranks_without_a_sample_of_their_own():
    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy

    with pytest.raises(ValueError, match="3 samples for 4 ranks: rank 3 would have no sample"):
        Trainer(_Net(), _data(3), _data(3)).fit(strategy=DiLoCoStrategy(H=2), num_nodes=4,
                                                max_steps=2, batch_size=1, **QUIET_FIT)


@pytest.mark.slow
def test_ranks_share_samples_only_when_asked_and_are_told_so():
    from exogym import Trainer
    from exogym.run.spec import DataWarning
    from exogym.strategy import DiLoCoStrategy

    trainer = Trainer(_Net(), _data(3), _data(3))
    with pytest.warns(DataWarning, match=r"3 samples for 4 ranks: rank 3 train on copies of "
                                         r"other ranks' samples \(shared_samples=True\)"):
        trainer.fit(strategy=DiLoCoStrategy(H=2), num_nodes=4, max_steps=2, batch_size=1,
                    shared_samples=True, **QUIET_FIT)
    assert trainer.history and trainer.history[-1]["step"] == 2
    with pytest.raises(ValueError, match="partition='dirichlet:0.5' splits 3 samples by label"):
        trainer.fit(strategy=DiLoCoStrategy(H=2), num_nodes=4, max_steps=2, batch_size=1,
                    shared_samples=True, partition="dirichlet:0.5", **QUIET_FIT)


def test_fit_warns_of_a_batch_larger_than_a_ranks_share_as_the_cli_does():
    from exogym import Trainer
    from exogym.run.spec import DataWarning
    from exogym.strategy import DiLoCoStrategy

    with pytest.warns(DataWarning, match=r"batch_size=32 is larger than one rank's share of "
                                         r"the data \(5 of 20 training samples over 4 ranks\)"):
        Trainer(_Net(), _data(20), _data(20)).fit(strategy=DiLoCoStrategy(H=2), num_nodes=4,
                                                  max_steps=2, batch_size=32, **QUIET_FIT)


@pytest.mark.slow
def test_a_quiet_fit_prints_nothing_when_a_rank_rejoins(capfd):
    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy

    Trainer(_Net(), _data(64), _data(64)).fit(strategy=DiLoCoStrategy(H=2), num_nodes=3,
                                              max_steps=8, batch_size=4,
                                              rank_failures=[(2, 2, 4)], **QUIET_FIT)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


@pytest.mark.slow
def test_a_fit_with_progress_tells_the_hand_over_once():
    from io import StringIO

    from rich.console import Console

    from exogym import Trainer
    from exogym.report.summary import RunReporter
    from exogym.strategy import DiLoCoStrategy

    shown = StringIO()
    reporter = RunReporter(3, console=Console(file=shown, width=200))
    Trainer(_Net(), _data(64), _data(64)).fit(strategy=DiLoCoStrategy(H=2), num_nodes=3,
                                              max_steps=8, batch_size=4, logger=None,
                                              val_size=0, progress=reporter,
                                              rank_failures=[(2, 2, 4)])
    lines = [line for line in shown.getvalue().splitlines() if "handed the state" in line]
    assert len(lines) == 1 and "rank 0 handed the state to rank 2" in lines[0], lines


# -- replay speaks plainly -------------------------------------------------------------

@pytest.mark.slow
def test_replay_says_why_a_setting_is_refused_and_describes_its_cluster_in_words(tmp_path):
    done = cli("distributed-train", "digits-diloco", "--set", "max_steps=20", "--set", "H=5",
               "--set", "network=100mbit", "--set", "val_size=16", "--logger", "none",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    folder = "runs/digits-diloco"
    whatif = cli("replay", folder, "--strategy", "ddp", "--set", "H=50", cwd=tmp_path)
    assert whatif.returncode == 2
    assert "--set H: ddp has no setting H (it is diloco's, the recorded run's)" in whatif.stderr
    assert "did you mean 'H'" not in whatif.stderr
    typo = cli("replay", folder, "--strategy", "ddp", "--set", "Hh=50", cwd=tmp_path)
    assert typo.returncode == 2 and "(did you mean 'H'?)" in typo.stderr, typo.stderr
    shown = cli("replay", folder, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if x.startswith("replayed with:"))
    assert "100 Mbit/s per host" in line and "no rank left" in line, line
    for raw in ("None", "{", "[]", "'bandwidth'"):
        assert raw not in line, line


def test_a_cluster_with_failures_and_hand_overs_is_described_in_words():
    from distributed.app.replay import describe_cluster

    said = describe_cluster({
        "network": {"bandwidth": 7871128746.0, "latency_s": 0.0002,
                    "rank_bandwidth": [1e9, 2e9]},
        "links_from": "each host's pre-flight probe", "rank_speeds": [1.0, 0.5],
        "compute_time_s": 0.02, "rank_failures": [[1, 5, 9], [0, 12, None]],
        "eval_s": {"round_end": 0.1, "mid_round": 0.0}, "hand_over_s": [0.25]})
    assert said == ("links 1 Gbit/s, 2 Gbit/s, 0.2 ms latency (from each host's pre-flight "
                    "probe); ranks at 1.00, 0.50 of the fastest's speed (0.02 s a step); rank "
                    "1 away from step 5 to 9; rank 0 away from step 12; an evaluation 0.1 s at "
                    "a round's end, 0 s inside one; hand-overs of 0.25 s")


FIT_INTERRUPTED = """
import torch
from torch.utils.data import TensorDataset
from exogym import Trainer
from exogym.strategy import DiLoCoStrategy
torch.manual_seed(0)
x = torch.randn(512, 8); y = torch.randint(0, 2, (512,))
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.l = torch.nn.Linear(8, 2)
    def forward(self, batch):
        import time; time.sleep(0.01)
        return torch.nn.functional.cross_entropy(self.l(batch[0]), batch[1])
ds = TensorDataset(x, y)
Trainer(Net(), ds, ds).fit(strategy=DiLoCoStrategy(H=2), num_nodes=2, max_steps=100000,
                           batch_size=8, val_size=0, logger=None, progress=False,
                           checkpoint_interval=2, save_dir="ckpt", run_name="r")
"""


@pytest.mark.slow
def test_ctrl_c_in_fit_ends_with_one_line_saying_how_to_continue(tmp_path):
    import signal
    import time

    script = tmp_path / "train.py"
    script.write_text(FIT_INTERRUPTED)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "ckpt/r/rank1").glob("step*.ckpt")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("exogym.run.trainer.FitInterrupted: fit() was interrupted"), err
    assert "the newest checkpoint every rank has is at step" in last
    assert "resume_from='auto'" in last
    assert "During handling" not in err and "direct cause" not in err, err


def test_a_resumed_trace_is_one_timeline():
    from distributed.app.replay import one_timeline, timeline

    def part(first: int, last: int, evals: tuple[int, ...], resumed: bool) -> list[dict]:
        lines = [{"kind": "run", "resumed": resumed}]
        for step in range(first, last + 1):
            lines.append({"kind": "step", "rank": 0, "step": step,
                          "wall_s": round(0.1 * (step - first + 1), 4)})
            if step in evals:
                lines.append({"kind": "eval", "rank": 0, "step": step,
                              "val_loss": 1.0 / step})
        lines.append({"kind": "membership", "t": 0.05, "step": first, "ranks": [0],
                      "reason": "start"})
        lines.append({"kind": "end", "status": "failed" if not resumed else "ok",
                      "error": None if resumed else "interrupted", "steps": last})
        return lines

    # interrupted at step 399, resumed from the checkpoint at 300, finished at 500
    lines = part(1, 399, (100, 200, 300, 350), False) + part(301, 500, (350, 400, 500), True)
    merged = one_timeline(lines)
    steps = [line["step"] for line in merged if line["kind"] == "step"]
    assert steps == list(range(1, 501))
    evals = [line["step"] for line in merged if line["kind"] == "eval"]
    assert evals == [100, 200, 300, 350, 400, 500]  # 350 once: the resumed run's
    ends = [line for line in merged if line["kind"] == "end"]
    assert len(ends) == 1 and ends[0]["status"] == "ok"
    walls = [line["wall_s"] for line in merged if line["kind"] == "step"]
    assert all(b > a for a, b in zip(walls, walls[1:]))  # the clock never goes back
    assert walls[-1] == pytest.approx(30.0 + 20.0)
    times = timeline(merged, 1, 1).times
    assert list(times) == list(range(1, 501)) and times[500] == pytest.approx(50.0)
    assert one_timeline(part(1, 10, (), True)) == part(1, 10, (), True)


def test_every_recommend_row_is_run_by_the_command_it_prints():
    """A row predicted with a strategy's default settings prints a command that sets them,
    also through a profile of that strategy whose own settings differ (digits-demo runs
    top-16; the DeMo row predicts top-32)."""
    from distributed.app.recommend import candidate_specs
    from distributed.app.run_with import run_with
    from distributed.profiles.profile import load_profile

    planned = load_profile("digits-diloco")
    for spec in candidate_specs(planned):
        how = run_with(planned, spec.name, spec.settings)
        assert how is not None, spec.label
        ran = load_profile(how.profile, overrides=dict(how.overrides))
        assert ran.strategy == spec.name or spec.name == "ddp", (spec.label, how)
        for key, value in spec.settings.items():
            assert ran.values.get(key, value) == value, (spec.label, how, key)
        if spec.name == "demo":
            assert ran.resolved.strategy_kwargs.get("compression_topk") == 32, how


def test_every_numeric_strategy_argument_is_refused_by_name():
    """Each built-in strategy's number and flag arguments: a value of the wrong kind or out
    of range is refused naming the argument, when the strategy is made."""
    import inspect
    import warnings

    from exogym.strategy import registry

    wrong = {int: [-1, "x", 1.5], float: [-1.0, "x", float("nan"), float("inf")],
             bool: ["x", 3]}
    valid_zero_or_more = {"fragment_delay", "max_staleness", "merge_delay", "grace_s",
                          "seed", "warmup_steps", "max_norm", "keep_checkpoints"}
    unnamed = []
    for name in registry.KNOWN:
        if name == "none":
            continue
        cls = registry.class_of(name)
        for arg, parameter in inspect.signature(cls.__init__).parameters.items():
            default = parameter.default
            kind = bool if isinstance(default, bool) else int if isinstance(default, int) \
                else float if isinstance(default, float) else None
            if kind is None or arg in valid_zero_or_more:
                continue
            for value in wrong[kind]:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        cls(**{arg: value})
                except (ValueError, TypeError) as exc:
                    if arg not in str(exc):
                        unnamed.append(f"{name}.{arg}={value!r}: {exc}")
                else:
                    unnamed.append(f"{name}.{arg}={value!r} accepted")
    assert unnamed == [], "\n".join(unnamed)
