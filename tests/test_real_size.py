"""Every data path at the size users train: a GPT of 23M parameters with a 16 MiB tensor.

Its token embedding (8192 x 512 float32) is one 16 MiB tensor, twice what torch's
rendezvous store would carry, so a tensor that went through the store would fail
here. Each run is a few steps of small batches, to stay well under two minutes on
two cores:

- a simulation packed several ranks to a process ends with the model of one
  process per rank (K=4, two ranks to each of two processes);
- three hosts over SSH with ``min_nodes=2``: a host killed and started again, the
  membership 3 -> 2 -> 3, the state handed over during a round (DiLoCo's long and
  short rounds, AsyncDiLoCo), and every rank ends with the same finite model;
- the same profile through ``torchrun`` and through the SSH launcher (without
  ``min_nodes``) ends with the simulation's model.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from io import StringIO

import pytest
import torch
from netbed import Events, worker_pid
from ranks import ROOT, Throttle, free_port
from rich.console import Console
from safetensors.torch import load_file
from sshd_fixture import HostSSHD, serve_sshd

from distributed.hosts.ssh import SSHOptions
from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram
from distributed.profiles.profile import parse_overrides
from distributed.tasks.tokens import gpt_task
from distributed.worker.run_profile import run_profile
from exogym import Trainer
from exogym.strategy import DiLoCoStrategy

THIRD = "127.0.0.7"
#: The members' speed once a host is lost (:class:`ranks.Throttle`), and while it starts
#: its rank again (a step's sleep ends as soon as the speed comes back).
SLOW, AWAY = 0.25, 0.01
#: The profile's model at 23M parameters, with short sequences and small batches.
SMALL_STEPS = ["block_size=32", "tokens=30000", "batch_size=2", "val_size=8", "num_threads=1",
               "checkpoint_interval=None", "warmup_steps=0"]


def assert_real_size(model: torch.nn.Module) -> None:
    params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert params >= 20_000_000 and largest >= 16 * 2**20, (params, largest)


def assert_states_equal(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key].float(), b[key].float(), atol=atol, rtol=0, msg=key)


# -- simulation: packed ranks ------------------------------------------------------------


@pytest.mark.slow(reason="a 23M-parameter model in 4 ranks, packed and then one process each")
def test_a_packed_simulation_of_a_23m_model_ends_with_the_unpacked_model():
    num_nodes = 4
    model, train, val = gpt_task(block_size=32, tokens=30000)
    assert_real_size(model)
    ends = {}
    for processes in (num_nodes, 2):  # one process per rank; then packed onto the two cores
        trainer = Trainer(model, train, val)
        final = trainer.fit(strategy=DiLoCoStrategy(H=2, inner_optim="adamw", lr=1e-3),
                            num_nodes=num_nodes, max_steps=4, batch_size=2, val_size=8,
                            val_interval=4, num_threads=1, processes=processes, logger=None,
                            progress=False)
        assert trainer.summary.get("processes") == (processes if processes < num_nodes else None)
        ends[processes] = (final.state_dict(), [r["comm_bytes"] for r in trainer.history])
    assert ends[2][1] == ends[num_nodes][1]  # the same bytes counted, row for row
    assert_states_equal(ends[2][0], ends[num_nodes][0])


def test_a_run_too_large_for_this_machine_is_refused_before_any_rank_starts(monkeypatch):
    import exogym.run.memory
    from exogym.run.memory import RUNTIME_BYTES, account_state, gib

    model, train, val = gpt_task(block_size=32, tokens=30000)
    state = account_state(model, DiLoCoStrategy(H=2), 8)
    params = sum(p.numel() * 4 for p in model.parameters())
    # parameters, gradients, Adam's two moments; DiLoCo's outer parameters and momentum
    assert (state.parameters, state.gradients) == (params, params)
    assert 0 <= state.optimizer - 2 * params < 4096  # and Adam's step counters
    assert (state.strategy, state.shared) == (0, 2 * params)  # the deltas use the parameters
    monkeypatch.setattr(exogym.run.memory, "available_memory", lambda: 2 * 2**30)
    trainer = Trainer(model, train, val)
    with pytest.raises(ValueError) as refused:
        trainer.fit(strategy=DiLoCoStrategy(H=2), num_nodes=8, max_steps=2, batch_size=2,
                    processes=8, logger=None, progress=False)
    message = str(refused.value)
    need = 8 * (state.per_rank + RUNTIME_BYTES)
    assert f"needs about {gib(need)}" in message and "2.00 GiB is available" in message
    assert f"8 ranks, each holding {gib(state.per_rank)} of training state" in message
    assert "pack ranks into fewer processes" in message and "smaller model" in message
    assert trainer.history == []  # refused before any rank started
    # Packed in 2 processes, DiLoCo's outer state and one set of gradients (the ranks step
    # in turn) are held once a process: less to hold.
    assert state.on_machine(8, 2) == need - 6 * (state.shared + state.gradients + RUNTIME_BYTES)


# -- hosts over SSH ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    yield from serve_sshd(tmp_path_factory)


@pytest.fixture
def third(sshd):
    host = HostSSHD(sshd, THIRD)
    host.start()
    yield host
    host.stop()


def launcher(sshd, workers, program, tmp_path, on_event, **options):
    worker = {"ssh_port": sshd.port}
    hosts = {"master": "127.0.0.1", "workers": [{"host": h, **worker} for h in workers],
             "ssh_user": sshd.user, "ssh_key_path": str(sshd.key_path),
             "python_env": sys.executable, "project_path": str(ROOT),
             "master_port": free_port()}
    ssh = SSHOptions(known_hosts_path=sshd.known_hosts, ssh_config_path=sshd.ssh_config,
                     allow_agent=False, look_for_keys=False, connect_timeout=5)
    return Launcher(hosts, program,
                    options=LaunchOptions(run_dir=tmp_path / "launch", grace_period=2, **options),
                    ssh=ssh, console=Console(file=StringIO(), width=200),
                    on_output=lambda line: None, on_event=on_event)


def _lose_and_take_back_rank_2(events: Events, third, out, at_step: int, throttle: Throttle,
                              *, after_ready: float = 1.0,
                              release: bool = True) -> tuple[dict, dict]:
    """Once rank 2 has trained ``at_step``: its host goes away and its process dies; once the
    members went on without it, the host answers again. The membership events of its loss
    and of its return.

    The run is held while the host is away, however long its rank takes to start on a busy
    machine: the members train at :data:`SLOW` from the loss, and all but stop
    (:data:`AWAY`) from the host's return until its restarted rank says it is ready; from
    there at ``after_ready`` of their speed while the state travels, and at full speed
    once it has rejoined (unless not ``release``: the caller gives the speed back)."""
    events.wait(lambda e: e.get("event") == "step" and e["rank"] == 2
                and e["step"] >= at_step, 300)
    throttle.set(SLOW)
    third.stop()
    pid = worker_pid(2, str(out))
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    _, lost = events.wait(lambda e: e.get("event") == "membership"
                          and e["ranks"] == [0, 1], 300)
    events.wait(lambda e: e.get("event") == "step" and e["rank"] == 0
                and e["step"] >= lost["step"] + 2, 60)
    throttle.set(AWAY)
    third.start()
    events.wait(lambda e: e.get("event") == "host" and e.get("rank") == 2
                and e.get("state") == "rejoining", 150)
    throttle.set(after_ready)
    _, rejoined = events.wait(lambda e: e.get("event") == "membership"
                              and e["ranks"] == [0, 1, 2] and e["step"] > 1, 150)
    if release:
        throttle.set(1.0)
    return lost, rejoined


@pytest.mark.slow(
    reason="three hosts over SSH train a 23M-parameter model, lose one and take it back: the "
           "hand-over at real size")
@pytest.mark.parametrize("h,strategy", [(10, []), (2, []),
                                        (10, ["strategy=async_diloco", "quorum=2"])],
                         ids=["long-rounds", "rounds-shorter-than-the-transfer", "async-diloco"])
def test_a_host_back_during_a_round_joins_at_the_next_step_while_the_others_train_at_23m(
        sshd, third, tmp_path, h, strategy):
    """DiLoCo's state can be handed over while training goes on: a host that comes back in
    the middle of a round takes it from a member on a link of their own while the members
    train, joins at the next step, not the next round, and the run ends with one model.

    The members all but stop while the host starts its rank again, so the round it comes
    back in outlasts the start however busy the machine, and train at full speed while
    the state travels. With H=2 rounds end while it travels: the joiner brings its copy
    up to date with the rounds' updates, and still ends with the others' model.

    AsyncDiLoCo's members merge at any step: the joiner starts a round of its own from
    the global model, trains it alone, and at the round's last step takes the members'
    global state and enters their merges with the steps it trained."""
    out = tmp_path / "net"
    events = Events()
    steps = 3 * h if h > 2 else 40
    speed = 1.0 if h == 2 else 0.5  # the members' speed while the state travels
    throttle = Throttle(tmp_path)
    program = RankProgram.from_profile("gpt-diloco", overrides=SMALL_STEPS + strategy + [
        "num_nodes=3", f"H={h}", f"max_steps={steps}", f"val_interval={max(h, 30)}",
        f"output_dir={out}"])
    with launcher(sshd, ["127.0.0.2", THIRD], program, tmp_path, events, min_nodes=2,
                  probe_interval=1.0, env=throttle.env) as job:
        runner = threading.Thread(target=lambda: setattr(job, "result", job.run()))
        runner.start()
        # Lost late in the first round, so that the next round (which goes on without it)
        # comes soon; the host answers again during that one.
        # With H=2 the state travels while the members train at full speed, so that rounds
        # end meanwhile; with H=10 at half speed, so that the run outlasts the hand-over.
        lost, rejoined = _lose_and_take_back_rank_2(events, third, out, max(3, 3 * h // 4),
                                                    throttle, after_ready=speed)
        runner.join(timeout=600)
    result = job.result
    assert result.ok, result.describe()
    print(f"lost at step {lost['step']}, rejoined at step {rejoined['step']} of {steps} (H={h})")
    assert "during a round" in rejoined["reason"] and THIRD in rejoined["reason"]
    assert [m["ranks"] for _, m in events.of("membership")] == [[0, 1, 2], [0, 1], [0, 1, 2]]
    # The joiner took the state during the round, from rank 0, which trained meanwhile.
    taken = [(t, e) for t, e in events.of("hand_over", 2)]
    given = [(t, e) for t, e in events.of("hand_over", 0)]
    assert taken and given and taken[-1][1]["during_round"] and given[-1][1]["during_round"]
    assert taken[-1][1]["step"] == rejoined["step"] and taken[-1][1]["source"] == 0
    # DiLoCo: the model, Adam's moments and the outer state; AsyncDiLoCo: the global model
    # and its outer momentum at least (a merge in flight travels with them)
    assert taken[-1][1]["bytes"] > (2 if strategy else 4) * 23_000_000 * 4
    # Rank 1 sent a share at the same time, unless its copy came after a round rank 0's
    # did not reach; whatever each sent adds up to what the joiner took.
    shares = taken[-1][1]["from"]
    assert "0" in shares and set(shares) <= {"0", "1"}
    assert sum(shares.values()) == taken[-1][1]["bytes"]
    print(f"the joiner took {shares} bytes from ranks {sorted(shares)}")
    sent_at, sent = given[-1]
    # The state travelled from the joiner's asking to its last update: the members train on.
    # In the ranks' own time (the events' "sent"): the launcher may read them late.
    taken_at, took = taken[-1]
    window = (took["sent"] - took["seconds"], took["sent"])
    during = {r: [e["step"] for _, e in events.of("step", r) if window[0] <= e["sent"] <= window[1]]
              for r in (0, 1)}
    ready_at = [t for t, e in events.of("host", 2) if e["state"] == "rejoining"][-1]
    first_at = next(t for t, e in events.of("step", 2) if e["step"] == rejoined["step"])
    print(f"hand-over {sent['bytes'] / 2**20:.0f} MiB in {sent['seconds']:.2f} s "
          f"({sent['rounds_caught_up']} rounds caught up), while "
          f"ranks 0 and 1 trained steps {during[0]} and {during[1]}; back to work "
          f"{first_at - ready_at:.1f} s after the restarted rank said it was ready")
    # Neither member stopped for it (the source is held only while it copies its state).
    held = {0: (sent.get("timing") or {}).get("copy_s") or 0.0, 1: 0.0}
    for r in (0, 1):
        if strategy and not during[r] and _waited_for_the_quorum(events, r, window, during):
            continue
        assert during[r] or _no_stall(events, r, window, held[r], speed), (r, window, during)
    # It joined at the step after the member's latest when the transfer was over, not at a
    # later round's start (a round start only where the transfer ended with a round).
    member_at = max(e["step"] for t, e in events.of("step", 0) if t <= sent_at)
    assert rejoined["step"] <= member_at + 2, (rejoined["step"], member_at)
    # It trained from the step it joined at, and every rank ended with the same model.
    steps2 = [e["step"] for _, e in events.of("step", 2) if e["step"] >= rejoined["step"]]
    assert steps2 and steps2[0] == rejoined["step"]
    done = {e["rank"]: e for _, e in events.of("done")}
    assert sorted(done) == [0, 1, 2] and all(d["step"] == steps for d in done.values())
    assert len({d["model_digest"] for d in done.values()}) == 1, done
    final = load_file(out / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in final.values())
    assert max(t.numel() * t.element_size() for t in final.values()) >= 16 * 2**20
    if strategy:
        _check_the_joiner_merged(events, rejoined["step"], h)
        _check_every_ranks_work_is_merged(events, out, steps)


def _check_every_ranks_work_is_merged(events: Events, out, steps: int) -> None:
    """AsyncDiLoCo: every merge is in summary.json, the last one, at the end, drops
    nothing, and each rank's last trained step is in a merge: the final model holds every
    rank's work (a rank measured slower may idle after its last merge, and then has
    nothing left for the final one)."""
    merges = json.loads((out / "summary.json").read_text())["merges"]
    last = merges["rounds"][-1]
    assert last["final"] and last["step"] == steps and last["dropped"] == [], last
    assert {r["rank"] for r in merges["ranks"]} == {0, 1, 2}
    for rank in (0, 1, 2):
        trained = max(e["step"] for _, e in events.of("step", rank) if not e.get("idle"))
        merged = max(m["step"] for m in merges["rounds"] if rank in m["contributors"])
        assert trained <= merged, (rank, trained, merged, last)


def _waited_for_the_quorum(events: Events, rank: int, window: tuple[float, float],
                          during: dict[int, list[int]]) -> bool:
    """AsyncDiLoCo with ``quorum=2`` and two members: whether ``rank`` was ahead of the
    other member, whose merge it waited for at its round's end, while the other trained
    through ``window`` (the hand-over held neither: the strategy's own quorum did)."""
    other = 1 - rank
    reached = [e["step"] for _, e in events.of("step", rank) if e["sent"] <= window[1]]
    return bool(during[other]) and bool(reached) and max(reached) >= max(during[other])


def _no_stall(events: Events, rank: int, window: tuple[float, float], held_s: float,
              speed: float = 1.0) -> bool:
    """Whether ``rank``'s steps went on across ``window`` at its own pace: the gap between
    its last step before the window's end and its first after it is at most twice its
    median step interval (most steps run at full speed) at the ``speed`` it was throttled
    to there, plus ``held_s`` (a window shorter than one step holds no step of its own)."""
    times = sorted(e["sent"] for _, e in events.of("step", rank) if not e.get("idle"))
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    if not gaps:
        return False
    before = [t for t in times if t <= window[1]]
    after = [t for t in times if t > window[1]]
    if not before or not after:
        return False
    return after[0] - before[-1] <= 2 * gaps[len(gaps) // 2] / speed + held_s


def _check_the_joiner_merged(events: Events, joined_at: int, h: int) -> list[dict]:
    """An AsyncDiLoCo joiner's steps reached the final model: after the round it joined
    ended, a merge took its round (begun at the step it joined, merged with every step it
    trained), and the last merge, at the end, dropped nothing. The merges from there, from
    every rank's events, as the launcher's summary.json has them (a rank that comes and
    goes reports some merges, rank 0 others)."""
    from exogym.report.summary import MergeLog

    log = MergeLog()
    for _, event in events.items:
        log.on_event(event)
    merges = log.merges()["rounds"]
    meets_at = (joined_at - 1) // h * h + h
    later = [m for m in merges if m["step"] >= meets_at]
    print(f"merges from step {meets_at}: "
          f"{[(m['step'], m['contributors'], m['steps']) for m in later]}")
    assert later and later[-1]["final"] and later[-1]["dropped"] == [], later
    with_joiner = [m for m in later if 2 in m["contributors"]]
    assert with_joiner and (with_joiner[0]["step"] > meets_at or with_joiner[0]["final"]), later
    return later


@pytest.mark.slow(
    reason="a 23M-parameter state handed over across hosts, then its giver killed and the "
           "joiner's round waited out")
def test_an_async_diloco_joiner_meets_the_members_after_the_member_that_gave_it_the_state_died(
        sshd, third, tmp_path):
    """AsyncDiLoCo at 23M: rank 2 comes back during a round and takes the state from rank 0;
    rank 0 is killed while rank 2 trains alone. At the round's last step rank 2 takes the
    members' global state from rank 1, the lowest member left, and the run goes on and
    ends with one model (min_nodes=2: without rank 2 the run would stop)."""
    out = tmp_path / "net"
    events = Events()
    h, steps = 20, 60
    throttle = Throttle(tmp_path)
    program = RankProgram.from_profile("gpt-diloco", overrides=SMALL_STEPS + [
        "strategy=async_diloco", "quorum=2", "num_nodes=3", f"H={h}", f"max_steps={steps}",
        "val_interval=20", f"output_dir={out}"])
    with launcher(sshd, ["127.0.0.2", THIRD], program, tmp_path, events, min_nodes=2,
                  probe_interval=1.0, env=throttle.env) as job:
        runner = threading.Thread(target=lambda: setattr(job, "result", job.run()))
        runner.start()
        # Slow until rank 0 is killed: the round rank 2 joins in holds its hand-over and
        # the kill, however long they take.
        _, rejoined = _lose_and_take_back_rank_2(events, third, out, 15, throttle,
                                                 after_ready=SLOW, release=False)
        meets_at = (rejoined["step"] - 1) // h * h + h
        assert rejoined["step"] < meets_at - 3, (rejoined, meets_at)  # time to kill rank 0
        source = worker_pid(0, str(out))
        os.kill(source, signal.SIGKILL)  # the member that handed rank 2 the state
        killed_at = max(e["step"] for _, e in events.of("step", 0))
        throttle.set(1.0)
        runner.join(timeout=600)
    result = job.result
    assert result.ok, result.describe()
    print(f"rank 2 rejoined at step {rejoined['step']}, rank 0 killed at step {killed_at}, "
          f"rank 2 met the members at step {meets_at}")
    assert killed_at < meets_at
    taken = [e for _, e in events.of("hand_over", 2)]
    assert taken[-1]["source"] == 0 and taken[-1]["step"] == rejoined["step"]
    ranks = [m["ranks"] for _, m in events.of("membership")]
    assert ranks[:3] == [[0, 1, 2], [0, 1], [0, 1, 2]], ranks
    # Rank 0, started again, can rejoin only during the last round, as a joiner itself:
    # the members' state at rank 2's entry came from rank 1.
    log = (tmp_path / "launch" / "rank2.log").read_text()
    assert f"step {meets_at}: rank 2 met the members and took their state from rank 1" in log
    steps2 = [e["step"] for _, e in events.of("step", 2) if e["step"] >= rejoined["step"]]
    assert steps2[0] == rejoined["step"] and steps2[-1] == steps
    done = {e["rank"]: e for _, e in events.of("done")}
    ended = {r: d for r, d in done.items() if d["step"] == steps}
    assert {1, 2} <= set(ended), done
    assert len({d["model_digest"] for d in ended.values()}) == 1, done
    # Rank 0, started again, rejoined for the last round or came back once the run was over
    # (then it trained and sent nothing).
    late = [d for r, d in done.items() if r not in ended]
    assert all(d["rank"] == 0 and d["comm_bytes"] == 0 for d in late), done
    _check_the_joiner_merged(events, rejoined["step"], h)


@pytest.mark.slow(
    reason="the 23M-parameter model trained three ways: simulated, under torchrun and over "
           "SSH")
def test_a_23m_model_through_torchrun_and_over_ssh_equals_the_simulation(sshd, tmp_path):
    settings = SMALL_STEPS + ["num_nodes=2", "H=2", "max_steps=4", "val_interval=4"]
    run_profile("gpt-diloco", overrides=parse_overrides(
        settings + [f"output_dir={tmp_path / 'sim'}"]), progress=False, local=True)
    simulated = load_file(tmp_path / "sim" / "model.safetensors")

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        env.pop(key, None)
    torchrun = shutil.which("torchrun")
    starter = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    sets = [arg for s in settings + [f"output_dir={tmp_path / 'torchrun'}"] for arg in ("--set", s)]
    done = subprocess.run(starter + ["--nnodes", "1", "--nproc-per-node", "2", "--master-port",
                                     str(free_port()), "-m", "distributed.worker", "--profile",
                                     "gpt-diloco", "--quiet", *sets],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert_states_equal(load_file(tmp_path / "torchrun" / "model.safetensors"), simulated)

    program = RankProgram.from_profile("gpt-diloco",
                                       overrides=settings + [f"output_dir={tmp_path / 'ssh'}"])
    with launcher(sshd, ["127.0.0.2"], program, tmp_path, lambda event: None) as job:
        result = job.run()
    assert result.ok, result.describe()
    assert_states_equal(load_file(tmp_path / "ssh" / "model.safetensors"), simulated)


CHECKPOINT_PEAKS = r"""
import json, sys, torch
from exogym.run.checkpoint import load_checkpoint, save_checkpoint
from exogym.base.io import atomic_save_safetensors
from exogym.run.memory import _reset_cpu_peak, _rss_kib
from distributed.tasks.tokens import gpt_task
model, _, _ = gpt_task(block_size=32, tokens=30000)
optim = torch.optim.AdamW(model.parameters())
for p in model.parameters():
    p.grad = torch.randn_like(p)
optim.step()
for p in model.parameters():
    p.grad = None
state = {"model": model.state_dict(), "optim": optim.state_dict()}
nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
nbytes += sum(v.numel() * v.element_size() for s in optim.state.values()
              for v in s.values() if torch.is_tensor(v))
largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
_reset_cpu_peak()
base = _rss_kib("VmRSS")
save_checkpoint(state, sys.argv[1], 0, 1)
saving = _rss_kib("VmHWM") - base
_reset_cpu_peak()
base = _rss_kib("VmRSS")
atomic_save_safetensors(model.state_dict(), sys.argv[1] + "/model.safetensors", {"a": "b"})
final = _rss_kib("VmHWM") - base
del optim, model, state
_reset_cpu_peak()
base = _rss_kib("VmRSS")
loaded = load_checkpoint(sys.argv[1] + "/rank0/step00000001.ckpt")
loading = _rss_kib("VmHWM") - base
print(json.dumps({"bytes": nbytes, "largest": largest, "saving": saving * 1024,
                  "loading": loading * 1024, "final": final * 1024}))
"""


@pytest.mark.slow(
    reason="checkpoints and the final model of a 23M-parameter model written and read back")
def test_a_checkpoint_and_the_final_model_stream_to_and_from_their_files(tmp_path):
    # A 23M-parameter model and its Adam state (264 MiB): saving holds no copy of the
    # payload in memory, loading holds the state once (not the file's bytes as well),
    # and the final model's file is written without a copy of the model either.
    done = subprocess.run([sys.executable, "-c", CHECKPOINT_PEAKS, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["largest"] >= 16 << 20 and figures["bytes"] >= 3 * 20_000_000 * 4
    assert figures["saving"] < 0.15 * figures["bytes"], figures
    assert figures["loading"] < 1.2 * figures["bytes"], figures
    assert figures["final"] < 0.05 * figures["bytes"], figures
    final = load_file(tmp_path / "model.safetensors")
    from exogym.run.checkpoint import load_checkpoint
    loaded = load_checkpoint(tmp_path / "rank0" / "step00000001.ckpt")
    model, _, _ = gpt_task(block_size=32, tokens=30000)
    assert loaded["model"].keys() == model.state_dict().keys() == final.keys()
    assert all(torch.equal(final[k], t) for k, t in loaded["model"].items())
    assert all(torch.isfinite(t).all() for t in loaded["model"].values())
