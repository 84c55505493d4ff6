"""LAN discovery: agents in network namespaces on a bridge, found by `discover` in another
namespace with real multicast; goodbyes on SIGTERM and SIGINT; the advert's TXT fields; and the
wizard's discovery step with its host key confirmation, in a real terminal against the test sshd."""

from __future__ import annotations

import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from faces_support import plain
from netns import namespaces, netns_available
from ranks import ROOT, free_port
from sshd_fixture import serve_sshd

from distributed.hosts.hostsfile import load_hosts
from distributed.hosts.mdns import DiscoveryError, MachineAdvert, require_zeroconf

CLI = str(ROOT / "cli_typer.py")
NETNS = netns_available()
needs_netns = pytest.mark.skipif(NETNS is not None, reason=f"no network namespaces: {NETNS}")
ENV = {**{k: v for k, v in os.environ.items() if k != "EXOGYM_DISCOVERED"},
       "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def advert(**fields) -> MachineAdvert:
    values = dict(name="mini", host="mini.lan", addresses=("192.168.1.7",), ssh_port=2222,
                  ssh_user="alice", python="/opt/venv/bin/python", project_path="/home/alice/gym",
                  code_hash="0123456789ab", torch="2.13.0", device="mps",
                  device_name="Apple M2", cores=8, memory_bytes=16 * 10**9)
    return MachineAdvert(**{**values, **fields})


# --------------------------------------------------------------------------- the advert


def test_an_advert_survives_its_txt_record_and_reads_as_a_person_names_it():
    sent = advert()
    props = {k.encode(): v.encode() for k, v in sent.properties().items()}
    got = MachineAdvert.from_service("mini._exogym._tcp.local.", ["192.168.1.7"], 2222, props)
    assert got == sent
    assert sent.summary == "mini (mps, 16 GB)"
    assert json.loads(json.dumps(sent.to_dict()))["memory_gb"] == 16


def test_a_field_over_the_txt_limit_is_refused_with_its_name():
    with pytest.raises(DiscoveryError, match=r"'path' field is 26\d bytes, over DNS-SD's 255"):
        advert(project_path="/" + "x" * 260).properties()


def test_an_advertised_name_that_is_not_a_dns_label_is_refused_before_any_work():
    from distributed.hosts.mdns import this_machine

    with pytest.raises(DiscoveryError, match=r"letters, digits or hyphens.*'my mac'.*--name"):
        this_machine(name="my mac")


def test_the_ssh_command_names_the_first_address_and_a_port_other_than_22():
    assert advert().ssh_command == "ssh -p 2222 alice@192.168.1.7"
    assert advert(ssh_port=22, addresses=("10.0.0.5", "172.17.0.1")).ssh_command == (
        "ssh alice@10.0.0.5")
    assert advert(addresses=(), ssh_user="").ssh_command == "ssh -p 2222 mini.lan"


def test_a_taken_name_is_followed_by_name_2_name_3_each_within_one_dns_label():
    from distributed.hosts.mdns import instance_names

    assert list(instance_names("vm", 4)) == ["vm", "vm-2", "vm-3", "vm-4"]
    long = list(instance_names("p" * 63, 12))
    assert long[0] == "p" * 63 and long[1] == "p" * 61 + "-2" and long[11] == "p" * 60 + "-12"
    assert all(len(name) <= 63 for name in long)


def test_a_browser_puts_the_addresses_on_its_own_subnets_first():
    from ipaddress import IPv4Network

    from distributed.hosts.mdns import reachable_first

    lan = [IPv4Network("192.168.1.0/24"), IPv4Network("127.0.0.0/8")]
    assert reachable_first(["172.17.0.1", "10.8.0.3", "192.168.1.7"], lan) == [
        "192.168.1.7", "172.17.0.1", "10.8.0.3"]
    assert reachable_first(["172.17.0.1", "10.8.0.3"], lan) == ["172.17.0.1", "10.8.0.3"]


def test_without_zeroconf_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "zeroconf", None)
    with pytest.raises(DiscoveryError, match=r"zeroconf package.*distributed extra"):
        require_zeroconf()


# --------------------------------------------------------------------------- across namespaces


@contextmanager
def lan(count: int) -> Iterator[tuple[list[str], list[str]]]:
    """``count`` namespaces on a bridge with a multicast route, as on a LAN."""
    with namespaces(count, subnet="10.231.31") as (names, addresses):
        for ns in names:
            links = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "type", "veth"],
                                   check=True, capture_output=True, text=True).stdout
            device = links.split(":")[1].strip().split("@")[0]
            subprocess.run(["ip", "-n", ns, "link", "set", device, "multicast", "on"], check=True)
            subprocess.run(["ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", device],
                           check=True)
        yield names, addresses


def lines_of(proc: subprocess.Popen) -> queue.Queue:
    """Every stdout line of ``proc``, as it comes."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def wait_for(lines: queue.Queue, text: str, timeout: float,
             seen: list[str] | None = None) -> str:
    """The first line holding ``text``; every line read on the way is added to ``seen``."""
    deadline = time.monotonic() + timeout
    seen = [] if seen is None else seen
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if text in line:
            return line
    raise AssertionError(f"{text!r} not seen within {timeout} s; saw: {''.join(seen)[-2000:]}")


def start_agent(ns: str, name: str, port: int, hostname: str | None = None,
                advertised: str | None = None) -> tuple[subprocess.Popen, queue.Queue, str]:
    """An agent in ``ns`` advertising ``name`` (``--name``; with ``hostname``, its host name and
    no ``--name``, as a cloned machine would run it), once it says it advertises ``advertised``
    (default ``name``): the process, its remaining lines and what it said until then."""
    command = [sys.executable, CLI, "agent", "--port", str(port), "--user", f"u-{name}"]
    if hostname is None:
        command += ["--name", name]
    else:  # its own UTS namespace: the host name changes for the agent only
        command = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname,
                   *command]
    proc = subprocess.Popen(["ip", "netns", "exec", ns, *command], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = lines_of(proc)
    said: list[str] = []
    wait_for(lines, f"Advertising {advertised or name} ", 60, said)
    return proc, lines, "".join(said)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


@pytest.mark.slow
@needs_netns
def test_discover_in_a_third_namespace_finds_both_agents_with_their_fields():
    with lan(3) as (names, addresses):
        alone = subprocess.run(["ip", "netns", "exec", names[2], sys.executable, CLI, "discover",
                                "--timeout", "1"], cwd=ROOT, env=ENV, capture_output=True,
                               text=True, timeout=120)
        assert alone.returncode == 0 and "no machines found in 1 s" in alone.stdout
        agents = [start_agent(names[0], "alpha", 2201), start_agent(names[1], "beta", 2202)]
        try:
            done = subprocess.run(["ip", "netns", "exec", names[2], sys.executable, CLI,
                                   "discover", "--json", "--timeout", "3"],
                                  cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
            table = subprocess.run(["ip", "netns", "exec", names[2], sys.executable, CLI,
                                    "discover", "--timeout", "3"], cwd=ROOT,
                                   env=dict(ENV, COLUMNS="200"), capture_output=True, text=True,
                                   timeout=120)
        finally:
            for proc, _, _ in agents:
                stop(proc)
    assert done.returncode == 0, done.stderr
    found = {m["name"]: m for m in json.loads(done.stdout)}
    assert sorted(found) == ["alpha", "beta"]
    for (name, port), address in zip((("alpha", 2201), ("beta", 2202)), addresses):
        m = found[name]
        assert m["addresses"] == [address] and m["ssh_port"] == port
        assert m["ssh_user"] == f"u-{name}" and m["python"] == sys.executable
        assert m["project_path"] == str(ROOT) and len(m["code_hash"]) == 12
        assert m["device"] in ("cpu", "cuda", "mps") and m["device_name"]
        assert m["cores"] == os.cpu_count() and m["memory_bytes"] > 0
        assert m["torch"] and m["torch"].split("+")[0] == __import__("torch").__version__.split(
            "+")[0]
    assert table.returncode == 0 and "2 machines on the LAN" in table.stdout
    assert "alpha" in table.stdout and "beta" in table.stdout


@pytest.mark.slow
@needs_netns
def test_a_stopped_agent_says_goodbye_and_leaves_a_running_browser_within_5_s():
    with lan(3) as (names, _):
        browser = subprocess.Popen(
            ["ip", "netns", "exec", names[2], sys.executable,
             str(ROOT / "tests" / "scripts" / "browse_events.py")],
            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        events = lines_of(browser)
        agents = {}
        try:
            wait_for(events, '"ready"', 60)
            agents["alpha"] = start_agent(names[0], "alpha", 2201)
            agents["beta"] = start_agent(names[1], "beta", 2202)
            for name in agents:
                wait_for(events, f'"added", "name": "{name}"', 10)
            for name, sig in (("alpha", signal.SIGTERM), ("beta", signal.SIGINT)):
                proc, lines, _ = agents[name]
                sent = time.time()
                proc.send_signal(sig)
                gone = json.loads(wait_for(events, f'"removed", "name": "{name}"', 5))
                assert gone["t"] - sent < 5
                assert proc.wait(10) == 0
                wait_for(lines, f"Stopped advertising {name} (goodbye sent)", 5)
        finally:
            for proc, _, _ in agents.values():
                stop(proc)
            stop(browser)


def discover_in(ns: str) -> tuple[list[dict], str]:
    """``discover --json`` and the table ``discover`` prints, run in namespace ``ns``."""
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, CLI, "discover", "--json",
                           "--timeout", "3"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)
    table = subprocess.run(["ip", "netns", "exec", ns, sys.executable, CLI, "discover",
                            "--timeout", "3"], cwd=ROOT, env=dict(ENV, COLUMNS="250"),
                           capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and table.returncode == 0, done.stderr + table.stderr
    return json.loads(done.stdout), table.stdout


needs_unshare = pytest.mark.skipif(shutil.which("unshare") is None,
                                   reason="util-linux unshare is not installed")


@pytest.mark.slow
@needs_netns
@needs_unshare
def test_a_second_machine_with_the_same_host_name_advertises_as_name_2_keeping_its_host_name():
    with lan(3) as (names, addresses):
        agents = []
        try:
            agents.append(start_agent(names[0], "one", 2201, hostname="vm", advertised="vm"))
            agents.append(start_agent(names[1], "two", 2202, hostname="vm", advertised="vm-2"))
            found, table = discover_in(names[2])
        finally:
            for proc, _, _ in agents:
                stop(proc)
    assert "already advertised" not in agents[0][2]
    assert ("The name 'vm' is already advertised on this LAN by another machine; advertising "
            "this one as 'vm-2' (host name 'vm', in its record)") in agents[1][2]
    machines = {m["name"]: m for m in found}
    assert sorted(machines) == ["vm", "vm-2"]
    for name, user, port, address in (("vm", "u-one", 2201, addresses[0]),
                                      ("vm-2", "u-two", 2202, addresses[1])):
        m = machines[name]
        assert (m["host"], m["ssh_user"], m["ssh_port"]) == ("vm", user, port)
        assert m["addresses"] == [address]  # its own host record: no address of the other
    assert re.search(r"│ vm\s+│ vm\s+│", table) and re.search(r"│ vm-2\s+│ vm\s+│", table)


@pytest.mark.slow
@needs_netns
def test_agent_and_discover_print_ssh_to_the_lan_address_not_to_a_docker_bridge_listed_first():
    with lan(2) as (names, addresses):
        # docker's bridge, whose index (2) is below the LAN link's: ifaddr lists it first
        for args in (("link", "add", "docker0", "type", "bridge"),
                     ("addr", "add", "172.31.9.1/24", "dev", "docker0"),
                     ("link", "set", "docker0", "up")):
            subprocess.run(["ip", "-n", names[0], *args], check=True)
        agent = start_agent(names[0], "alpha", 2201)
        try:
            found, table = discover_in(names[1])
        finally:
            stop(agent[0])
    ssh = f"ssh -p 2201 u-alpha@{addresses[0]}"
    assert f"on {addresses[0]}, 172.31.9.1 until Ctrl-C; log in with: {ssh}\n" in agent[2]
    assert [m["addresses"] for m in found] == [[addresses[0], "172.31.9.1"]]
    assert ssh in table


def test_discover_with_nothing_answering_says_so_and_exits_0(tmp_path):
    saved = tmp_path / "none.json"
    saved.write_text("[]")
    done = subprocess.run([sys.executable, CLI, "discover", "--timeout", "0.5"], cwd=ROOT,
                          env=dict(ENV, EXOGYM_DISCOVERED=str(saved)), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "no machines found" in done.stdout


# --------------------------------------------------------------------------- the wizard


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    yield from serve_sshd(tmp_path_factory)


@pytest.mark.slow
def test_wizard_uses_found_machines_after_each_fingerprint_is_confirmed(sshd, tmp_path):
    """The discovery answer is injected (EXOGYM_DISCOVERED, as `discover --json` writes it):
    the test sshd listens on 127.0.0.x of this namespace, which an agent in another namespace
    could not advertise. Host keys are fetched from the real sshd."""
    pexpect = pytest.importorskip("pexpect", reason="pip install pexpect")
    machines = [advert(name=name, addresses=(address,), ssh_port=sshd.port, ssh_user=sshd.user,
                       python=sys.executable, project_path=str(ROOT), device="cpu",
                       memory_bytes=memory * 10**9).to_dict()
                for name, address, memory in (("mini", "127.0.0.2", 16),
                                              ("studio", "127.0.0.3", 64))]
    found = tmp_path / "found.json"
    found.write_text(json.dumps(machines))
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    config = tmp_path / "config.ini"
    config.write_text((ROOT / "config.ini").read_text())
    env = dict(ENV, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm-256color",
               EXOGYM_DISCOVERED=str(found))
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    child = pexpect.spawn(sys.executable, [str(ROOT / "wizard.py"), "--config", str(config),
                                           "--known-hosts", str(known_hosts), "--ssh-config",
                                           str(sshd.ssh_config), "--no-run",
                                           "--strategy", "ddp"],
                          cwd=str(tmp_path), env=env, dimensions=(50, 200), timeout=120,
                          encoding="utf-8", codec_errors="replace")
    child.logfile_read = log = io.StringIO()
    clear = "\x15"

    def answer(prompt: str, keys: str) -> None:
        child.expect(prompt)
        child.send(keys)

    fingerprint = sshd_fingerprint(sshd)
    try:
        answer(r"I found 2 other machines: mini \(cpu, 16 GB\), studio \(cpu, 64 GB\)\. "
               r"Use them\?", "y")
        child.expect("ED25519 key fingerprint is " + re.escape(fingerprint))
        answer("Trust mini's host key", "y")
        child.expect("ED25519 key fingerprint is " + re.escape(fingerprint))
        answer("Trust studio's host key", "n")
        child.expect("Skipping studio: its host key was not trusted")
        answer("Address of this machine, the master", clear + "127.0.0.1\r")
        answer("Training port on the master", clear + str(free_port()) + "\r")
        answer("SSH private key for the workers", clear + str(sshd.key_path) + "\r")
        child.expect(r"ok.*127\.0\.0\.2: ssh ok")
        answer("Which profile", "\r")
        answer("Training steps", clear + "20\r")
        answer("how fast is it", "\r")  # measure
        child.expect(r"Strategy ddp \(--strategy\)")
        answer("Name of the profile to write", clear + "found-test\r")
        answer("Set up the hosts now", "n")
        answer("Copy this project.s files", "n")
        child.expect(pexpect.EOF, timeout=300)
    finally:
        child.close()
        screen = plain(log.getvalue())
    assert child.exitstatus == 0, screen[-4000:]
    assert "127.0.0.3: ssh" not in screen
    hosts = load_hosts(tmp_path / "distributed_hosts.json")
    assert [h.host for h in hosts.hosts] == ["127.0.0.1", "127.0.0.2"]
    worker = hosts.workers[0]
    assert (worker.ssh_port, worker.ssh_user, worker.python_env, worker.project_path) == (
        sshd.port, sshd.user, sys.executable, str(ROOT))
    assert known_hosts.read_text().split()[0] == f"[127.0.0.2]:{sshd.port}"
    assert len(known_hosts.read_text().splitlines()) == 1  # studio was not trusted


def sshd_fingerprint(sshd) -> str:
    import base64
    import hashlib

    blob = base64.b64decode(sshd.host_public_key.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


@pytest.mark.parametrize("command", ["agent", "discover"])
def test_without_zeroconf_the_commands_exit_2_naming_the_extra(command):
    blocked = ("import runpy, sys; sys.modules['zeroconf'] = None; "
               f"sys.argv = ['cli_typer.py', {command!r}]; "
               "runpy.run_path('cli_typer.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "zeroconf package" in done.stderr and "distributed" in done.stderr
    assert "Traceback" not in done.stderr
