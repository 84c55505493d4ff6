"""A run across hosts acts only on what its own ranks wrote to its store.

The launcher draws a key for each run and hands it to every rank through its
supervisor's pipe; every store value is signed with it (``SignedStore``). A
stranger who reaches the store's port writes values too, as torch's own client
does: each test here checks that such a value is ignored and counted, never acted
on, and that a run under attack either finishes as it would have or fails naming
the cause.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta
from io import StringIO

import pytest
import torch
import torch.distributed as dist
from ranks import ROOT, free_port

from exogym.comm.store import (
    UnsignedValueError,
    ignored_messages,
    open_store,
)

KEY = bytes(range(32))


def stranger_client(port: int) -> dist.TCPStore:
    """torch's own store client, as anyone who knows the port has it."""
    return dist.TCPStore("127.0.0.1", port, None, is_master=False,
                         timeout=timedelta(seconds=5), wait_for_workers=False)


def planted(stranger: dist.TCPStore, key: str, value: bytes) -> None:
    stranger.set(key, value)
    stranger.get(key)  # a set is not answered: read it back so it has landed


def test_a_signed_store_ignores_and_counts_every_value_a_stranger_writes():
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=1.0, key=KEY)
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
    assert read_beat(master, "exogym/beat/1") == beat > 10**12
    planted(stranger, "exogym/beat/1", b"99999999999999")
    assert read_beat(master, "exogym/beat/1") == 0

    after, keys = ignored_messages()
    assert after - before >= 6
    assert {"exogym/elastic/stop", "exogym/elastic/lost/1", "exogym/beat/1"} <= set(keys)


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
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=20, key=KEY)
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


def test_a_group_whose_peer_address_is_only_forged_fails_naming_the_key():
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=2, key=KEY)
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
        "sys.path.insert(0, os.environ['ROOT'])\n"
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
                                  env={**os.environ, "ROOT": str(ROOT)})
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


def attack(s):
    # Stop the run, declare ranks lost, decide a membership, fake a heartbeat, point a
    # group at this machine, and write back every signed value read earlier.
    s.set(f"{ns}/stop", "stopped by a stranger on the LAN")
    for rank in (1, 2):
        s.set(f"{ns}/why/{rank}/1", "lost to a stranger")
        s.set(f"exogym/beat/{rank}", "1")
    for start in range(0, 1600, 100):
        s.compare_set(f"{ns}/members/{start}", "", '{"ranks": [0], "step": 0}')
    s.set(f"{ns}/latest", "1500")
    for name in ("e1-x", "e2-x"):
        s.set(f"{ns}/pg/{name}//0/1", "\x00" * 64)
    for key, value in copied.items():
        s.set(key, value)
    for key in (f"{ns}/log/1", f"{ns}/log/n", "exogym/beat/2"):
        if s.check([key]):
            copied[key] = s.get(key)
    for rank in (1, 2):
        s.add(f"{ns}/lost/{rank}", 1)  # the server may drop a client adding to a signed value


rounds = dropped = 0
end = time.monotonic() + float(sys.argv[3])
s = connect()
while time.monotonic() < end:
    try:
        attack(s)
        rounds += 1
    except Exception:
        dropped += 1
        try:
            s = connect()
        except Exception:  # the run has ended and its store with it
            break
    time.sleep(0.1)
print(f"stranger wrote {rounds} rounds ({dropped} dropped)", flush=True)
"""


@pytest.mark.slow
def test_a_stranger_on_the_lan_neither_stops_nor_steers_a_run_across_hosts(tmp_path):
    from netbed import Testbed
    from netns import netns_available
    from rich.console import Console

    from distributed.hosts.ssh import SSHOptions
    from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram

    why = netns_available()
    if why:
        pytest.skip(why)
    out = tmp_path / "net"
    events: list[dict] = []
    output: list[str] = []
    program = RankProgram.from_profile("digits-diloco", overrides=[
        "max_steps=1500", "val_interval=500", "val_size=256", "num_threads=1",
        "checkpoint_interval=None", "num_nodes=3", f"output_dir={out}"])
    port = free_port()
    with Testbed(3, subnet="10.213.93", pin=False) as bed:
        config = bed.hosts_config(port, launcher_is_master=True, count=2)
        stranger_host = bed.hosts[2]  # on the same LAN, in no hosts file
        console = StringIO()
        job = Launcher(config, program, options=LaunchOptions(
            run_dir=tmp_path / "launch", grace_period=2, probe_interval=1.0, min_nodes=2,
            lost_after=6),
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
                bed.in_host(stranger_host, sys.executable, "-c", ATTACK,
                            bed.uplink_address, str(port), "15"),
                capture_output=True, text=True, timeout=120,
                env={**os.environ, "PYTHONPATH": str(ROOT)})
            rounds = re.search(r"stranger wrote (\d+) rounds", attack.stdout)
            assert rounds and int(rounds.group(1)) >= 20, (attack.stdout, attack.stderr[-2000:])
            key = job.store_key.hex()
            runner.join(timeout=300)
        result = job.result
    assert result.ok, result.describe()
    memberships = [e["ranks"] for e in events if e.get("event") == "membership"]
    assert memberships == [[0, 1, 2]], memberships
    steps = {e["rank"]: e["step"] for e in events if e.get("event") == "step"}
    assert steps == {0: 1500, 1: 1500, 2: 1500}, steps
    assert (out / "model.safetensors").is_file()
    said = console.getvalue() + "\n".join(output)
    assert "not signed by this run" in said, said[-3000:]
    print(attack.stdout.strip(), "|", next(line for line in said.splitlines()
                                           if "not signed by this run" in line).strip())
    assert "stopped by a stranger" not in said
    # The key reached the ranks, and no log, command line or record holds it.
    for path in (tmp_path / "launch").rglob("*"):
        if path.is_file():
            assert key not in path.read_text(errors="replace"), path
    assert key not in said
