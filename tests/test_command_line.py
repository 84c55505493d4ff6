"""The command line as a mature tool: what a person meets before, around and after a command.

Each test pins one rough edge a user met: ``--version`` and shell completion
on both faces, the command list in ``--help`` whole, a printed command that
runs as printed, output to a file or a pipe not folded at 80 columns, plurals,
extras named with the command that installs them, compare's time columns and
what ``recommend`` tells to run. The programs run as programs (a real bash
completes them), except where Typer's test runner is enough to read a message.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer.main
from ranks import ROOT
from typer.testing import CliRunner

import cli_typer

runner = CliRunner()


def program(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``args`` (a program of the project, its arguments) with this Python first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PATH": path, **(env or {})})


def flat(text: str) -> str:
    """``text`` with every run of white space as one space (help pages wrap lines)."""
    return " ".join(text.split())


# --------------------------------------------------------------------------- --version


@pytest.mark.slow
@pytest.mark.parametrize("face", ["cli_typer.py", "wizard.py"])
def test_version_names_the_package_version_the_commit_and_python(face):
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                         re.M).group(1)
    done = program(sys.executable, face, "--version")
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith(f"exogym {declared} ({face}"), line
    assert f"Python {sys.version.split()[0]}" in line
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    if head.returncode == 0:
        assert f"commit {head.stdout.strip()}" in line, line


def test_version_answers_without_importing_torch():
    code = ("import sys\nfrom typer.testing import CliRunner\nimport cli_typer\n"
            "result = CliRunner().invoke(cli_typer.app, ['--version'])\n"
            "assert result.exit_code == 0 and 'exogym' in result.output, result.output\n"
            "print('torch' in sys.modules)\n")
    done = program(sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


# --------------------------------------------------------------------------- completion


def bash_completions(face: str, words: list[str]) -> list[str]:
    """What a real bash offers for ``./FACE WORDS...<Tab>``, through the script the program's
    ``--show-completion bash`` prints."""
    function = "_" + re.sub(r"[^a-zA-Z0-9_]", "", face.replace("-", "_")) + "_completion"
    line = " ".join(shlex.quote(w) for w in [f"./{face}", *words])
    script = (f"source <(./{face} --show-completion bash)\n"
              f"COMP_WORDS=({line}); COMP_CWORD={len(words)}\n"
              f"{function} ./{face}\n"
              'printf "%s\\n" "${COMPREPLY[@]}"\n')
    done = program("bash", "-c", script)
    assert done.returncode == 0, done.stderr
    return [w for w in done.stdout.splitlines() if w]


@pytest.mark.slow
def test_bash_completes_commands_options_and_profile_names():
    assert bash_completions("cli_typer.py", ["distributed-tr"]) == ["distributed-train"]
    assert bash_completions("cli_typer.py", ["compare", "--strat"]) == ["--strategies"]
    profiles = bash_completions("cli_typer.py", ["compare", "digits-d"])
    assert {"digits-ddp", "digits-diloco"} <= set(profiles)
    assert all(p.startswith("digits-d") for p in profiles)
    assert "--yes" in bash_completions("wizard.py", ["--y"])


def test_profile_completion_reads_the_config_given(tmp_path):
    config = tmp_path / "mine.ini"
    config.write_text("[distributed:zebra-run]\ntask = digits\n")
    assert bash_completions("cli_typer.py", ["compare", "--config", str(config), "z"]) == [
        "zebra-run"]


@pytest.mark.parametrize("face", ["cli_typer.py", "wizard.py"])
def test_install_completion_writes_the_script_and_sources_it_from_bashrc(tmp_path, face):
    # bash forks for the command (a second one follows it) rather than exec'ing it, so the
    # shell typer looks for among the command's parents is this bash, whoever runs the tests
    done = program("bash", "-c", f"./{face} --install-completion; exit $?",
                   env={"HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    script = tmp_path / ".bash_completions" / f"{face}.sh"
    assert "complete -o default -F" in script.read_text()
    assert str(script) in (tmp_path / ".bashrc").read_text()


def test_both_faces_run_by_their_name():
    for face in ("cli_typer.py", "wizard.py"):
        assert os.access(ROOT / face, os.X_OK), face
        assert (ROOT / face).read_text().startswith("#!/usr/bin/env python3\n"), face


# --------------------------------------------------------------------------- --help


def test_top_level_help_lists_every_command_with_its_whole_summary():
    done = program(sys.executable, "cli_typer.py", "--help", env={"COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    commands = done.stdout.split("Commands:", 1)[1]
    assert "..." not in commands and "…" not in commands
    group = typer.main.get_command(cli_typer.app)
    for name, command in group.commands.items():
        summary = flat((command.help or "").split("\n\n")[0])
        assert summary and summary in flat(commands), (name, summary, commands)
    assert all(len(line) <= 80 for line in done.stdout.splitlines())


# --------------------------------------------------------------------------- plurals


def test_plural_counts_one_thing_or_many():
    from exogym.base.plural import plural, plural_noun

    assert [plural(n, "rank") for n in (0, 1, 2)] == ["0 ranks", "1 rank", "2 ranks"]
    assert plural(1, "process") == "1 process" and plural(3, "process") == "3 processes"
    assert plural(2, "strategy") == "2 strategies" and plural(2, "day") == "2 days"
    assert plural(2, "GPU") == "2 GPUs" and plural(2, "child", "children") == "2 children"
    assert plural_noun(1, "rank") == "rank" and plural_noun(4, "rank") == "ranks"


def _fstring_hedges(path: Path) -> list[str]:
    import io
    import tokenize

    found = []
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    for token in tokens:
        text = token.string
        if token.type in (tokenize.STRING, getattr(tokenize, "FSTRING_START", -1)) \
                and re.match(r"(?i)r?f", text) and re.search(r"[a-z]\(s\)", text):
            found.append(f"{path.relative_to(ROOT)}:{token.start[0]}: {text.strip()[:70]}")
    return found


@pytest.mark.slow
def test_no_message_hedges_a_count_with_s_in_parentheses():
    """Counts go through exogym.base.plural: "1 rank", "3 ranks", never "rank(s)"."""
    files = [ROOT / "cli_typer.py", ROOT / "wizard.py",
             *sorted((ROOT / "distributed").rglob("*.py")), *sorted((ROOT / "exogym").rglob("*.py"))]
    hedges = [hit for path in files for hit in _fstring_hedges(path)]
    assert not hedges, hedges


def test_slurm_says_one_rank_on_one_node(tmp_path):
    result = runner.invoke(cli_typer.app, ["slurm", "digits-ddp", "--nodes", "1", "--out",
                                           str(tmp_path / "job.sbatch")])
    assert result.exit_code == 0, result.output
    assert "1 rank on 1 node." in result.output
    assert "on 1 rank;" in (tmp_path / "job.sbatch").read_text()


def one_host_file(tmp_path: Path) -> Path:
    """A hosts file of this machine alone: rank 0, no SSH."""
    import json

    from ranks import free_port

    path = tmp_path / "one.json"
    path.write_text(json.dumps({"master": "127.0.0.1", "workers": [],
                                "python_env": sys.executable, "project_path": str(ROOT),
                                "master_port": free_port()}))
    return path


def test_one_host_is_counted_as_one_in_the_dry_run_and_the_pre_flight(tmp_path):
    hosts = one_host_file(tmp_path)
    dry = runner.invoke(cli_typer.app, ["distributed-train", "digits-ddp", "--hosts", str(hosts),
                                        "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "Dry run: 1 rank on 1 host," in dry.output
    assert "note: the hosts file's 1 rank replaces the profile's num_nodes=4" in dry.output
    checked = program(sys.executable, "cli_typer.py", "check-hosts", str(hosts))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Pre-flight: 1 host, master port" in checked.stdout
    assert f"the only host in {hosts} is ready." in checked.stdout


# --------------------------------------------------------------------------- not a terminal


def piped(*args: str) -> subprocess.CompletedProcess[str]:
    """A program of the project writing into a pipe, as under a log or `| tee`: no terminal
    on any of its streams, no COLUMNS."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=120)


def test_a_table_written_to_a_pipe_is_not_folded():
    from distributed.profiles.profile import ProfileSet

    done = piped("cli_typer.py", "profiles")
    assert done.returncode == 0, done.stderr
    profiles = ProfileSet()
    longest = max(profiles.names(), key=lambda n: len(str(profiles.values(n).get(
        "description", ""))))
    description = str(profiles.values(longest)["description"])
    assert len(description) > 80
    row = next(line for line in done.stdout.splitlines() if f" {longest} " in line)
    assert description in row, row  # whole, on the profile's own line


def test_a_long_line_written_to_a_pipe_is_not_broken(tmp_path):
    deep = tmp_path / ("a-folder-whose-name-is-long-" * 6)
    deep.mkdir()
    hosts = one_host_file(deep)
    done = piped("cli_typer.py", "check-hosts", str(hosts))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"the only host in {hosts} is ready." in done.stdout.splitlines()


def test_output_console_off_a_terminal_keeps_lines_whole_and_rules_short():
    code = ("from exogym.base.terminal import output_console\n"
            "c = output_console()\n"
            "c.print('word ' * 60)\n"
            "c.rule('heading')\n"
            "from exogym.report.summary import RunReporter\n"
            "print(RunReporter(2).console.width > 1000)\n")
    done = piped("-c", code)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].strip() == ("word " * 60).strip()
    assert len(lines[1]) == 80 and "heading" in lines[1]
    assert lines[2] == "True"


# --------------------------------------------------------------------------- the pre-flight hint


def test_preflight_hint_to_simulate_instead_keeps_the_users_own_options(tmp_path):
    import json

    from ranks import free_port

    hosts = tmp_path / "my hosts.json"
    hosts.write_text(json.dumps({  # the worker's port answers nothing: pre-flight refuses it
        "master": "127.0.0.1", "workers": [{"host": "127.0.0.2", "ssh_port": free_port()}],
        "python_env": sys.executable, "project_path": str(ROOT)}))
    result = runner.invoke(cli_typer.app, [
        "distributed-train", "digits-ddp", "--hosts", str(hosts), "--set", "max_steps=7",
        "--set", "description=my own run", "--logger", "none"])
    assert result.exit_code == 2, result.output
    hint = flat(result.output).split("add --local (", 1)[1].rsplit(").", 1)[0]
    args = shlex.split(hint)
    assert args[:4] == ["python", "cli_typer.py", "distributed-train", "digits-ddp"]
    assert args[-1] == "--local"
    for pair in ("max_steps=7", "description=my own run", "logger=none"):
        assert args[args.index(pair) - 1] == "--set", (pair, args)
    assert f"check-hosts {shlex.quote(str(hosts))}" in flat(result.output)
    dry = runner.invoke(cli_typer.app, [*args[2:], "--dry-run"])  # it runs as printed
    assert dry.exit_code == 0, dry.output
    assert "as a local simulation" in dry.output and "max_steps=7" in dry.output


# --------------------------------------------------------------------------- --dry-run


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    from sshd_fixture import serve_sshd

    yield from serve_sshd(tmp_path_factory)


def printed_commands(output: str) -> list[str]:
    """The ``command:`` of every rank a dry run printed, as printed."""
    return [line.split("command:", 1)[1].strip() for line in output.splitlines()
            if line.lstrip().startswith("command:")]


@pytest.mark.slow(
    reason="the printed command run from several folders, each a training run")
def test_dry_run_of_a_simulation_prints_a_command_that_runs_as_printed_from_anywhere(tmp_path):
    from distributed.worker.environment import FINAL_MODEL

    out = tmp_path / "out dir"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = ["distributed-train", "digits-ddp", "--config", str(ROOT / "config.ini"), "--dry-run",
            "--set", "max_steps=2", "--set", "num_nodes=2", "--set", "val_size=0",
            "--set", "checkpoint_interval=None", "--set", "num_threads=1",
            "--set", f"output_dir={out}", "--set", "description=run by hand, 'quoted'"]
    done = program(sys.executable, str(ROOT / "cli_typer.py"), *args, cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    (command,) = printed_commands(done.stdout)
    assert command.startswith(f"cd {shlex.quote(str(ROOT))} && python -m distributed.worker ")
    ran = program("bash", "-c", command, cwd=elsewhere, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert (out / FINAL_MODEL).is_file()


@pytest.mark.slow
def test_dry_run_across_hosts_prints_commands_that_start_the_run_by_hand(sshd, tmp_path):
    """Each rank's printed command, pasted into a shell of its own (the worker's over the
    real ssh client to the test sshd), trains the run: nothing the launcher adds is missing,
    and the quoting survives the remote shell."""
    import json

    from faces_support import TINY, sshd_hosts

    from distributed.worker.environment import FINAL_MODEL

    out = tmp_path / "out dir"
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps(sshd_hosts(sshd, workers=1)))
    sets = [arg for pair in [*TINY, "max_steps=4", f"output_dir={out}",
                             "description=by hand, 'quoted'"] for arg in ("--set", pair)]
    result = runner.invoke(cli_typer.app, [
        "distributed-train", "digits-ddp", "--hosts", str(hosts), "--dry-run", *sets,
        "--known-hosts", str(sshd.known_hosts), "--ssh-config", str(sshd.ssh_config)])
    assert result.exit_code == 0, result.output
    local, remote = printed_commands(result.output)
    assert local.startswith(f"cd {shlex.quote(str(ROOT))} && env RANK=0 ")
    words = shlex.split(remote)
    assert words[:2] == ["ssh", "-t"] and f"{sshd.user}@127.0.0.2" in words
    assert "-c" not in shlex.split(words[-1])  # the rank itself, not the launcher's loader
    ranks = [subprocess.Popen(["bash", "-c", command], cwd=tmp_path, text=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for command in (local, remote)]
    try:
        outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert (out / FINAL_MODEL).is_file()


# --------------------------------------------------------------------------- extras


@pytest.fixture
def no_whisper_extra(monkeypatch):
    """This process as on a machine without the whisper extra: its packages cannot be found
    (``None`` in ``sys.modules`` is what Python reads as "no such module")."""
    from distributed.tasks.extras import TASK_EXTRAS

    for module in TASK_EXTRAS["whisper"][1]:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.delenv("COLUMNS", raising=False)


WHISPER_INSTALL = "pip install -e '.[whisper]'"


@pytest.mark.parametrize("command", [
    ["distributed-train", "whisper-tiny-diloco"],
    ["distributed-train", "whisper-tiny-lora-diloco", "--set", "max_steps=1"],
    ["compare", "whisper-tiny-diloco", "--strategies", "ddp,diloco"],
])
def test_a_whisper_profile_without_its_extra_names_the_command_that_installs_it(
        no_whisper_extra, command):
    result = runner.invoke(cli_typer.app, command)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "the whisper extra, which is not installed here (missing: transformers" \
           in flat(result.stderr)
    assert WHISPER_INSTALL in result.stderr
    assert "Comparing" not in result.output  # refused before any run


def test_a_dry_run_notes_the_missing_extra(no_whisper_extra):
    result = runner.invoke(cli_typer.app, ["distributed-train", "whisper-tiny-diloco",
                                           "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "note: the whisper task needs the whisper extra" in result.output
    assert WHISPER_INSTALL in result.output


def test_profiles_marks_each_profile_whose_extra_is_missing(no_whisper_extra):
    result = runner.invoke(cli_typer.app, ["profiles"])
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}
    whisper = [name for name in rows if name.startswith("whisper-")]
    assert whisper and all(f"this machine lacks the whisper extra: {WHISPER_INSTALL}"
                           in rows[name] for name in whisper)
    assert not any("lacks" in rows[name] for name in rows if not name.startswith("whisper-"))


def test_profiles_marks_nothing_when_the_extra_is_installed(monkeypatch):
    from distributed.tasks.extras import missing_modules

    if missing_modules("whisper"):
        pytest.skip("the whisper extra is not installed here")
    monkeypatch.delenv("COLUMNS", raising=False)
    result = runner.invoke(cli_typer.app, ["profiles"])
    assert result.exit_code == 0 and "lacks" not in result.output


# --------------------------------------------------------------------------- compare's times

#: The start-up the first strategy of a comparison pays alone (see slow_first_digits).
#: A start-up the later runs of a comparison reuse, far longer than any real one: it is
#: added to the comparison's clock, not slept, so a loaded machine cannot blur it.
SHARED_START_S = 1000.0
_built: list[bool] = []
_clock_ahead = [0.0]


def _compare_clock() -> float:
    return time.perf_counter() + _clock_ahead[0]


def slow_first_digits(**settings):
    """The digits task, built SHARED_START_S later the first time in a process: a start-up
    the later runs reuse (a dataset loaded once, a server started once), which whichever
    strategy runs first pays."""
    from distributed.tasks.builtin import digits_task

    if not _built:
        _clock_ahead[0] += SHARED_START_S
        _built.append(True)
    return digits_task(**settings)


def table_rows(output: str, title: str) -> dict[str, dict[str, str]]:
    """The rows of the table titled ``title``, by first cell, each by column name."""
    lines = output.split(title, 1)[1].splitlines()
    header = next(line for line in lines if line.startswith("┃"))
    names = [cell.strip() for cell in header.strip("┃").split("┃")]
    rows = {}
    for line in lines:
        if line.startswith("└"):
            break
        if line.startswith("│"):
            cells = [cell.strip() for cell in line.strip("│").split("│")]
            rows[cells[0]] = dict(zip(names, cells))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("order", [("ddp", "diloco"), ("diloco", "ddp")])
def test_compare_times_each_strategy_alone_and_reports_the_start_up_apart(tmp_path, order,
                                                                         monkeypatch):
    from distributed.app.compare import StartClock

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(StartClock.__init__, "__defaults__", (_compare_clock,))
    _built.clear()
    config = tmp_path / "compare.ini"
    config.write_text("[distributed:slow-start]\ntask = test_command_line:slow_first_digits\n"
                      "num_nodes = 2\nbatch_size = 16\nmax_steps = 10\nval_interval = 10\n"
                      "val_size = 32\nnum_threads = 1\ncheckpoint_interval = None\n"
                      f"output_dir = {tmp_path / 'runs'}\n")
    result = runner.invoke(cli_typer.app, [
        "compare", "slow-start", "--config", str(config), "--strategies", ",".join(order),
        "--out", str(tmp_path / "compare.png")])
    assert result.exit_code == 0, result.output
    rows = table_rows(result.output, "slow-start: 2 strategies")

    def seconds(strategy: str, column: str) -> float:
        return float(rows[strategy][column].removesuffix(" s"))

    first, second = order
    # the shared start-up is charged to the start-up of whichever ran first, never to a
    # strategy's time: swapping the order swaps the start-ups, not the training times
    assert seconds(first, "start-up") >= SHARED_START_S > seconds(second, "start-up")
    assert seconds(first, "train time") < SHARED_START_S
    assert seconds(second, "train time") < SHARED_START_S
    assert f"{first}: val loss" in result.output and "s training (start-up" in result.output


# --------------------------------------------------------------------------- strategies' checks


def test_a_strategy_setting_the_model_cannot_run_is_one_paragraph_before_any_rank():
    result = runner.invoke(cli_typer.app, [
        "distributed-train", "digits-diloco", "--set", "strategy=streaming_diloco",
        "--set", "num_fragments=5"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "num_fragments=5 is more than the model's 2 layers" in result.stderr
    assert "step 1" not in result.output  # no rank trained a step


# --------------------------------------------------------------------------- recommend's profiles


def write_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "profiles.ini"
    path.write_text(text)
    return str(path)


FAMILY = """
[distributed:mine-base]
task = digits
num_nodes = 2
batch_size = 16
max_steps = 100

[distributed:mine-diloco]
base_profile = mine-base
strategy = diloco
H = 20
outer_lr = 0.7

[distributed:mine-fedavg]
base_profile = mine-base
strategy = fedavg
H = 10
lr = 0.01
"""


def trains_the_same(config: str, planned: str, found, strategy: str) -> None:
    """``found`` (a RunWith) trains ``planned``'s model and run with ``strategy``."""
    from distributed.profiles.profile import load_profile, strategy_class

    mine = load_profile(planned, config)
    theirs = load_profile(found.profile, config, found.overrides or None)
    assert theirs.resolved.strategy_cls is strategy_class(strategy)
    assert theirs.resolved.task_kwargs == mine.resolved.task_kwargs
    for key in ("num_nodes", "batch_size", "max_steps", "task"):
        assert theirs.values.get(key) == mine.values.get(key), key


def test_run_with_names_the_profile_of_the_family_that_runs_a_strategy(tmp_path):
    from distributed.app.run_with import run_with
    from distributed.profiles.profile import load_profile

    config = write_config(tmp_path, FAMILY)
    planned = load_profile("mine-diloco", config)
    fedavg = run_with(planned, "fedavg", {"H": 1}, config)
    assert (fedavg.profile, fedavg.overrides) == ("mine-fedavg", {"H": 1})  # its lr stays
    trains_the_same(config, "mine-diloco", fedavg, "fedavg")
    own = run_with(planned, "diloco", {"H": 100}, config)
    assert own.args == "mine-diloco --set H=100"
    # no profile names DDP, and mine-diloco's H cannot go with it: --set on the base does
    ddp = run_with(planned, "ddp", {}, config)
    assert ddp.args == "mine-base --set strategy=ddp"
    trains_the_same(config, "mine-diloco", ddp, "ddp")


def test_run_with_sets_what_the_planned_run_changes_and_takes_back_what_another_adds(tmp_path):
    import inspect

    from distributed.app.run_with import run_with
    from distributed.profiles.profile import load_profile
    from distributed.tasks.builtin import digits_task

    config = write_config(tmp_path, FAMILY + """
[distributed:wide-ddp]
task = digits
strategy = ddp
hidden = 64
num_nodes = 2
batch_size = 16
max_steps = 100
num_threads = 1
""")
    user = {"num_nodes": 3, "H": 5}
    planned = load_profile("mine-diloco", config, user)
    ddp = run_with(planned, "ddp", {}, config, user)
    # the only DDP profile trains a wider model with one thread: both are taken back
    assert ddp.profile == "wide-ddp"
    assert ddp.overrides["num_nodes"] == 3 and "H" not in ddp.overrides
    default_width = inspect.signature(digits_task).parameters["hidden"].default
    assert ddp.overrides["num_threads"] is None and ddp.overrides["hidden"] == default_width
    assert "hidden" not in planned.values and default_width != 64
    theirs = load_profile(ddp.profile, config, ddp.overrides)
    assert theirs.resolved.strategy_cls.__name__ == "SimpleReduceStrategy"


def test_run_with_is_none_when_no_profile_of_the_task_can_run_it(tmp_path):
    from distributed.app.run_with import run_with
    from distributed.profiles.profile import load_profile

    config = write_config(tmp_path, """
[distributed:only-diloco]
task = digits
strategy = diloco
H = 20
""")
    assert run_with(load_profile("only-diloco", config), "ddp", {}, config) is None


def test_recommend_names_the_profile_that_runs_each_candidate_and_the_picks_command():
    result = runner.invoke(cli_typer.app, ["recommend", "digits-diloco", "--link-mbit", "100"])
    assert result.exit_code == 0, result.output
    assert "needs its own profile" not in result.output
    rows = table_rows(result.output, "Mbit/s")
    column = "run it with: distributed-train ..."
    assert rows["DDP"][column] == "digits-ddp"
    assert rows["SPARTA p=0.005"][column] == "digits-sparta"
    assert rows["FedAvg H=1"][column] == "digits-fedavg --set H=1"
    picked = next(label for label, row in rows.items() if row[""] == "<- pick")
    command = flat(result.output).split("to train with it: ", 1)[1].split(" rule:", 1)[0]
    assert shlex.split(command)[:4] == ["python", "cli_typer.py", "distributed-train",
                                        rows[picked][column].split()[0]]
    dry = runner.invoke(cli_typer.app, [*shlex.split(command)[2:], "--dry-run"])
    assert dry.exit_code == 0, dry.output  # the printed command runs


def test_recommend_json_gives_each_candidates_profile():
    import json

    result = runner.invoke(cli_typer.app, ["recommend", "digits-diloco", "--link-mbit", "100",
                                           "--json"])
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    by_label = {c["label"]: c["run_with"] for c in found["candidates"]}
    assert by_label["DDP"] == {"profile": "digits-ddp", "overrides": {}}
    assert by_label["DiLoCo H=100"] == {"profile": "digits-diloco", "overrides": {"H": 100}}
