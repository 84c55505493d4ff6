"""Nobody else gets in: every attack a stranger can make is refused.

A stranger here can write files a person later opens (a checkpoint, a run folder
with its trace, a hosts file), or reach this machine over the network. Each test
makes one such attack, as the stranger would, and checks that it is refused: no
code of theirs runs, nothing of the person's is lost, nothing hangs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import ROOT, free_port

from exogym.comm.store import UnsignedValueError, ignored_messages, open_store
from exogym.run.checkpoint import MAGIC, CheckpointError, checkpoint_path, load_checkpoint

QUIET = dict(logger=None, progress=False)


def cli(*args, cwd: Path, env: dict | None = None, timeout: float = 120
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "cli_typer.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, "COLUMNS": "400", **(env or {})})


class _Planted:
    """Unpickling this creates the file ``marker``: what a stranger's payload would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _crafted_checkpoint(path: Path, payload: object) -> None:
    """A checkpoint with a valid header and checksum around ``payload`` (torch.save'd)."""
    import io

    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(MAGIC + hashlib.sha256(body).digest() + body)


# -- A: no file runs code --------------------------------------------------------------


def test_a_crafted_checkpoint_is_refused_without_running_its_code(tmp_path):
    marker = tmp_path / "ran"
    path = checkpoint_path(tmp_path / "run", 0, 4)
    _crafted_checkpoint(path, {"state": _Planted(marker)})
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        load_checkpoint(path)
    assert not marker.exists()


@pytest.mark.slow(reason="a run resumed from crafted checkpoints of each kind")
def test_resuming_from_a_crafted_checkpoint_runs_no_code_and_starts_afresh(tmp_path):
    marker = tmp_path / "ran"
    _crafted_checkpoint(checkpoint_path(tmp_path / "run", 0, 4), {"step": _Planted(marker)})
    # In an interpreter of its own, so that what the rank prints reaches this test's pipe
    # whichever process started the ranks of earlier tests.
    script = ("import json\n"
              "from toys import tiny_model, toy_dataset\n"
              "from exogym import Trainer\nfrom exogym.strategy import FedAvgStrategy\n"
              "ds = toy_dataset(32)\ntrainer = Trainer(tiny_model(), ds, ds)\n"
              "trainer.fit(strategy=FedAvgStrategy(), num_nodes=1, max_steps=2, batch_size=8, "
              f"save_dir={str(tmp_path)!r}, run_name='run', resume_from='auto', "
              "logger=None, progress=False)\n"
              "print('steps', json.dumps([r['step'] for r in trainer.history]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not marker.exists()
    assert "steps [1, 2]" in done.stdout  # nothing was resumed
    assert "skipping checkpoint" in done.stdout + done.stderr


def test_a_checkpoint_round_trips_the_training_state_as_tensors_and_json(tmp_path):
    import random

    import numpy as np

    from exogym.run.checkpoint import save_checkpoint

    model = torch.nn.BatchNorm1d(3)
    state = {"model": model.state_dict(), "rng": {"numpy": np.random.get_state(),
                                                  "python": random.getstate()},
             "optim": {"state": {0: {"step": torch.tensor(3.0)}},
                       "param_groups": [{"betas": (0.9, 0.99), "lr": float("inf")}]},
             "dtype": torch.bfloat16}
    back = load_checkpoint(save_checkpoint(state, tmp_path, 0, 1))
    assert back["model"]._metadata == model.state_dict()._metadata  # the module versions
    assert back["rng"]["python"] == state["rng"]["python"]
    assert (back["rng"]["numpy"][1] == state["rng"]["numpy"][1]).all()
    assert back["optim"]["state"][0]["step"].item() == 3.0
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert back["dtype"] is torch.bfloat16


def test_a_state_holding_an_object_is_refused_when_saved_naming_its_place(tmp_path):
    from exogym.base.plain_state import PlainStateError
    from exogym.run.checkpoint import save_checkpoint

    with pytest.raises(PlainStateError, match=r"state\['strategy'\]\['helper'\] is a .*Path"):
        save_checkpoint({"strategy": {"helper": Path("x")}}, tmp_path, 0, 1)


def test_a_hand_over_description_that_is_a_pickle_is_refused_without_running_it(tmp_path):
    import io

    from exogym.base.plain_state import PlainStateError
    from exogym.membership.handover import describe, flatten_tensors, read_description

    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({"state": _Planted(marker), "tensors": []}, buffer)
    with pytest.raises(PlainStateError):
        read_description(buffer.getvalue())
    assert not marker.exists()
    # what a rank really sends reads back
    tensors, skeleton = flatten_tensors({"model": {"w": torch.ones(2)}, "step": 3})
    again = read_description(describe(skeleton))
    assert again["tensors"] == [((2,), torch.float32)] and again["state"]["step"] == 3


def test_no_loader_unpickles():
    found = subprocess.run(
        ["grep", "-rnE", r"weights_only *= *False|pickle\.loads?\(|cloudpickle\.loads?\(",
         "exogym", "distributed"], capture_output=True, text=True, cwd=ROOT)
    assert found.stdout == ""


def _planted_run_folder(folder: Path, task: str) -> None:
    """A run folder as a stranger writes it: its trace names ``task`` to import."""
    from exogym.report.trace import TRACE_FILE

    settings = {"task": task, "strategy": "ddp", "num_nodes": 1, "max_steps": 1}
    header = {"kind": "run", "version": 2, "source": "simulation", "num_nodes": 1,
              "run": {"profile": "p", "fingerprint": "0" * 64,
                      "started": "2024-01-01T00:00:00Z", "settings": settings}}
    step = {"kind": "step", "rank": 0, "step": 1, "loss": 1.0}
    folder.mkdir(parents=True)
    (folder / TRACE_FILE).write_text(json.dumps(header) + "\n" + json.dumps(step) + "\n")


@pytest.mark.slow(reason="each command that reads a run folder, run on a crafted one")
@pytest.mark.parametrize("command", ["replay", "recommend"])
def test_a_run_folder_naming_code_is_not_imported_unless_the_persons_profile_names_it(
        tmp_path, command):
    # the module a stranger's folder names: importing it leaves a marker behind
    (tmp_path / "lib").mkdir()
    marker = tmp_path / "imported"
    (tmp_path / "lib" / "planted_task.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef task(**kw):\n    return None\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "lib"), os.environ.get(
        "PYTHONPATH", "")])}
    run = tmp_path / "run"
    _planted_run_folder(run, "planted_task:task")
    args = ["replay", run] if command == "replay" else \
        ["recommend", "digits-ddp", "--trace", run, "--link-mbit", "100"]
    done = cli(*args, cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "'planted_task:task'" in done.stderr and "--trust-code" in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists()
    # the person's own profile names the same task: it is theirs to run
    config = tmp_path / "config.ini"
    config.write_text("[distributed:mine]\ntask = planted_task:task\nstrategy = ddp\n")
    cli("replay", run, "--config", config, cwd=tmp_path, env=env)
    assert marker.exists()
    marker.unlink()
    cli(*args, "--trust-code", cwd=tmp_path, env=env)
    assert marker.exists()


# -- C: limits and hostile text, refused before anything is allocated --------------------


@pytest.mark.parametrize("setting, message", [
    ("num_nodes=100000000", "num_nodes=100000000 is over the limit of 1,024"),
    ("max_steps=10000000000", "max_steps=10000000000 is over the limit of 1,000,000,000"),
    ("max_steps=1e309", "'1e309' is not a finite number once read (it reads as inf)"),
    ("lr=[1, -1e400]", "it reads as -inf"),
    ("lr=", "--set lr= gives no value"),
    ("lr=" + "9" * 5000, "a number of 5,000 digits"),
], ids=["num_nodes", "max_steps", "1e309", "-1e400", "empty", "digits"])
def test_a_setting_beyond_its_limit_is_refused_naming_the_limit(setting, message):
    from distributed.profiles.profile import ProfileError, load_profile, parse_overrides

    with pytest.raises(ProfileError) as refused:
        load_profile("digits-ddp", overrides=parse_overrides([setting]))
    assert message in str(refused.value)


@pytest.mark.slow
def test_a_refusal_prints_the_persons_text_literally(tmp_path):
    done = cli("distributed-train", "digits-ddp", "--set", "partition=dirichlet:-1:",
               "--dry-run", cwd=tmp_path)
    assert done.returncode == 2
    assert "dirichlet:-1:" in done.stderr and "\N{THUMBS DOWN SIGN}" not in done.stderr


def _hosts(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "hosts.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


HOST_ENV = '"python_env": "python", "project_path": "/x"'


@pytest.mark.parametrize("text, message", [
    ('{"master": "127.0.0.1", "workers": [{"host": "127.0.0.2", "slots": 1000000000}], '
     + HOST_ENV + "}", "an integer from 1 to 1024"),
    ('{"master": "127.0.0.1", "workers": [{"host": "127.0.0.2", "slots": 1000}, '
     '{"host": "127.0.0.3", "slots": 1000}], ' + HOST_ENV + "}", "add up to 2,001 ranks"),
    ('{"master": "10.0.0.1", "workers": ' + json.dumps([f"10.1.{i // 250}.{i % 250}"
                                                       for i in range(1100)])
     + ", " + HOST_ENV + "}", "lists 1,100 hosts"),
    ('{"master": "127.0.0.1\\u202e", "workers": [], ' + HOST_ENV + "}",
     "not printable (\\u202e)"),
    ('{"master": "127.0.0.1", "workers": ["a\\u0000b"], ' + HOST_ENV + "}",
     "not printable (\\x00)"),
    ('{"master": "127.0.0.1", "workers": [], "python_env": "python\\u001b[2J", '
     '"project_path": "/x"}', "not printable (\\x1b)"),
    ("[" * 100_000, "nests lists or objects deeper"),
    ('{"master": "a", "master_port": ' + "9" * 5000 + "}", "a number of more digits"),
    (b"\x00\x01binary" * 10, "holds NUL bytes"),
    (b"\xff\xfe{}", "is not UTF-8 text"),
], ids=["slots", "world", "hosts", "bidi", "nul", "escape", "nested", "digits", "binary",
        "not-utf8"])
def test_a_hostile_hosts_file_is_refused_naming_the_file(tmp_path, text, message):
    from distributed.hosts.hostsfile import HostsFileError, load_hosts

    path = _hosts(tmp_path, text)
    with pytest.raises(HostsFileError) as refused:
        load_hosts(path)
    assert message in str(refused.value)


@pytest.mark.slow
def test_check_hosts_refuses_a_billion_slots_before_allocating_anything(tmp_path):
    path = _hosts(tmp_path, '{"master": "127.0.0.1", "workers": [{"host": "127.0.0.2", '
                            '"slots": 1000000000}], ' + HOST_ENV + "}")
    done = cli("check-hosts", path, cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "an integer from 1 to 1024" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("content, message", [
    (b"\x00\x01\x02" * 100, "holds NUL bytes"),
    (b"[distributed:x]\ntask = digits\nlr = \xff\xfe\n", "is not UTF-8 text"),
    (b"[distributed:x]\ntask = digits\nmax_steps = " + b"9" * 5000 + b"\n",
     "a number of 5,000 digits"),
    (b"[distributed:x]\ntask = digits\nlr = 1e999\n", "not a finite number"),
], ids=["binary", "not-utf8", "digits", "1e999"])
def test_a_hostile_config_file_is_refused_naming_the_file(tmp_path, content, message):
    from distributed.profiles.profile import ProfileError, ProfileSet

    path = tmp_path / "config.ini"
    path.write_bytes(content)
    with pytest.raises(ProfileError) as refused:
        ProfileSet(path, local=False).get("x")
    assert message in str(refused.value) and str(path) in str(refused.value)


def test_a_lan_advert_is_shown_with_its_control_characters_escaped():
    import io

    from rich.console import Console

    from distributed.app.discovery import machines_table
    from distributed.hosts.mdns import MachineAdvert

    props = {b"host": b"mini\x1b[2J\x1b]0;owned\x07", b"py": "/usr/bin/python\u202e".encode(),
             b"path": b"[bold red]x[/]", b"cores": b"9" * 5000}
    advert = MachineAdvert.from_service("evil\x1b[31m._exogym._tcp.local.", ["10.0.0.9"], 22,
                                        props)
    assert "\x1b" not in advert.host and advert.host.startswith("mini\\x1b[2J")
    assert "\u202e" not in advert.python and advert.python.endswith("\\u202e")
    assert advert.cores == 0
    out = io.StringIO()
    Console(file=out, width=400, force_terminal=False).print(machines_table([advert]))
    shown = out.getvalue()
    assert "\x1b" not in shown and "[bold red]x[/]" in shown


# -- D: a local simulation opens no port another machine can reach ----------------------

VICTIM = """
import torch
from exogym import Trainer
from exogym.strategy import DiLoCoStrategy
from torch.utils.data import TensorDataset
torch.manual_seed(0)
x = torch.randn(4096, 64); y = torch.randint(0, 4, (4096,))
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.l = torch.nn.Linear(64, 4)
    def forward(self, batch):
        import time; time.sleep(0.05)
        return torch.nn.functional.cross_entropy(self.l(batch[0]), batch[1])
ds = TensorDataset(x, y)
Trainer(Net(), ds, ds).fit(strategy=DiLoCoStrategy(H=2), num_nodes=4, processes=2,
                           max_steps=120, batch_size=8, val_size=0, logger=None, progress=False)
print("victim done", flush=True)
"""


def _listening(namespace: str) -> list[tuple[str, int]]:
    out = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-ltnH"], capture_output=True,
                         text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        local = line.split()[3]
        host, _, port = local.rpartition(":")
        found.append((host.strip("[]"), int(port)))
    return found


@pytest.mark.slow
def test_a_stranger_on_the_lan_reaches_no_port_of_a_local_simulation():
    import time

    from netns import namespaces, netns_available

    why = netns_available()
    if why:
        pytest.skip(why)
    with namespaces(2, subnet="10.231.9") as (names, addresses):
        victim = subprocess.Popen(["ip", "netns", "exec", names[0], "ip", "link", "set", "lo",
                                   "up"])
        victim.wait(10)
        victim = subprocess.Popen(["ip", "netns", "exec", names[0], sys.executable, "-c",
                                   VICTIM], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            seen: set[tuple[str, int]] = set()
            deadline = time.monotonic() + 60
            while victim.poll() is None and time.monotonic() < deadline:
                seen.update(_listening(names[0]))
                if len(seen) >= 3:  # the store and the ranks' gloo pairs
                    break
                time.sleep(0.2)
            assert seen, "the simulation never listened: nothing was checked"
            assert all(host in ("127.0.0.1", "::1") for host, _ in seen), seen
            for _, port in seen:  # and from the other machine: nothing answers
                stranger = subprocess.run(
                    ["ip", "netns", "exec", names[1], sys.executable, "-c",
                     "import socket,sys\n"
                     "s=socket.socket(); s.settimeout(3)\n"
                     f"sys.exit(s.connect_ex(({addresses[0]!r}, {port})) == 0)"],
                    capture_output=True, timeout=30)
                assert stranger.returncode == 0, f"port {port} answered the stranger"
            out, _ = victim.communicate(timeout=300)
            assert victim.returncode == 0 and "victim done" in out, out[-3000:]
        finally:
            if victim.poll() is None:
                victim.kill()
                victim.wait()


def test_a_forged_shared_memory_announcement_maps_nothing(tmp_path):
    from exogym.comm.mailbox import AnnouncementError, Mailbox, new_run_id
    from exogym.comm.store import open_store

    store = open_store("127.0.0.1", 0, is_master=True)
    run = new_run_id()
    reader = Mailbox(run, 0, timeout_s=5, directory=tmp_path)
    owner = Mailbox(run, 1, timeout_s=5, directory=tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    segment = owner.take(16, "n/read/1", 1)
    segment.data[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    forged = {
        "a path": f"../{victim.name}:4096:0:1",
        "another run's segment": f"exogym-1-deadbeef-1-1:{segment.nbytes}:0:4",
        "another process's": f"{run}-2-1:{segment.nbytes}:0:4",
        "a file of another size": f"{segment.path.name}:{segment.nbytes * 2}:0:4",
        "bytes past its end": f"{segment.path.name}:{segment.nbytes}:{segment.nbytes}:4",
        "another file": "victim:8:0:1",
    }
    for why, value in forged.items():
        store.set(f"x/{why}", value)
        with pytest.raises(AnnouncementError, match="refused|cannot be read"):
            reader.read(store, f"x/{why}", lambda why=why: why, owner=1)
    assert victim.read_bytes() == b"precious"  # neither extended nor zeroed
    Mailbox.announce(store, "x/real", segment, 0, 4)
    assert reader.read(store, "x/real", lambda: "real", owner=1).tolist() == [1, 2, 3, 4]
    owner.close()


# ---------------------------------------------------------------- the dashboards' servers

def _get(port: int, path: str = "/", host: str | None = None) -> tuple[int, bytes]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def _dashboards():
    """Both servers, each on loopback: (name, port, stop)."""
    pytest.importorskip("plotly")
    from distributed.app.web import WebDashboard
    from distributed.app.web.replay_page import PageServer

    live = WebDashboard()
    page = PageServer("<p>figures</p>")
    return [("live", live.port, live.stop),
            ("replay", int(page.url.rsplit(":", 1)[1].strip("/")), page.stop)]


def test_a_dashboard_refuses_a_request_addressed_to_a_strangers_name_dns_rebinding():
    servers = _dashboards()
    try:
        for name, port, _ in servers:
            for forged in (f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}",
                           f"localhost.evil.example:{port}", ""):
                status, body = _get(port, "/", forged)
                assert status == 421, (name, forged, status)
                assert b"own address" in body and b"figures" not in body
            for own in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
                assert _get(port, "/", own)[0] == 200, (name, own)
    finally:
        for _, _, stop in servers:
            stop()


def test_a_dashboard_shared_on_the_lan_still_refuses_a_strangers_host_name():
    pytest.importorskip("plotly")
    from distributed.app.web import WebDashboard

    with WebDashboard("0.0.0.0") as web:
        token = web.token
        status, _ = _get(web.port, f"/state?token={token}", f"attacker.example:{web.port}")
        assert status == 421
        assert _get(web.port, f"/state?token={token}", f"192.0.2.7:{web.port}")[0] == 200
        assert _get(web.port, "/state", f"192.0.2.7:{web.port}")[0] == 403


def _reset_mid_answer(port: int, path: str) -> None:
    """Ask for ``path``, read a little of the answer, then reset the connection (RST)."""
    import socket
    import struct

    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    sock.recv(1024)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_a_browser_resetting_its_connection_prints_no_traceback(capfd):
    import time

    pytest.importorskip("plotly")
    from distributed.app.web import WebDashboard

    with WebDashboard() as web:
        for _ in range(3):  # plotly.min.js is megabytes: the server is still writing it
            _reset_mid_answer(web.port, "/plotly.min.js")
        _reset_mid_answer(web.port, "/events")
        time.sleep(1.0)
        assert _get(web.port, "/state", f"127.0.0.1:{web.port}")[0] == 200  # still serving
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Connection" not in err, err


def test_a_real_error_in_a_dashboard_is_one_line_and_bounded(capfd, monkeypatch):
    pytest.importorskip("plotly")
    from distributed.app.web import WebDashboard
    from distributed.app.web.guard import ERRORS_SHOWN

    with WebDashboard() as web:
        def broken(since: int) -> dict:
            raise RuntimeError("the state is broken")

        monkeypatch.setattr(web.state, "view", broken)
        for _ in range(ERRORS_SHOWN + 3):
            try:
                _get(web.port, "/state", f"127.0.0.1:{web.port}")
            except ConnectionError:
                pass
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "the state is broken" in line]
    assert "Traceback" not in err
    assert len(lines) == ERRORS_SHOWN
    assert lines[0].startswith("dashboard: answering 127.0.0.1 failed: RuntimeError")
    assert lines[-1].endswith("further errors are not shown")


# -- E: across hosts, the store acts only on what the run's own ranks signed ---------------
# The launcher draws a key for each run and hands it to every rank through its
# supervisor's pipe; every store value is signed with it (SignedStore). The store's front
# refuses what the run did not sign (tests/test_store_front.py); behind it, the ranks check
# every value again. The tests here reach torch's server directly (front=False), as a
# local user on the master host can on loopback, and write values as torch's own client
# does: each is ignored and counted, never acted on, and a run under attack finishes as it
# would have, or fails naming the cause.

KEY = bytes(range(32))


def stranger_client(port: int) -> dist.TCPStore:
    """torch's own store client, as anyone who knows the port has it."""
    return dist.TCPStore("127.0.0.1", port, None, is_master=False,
                         timeout=timedelta(seconds=5), wait_for_workers=False)


def planted(stranger: dist.TCPStore, key: str, value: bytes) -> None:
    stranger.set(key, value)
    stranger.get(key)  # a set is not answered: read it back so it has landed


@pytest.mark.slow
def test_a_signed_store_ignores_and_counts_every_value_a_stranger_writes():
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=1.0, key=KEY, front=False)
    rank = open_store("127.0.0.1", master.port, timeout_s=1.0, key=KEY)
    stranger = stranger_client(master.port)
    before, _ = ignored_messages()

    rank.set("exogym/elastic/host/1", "10.0.0.2")
    assert master.get("exogym/elastic/host/1") == b"10.0.0.2"

    # A planted value is unset to the run, and a read that waits for it fails naming it.
    planted(stranger, "exogym/elastic/stop", b"stopped by a stranger")
    assert not rank.check(["exogym/elastic/stop"])
    assert rank.get_if_set("exogym/elastic/stop") is None
    started = time.monotonic()
    with pytest.raises(UnsignedValueError, match="'exogym/elastic/stop'.*not signed by this run"):
        rank.get("exogym/elastic/stop")
    assert time.monotonic() - started < 5
    # The run's own first-writer-wins decision replaces it, as if it were unset.
    assert rank.compare_set("exogym/elastic/stop", "", "fewer than min_nodes") == \
        b"fewer than min_nodes"
    assert master.get("exogym/elastic/stop") == b"fewer than min_nodes"

    # A signed value moved to another key does not verify there.
    planted(stranger, "exogym/elastic/stop/2", stranger.get("exogym/elastic/host/1"))
    assert rank.get_if_set("exogym/elastic/stop/2") is None

    # Counters: torch's add on a signed counter, and an older signed value written back.
    assert rank.add("exogym/elastic/lost/1", 1) == 1
    older = stranger.get("exogym/elastic/lost/1")
    assert rank.add("exogym/elastic/lost/1", 1) == 2
    stranger.add("exogym/elastic/lost/1", 5)
    stranger.get("exogym/elastic/lost/1")
    assert rank.add("exogym/elastic/lost/1", 0) == 2
    planted(stranger, "exogym/elastic/lost/1", older)
    assert rank.add("exogym/elastic/lost/1", 0) == 2
    # ... and put back for a process that never saw the counter.
    fresh = open_store("127.0.0.1", master.port, timeout_s=1.0, key=KEY)
    assert fresh.add("exogym/elastic/lost/1", 0) == 2
    # A counter only the stranger wrote: a process that never saw it waits, then refuses.
    stranger.add("exogym/elastic/ready/1", 7)
    with pytest.raises(UnsignedValueError, match="ready/1"):
        fresh.add("exogym/elastic/ready/1", 0)

    # A heartbeat only counts when it is higher than every one seen.
    from exogym.comm import next_beat, read_beat
    beat = next_beat(0)
    rank.set("exogym/beat/1", str(beat))
    # a set is not answered: the rank's next call on its connection is, once the set is in
    assert rank.check(["exogym/beat/1"])
    assert read_beat(master, "exogym/beat/1") == beat > 10**12
    planted(stranger, "exogym/beat/1", b"99999999999999")
    assert read_beat(master, "exogym/beat/1") == 0

    after, keys = ignored_messages()
    assert after - before >= 6
    assert {"exogym/elastic/stop", "exogym/elastic/lost/1", "exogym/beat/1"} <= set(keys)


class _Deleter:
    """A stranger who deletes ``keys`` in a loop, as fast as the store answers."""

    def __init__(self, port: int, keys: list[str]):
        self.client = stranger_client(port)
        self.keys = keys
        self.deletes = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for key in self.keys:
                self.client.delete_key(key)
                self.deletes += 1
            time.sleep(0.002)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(10)


def test_a_deleted_heartbeat_is_counted_and_never_taken_for_a_ranks_silence():
    """Deleting a rank's heartbeat key faster than the launcher looks neither makes it lost
    nor goes unsaid; a rank silent on every channel is still lost within ``lost_after``."""
    from types import SimpleNamespace

    from distributed.launch.elastic_attempt import ElasticAttempt
    from distributed.launch.progress import ProgressWatch
    from exogym import comm
    from exogym.comm.store import deleted_keys, describe_ignored

    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=5, key=KEY, front=False)
    rank_store = open_store("127.0.0.1", master.port, timeout_s=5, key=KEY)
    run = SimpleNamespace(running=True, beat_heard_at=0.0)
    lost: dict[int, float] = {}
    attempt = SimpleNamespace(
        runs={1: run}, lost={}, beats={}, lost_after=1.5, store=master,
        progress=ProgressWatch(), comm=comm,
        _lose=lambda rank, why: (lost.setdefault(rank, time.monotonic()),
                                 attempt.lost.update({rank: why})))
    beating = threading.Event()
    beating.set()
    ended = threading.Event()

    def rank_one() -> None:  # beats in the store and on its own channel, as a rank does
        beat = 0
        while not ended.wait(0.2):
            if beating.is_set():
                beat = comm.next_beat(beat)
                rank_store.set("exogym/beat/1", str(beat))
                run.beat_heard_at = time.monotonic()

    def watch(seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until and not lost:
            ElasticAttempt._watch_heartbeats(attempt, time.monotonic())
            time.sleep(0.1)

    beater = threading.Thread(target=rank_one, daemon=True)
    beater.start()
    before, _ = deleted_keys()
    watch(1.0)  # the launcher has seen a beat
    deleter = _Deleter(master.port, ["exogym/beat/1"])
    try:
        watch(5.0)  # more than three times lost_after
        assert lost == {}, attempt.lost
        assert deleter.deletes > 100
        count, keys = deleted_keys()
        assert count > before and "exogym/beat/1" in keys
        assert "deletion" in describe_ignored() and "exogym/beat/1" in describe_ignored()
        # Silent on every channel, while the stranger still deletes: lost in time.
        beating.clear()
        silent_since = time.monotonic()
        watch(10.0)
        assert 1 in lost, "a rank silent on every channel was never declared lost"
        assert lost[1] - silent_since < 1.5 + 1.0
    finally:
        deleter.end()
        ended.set()
        beater.join(5)


def test_ranks_watching_each_other_do_not_lose_a_peer_whose_heartbeat_is_deleted():
    """Where the ranks judge each other (every rank needed), a deleted heartbeat is no news
    of the peer: counted, never its silence; a peer that stops beating is still lost."""
    from exogym.comm.store import deleted_keys
    from exogym.run.run_rank import PeerWatch, Rendezvous

    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=5, key=KEY, front=False)
    rendezvous = Rendezvous("127.0.0.1", master.port, store_on_rank0=False, watch_peers=True,
                            key=KEY)
    watchers = [PeerWatch(rendezvous, rank, 2, interval_s=0.1, silent_after_s=1.5)
                for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 10
        while 1 not in watchers[0].seen or watchers[0].seen[1][0] == 0:
            assert time.monotonic() < deadline, "rank 0 never saw rank 1 beat"
            time.sleep(0.05)
        before, _ = deleted_keys()
        deleter = _Deleter(master.port, ["exogym/beat/1"])
        try:
            for _ in range(40):  # 4 s: more than twice the silence allowed
                assert watchers[0].silent() == []
                time.sleep(0.1)
        finally:
            deleter.end()
        assert deleted_keys()[0] > before
        stranger = stranger_client(master.port)  # an unsigned beat over it is no news either
        for _ in range(30):
            planted(stranger, "exogym/beat/1", b"99999999999999")
            assert watchers[0].silent() == []
            time.sleep(0.1)
        watchers[1].stop()  # now truly silent
        stopped = time.monotonic()
        while watchers[0].silent() != [1]:
            assert time.monotonic() - stopped < 1.5 + 2.0, "a silent peer was never lost"
            time.sleep(0.05)
    finally:
        for watcher in watchers:
            watcher.stop()


def test_a_store_across_hosts_listens_on_the_masters_address_alone():
    import socket

    store = open_store("127.0.0.2", 0, is_master=True, timeout_s=2, key=KEY)
    with socket.socket() as elsewhere:
        assert elsewhere.connect_ex(("127.0.0.1", store.port)) != 0
    rank = open_store("127.0.0.2", store.port, timeout_s=2, key=KEY)
    rank.set("exogym/elastic/host/0", "127.0.0.2")
    assert store.get("exogym/elastic/host/0") == b"127.0.0.2"


def test_signed_counters_added_to_at_once_give_every_adder_a_number_of_its_own():
    """A signed counter is a compare-and-set loop: two adders that meet the same value must
    not both take the same next number (each write carries a nonce of its own)."""
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=10, key=KEY)
    got: list[int] = []
    lock = threading.Lock()

    def adder() -> None:
        store = open_store("127.0.0.1", master.port, timeout_s=10, key=KEY)
        for i in range(150):
            if i % 3 == 0:
                store.add("exogym/elastic/log/n", 0)
            number = store.add("exogym/elastic/log/n", 1)
            with lock:
                got.append(number)

    threads = [threading.Thread(target=adder) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(got) == list(range(1, 601))
    assert master.add("exogym/elastic/log/n", 0) == 600


def test_a_key_shorter_than_sixteen_bytes_is_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        open_store("127.0.0.1", 0, is_master=True, key=b"short")


def _form(store, rank: int, out: dict) -> None:
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("exogym/elastic/pg/e1/", store.raw), rank, 2,
                                   timedelta(seconds=20))
        tensor = torch.full((4,), float(rank + 1))
        pg.allreduce([tensor]).wait()
        out[rank] = tensor.tolist()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out[rank] = exc


def test_a_group_meets_only_at_addresses_its_ranks_signed():
    """gloo's rendezvous goes through the signed store: forged addresses planted first are
    passed over, and the group forms at the ranks' own."""
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=20, key=KEY, front=False)
    stranger = stranger_client(master.port)
    forged = b"\x00" * 64
    for rank in (0, 1):
        planted(stranger, f"exogym/elastic/pg/e1//0/{rank}", forged)
    before, _ = ignored_messages()
    out: dict = {}
    stores = [open_store("127.0.0.1", master.port, timeout_s=20, key=KEY) for _ in range(2)]
    late = threading.Thread(target=_form, args=(stores[1], 1, out))
    late.start()
    time.sleep(1.0)  # rank 1 meets rank 0's forged address first
    _form(stores[0], 0, out)
    late.join(60)
    assert out == {0: [3.0] * 4, 1: [3.0] * 4}, out
    assert ignored_messages()[0] > before


@pytest.mark.slow
def test_a_group_whose_peer_address_is_only_forged_fails_naming_the_key():
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=2, key=KEY, front=False)
    stranger = stranger_client(master.port)
    planted(stranger, "exogym/elastic/pg/e2//0/0", b"\x00" * 64)
    store = open_store("127.0.0.1", master.port, timeout_s=2, key=KEY)
    started = time.monotonic()
    with pytest.raises(Exception, match="not signed by this run"):
        dist.ProcessGroupGloo(dist.PrefixStore("exogym/elastic/pg/e2/", store.raw), 1, 2,
                              timedelta(seconds=5))
    assert time.monotonic() - started < 15


def test_the_rank_reads_the_key_from_its_pipe_and_nowhere_else(tmp_path):
    """The supervisor hands the key over a pipe: the rank's argv and environment hold only
    the pipe's number."""
    from distributed.hosts.onhost.bootstrap import STORE_KEY_FD_VARIABLE
    from distributed.hosts.remote import BOOTSTRAP_SOURCE, LOADER

    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, sys, json\n"
        "from distributed.worker.environment import read_store_key\n"
        "fd = os.environ['" + STORE_KEY_FD_VARIABLE + "']\n"
        "seen = open('/proc/self/cmdline','rb').read() + open('/proc/self/environ','rb').read()\n"
        "key = read_store_key(fd)\n"
        "print(json.dumps({'key': key.hex(), 'leaked': key.hex().encode() in seen}))\n")
    key = os.urandom(32).hex()
    message = {"code": BOOTSTRAP_SOURCE, "env": {}, "grace": 2, "store_key": key}
    # The supervisor stops its rank when its stdin closes (the launcher gone): keep it open.
    supervisor = subprocess.Popen([sys.executable, "-u", "-c", LOADER, str(probe)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        supervisor.stdin.write(json.dumps(message) + "\n")
        supervisor.stdin.flush()
        lines = []
        for line in supervisor.stdout:
            lines.append(line)
            if line.startswith("{") or '"exit"' in line:
                break
        assert any(line.startswith("{") for line in lines), lines
    finally:
        supervisor.stdin.close()
        supervisor.wait(30)
    answer = json.loads(next(line for line in lines if line.startswith("{")))
    assert answer == {"key": key, "leaked": False}


def test_a_rank_refuses_a_pipe_that_holds_no_key():
    from distributed.worker.environment import read_store_key

    read_end, write_end = os.pipe()
    os.write(write_end, b"not hex\n")
    os.close(write_end)
    with pytest.raises(ValueError, match="EXOGYM_STORE_KEY_FD.*is not a store key"):
        read_store_key(str(read_end))
    with pytest.raises(ValueError, match="must be a file descriptor"):
        read_store_key("three")


# -- a stranger in a namespace against a run across hosts --------------------------------

ATTACK = r"""
import sys, time, torch.distributed as dist
from datetime import timedelta
addr, port = sys.argv[1], int(sys.argv[2])


def connect():
    return dist.TCPStore(addr, port, None, is_master=False, timeout=timedelta(seconds=10),
                         wait_for_workers=False)


ns = "exogym/elastic"
copied = {}


def attack():
    # Stop the run, declare ranks lost, decide a membership, fake a heartbeat, point a
    # group at this machine, delete what steers the run, and write back every signed value
    # read earlier: each on its own, as the store's front closes a connection it refuses.
    yield "write", lambda s: s.set(f"{ns}/stop", "stopped by a stranger on the LAN")
    for rank in (1, 2):
        yield "write", lambda s: s.set(f"{ns}/why/{rank}/1", "lost to a stranger")
        yield "write", lambda s: s.set(f"exogym/beat/{rank}", "1")
        yield "write", lambda s: s.add(f"{ns}/lost/{rank}", 1)
        yield "write", lambda s: s.delete_key(f"exogym/beat/{rank}")
    for start in (0, 100):
        yield "write", lambda s: s.compare_set(f"{ns}/members/{start}", "",
                                               '{"ranks": [0], "step": 0}')
        yield "write", lambda s: s.delete_key(f"{ns}/members/{start}")
    yield "write", lambda s: s.set(f"{ns}/latest", "1500")
    yield "write", lambda s: s.set(f"{ns}/pg/e1-x//0/1", "\x00" * 64)
    for key in (f"{ns}/stop", f"{ns}/finished", f"{ns}/log/1", f"{ns}/log/n"):
        yield "write", lambda s: s.delete_key(key)
    for key, value in list(copied.items()):
        yield "replay", lambda s: s.set(key, value)  # signed: the front lets it pass
    for key in (f"{ns}/log/1", f"{ns}/log/n", "exogym/beat/2"):
        yield "read", lambda s: copied.__setitem__(key, s.get(key)) if s.check([key]) else None


rounds = 0
tried, refused = {"write": 0, "replay": 0, "read": 0}, {"write": 0, "replay": 0, "read": 0}
end = time.monotonic() + float(sys.argv[3])
s = connect()
while time.monotonic() < end:
    for kind, step in attack():
        tried[kind] += 1
        try:
            step(s)
            s.check([f"{ns}/nothing"])  # a set has no answer: a refused one shows here
        except Exception:
            refused[kind] += 1
            try:
                s = connect()
            except Exception:  # the run has ended and its store with it
                end = 0
                break
    rounds += 1
    time.sleep(0.1)
print(f"stranger's {rounds} rounds: {tried['write']} writes, {refused['write']} refused; "
      f"{tried['replay']} replays, {refused['replay']} refused; "
      f"{tried['read']} reads, {refused['read']} refused", flush=True)
"""


@pytest.mark.slow(reason="attacks a run across hosts over SSH while it trains")
def test_a_stranger_on_the_lan_neither_stops_nor_steers_a_run_across_hosts(tmp_path):
    from netbed import Testbed
    from netns import netns_available
    from ranks import Throttle
    from rich.console import Console

    from distributed.hosts.ssh import SSHOptions
    from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram

    why = netns_available()
    if why:
        pytest.skip(why)
    out = tmp_path / "net"
    events: list[dict] = []
    output: list[str] = []
    steps = 600
    program = RankProgram.from_profile("digits-diloco", overrides=[
        f"max_steps={steps}", "val_interval=300", "val_size=256", "num_threads=1",
        "checkpoint_interval=None", "num_nodes=3", f"output_dir={out}"])
    port = free_port()
    # The run outlasts the attack however busy the machine is: every rank trains at a
    # hundredth of its speed until the stranger is done, then at full speed to the end.
    throttle = Throttle(tmp_path)
    throttle.set(0.01)
    with Testbed(3, subnet="10.213.93", pin=False) as bed:
        config = bed.hosts_config(port, launcher_is_master=True, count=2)
        stranger_host = bed.hosts[2]  # on the same LAN, in no hosts file
        console = StringIO()
        job = Launcher(config, program, options=LaunchOptions(
            run_dir=tmp_path / "launch", grace_period=2, probe_interval=1.0, min_nodes=2,
            lost_after=6, env=throttle.env),
            ssh=SSHOptions(**bed.ssh_settings(connect_timeout=3)),
            console=Console(file=console, width=200),
            on_output=lambda line: output.append(line.text), on_event=events.append)
        with job:
            runner = threading.Thread(target=lambda: setattr(job, "result", job.run()))
            runner.start()
            deadline = time.monotonic() + 120
            while not any(e.get("event") == "step" and e.get("rank") == 2 for e in events):
                assert time.monotonic() < deadline, "the run never trained"
                time.sleep(0.2)
            # The launcher's store listens on the hosts' address alone.
            listening = [line.split()[3] for line in subprocess.run(
                ["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout.splitlines()
                if line.split()[3].endswith(f":{port}")]
            assert listening == [f"{bed.uplink_address}:{port}"], listening
            attack = subprocess.run(
                bed.in_host(stranger_host, sys.executable, "-c", ATTACK,
                            bed.uplink_address, str(port), "15"),
                capture_output=True, text=True, timeout=120,
                env={**os.environ, "PYTHONPATH": str(ROOT)})
            throttle.set(1.0)
            found = re.search(r"stranger's (\d+) rounds: (\d+) writes, (\d+) refused; (\d+) "
                              r"replays, (\d+) refused; (\d+) reads, (\d+) refused",
                              attack.stdout)
            assert found and int(found.group(1)) >= 20, (attack.stdout, attack.stderr[-2000:])
            key = job.store_key.hex()
            runner.join(timeout=300)
        result = job.result
    assert result.ok, result.describe()
    memberships = [e["ranks"] for e in events if e.get("event") == "membership"]
    assert memberships == [[0, 1, 2]], memberships
    trained = {e["rank"]: e["step"] for e in events if e.get("event") == "step"}
    assert trained == {0: steps, 1: steps, 2: steps}, trained
    assert (out / "model.safetensors").is_file()
    said = console.getvalue() + "\n".join(output)
    # Every write and delete refused at the store's front, and the launcher says so, with
    # how many and from where.
    rounds, writes, refused, replays, replays_refused, reads, reads_refused = map(
        int, found.groups())
    assert writes == refused > 0 and replays > 0 and reads_refused == replays_refused == 0, \
        found.group(0)
    told = re.search(r"refused (\d+) writes not signed by the run and (\d+) deletes of keys "
                     r"the run had not marked deleted \(from ([\d.]+)\)", said)
    assert told, said[-3000:]
    assert int(told.group(1)) + int(told.group(2)) == refused, (told.group(0), found.group(0))
    assert told.group(3) == stranger_host.address
    print(found.group(0), "|", told.group(0))
    assert "stopped by a stranger" not in said
    # The key reached the ranks, and no log, command line or record holds it.
    for path in (tmp_path / "launch").rglob("*"):
        if path.is_file():
            assert key not in path.read_text(errors="replace"), path
    assert key not in said


DELETE_KEYS = r"""
import sys, time, torch.distributed as dist
from datetime import timedelta
addr, port, bound = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ns = "exogym/elastic"
keys = ["exogym/beat/1", "exogym/beat/2", f"{ns}/stop", f"{ns}/finished", f"{ns}/members/0",
        f"{ns}/log/1", f"{ns}/log/n", f"{ns}/lost/1"]


def connect():
    return dist.TCPStore(addr, port, None, is_master=False, timeout=timedelta(seconds=10),
                         wait_for_workers=False)


deletes = refused = 0
started = time.monotonic()
try:
    s = connect()
    while time.monotonic() - started < bound:
        for key in keys:
            deletes += 1
            try:
                s.delete_key(key)
            except Exception:  # refused: the store's front closed the connection
                refused += 1
                s = connect()
        time.sleep(0.005)
except Exception:  # the run has ended and its store with it
    pass
print(f"stranger deleted {deletes} times over {time.monotonic() - started:.1f} s, "
      f"{refused} refused", flush=True)
"""


@pytest.mark.slow(reason="three hosts in network namespaces train while a stranger on their "
                         "LAN deletes the run's keys for four times the deadline")
def test_a_stranger_deleting_the_run_s_keys_changes_no_membership_across_hosts(tmp_path):
    """Deleting two ranks' heartbeats and the keys that stop the run or say who is in it
    (stop, finished, a membership, the change log, a loss count) again and again, for four
    times the silence that loses a host: every delete is refused, no host is dropped, a
    ``min_nodes=2`` run goes on, and the launcher says how many deletes it refused and from
    where."""
    from netbed import Testbed
    from netns import netns_available
    from ranks import Throttle
    from rich.console import Console

    from distributed.hosts.ssh import SSHOptions
    from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram

    why = netns_available()
    if why:
        pytest.skip(why)
    out = tmp_path / "net"
    events: list[dict] = []
    output: list[str] = []
    steps = 800
    program = RankProgram.from_profile("digits-diloco", overrides=[
        f"max_steps={steps}", "val_interval=400", "val_size=256", "num_threads=1",
        "checkpoint_interval=None", "num_nodes=3", f"output_dir={out}"])
    port = free_port()
    lost_after = 4.0
    # The run must outlast the attack however busy the machine is: every rank trains at a
    # hundredth of its speed until the stranger is done, then at full speed to the end.
    throttle = Throttle(tmp_path)
    throttle.set(0.01)
    with Testbed(3, subnet="10.213.94", pin=False) as bed:
        config = bed.hosts_config(port, launcher_is_master=True, count=2)
        stranger_host = bed.hosts[2]  # on the same LAN, in no hosts file
        console = StringIO()
        job = Launcher(config, program, options=LaunchOptions(
            run_dir=tmp_path / "launch", grace_period=2, probe_interval=1.0, min_nodes=2,
            lost_after=lost_after, env=throttle.env),
            ssh=SSHOptions(**bed.ssh_settings(connect_timeout=3)),
            console=Console(file=console, width=200),
            on_output=lambda line: output.append(line.text), on_event=events.append)
        with job:
            runner = threading.Thread(target=lambda: setattr(job, "result", job.run()))
            runner.start()
            deadline = time.monotonic() + 120
            while not any(e.get("event") == "step" and e.get("rank") == 2 for e in events):
                assert time.monotonic() < deadline, "the run never trained"
                time.sleep(0.2)
            attack = subprocess.run(
                bed.in_host(stranger_host, sys.executable, "-c", DELETE_KEYS,
                            bed.uplink_address, str(port), str(4 * lost_after)),
                capture_output=True, text=True, timeout=400,
                env={**os.environ, "PYTHONPATH": str(ROOT)})
            throttle.set(1.0)
            runner.join(timeout=300)
        result = job.result
    found = re.search(r"stranger deleted (\d+) times over ([\d.]+) s, (\d+) refused",
                      attack.stdout)
    assert found, (attack.stdout, attack.stderr[-2000:])
    # Deleting while the run went on, four times the silence that loses a host.
    deletes, refused = int(found.group(1)), int(found.group(3))
    assert deletes > 500 and float(found.group(2)) >= 4 * lost_after, found.group(0)
    assert refused == deletes, found.group(0)
    assert result.ok, result.describe()
    memberships = [e["ranks"] for e in events if e.get("event") == "membership"]
    assert memberships == [[0, 1, 2]], memberships
    assert not [e for e in events if e.get("event") == "host" and e.get("state") == "lost"]
    assert not [e for e in events if e.get("event") == "beat"]  # the launcher's alone
    trained = {e["rank"]: e["step"] for e in events if e.get("event") == "step"}
    assert trained == {0: steps, 1: steps, 2: steps}, trained
    said = console.getvalue() + "\n".join(output)
    told = re.search(r"refused (\d+) deletes of keys the run had not marked deleted "
                     r"\(from ([\d.]+)\)", said)
    assert told and int(told.group(1)) == refused, (said[-3000:], found.group(0))
    assert told.group(2) == stranger_host.address
    assert "fewer than min_nodes" not in said and "no heartbeat" not in said
    print(found.group(0), "|", told.group(0))


# -- the wheel cache -----------------------------------------------------------------------

FAKE_PIP = """import pathlib, sys
args = sys.argv[1:]
dest = pathlib.Path(args[args.index("--dest") + 1])
count = dest.parent / "downloads"
count.write_text(str(int(count.read_text()) + 1 if count.exists() else 1))
if "--no-deps" not in args:
    (dest / "pkg-1.0-py3-none-any.whl").write_bytes(b"the real wheel")
else:
    (dest / "uv-0.1-py3-none-manylinux_2_17_x86_64.whl").write_bytes(b"the uv wheel")
"""


def test_a_swapped_or_added_wheel_in_the_cache_is_refused_before_anything_is_sent(tmp_path):
    """The wheels sent to hosts without an index are held to the hashes taken when the
    cache was filled: a wheel swapped for one of the same name and size (whose ``.pth``
    would run at every start of the host's Python), or one added beside them, stops the
    setup naming it; a cache filled before hashes were kept is downloaded again."""
    from distributed.hosts.provision import HostPlatform, ProvisionError, download_wheels

    linux = HostPlatform(python="3.11.2", implementation="cpython", system="Linux",
                         machine="x86_64", libc="glibc", libc_version="2.36")
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_PIP}")
    fake.chmod(0o755)
    cache = tmp_path / "cache"

    def download():
        return download_wheels(linux, ["pkg==1.0"], ROOT / "constraints.txt", cache=cache,
                               python=str(fake))

    folder = download()
    wheel = folder / "pkg-1.0-py3-none-any.whl"
    sealed = json.loads((folder / ".complete").read_text())["wheels"]
    assert sealed[wheel.name] == hashlib.sha256(b"the real wheel").hexdigest()
    assert len(sealed) == 2
    downloads = cache / "downloads"
    assert download() == folder and downloads.read_text() == "2"  # reused, not fetched
    wheel.write_bytes(b"a bad wheel!!!")  # the same name and size
    with pytest.raises(ProvisionError) as swapped:
        download()
    assert "pkg-1.0-py3-none-any.whl changed since it was downloaded" in str(swapped.value)
    assert f"delete {folder}" in str(swapped.value)
    wheel.write_bytes(b"the real wheel")
    (folder / "evil-1.0-py3-none-any.whl").write_bytes(b"x")
    with pytest.raises(ProvisionError, match="holds evil-1.0-py3-none-any.whl, which no "
                                             "download put there"):
        download()
    # A folder from before the hashes: everything in it downloaded again, and sealed.
    (folder / ".complete").write_text(json.dumps({"requirements": ["pkg==1.0"]}))
    assert download() == folder and downloads.read_text() == "4"
    assert not (folder / "evil-1.0-py3-none-any.whl").exists()
    assert json.loads((folder / ".complete").read_text())["wheels"] == sealed
