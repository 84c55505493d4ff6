"""What a crafted file can do: nothing but be refused or shown as it is.

A run folder, a profile, a hosts file and a project are files a stranger may have
written (or handed over). Each test plants one as they would and checks that nothing
hangs, nothing fills memory, nothing the terminal would act on reaches it, no page
shows a link the stranger wrote, no file lands where it must not, and the other runs
are still listed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
from ranks import ROOT
from typer.testing import CliRunner

from distributed.hosts.onhost import runfolders

#: What a stranger puts in a name or an error: a window title, a clear screen, a link, a
#: clipboard write, a cursor move, a fake status and rich markup.
HOSTILE = ("\x1b]0;owned\x07\x1b[2J\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\"
           "\x1b]52;c;ZXZpbA==\x07\x1b[1A\r FINISHED OK [bold green]done[/] "
           "[link=https://evil.example]x[/link]")


def claim(base: Path, identity: dict) -> Path:
    return Path(runfolders.claim_new(str(base), {"fingerprint": "f", **identity})["folder"])


def a_good_run(root: Path) -> Path:
    folder = claim(root / "good", {"profile": "good", "started": "2026-11-01T10:00:00",
                                   "settings": {"strategy": "ddp"}})
    (folder / "summary.json").write_text(json.dumps({"steps": 3, "final_train_loss": 0.5}))
    return folder


def run_bounded(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``code`` in a Python of its own, with 1 GiB of address space and ``timeout`` s: a
    read that would wait forever or fill memory fails that process, not the suite."""
    prelude = ("import resource\n"
               "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


# -- 9: a run folder's files are read as regular files of a bounded size -----------------


def test_runs_lists_damaged_folders_as_damaged_and_the_others_as_usual(tmp_path):
    root = tmp_path / "runs"
    good = a_good_run(root)
    fifo = claim(root / "fifo", {"profile": "fifo", "started": "2026-11-02T10:00:00"})
    os.mkfifo(fifo / "summary.json")  # nobody ever writes to it
    zero = claim(root / "zero", {"profile": "zero", "started": "2026-11-03T10:00:00"})
    (zero / "summary.json").symlink_to("/dev/zero")
    deep = claim(root / "deep", {"profile": "deep", "started": "2026-11-04T10:00:00"})
    (deep / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    writing = claim(root / "writing", {"profile": "writing", "started": "2026-11-05"})
    os.mkfifo(writing / ".trace.jsonl.abc.tmp")
    big = claim(root / "big", {"profile": "big", "started": "2026-11-06T10:00:00"})
    with open(big / "summary.json", "wb") as f:
        f.truncate(64 << 20)  # sparse: takes no room, reads as 64 MiB
    done = run_bounded(f"""
        import json
        from distributed.app.run_list import list_runs
        rows = list_runs({str(root)!r})
        print(json.dumps({{r.folder.name: [r.status, r.why] for r in rows}}))
    """, timeout=30)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert rows.pop(good.name) == ["finished", ""]
    assert rows["fifo"][0] == "damaged" and "FIFO" in rows["fifo"][1], rows
    assert rows["zero"][0] == "damaged" and "device" in rows["zero"][1], rows
    assert rows["deep"][0] == "damaged" and "nests" in rows["deep"][1], rows
    assert rows["writing"][0] == "damaged" and "FIFO" in rows["writing"][1], rows
    assert rows["big"][0] == "damaged" and "over the" in rows["big"][1], rows


def test_replay_refuses_a_trace_that_is_a_fifo_or_a_device_without_waiting(tmp_path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "trace.jsonl")
    zero = tmp_path / "zero"
    zero.mkdir()
    (zero / "trace.jsonl").symlink_to("/dev/zero")
    done = run_bounded(f"""
        from distributed.app.replay import load_recording
        from distributed.app.replay.recording import ReplayError
        for folder in ({str(fifo)!r}, {str(zero)!r}):
            try:
                load_recording(folder)
            except ReplayError as exc:
                print("refused:", exc)
    """, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FIFO" in done.stdout and "a device" in done.stdout, done.stdout


def test_a_trace_line_nested_past_reading_is_a_value_error_naming_the_line(tmp_path):
    from exogym.base.untrusted import TooDeepJSON
    from exogym.report.trace import read_trace

    path = tmp_path / "trace.jsonl"
    path.write_text('{"kind": "x"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(TooDeepJSON, match="line 2"):
        read_trace(path)


def test_a_base_profile_chain_past_the_limit_is_refused_naming_the_chain(tmp_path):
    from distributed.profiles.profile import MAX_BASE_CHAIN, ProfileError, ProfileSet

    path = tmp_path / "config.ini"
    count = 30_000
    path.write_text("".join(f"[distributed:p{i}]\nbase_profile = p{i + 1}\n"
                            for i in range(count)) + f"[distributed:p{count}]\ntask = digits\n")
    with pytest.raises(ProfileError) as refused:
        ProfileSet(path, local=False).get("p0")
    message = str(refused.value)
    assert f"more than {MAX_BASE_CHAIN} base_profile links" in message
    assert "'p0' -> 'p1'" in message and len(message) < 1000


# -- 8: what a run folder holds is shown, never acted on by the terminal -----------------


def a_hostile_tree(root: Path) -> None:
    a_good_run(root)
    folder = claim(root / "evil", {"profile": "evil" + HOSTILE, "started": "2026-11-02" + HOSTILE,
                                   "settings": {"strategy": "ddp" + HOSTILE}})
    (folder / "trace.jsonl").write_text(json.dumps(
        {"kind": "end", "status": "failed", "error": "boom" + HOSTILE, "steps": 1}) + "\n")


def assert_shown_not_acted_on(output: str) -> None:
    assert "\x1b" not in output and "\x07" not in output and "\r" not in output, repr(output)
    assert "\\x1b]0;owned\\x07" in output, output  # the stranger's bytes, visible
    assert "[bold green]done[/]" in output, output  # markup shown as written


@pytest.mark.parametrize("words", [["runs"], ["runs", "clean"]], ids=["runs", "clean"])
def test_runs_and_runs_clean_show_a_run_folders_text_with_its_escapes_visible(tmp_path,
                                                                               monkeypatch,
                                                                               words):
    from cli_typer import app

    a_hostile_tree(tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, words, env={"COLUMNS": "2000"})
    assert_shown_not_acted_on(result.output)
    if words == ["runs"]:
        assert result.exit_code == 0, result.output
        assert "finished" in result.output
    else:  # the list it would remove, then no terminal to ask
        assert result.exit_code == 2 and "give --yes" in result.output, result.output


def test_an_error_naming_a_crafted_folder_prints_its_escapes_visible(tmp_path, monkeypatch):
    from cli_typer import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["runs", "x" + HOSTILE], env={"COLUMNS": "2000"})
    assert result.exit_code == 2
    assert_shown_not_acted_on(result.output)


def test_replay_tables_show_a_recorded_profile_and_reason_as_written():
    from io import StringIO

    from rich.console import Console

    from distributed.app.replay.report import replay_tables

    timeline = {"clock": "wall", "wall_s": 1.0, "round_steps": 1, "round_s_median": 0.1,
                "round_s_p10": 0.1, "round_s_p90": 0.1, "evaluations": [[1, 0.5]],
                "membership": [{"step": 5, "reason": "lost" + HOSTILE, "lost_s": 0.1}]}
    report = {"profile": "p" + HOSTILE, "real": timeline,
              "replay": {**timeline, "membership": []},
              "ratios": {"wall_s": 1.0, "round_s_median": 1.0, "val_loss": [[1, 1.0]]},
              "target_val_loss": 0.5,
              "what_if": [{"place": 1, "label": "v" + HOSTILE, "reaches_target": True,
                           "time_to_target_s": 1.0, "wall_s": 1.0, "round_s_median": 0.1,
                           "final_val_loss": 0.5}],
              "cluster": {"network": None, "links_from": "none: x" + HOSTILE,
                          "compute_time_s": 0.1}}
    tables = replay_tables(report)
    out = StringIO()
    console = Console(file=out, width=3000, force_terminal=True, highlight=False)
    console.print(tables.comparison)
    console.print(tables.what_if)
    console.print(tables.cluster, markup=False)
    text = out.getvalue()
    assert "]0;owned" not in text.replace("\\x1b]0;owned", ""), repr(text)
    assert "\x1b]" not in text and "\x07" not in text, repr(text)
    assert text.count("[bold green]done[/]") == 4, text


# -- 13: settings past any real run are refused before anything starts -------------------


@pytest.mark.parametrize("setting, message", [
    ("num_threads=1000000", "num_threads=1000000 is over the limit of 1,024"),
    ("batch_size=1000000000000", "batch_size=1000000000000 is over the limit of 16,777,216"),
    ("minibatch_size=1000000000000", "minibatch_size=1000000000000 is over the limit of "),
    ("val_size=1000000000000", "val_size=1000000000000 is over the limit of 16,777,216"),
    ("num_threads=1e6", "num_threads must be an integer"),
    ("batch_size=1e12", "batch_size must be an integer"),
], ids=["num_threads", "batch_size", "minibatch_size", "val_size", "threads-float",
        "batch-float"])
def test_a_setting_past_any_real_run_is_refused_naming_it_and_its_range(setting, message):
    from distributed.profiles.profile import ProfileError, load_profile, parse_overrides

    with pytest.raises(ProfileError) as refused:
        load_profile("digits-ddp", overrides=parse_overrides([setting]))
    assert message in str(refused.value)
    if "over the limit" in message:
        assert re.search(r"an integer from [01] to [0-9,]+\)", str(refused.value))


def test_fit_refuses_a_batch_size_past_the_limit_before_starting_a_rank():
    from exogym.config.fit_args import MAX_BATCH_SIZE, RunArgs

    with pytest.raises(ValueError, match=f"batch_size={10**12} is over the limit of "
                                         f"{MAX_BATCH_SIZE:,}"):
        RunArgs(batch_size=10**12, strategy=object())


# -- 10: a hosts file never sends a project or an environment into the system's folders --


@pytest.mark.parametrize("project", ["/", "//", "/etc", "/usr/local/gym", "/var/lib/gym",
                                     "/lib64", "/home/me", "~", "~/", ".", "~/../x", "/root"])
def test_a_project_path_in_the_systems_folders_or_a_home_itself_is_refused(tmp_path, project):
    from distributed.hosts.hostsfile import HostsFileError, load_hosts

    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"master": "10.0.0.1", "workers": [
        {"host": "10.0.0.2", "project_path": project}], "python_env": "python3",
        "project_path": "~/exogym"}))
    with pytest.raises(HostsFileError) as refused:
        load_hosts(path)
    assert f'"workers[0].project_path" is {json.dumps(project)}: it ' in str(refused.value)
    assert "give a folder of its own" in str(refused.value)


@pytest.mark.parametrize("project", ["~/exogym", "exogym", "/srv/gym", "/home/me/gym",
                                     "/opt/exogym", "/root/gym", "/tmp/gym"])
def test_a_project_path_of_its_own_is_accepted(tmp_path, project):
    from distributed.hosts.hostsfile import load_hosts

    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"master": "10.0.0.1", "workers": ["10.0.0.2"],
                                "python_env": "python3", "project_path": project}))
    assert load_hosts(path).hosts[1].project_path == project


@pytest.mark.parametrize("python_env, where", [("/usr/bin/python3", "/usr"),
                                               ("/bin/python3", "/"),
                                               ("~/bin/python3", "~")])
def test_setup_hosts_refuses_to_make_an_environment_in_a_system_folder_before_any_ssh(
        tmp_path, python_env, where):
    from distributed.app.setup_hosts import SetupRequest, setup_hosts
    from distributed.hosts.hostsfile import HostsFileError

    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"master": "10.255.255.1", "workers": [],
                                "python_env": python_env, "project_path": "~/exogym"}))
    request = SetupRequest(hosts_file=path, known_hosts=str(tmp_path / "known_hosts"),
                           ssh_config=str(tmp_path / "ssh_config"), ssh_timeout=0.5,
                           write=False, preflight=False)
    with pytest.raises(HostsFileError) as refused:
        setup_hosts(request, console=None)
    assert f"would make its environment in {where!r}" in str(refused.value)


# -- 12: a host's reported versions are believed only within reason ----------------------


def test_an_absurd_c_library_or_macos_version_is_refused_without_allocating():
    done = run_bounded("""
        from distributed.hosts.provision import HostPlatform, ProvisionError
        for system, field, version in [
                ("Linux", "libc_version", "2.999999999"), ("Linux", "libc_version", "2." + "9" * 5000),
                ("Linux", "libc_version", "7.1"), ("Linux", "libc_version", "2.x"),
                ("Darwin", "mac_version", "999999999.0")]:
            platform = HostPlatform(python="3.11.2", implementation="cpython", system=system,
                                    machine="x86_64", libc="glibc" if system == "Linux" else None,
                                    **{field: version})
            try:
                platform.wheel_platforms()
            except ProvisionError as exc:
                assert "its Python reports" in str(exc) and len(str(exc)) < 400, exc
                print("refused:", str(exc)[:100])
    """, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("refused:") == 5, done.stdout


def test_a_real_glibc_still_gets_its_wheel_platforms():
    from distributed.hosts.provision import HostPlatform

    platform = HostPlatform(python="3.11.2", implementation="cpython", system="Linux",
                            machine="x86_64", libc="glibc", libc_version="2.36")
    assert platform.wheel_platforms()[0] == "manylinux_2_36_x86_64"


# -- 14: the sync sends a project's links as links, never what a link out of it names ---


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    from sshd_fixture import serve_sshd

    yield from serve_sshd(tmp_path_factory)


def a_project_with_links(root: Path, outside: Path) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "code.py").write_text("x = 1\n")
    (root / "inside.py").symlink_to("pkg/code.py")
    (root / "pkg_link").symlink_to("pkg")
    (root / "absolute.txt").symlink_to(outside / "secret.txt")
    (root / "pkg" / "climbs.txt").symlink_to("../../outside/secret.txt")
    (root / "outside_dir").symlink_to(outside)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "."], check=True)


def test_a_projects_files_leave_out_every_link_that_leads_out_of_it(tmp_path):
    from distributed.hosts import sync

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("the stranger's target\n")
    project = tmp_path / "project"
    a_project_with_links(project, outside)
    assert sync.shared_files(project) == ["inside.py", "pkg/code.py", "pkg_link"]
    assert sync.code_files(project) == ["inside.py", "pkg/code.py"]
    assert set(sync.leaving_links(project, sync.tracked_files(project))) == {
        "absolute.txt", "pkg/climbs.txt", "outside_dir"}


@contextmanager
def _ssh_client(sshd):
    """A paramiko client connected to the test's sshd."""
    import paramiko

    client = paramiko.SSHClient()
    client.load_host_keys(str(sshd.known_hosts))
    client.connect(sshd.addresses[0], port=sshd.port, username=sshd.user,
                   key_filename=str(sshd.key_path), look_for_keys=False, allow_agent=False)
    try:
        yield client
    finally:
        client.close()


@pytest.mark.slow(reason="copies a project to a real sshd over SFTP")
def test_the_sync_copies_nothing_into_a_folder_of_someone_elses_files(tmp_path, sshd):
    """A project_path naming a person's folder by mistake (``~/Documents``) gets nothing
    copied into it; an empty folder is taken and marked, so that a sync cut short is
    taken up again, and a checkout of the project is used as it is."""
    from distributed.hosts.sync import PROJECT_MARK, ForeignFolderError, sync_files

    project = tmp_path / "project"
    (project / "exogym").mkdir(parents=True)
    (project / "exogym" / "__init__.py").write_text("")
    (project / "pyproject.toml").write_text("[project]\nname = 'exogym'\n")
    files = ["exogym/__init__.py", "pyproject.toml"]
    documents = tmp_path / "documents"
    documents.mkdir()
    (documents / "thesis.tex").write_text("years of work\n")
    empty, checkout = tmp_path / "empty", tmp_path / "checkout"
    empty.mkdir()
    (checkout / "exogym").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("[project]\n")
    with _ssh_client(sshd) as client:
        with pytest.raises(ForeignFolderError) as refused:
            sync_files(client, "h", project, str(documents), files)
        assert sorted(os.listdir(documents)) == ["thesis.tex"]
        assert f"{documents} holds files that are not the project's (thesis.tex)" in \
            str(refused.value)
        assert "point project_path to a new or empty folder" in str(refused.value)
        assert sync_files(client, "h", project, str(empty), files).copied == 2
        assert (empty / PROJECT_MARK).is_file() and (empty / "pyproject.toml").is_file()
        (empty / "pyproject.toml").unlink()  # as if the last sync was cut short
        assert sync_files(client, "h", project, str(empty), files).copied == 1
        assert sync_files(client, "h", project, str(checkout), files).copied == 2
        assert not (checkout / PROJECT_MARK).exists()


@pytest.mark.slow(reason="copies a project to a real sshd over SFTP")
def test_the_sync_copies_links_inside_the_project_as_links_and_skips_those_leading_out(
        tmp_path, sshd):
    from distributed.hosts.sync import sync_files, tracked_files

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("the stranger's target\n")
    project = tmp_path / "project"
    a_project_with_links(project, outside)
    remote = tmp_path / "remote"
    with _ssh_client(sshd) as client:
        files = tracked_files(project)
        stats = sync_files(client, "h", project, str(remote), files)
        again = sync_files(client, "h", project, str(remote), files)
    assert not any("stranger" in p.read_text() for p in remote.rglob("*") if p.is_file())
    for name in ("absolute.txt", "pkg/climbs.txt", "outside_dir"):
        assert not os.path.lexists(remote / name), name
    assert sorted(stats.skipped) == sorted([f"absolute.txt -> {outside / 'secret.txt'}",
                                            f"outside_dir -> {outside}",
                                            f"pkg/climbs.txt -> {outside / 'secret.txt'}"])
    assert os.readlink(remote / "inside.py") == "pkg/code.py"
    assert os.readlink(remote / "pkg_link") == "pkg"
    assert (remote / "inside.py").read_text() == "x = 1\n"
    assert (again.copied, again.unchanged) == (0, 3)


# -- 7: a name on the dashboard's charts is text, never a link ---------------------------

LINK = '<a href="https://evil.example/login">Click to re-authenticate</a>'
LINKS_JS = """return Array.from(document.querySelectorAll('.js-plotly-plot a'))
  .map(a => a.getAttribute('href') || a.getAttribute('xlink:href'));"""
LEGENDS_JS = """return Array.from(document.querySelectorAll('.js-plotly-plot .legendtext'))
  .map(t => t.textContent);"""


@pytest.mark.slow(reason="Chromium draws a dashboard's charts")
def test_a_host_or_run_named_with_a_link_shows_as_text_on_the_dashboards_charts():
    from test_web_dashboard import launch_chromium, step, wait_for

    from distributed.app.web.server import WebDashboard

    browser = launch_chromium()
    chromium = next(browser)
    try:
        with WebDashboard() as web:
            for run in ("first" + LINK, "second" + LINK):
                web.begin_run(run, {"lr": 0.1}, 1, hosts=[LINK])
                for n in range(1, 6):
                    web.on_event(step(0, n, 1.0 / n, host=LINK))
            chromium.get(f"http://127.0.0.1:{web.port}/")
            legends = wait_for(lambda: [t for t in chromium.execute_script(LEGENDS_JS)
                                        if "Click" in t] or None, 20, "the charts' legends")
            assert any(t.startswith("first" + LINK) for t in legends), legends
            assert chromium.execute_script(LINKS_JS) == []
    finally:
        next(browser, None)


# -- 6: values replayed into a run's store leave its recorded membership whole ----------


def test_a_replayed_log_entry_leaves_the_summary_with_the_runs_real_membership():
    from types import SimpleNamespace

    from distributed.app.run import launcher_record
    from exogym.comm.store import ControlStore, new_run_key, open_store
    from exogym.membership.hosts import key, log_change, membership_log
    from exogym.report.goodput import GoodputMeter
    from exogym.report.summary import MergeLog

    decided = [{"step": 1, "ranks": [0, 1, 2], "hosts": ["a", "b", "c"], "reason": "start"},
               {"step": 40, "ranks": [0, 1], "hosts": ["a", "b"], "reason": "c (rank 2) lost"}]
    store = open_store("127.0.0.1", 0, is_master=True, timeout_s=5, key=new_run_key())
    for entry in decided:
        log_change(store, json.dumps(entry).encode())
    # The launcher reads each entry as it is decided (distributed.launch.elastic_attempt).
    launcher_read = membership_log(store)
    assert launcher_read == decided
    # Then a value signed by an earlier run's key is written over the first entry: the
    # run ignores it as unsigned, and reads the log's other entries all the same.
    earlier_run = ControlStore(store.raw.inner, new_run_key(), 5)
    earlier_run.set(key("log", 1), json.dumps({**decided[0], "ranks": [9]}))
    assert membership_log(store, whole=True) == decided[1:]
    launcher = SimpleNamespace(membership=launcher_read, injector=None, fault_records=[])
    recorded = launcher_record(launcher, GoodputMeter(3), MergeLog())
    assert recorded["membership"] == decided
