"""What one peer can cost a run's store: the bounded front of a store across hosts.

A run across hosts serves its store through :class:`exogym.comm.store_front.StoreFront`:
torch's server on loopback alone, a relay on the public address. Each test makes a peer
do what a stranger on the LAN could (values of 7 MiB, idle connections by the hundred,
a store filled to its bound, commands out of order) against a real store on loopback,
and checks that the front refuses it within its bounds, says so once, and keeps serving
the run's own clients, which go through it too.

Strangers take addresses of their own on loopback (``127.0.0.2`` and up); the run's
clients connect from ``127.0.0.1``.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
from ports import wait_for

from exogym.comm.signing import SIGNATURE_BYTES, signature
from exogym.comm.store import new_run_key, open_store
from exogym.comm.store_front import (
    MAGIC,
    WAIT,
    FrontLimits,
    Refused,
    Request,
    _answer_for,
    parse_request,
)

KEY = new_run_key()
MIB = 1024 * 1024


def stranger(port: int, source: str = "127.0.0.2", handshake: bool = True) -> socket.socket:
    """A connection to the store from ``source`` that speaks torch's store protocol by hand;
    with ``handshake``, past the client's handshake (validate, then ping)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    if handshake:
        sock.sendall(b"\x00" + struct.pack("<I", MAGIC) + b"\x0d" + struct.pack("<I", 7))
        assert sock.recv(4) == struct.pack("<I", 7)
    return sock


def send_value(sock: socket.socket, key: bytes, size: int, signed: bool = True) -> bool:
    """Send a ``set`` of ``size`` bytes at ``key`` (as torch's client names it: with a
    leading ``/``), signed with the run's key as a rank signs it unless ``signed`` is False;
    False when the store closed the connection before all of it was sent."""
    head = b"\x01" + struct.pack("<Q", len(key)) + key + struct.pack("<Q", size)
    payload = b"x" * (size - SIGNATURE_BYTES) if signed else b"x" * size
    if signed:
        payload += signature(KEY, key[1:], payload)
    try:
        sock.sendall(head)
        view = memoryview(payload)
        while view:
            sent = sock.send(view[:MIB])
            view = view[sent:]
        sock.sendall(b"\x07")  # num_keys: an answer comes only once the set has gone through
        return len(sock.recv(8)) == 8
    except OSError:
        return False


def closed_by_peer(sock: socket.socket, timeout: float = 10) -> bool:
    """Whether the store closes ``sock`` (sending nothing) within ``timeout``."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_flood_of_7_mib_values_is_refused_at_its_length_and_a_rank_is_still_served(capfd):
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=10, key=KEY)
    rank = open_store("127.0.0.1", master.port, timeout_s=10, key=KEY)
    rank.set("exogym/elastic/host/1", "10.0.0.2")
    front = master.front
    for i in range(20):  # 140 MiB offered; each refused at its 17th byte
        with stranger(master.port) as sock:
            assert not send_value(sock, f"/big/{i}".encode(), 7 * MIB)
    assert front.refusals["value_bytes"] == 20
    assert not master.raw.inner.check([f"big/{i}" for i in range(20)])
    assert front.stored_bytes < 64 * 1024
    # The run's own clients, through the same front, are served as before.
    assert rank.get("exogym/elastic/host/1") == b"10.0.0.2"
    rank.set("exogym/elastic/host/2", "x" * 60_000)
    assert master.get("exogym/elastic/host/2") == b"x" * 60_000
    # A value under the bound from the stranger still reaches the store (it is signed
    # nowhere, so the run ignores it; that is the signed store's business).
    with stranger(master.port) as sock:
        assert send_value(sock, b"/small", 1000)
    assert master.raw.inner.check(["small"])
    err = capfd.readouterr().err
    assert err.count("store: refused a connection from 127.0.0.2: it sent a value of "
                     "7,340,032 bytes; a value may hold 131,072 bytes (further ones are "
                     "counted, not shown)") == 1, err
    master.close()


def test_a_store_full_to_its_bound_refuses_further_writes_and_still_answers_reads(capfd):
    limits = FrontLimits(stored_bytes=MIB)
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=10, key=KEY, front=limits)
    rank = open_store("127.0.0.1", master.port, timeout_s=10, key=KEY)
    rank.set("exogym/elastic/host/1", "10.0.0.2")
    refused_at = None
    with stranger(master.port) as sock:
        for i in range(20):  # 20 x 100 KB: twice the bound
            if not send_value(sock, f"/fill/{i}".encode(), 100_000):
                refused_at = i
                break
    assert refused_at is not None and 8 <= refused_at <= 10, refused_at
    assert master.front.stored_bytes <= MIB
    # The same key written again takes no more room, and reads are answered.
    with stranger(master.port) as sock:
        assert send_value(sock, b"/fill/0", 100_000)
    assert rank.get("exogym/elastic/host/1") == b"10.0.0.2"
    # Deleting makes room again.
    assert master.raw.inner.delete_key("fill/0")  # the server's own client: not counted
    assert rank.delete_key("fill/1")
    with stranger(master.port) as sock:
        assert send_value(sock, b"/fill/again", 90_000)
    err = capfd.readouterr().err
    assert err.count("store: refused a connection from 127.0.0.2: its write would take the "
                     "store past 1 MiB, the most it holds") == 1, err
    master.close()


def test_idle_connections_from_one_address_are_capped_and_closed_and_a_rank_still_connects(
        capfd):
    limits = FrontLimits(per_address=8, total=32, handshake_s=1.0)
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=10, key=KEY, front=limits)
    front = master.front
    before = descriptors()
    held = [stranger(master.port, handshake=False) for _ in range(200)]
    try:
        wait_for(lambda: front.refusals["per_address"] >= 192, 10,
                 "the connections past the address's share refused")
        assert front.open_connections <= 8
        assert descriptors() <= before + 200 + 8  # the test's own, and the front's 8
        started = time.monotonic()
        rank = open_store("127.0.0.1", master.port, timeout_s=10, key=KEY)
        rank.set("exogym/beat/1", "1")
        assert master.get("exogym/beat/1") == b"1"
        assert time.monotonic() - started < 5
        # Those that never completed the handshake are closed after handshake_s.
        wait_for(lambda: front.open_connections == 1, limits.handshake_s + 5,
                 "the idle connections closed")
        assert all(closed_by_peer(sock, 1) for sock in held[:8])
    finally:
        for sock in held:
            sock.close()
    # The rank's connection remains: its socket, the front's two, the server's own.
    wait_for(lambda: descriptors() <= before + 4, 5, "the descriptors given back")
    err = capfd.readouterr().err
    assert err.count("store: refused a connection from 127.0.0.2: it holds 8 connections, "
                     "the most one address may (further ones are counted, not shown)") == 1, err
    assert err.count("did not complete a store client's handshake within 1 s") == 1, err
    master.close()


def test_when_every_place_is_taken_one_still_waiting_for_its_handshake_or_its_proof_makes_room(
        capfd):
    """Every place taken: the connection waiting longest for its handshake, or past it but
    yet to write anything the run signed, is closed for a newcomer; connections of the
    run's clients (each writes a signed value as it connects) keep theirs, and an idle
    connection that never proves it holds the run's key is closed after ``proof_s``."""
    limits = FrontLimits(per_address=16, total=12, handshake_s=30.0, proof_s=30.0)
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=10, key=KEY, front=limits)
    front = master.front
    held = [stranger(master.port, f"127.0.0.{3 + i % 6}", handshake=False) for i in range(24)]
    try:
        wait_for(lambda: front.refusals["made_room"] >= 12, 10, "room made")
        assert front.open_connections == 12
        # A rank from another address takes the place of the one waiting longest.
        rank = open_store("127.0.0.1", master.port, timeout_s=10, key=KEY)
        assert rank.add("exogym/elastic/log/n", 1) == 1
        # Strangers past the handshake, who cannot sign, make room as well.
        talkers = [stranger(master.port, f"127.0.0.{20 + i % 4}") for i in range(16)]
        wait_for(lambda: front.refusals["made_room"] >= 12 + 1 + 16, 10, "room made again")
        assert front.open_connections == 12
        # Clients of the run hold their places: then a newcomer is refused.
        ranks = [open_store("127.0.0.1", master.port, timeout_s=10, key=KEY) for _ in range(11)]
        with stranger(master.port, "127.0.0.30", handshake=False) as late:
            assert closed_by_peer(late)
        assert front.refusals["total"] >= 1
        assert rank.add("exogym/elastic/log/n", 1) == 2  # the rank keeps its place
        for other in ranks:
            assert other.add("exogym/elastic/log/n", 0) == 2
        for sock in talkers:
            sock.close()
    finally:
        for sock in held:
            sock.close()
    master.close()
    # Past its handshake and idle, a connection that never wrote what the run signed is
    # closed after proof_s; the run's client, as idle, is not.
    limits = FrontLimits(proof_s=1.0)
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=10, key=KEY, front=limits)
    rank = open_store("127.0.0.1", master.port, timeout_s=10, key=KEY)
    with stranger(master.port, "127.0.0.31") as idle:
        assert closed_by_peer(idle, 10)
    assert rank.add("exogym/elastic/log/n", 1) == 1
    err = capfd.readouterr().err
    assert err.count("store: refused a connection from 127.0.0.31: it sent nothing the run "
                     "signed within 1 s, as the run's own clients do when they connect") == 1, err
    master.close()


def test_waits_pass_the_front_whether_they_end_or_time_out():
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=10, key=KEY)
    rank = open_store("127.0.0.1", master.port, timeout_s=10, key=KEY)
    assert rank.wait(["exogym/elastic/finished"], 0.2) is False  # torch cancels the wait
    assert rank.add("exogym/elastic/ready/0", 1) == 1  # the connection goes on after it
    setter = threading.Timer(0.3, lambda: master.set("exogym/elastic/finished", "1"))
    setter.start()
    assert rank.wait(["exogym/elastic/finished"], 10) is True
    assert rank.get("exogym/elastic/finished") == b"1"
    assert rank.values_if_set(["exogym/elastic/finished", "exogym/elastic/ready/0"]) \
        is not None
    setter.join()
    master.close()


def test_a_command_before_the_handshake_or_never_sent_by_the_project_is_refused(capfd):
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=10, key=KEY)
    with stranger(master.port, handshake=False) as sock:
        sock.sendall(b"\x07")  # num_keys, without the handshake
        assert closed_by_peer(sock)
    with stranger(master.port) as sock:
        sock.sendall(b"\x0e" + struct.pack("<Q", 1) + b"q" + struct.pack("<Q", 1) + b"v")
        assert closed_by_peer(sock)  # a queue push
    assert master.front.refusals["command"] == 2
    err = capfd.readouterr().err
    assert "it sent num_keys before a store client's handshake" in err, err
    master.close()


def test_a_request_past_a_bound_is_refused_as_soon_as_its_length_arrives():
    limits = FrontLimits()
    head = b"\x01" + struct.pack("<Q", 3) + b"key"
    assert parse_request(head, limits) is None  # a set still arriving
    with pytest.raises(Refused) as refused:
        parse_request(head + struct.pack("<Q", 7 * MIB), limits)
    assert refused.value.kind == "value_bytes"
    with pytest.raises(Refused) as refused:
        parse_request(b"\x03" + struct.pack("<Q", 10**12), limits)
    assert refused.value.kind == "key_bytes"
    with pytest.raises(Refused) as refused:
        parse_request(b"\x0a" + struct.pack("<Q", 10**6), limits)
    assert refused.value.kind == "keys_per_request"
    request = parse_request(head + struct.pack("<Q", 2) + b"vvEXTRA", limits)
    assert request is not None and request.size == len(head) + 10
    assert request.writes == [(b"key", 2, False)]
    with pytest.raises(ValueError, match="stored_bytes must be at least 1"):
        FrontLimits(stored_bytes=0)


def test_a_local_store_has_no_front_and_a_store_across_hosts_reports_its_public_port():
    local = open_store("127.0.0.1", 0, is_master=True, timeout_s=5)
    assert local.front is None
    across = open_store("127.0.0.1", 0, is_master=True, timeout_s=5, key=KEY)
    assert across.front is not None and across.port == across.front.port
    assert across.raw.port == across.port != across.raw.inner.port
    across.close()
    with socket.socket() as late:
        assert late.connect_ex(("127.0.0.1", across.port)) != 0


def test_a_request_trickled_in_is_cut_off_and_a_read_that_could_answer_too_much_is_refused(
        capfd):
    limits = FrontLimits(request_s=0.5, reply_bytes=MIB)
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=10, key=KEY, front=limits)
    with stranger(master.port) as sock:
        sock.sendall(b"\x01" + struct.pack("<Q", 4))  # a set whose key never comes
        assert closed_by_peer(sock, 5)
    with stranger(master.port) as sock:
        assert send_value(sock, b"/wide", 100_000)
        key = b"/wide"
        many = b"".join(struct.pack("<Q", len(key)) + key for _ in range(20))
        sock.sendall(b"\x0a" + struct.pack("<Q", 20) + many)  # 2 MB of answer, asked for
        assert closed_by_peer(sock)
    assert master.front.refusals["request_s"] == 1
    assert master.front.refusals["reply_bytes"] == 1
    err = capfd.readouterr().err
    assert "its request did not arrive whole within 0.5 s" in err, err
    assert "its read could answer 2,002,820 bytes; an answer may hold 1 MiB" in err, err
    master.close()


def test_one_address_holds_at_most_its_share_of_the_store_and_reading_its_keys_moves_none(
        capfd):
    limits = FrontLimits(stored_bytes_per_address=MIB // 4)
    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=10, key=KEY, front=limits)
    rank = open_store("127.0.0.1", master.port, timeout_s=10, key=KEY)
    with stranger(master.port) as sock:
        assert send_value(sock, b"/exogym/beat/1", 100_000)
        assert send_value(sock, b"/exogym/beat/2", 100_000)
        assert not send_value(sock, b"/exogym/beat/3", 100_000)
    with stranger(master.port, "127.0.0.3") as sock:  # another address has a share of its own
        assert send_value(sock, b"/exogym/beat/3", 100_000)
    # The run looks at the other peer's keys (a compare-and-set that never matches): the
    # bytes there stay that peer's, so the run's own writes are not refused for them.
    for _ in range(5):
        assert rank.get_if_set("exogym/beat/1") == b"x" * (100_000 - SIGNATURE_BYTES)
        assert rank.get_if_set("exogym/beat/2") == b"x" * (100_000 - SIGNATURE_BYTES)
    rank.set("exogym/beat/1", "x" * 60_000)  # a set takes the key, and frees the stranger's
    rank.set("exogym/beat/4", "x" * 60_000)
    assert master.get("exogym/beat/4") == b"x" * 60_000
    with stranger(master.port) as sock:
        assert send_value(sock, b"/exogym/elsewhere", 100_000)
    err = capfd.readouterr().err
    assert err.count("store: refused a connection from 127.0.0.2: its writes would hold more "
                     "than 0.25 MiB of the store, the most one address's may") == 1, err
    master.close()


def test_a_cancelled_wait_ends_at_the_cancels_answer_whether_or_not_the_wait_ended_first():
    for answers in (b"\x01", b"\x00\x01", b"\x00", b""):
        answer = _answer_for(Request(WAIT, 0, [b"/k"], []))
        answer.cancel = True
        answer.feed(memoryview(answers))
        assert answer.done == (answers.endswith(b"\x01")), answers
    answer = _answer_for(Request(WAIT, 0, [b"/k"], []))
    answer.feed(memoryview(b"\x00"))  # a wait that ended, not cancelled
    assert answer.done


def test_a_signed_store_s_front_lets_through_only_what_the_run_signed_and_its_own_deletes(
        capfd):
    """With the run's key, the front refuses every write without the run's signature, every
    add and append, and a delete of any key the run did not mark deleted first; it lets the
    run's own writes, reads and deletes through, and says what it refused and from where."""
    import torch.distributed as dist

    master = open_store("127.0.0.1", 0, is_master=True, timeout_s=10, key=KEY)
    rank = open_store("127.0.0.1", master.port, timeout_s=10, key=KEY)
    rank.set("exogym/elastic/stop", "")  # keys the run wrote
    rank.compare_set("exogym/elastic/members/0", "", '{"ranks": [0, 1, 2]}')
    assert rank.add("exogym/elastic/log/n", 1) == 1

    def raw() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", master.port, None, is_master=False,
                             timeout=timedelta(seconds=10), wait_for_workers=False)

    attempts = {
        "an unsigned set": lambda s: s.set("exogym/elastic/stop", "stopped by a stranger"),
        "an unsigned compare-and-set": lambda s: s.compare_set(
            "exogym/elastic/members/100", "", '{"ranks": [0]}'),
        "a set signed for another key": lambda s: s.set(
            "exogym/elastic/members/100", s.get("exogym/elastic/members/0")),
        "an add": lambda s: s.add("exogym/elastic/log/n", 1),
        "an append": lambda s: s.append("exogym/elastic/stop", "x"),
        "a delete": lambda s: s.delete_key("exogym/elastic/members/0"),
        "a delete of a counter": lambda s: s.delete_key("exogym/elastic/log/n"),
    }
    for what, attempt in attempts.items():
        client = raw()
        try:
            attempt(client)
            client.check(["exogym/elastic/nothing"])  # a set has no answer: its refusal shows here
        except Exception:  # noqa: BLE001 - torch's store error: the front closed the connection
            continue
        pytest.fail(f"{what} was let through")
    # Nothing changed, and a read that cannot change a key (a signed store's own) passes.
    assert rank.get("exogym/elastic/stop") == b""
    assert rank.get("exogym/elastic/members/0") == b'{"ranks": [0, 1, 2]}'
    assert rank.get_if_set("exogym/elastic/members/100") is None
    assert rank.add("exogym/elastic/log/n", 0) == 1
    # The run's own delete: its signed mark, then the delete, both let through.
    rank.set("exogym/elastic/v/a/1/0", "ok")
    assert rank.delete_key("exogym/elastic/v/a/1/0")
    assert not master.check(["exogym/elastic/v/a/1/0"])
    assert rank.get_if_set("exogym/elastic/v/a/1/0") is None
    # A value the run signed, written again at its own key, passes: it changes nothing.
    client = raw()
    signed = client.get("exogym/elastic/members/0")
    client.set("exogym/elastic/members/0", signed)
    assert client.check(["exogym/elastic/members/0"])
    assert rank.get("exogym/elastic/members/0") == b'{"ranks": [0, 1, 2]}'
    told = master.describe_refused()
    assert told == ("refused 5 writes not signed by the run and 2 deletes of keys the run had "
                    "not marked deleted (from 127.0.0.1)"), told
    # A process that serves the store without a launcher (rank 0 of a run without
    # --min-nodes) says so through its report of what it ignored.
    from exogym.comm.store import describe_ignored

    assert re.search(r"refused \d+ writes not signed by the run and \d+ deletes of keys the "
                     r"run had not marked deleted \(from [\d., ]*127\.0\.0\.1",
                     describe_ignored()), describe_ignored()
    assert "refused" not in describe_ignored(fronts=False)
    err = capfd.readouterr().err
    assert err.count("not signed by the run: its ranks sign every value they write") == 1, err
    assert err.count("which the run had not marked deleted") == 1, err
    master.close()
