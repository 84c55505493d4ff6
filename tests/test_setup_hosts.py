"""`setup-hosts`: hosts that hold nothing but their system python3 made ready to train.

The whole journey, hosts apart (each its own network, home and /tmp) set up from nothing
by the wizard, set up again, then trained with --min-nodes, is in test_journeys. Here are
the pieces: which paths a hosts file gets, which wheel platforms a host accepts, the
errors for a platform without a wheel or an environment setup may not touch, hosts that
share a folder, and setup's lock.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ports import free_port

from distributed.app.setup_hosts import DEFAULT_PROJECT_PATH, fill_paths
from distributed.hosts.provision import (
    HostPlatform,
    NoWheelError,
    ProvisionError,
    declared_requirements,
    download_wheels,
    lock_path,
    venv_of,
    wheel_error,
)

ROOT = Path(__file__).resolve().parents[1]
LINUX = HostPlatform(python="3.11.2", implementation="cpython", system="Linux",
                     machine="x86_64", libc="glibc", libc_version="2.36")


def test_missing_paths_are_filled_per_host_and_this_machine_keeps_its_checkout():
    data = {"master": "127.0.0.1", "workers": ["10.0.0.2", {"host": "10.0.0.3",
                                                           "project_path": "/srv/gym"}],
            "ssh_user": "me"}
    out, filled = fill_paths(data, this_checkout="/here", this_python="/here/.venv/bin/python")
    assert out["master"] == {"host": "127.0.0.1", "project_path": "/here",
                             "python_env": "/here/.venv/bin/python"}
    assert out["workers"][0] == {"host": "10.0.0.2", "project_path": DEFAULT_PROJECT_PATH,
                                 "python_env": f"{DEFAULT_PROJECT_PATH}/.venv/bin/python"}
    # a project_path given is kept, and its environment goes inside it
    assert out["workers"][1] == {"host": "10.0.0.3", "project_path": "/srv/gym",
                                 "python_env": "/srv/gym/.venv/bin/python"}
    assert filled["10.0.0.3"] == {"python_env": "/srv/gym/.venv/bin/python"}
    assert out["ssh_user"] == "me" and data["workers"][0] == "10.0.0.2"  # input untouched
    # top-level values count for every host: nothing to fill
    same, none = fill_paths({**data, "python_env": "/opt/v/bin/python", "project_path": "/p"})
    assert none == {} and same["workers"][0] == "10.0.0.2"


def test_a_host_accepts_the_wheel_platforms_of_its_c_library_and_system():
    tags = LINUX.wheel_platforms()
    assert tags[0] == "manylinux_2_36_x86_64" and "manylinux_2_17_x86_64" in tags
    assert "manylinux2014_x86_64" in tags and "manylinux1_x86_64" in tags
    assert "manylinux_2_37_x86_64" not in tags
    mac = HostPlatform(python="3.12.1", implementation="cpython", system="Darwin",
                       machine="arm64", mac_version="14.2")
    mac_tags = mac.wheel_platforms()
    assert mac_tags[:2] == ["macosx_14_0_arm64", "macosx_14_0_universal2"]
    assert "macosx_11_0_arm64" in mac_tags and "macosx_10_9_universal2" in mac_tags
    args = mac.pip_download_args()
    assert args[:3] == ["--only-binary=:all:", "--python-version", "3.12"]
    assert "cp" in args
    musl = HostPlatform(python="3.11.2", implementation="cpython", system="Linux",
                        machine="x86_64", libc=None, libc_version=None)
    with pytest.raises(ProvisionError, match="not glibc"):
        musl.wheel_platforms()


def test_pip_finding_no_wheel_names_the_package_and_the_platform():
    output = ("ERROR: Could not find a version that satisfies the requirement torch==2.13.0 "
              "(from versions: none)\nERROR: No matching distribution found for torch==2.13.0\n")
    error = wheel_error(output, LINUX)
    assert isinstance(error, NoWheelError) and error.package == "torch==2.13.0"
    assert "torch==2.13.0" in str(error) and "Linux x86_64 (glibc 2.36), CPython 3.11" in str(error)


@pytest.mark.slow
def test_a_platform_without_a_wheel_is_refused_naming_the_package(tmp_path):
    riscv = HostPlatform(python="3.11.2", implementation="cpython", system="Linux",
                         machine="riscv64", libc="glibc", libc_version="2.36")
    with pytest.raises(NoWheelError) as caught:
        download_wheels(riscv, ["torch==2.13.0"], lock_path(), cache=tmp_path, timeout=300)
    assert caught.value.package.startswith("torch")
    assert "riscv64" in str(caught.value) and "CPython 3.11" in str(caught.value)
    assert not (tmp_path / next(iter(os.listdir(tmp_path))) / ".complete").exists()


def test_setup_manages_only_environments_it_can_name():
    assert venv_of("/srv/gym/.venv/bin/python") == "/srv/gym/.venv"
    assert venv_of("~/exogym/.venv/bin/python3") == "~/exogym/.venv"
    for bad in ("python3", "/usr/bin/env", "/opt/python/python"):
        with pytest.raises(ValueError, match="VENV/bin/python"):
            venv_of(bad)


def test_the_requirements_are_the_declared_ones_of_the_extras_asked():
    found = declared_requirements(["distributed", "examples"])
    names = {r.split(">")[0].split("=")[0].split("[")[0].strip().lower() for r in found}
    assert {"torch", "numpy", "paramiko", "typer", "scikit-learn"} <= names
    assert not any(r.startswith("exogym") for r in found)
    with pytest.raises(ValueError, match="unknown extra 'gpu'"):
        declared_requirements(["gpu"])


def test_an_installed_package_sends_its_own_files_laid_out_as_installed(tmp_path):
    """Under a wheel's site-packages the files sent are exogym's and this package's (with
    its config.ini), not every package there; a host then runs the same layout."""
    from distributed.hosts.sync import PACKAGE_FOLDER, is_checkout, tracked_files

    site = tmp_path / "site-packages"
    for rel in ("exogym/__init__.py", f"{PACKAGE_FOLDER}/__init__.py",
                f"{PACKAGE_FOLDER}/config.ini", f"{PACKAGE_FOLDER}/worker/__main__.py",
                f"{PACKAGE_FOLDER}/__pycache__/x.cpython-311.pyc", "numpy/__init__.py",
                "dask/__init__.py"):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("")
    assert not is_checkout(site)
    assert tracked_files(site) == sorted(["exogym/__init__.py", f"{PACKAGE_FOLDER}/__init__.py",
                                          f"{PACKAGE_FOLDER}/config.ini",
                                          f"{PACKAGE_FOLDER}/worker/__main__.py"])


# --------------------------------------------------------------------------- shared folders
# The test sshd's addresses are hosts that share this machine's disk and home: the layout
# of hosts with one home on NFS.


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    from sshd_fixture import serve_sshd

    yield from serve_sshd(tmp_path_factory)


def _ssh(sshd):
    from distributed.hosts.ssh import SSHOptions

    return SSHOptions(known_hosts_path=sshd.known_hosts, ssh_config_path=sshd.ssh_config,
                      allow_agent=False, look_for_keys=False, connect_timeout=5.0)


def _connect(sshd, address):
    import paramiko

    client = paramiko.SSHClient()
    client.load_host_keys(str(sshd.known_hosts))
    client.connect(address, port=sshd.port, username=sshd.user,
                   key_filename=str(sshd.key_path), look_for_keys=False, allow_agent=False)
    return client


def _small_project(root: Path, files: int) -> list[str]:
    (root / "pkg").mkdir(parents=True)
    (root / "config.ini").write_text("[distributed:x]\n")
    for i in range(files):
        (root / "pkg" / f"m{i}.py").write_text(f"VALUE = {i}\n" + "# padding\n" * 400)
    (root / "pkg" / "first.py").symlink_to("m0.py")  # travels as a link
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "."], check=True)
    from distributed.hosts.sync import tracked_files

    return tracked_files(root)


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.name.startswith(".exogym-share.") or p.name.endswith(".exogym-sync.tmp"))


def test_hosts_are_told_apart_by_their_folders_not_by_the_folders_names(sshd, tmp_path):
    """Probes find one folder behind two spellings (a link, as one NFS home mounted at two
    places), and two folders of one machine are not taken as one."""
    from distributed.hosts.shared import find_shared

    shared, own = tmp_path / "home" / "gym", tmp_path / "own" / "gym"
    (tmp_path / "home").mkdir()
    (tmp_path / "mount").symlink_to(tmp_path / "home")
    clients = {}
    try:
        for k, address in enumerate(sshd.addresses[:4]):
            clients[k] = _connect(sshd, address)
        names = dict(enumerate(sshd.addresses[:4]))
        folders = {0: str(shared), 1: str(own), 2: str(tmp_path / "mount" / "gym"),
                   3: str(tmp_path / "third")}
        groups = find_shared(clients, folders, names)
        apart = find_shared(clients, {0: str(shared), 1: str(own)}, names)
    finally:
        for client in clients.values():
            client.close()
    assert [(g.keys, g.paths) for g in groups] == [((0, 2), (folders[0], folders[2]))]
    assert groups[0].leader_host == sshd.addresses[0]
    assert groups[0].describe() == (f"hosts {sshd.addresses[0]} and {sshd.addresses[2]} share "
                                    f"one folder ({sshd.addresses[0]}: {folders[0]}, "
                                    f"{sshd.addresses[2]}: {folders[2]})")
    assert apart == []
    assert shared.is_dir() and own.is_dir() and (tmp_path / "third").is_dir()
    assert _leftovers(tmp_path) == []


def test_the_project_is_copied_once_into_a_folder_hosts_share_and_into_each_of_its_own(
        sshd, tmp_path):
    """A session's sync (setup-hosts', a run's --sync) copies into a shared project folder
    from its first host alone and says so; a host with a folder of its own gets its copy."""
    from rich.console import Console

    from distributed.hosts.session import HostSession

    project = tmp_path / "project"
    files = _small_project(project, 20)
    shared = tmp_path / "home" / "gym"
    a, b, c = sshd.addresses[:3]
    hosts = {"master": "127.0.0.1", "master_port": free_port(),
             "workers": [{"host": a, "project_path": str(shared)},
                         {"host": b, "project_path": str(shared)},
                         {"host": c, "project_path": str(tmp_path / "own")}],
             "ssh_port": sshd.port, "ssh_user": sshd.user, "ssh_key_path": str(sshd.key_path),
             "python_env": sys.executable, "project_path": str(project)}
    out = io.StringIO()
    with HostSession(hosts, ssh=_ssh(sshd), project_root=project,
                     console=Console(file=out, width=300)) as session:
        first = {s.host: s for s in session.sync()}
        again = {s.host: s for s in session.sync()}
    assert (first[a].copied, first[a].shared_from) == (len(files), None)
    assert (first[b].copied, first[b].shared_from) == (0, a)
    assert (first[c].copied, first[c].shared_from) == (len(files), None)
    assert (again[a].unchanged, again[b].shared_from, again[c].unchanged) == (
        len(files), a, len(files))
    assert f"hosts {a} and {b} share {shared}: set up once from {a}" in out.getvalue()
    assert c not in out.getvalue().split("share")[1].split("\n")[0]
    for rel in files:
        assert (shared / rel).read_bytes() == (project / rel).read_bytes()
        assert (tmp_path / "own" / rel).read_bytes() == (project / rel).read_bytes()
    assert _leftovers(tmp_path) == []


def test_two_copies_into_one_new_folder_at_once_neither_fails(sshd, tmp_path):
    """Two writers into one folder not made yet (two runs, or hosts sharing a home that were
    not told apart): each makes the folders the other may have made, and writes temporary
    files the other never takes away; the old shared temporary name failed with
    '[Errno 2] No such file'."""
    from distributed.hosts.sync import sync_files

    project = tmp_path / "project"
    files = _small_project(project, 150)
    remote = tmp_path / "home" / "new" / "gym"
    clients = []
    try:
        for address in sshd.addresses[:2]:
            clients.append(_connect(sshd, address))
        start = threading.Barrier(2, timeout=30)

        def copy(client):
            start.wait()
            return sync_files(client, "h", project, str(remote), files)

        with ThreadPoolExecutor(2) as pool:
            stats = list(pool.map(copy, clients))
    finally:
        for client in clients:
            client.close()
    assert sum(s.copied + s.unchanged for s in stats) == 2 * len(files)
    for rel in files:
        assert (remote / rel).read_bytes() == (project / rel).read_bytes()
    assert os.readlink(remote / "pkg" / "first.py") == "m0.py"
    assert _leftovers(tmp_path) == []


def test_a_shared_environment_made_for_another_platform_is_refused_naming_both_hosts(
        sshd, tmp_path):
    """A host that shares an environment another host made checks it and writes nothing;
    one made for another platform (NFS homes across x86 and ARM machines) is refused with
    the fix: an environment of its own."""
    from distributed.hosts.provision import MARKER, HostProvisioner, ProvisionResult
    from distributed.hosts.remote import SSHShell

    venv = tmp_path / "home" / "gym" / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (venv / MARKER).write_text(json.dumps({"key": "made-for-another-platform"}))
    before = sorted(venv.rglob("*"))
    a, b = sshd.addresses[:2]
    client = _connect(sshd, b)
    try:
        sftp = client.open_sftp()
        provisioner = HostProvisioner(
            SSHShell(client, b), sftp, b, python_env=str(venv / "bin" / "python"),
            project_path=str(venv.parent), requirements=["numpy"], lock=lock_path(),
            base_python=sys.executable)
        made = ProvisionResult(a, "Linux aarch64 (glibc 2.36), CPython 3.11",
                               str(venv / "bin" / "python"), "wheels", 1.0)
        with pytest.raises(ProvisionError) as caught:
            provisioner.check_shared(made)
        sftp.close()
    finally:
        client.close()
    message = str(caught.value)
    assert message.startswith(f"[{b}] shares the environment {venv} with {a}, which made it")
    assert "the environment was made for Linux aarch64 (glibc 2.36), CPython 3.11" in message
    assert "give " + b + " a python_env in a folder only it uses" in message
    assert sorted(venv.rglob("*")) == before  # checked, nothing written
    assert json.loads((venv / MARKER).read_text()) == {"key": "made-for-another-platform"}


def test_a_second_setup_waits_for_the_first_ones_lock_and_one_left_behind_is_taken_over(
        sshd, tmp_path):
    """Two setups at once (two terminals, or two machines into one home) through two hosts
    sharing the folder: the second waits until the first releases the lock; one held past
    the wait is refused naming its holder and the lock; one left by a setup that died is
    taken over."""
    import time

    from distributed.hosts.shared import FolderBusyError, FolderLock

    folder = tmp_path / "home" / "gym"
    folder.mkdir(parents=True)
    lock_file = folder / ".venv.exogym-setup.lock"
    a, b = sshd.addresses[:2]
    clients = [_connect(sshd, a), _connect(sshd, b)]
    said: list[str] = []
    try:
        first, second = (c.open_sftp() for c in clients)

        def lock(sftp, host, **kw):
            return FolderLock(sftp, str(lock_file), what="the environment gym/.venv",
                              host=host, stale_after=kw.pop("stale_after", 600),
                              poll=0.05, say=said.append, **kw)

        events: list[str] = []

        def wait_for_it():
            with lock(second, b, wait=30) as held:
                events.append("second holds it")
                return held.contended

        holding = lock(first, a, wait=0)
        holding.acquire()
        with ThreadPoolExecutor(1) as pool:
            try:
                waiting = pool.submit(wait_for_it)
                deadline = time.monotonic() + 30
                while not said and time.monotonic() < deadline:
                    time.sleep(0.02)
                with pytest.raises(FolderBusyError) as busy:
                    lock(second, b, wait=0.1).acquire()
                events.append("first releases it")
            finally:
                holding.release()
            assert waiting.result(timeout=30) is True
        assert events == ["first releases it", "second holds it"]
        assert said[0].startswith(f"[{b}] another setup (from ") and f"through {a}" in said[0]
        assert "is making the environment gym/.venv: waiting for it" in said[0]
        assert f"remove {lock_file} on {b}" in str(busy.value)
        assert not lock_file.exists()

        lock_file.write_text(json.dumps({"token": "dead", "by": "gone", "host": a,
                                         "started": time.time() - 3600}))
        with lock(second, b, wait=0, stale_after=60) as taken:
            assert json.loads(lock_file.read_text())["token"] == taken.token
        assert not lock_file.exists() and list(folder.iterdir()) == []
        first.close()
        second.close()
    finally:
        for client in clients:
            client.close()


def test_setup_makes_no_environment_while_another_setup_holds_its_lock(sshd, tmp_path):
    """ensure() takes the environment's lock before it makes anything: held by another
    setup past the wait, the host's error names that setup, and nothing is made."""
    import time

    from distributed.hosts.provision import HostProvisioner
    from distributed.hosts.remote import SSHShell

    python, made = _counting_python(tmp_path)
    project = tmp_path / "home" / "gym"
    project.mkdir(parents=True)
    (project / ".venv.exogym-setup.lock").write_text(json.dumps(
        {"token": "theirs", "by": "laptop", "host": "10.0.0.9", "started": time.time()}))
    b = sshd.addresses[1]
    client = _connect(sshd, b)
    try:
        sftp = client.open_sftp()
        provisioner = HostProvisioner(
            SSHShell(client, b), sftp, b, python_env=str(project / ".venv" / "bin" / "python"),
            project_path=str(project), requirements=["numpy"], lock=lock_path(),
            base_python=str(python), wheels="never", lock_wait=0.2)
        with pytest.raises(ProvisionError) as caught:
            provisioner.ensure()
        sftp.close()
    finally:
        client.close()
    assert str(caught.value).startswith(f"[{b}] another setup (from laptop, through 10.0.0.9")
    assert f"is making the environment {project}/.venv" in str(caught.value)
    assert not made.exists() and not (project / ".venv").exists()


def _counting_python(folder: Path) -> tuple[Path, Path]:
    """A host's ``python3`` that counts the environments it makes (a line each in the count
    file) and makes them see this interpreter's packages, so that installing the lock from
    the host's index finds every package there and fetches nothing."""
    count = folder / "environments-made"
    script = folder / "python3"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = venv ]; then\n'
        f"  echo made >> {count}\n"
        "  shift 2\n"
        f"  exec {sys.executable} -m venv --system-site-packages --without-pip \"$@\"\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return script, count


@pytest.mark.slow(reason="sets up two hosts sharing a home (the project copied, an "
                         "environment made and pre-flighted), then trains a short run on them")
def test_two_hosts_sharing_a_home_are_set_up_once_and_then_train(sshd, tmp_path):
    """Two hosts whose hosts-file entries name no project_path or python_env of the same
    folder alike (one home, mounted at two places): the project is copied once, the
    environment made once, the messages name what is shared, pre-flight passes on both, and
    a run with --sync trains on both."""
    from rich.console import Console

    from distributed.app.setup_hosts import SetupRequest, setup_hosts
    from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram

    (tmp_path / "home").mkdir()
    (tmp_path / "mount").symlink_to(tmp_path / "home")
    a, b = sshd.addresses[:2]
    paths = {a: str(tmp_path / "home" / "exogym"), b: str(tmp_path / "mount" / "exogym")}
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({
        "master": {"host": a, "project_path": paths[a]},
        "workers": [{"host": b, "project_path": paths[b]}],
        "ssh_port": sshd.port, "ssh_user": sshd.user, "ssh_key_path": str(sshd.key_path),
        "master_port": free_port()}))
    python, made = _counting_python(tmp_path)
    out = io.StringIO()
    outcome = setup_hosts(SetupRequest(
        hosts, base_python=str(python), wheels="never", known_hosts=str(sshd.known_hosts),
        ssh_config=str(sshd.ssh_config), ssh_timeout=5.0), Console(file=out, width=400))
    said = out.getvalue()
    assert outcome.report is not None and outcome.report.ok, said
    assert made.read_text() == "made\n"  # one environment made, for both hosts
    synced = {s.host: s for s in outcome.synced}
    assert synced[a].copied > 100 and synced[a].shared_from is None
    assert (synced[b].copied, synced[b].shared_from) == (0, a)
    assert {r.host: (r.action, r.shared_from) for r in outcome.hosts} == {
        a: ("index", None), b: ("shared", a)}
    assert (f"hosts {a} and {b} share one folder ({a}: {paths[a]}, {b}: {paths[b]}): "
            f"set up once from {a}") in said
    assert (f"hosts {a} and {b} share one environment ({a}: {paths[a]}/.venv, "
            f"{b}: {paths[b]}/.venv): made once, on {a}") in said
    assert f"made on {a}" in said and f"copied to {a}" in said  # b's row of the table
    told = {h["host"]: h for h in outcome.to_dict()["hosts"]}
    assert (told[b]["environment_from"], told[b]["project_from"]) == (a, a)
    assert (told[a]["environment_from"], told[a]["project_from"]) == (None, None)
    written = json.loads(hosts.read_text())
    assert written["workers"][0]["python_env"] == f"{paths[b]}/.venv/bin/python"
    assert _leftovers(tmp_path / "home") == []
    assert not (tmp_path / "home" / "exogym" / ".venv.exogym-setup.lock").exists()

    again = setup_hosts(SetupRequest(
        hosts, base_python=str(python), wheels="never", known_hosts=str(sshd.known_hosts),
        ssh_config=str(sshd.ssh_config), ssh_timeout=5.0, preflight=False),
        Console(file=io.StringIO(), width=400))
    assert made.read_text() == "made\n"
    assert {r.host: r.action for r in again.hosts} == {a: "unchanged", b: "shared"}

    events: list[dict] = []
    program = RankProgram.from_profile("digits-diloco", overrides=[
        "max_steps=10", "H=5", "num_nodes=2", "val_interval=10", "val_size=64",
        "num_threads=1", "checkpoint_interval=None", f"output_dir={tmp_path / 'run'}"])
    with Launcher(hosts, program, options=LaunchOptions(run_dir=tmp_path / "launch",
                                                         grace_period=2, sync=True),
                  ssh=_ssh(sshd), console=Console(file=io.StringIO(), width=200),
                  on_output=lambda line: None, on_event=events.append) as job:
        result = job.run()
    assert result.ok, result.describe()
    assert {e["rank"] for e in events if e.get("event") == "step"} == {0, 1}
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 10
