"""A rank's link and host, as its monitor reports them: the progress of a collective in
flight (read from another thread), its rate, the host's CPU and memory, and a real
simulation's ``link`` and ``system`` events."""

from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from ranks import free_port
from rich.console import Console

from exogym import LocalTrainer, comm
from exogym.comm.protocol import Collectives, done
from exogym.report.health import HealthBoard
from exogym.report.summary import RunReporter
from exogym.run.monitor import INTERVAL_ENV, RankMonitor, monitor_interval
from exogym.run.system_sampler import SystemSampler
from exogym.strategy import DiLoCoStrategy

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


class SlowLink(Collectives):
    """A transport to one peer holding the same tensors, over a link of ``bytes_per_s``:
    each call takes its payload's time on the link and leaves the sum (twice the tensor)."""

    name = "a slow link"

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s

    @property
    def active(self) -> bool:
        return True

    def world_size(self) -> int:
        return 2

    def group_ranks(self, group=None) -> list[int]:
        return [0, 1]

    def _carry(self, tensor: torch.Tensor) -> None:
        time.sleep(tensor.numel() * tensor.element_size() / self.bytes_per_s)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self._carry(tensor)
        tensor.mul_(2)
        return done(async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        self._carry(tensor)
        for out in tensor_list:
            out.copy_(tensor)
        return done(async_op)


@pytest.fixture
def slow_link():
    """Carries this thread's collectives over a :class:`SlowLink` of 4 MiB/s (33.6 Mbit/s)."""
    link = SlowLink(4 * MIB)
    previous = comm.use_backend(link)
    comm.reset_counters()
    try:
        yield link
    finally:
        comm.use_backend(previous)


class Timed:
    """Collects emitted events with the time each arrived."""

    def __init__(self) -> None:
        self.events: list[tuple[float, dict]] = []
        self.lock = threading.Lock()

    def __call__(self, event: dict) -> None:
        with self.lock:
            self.events.append((time.monotonic(), event))

    def of(self, kind: str) -> list[tuple[float, dict]]:
        return [(t, e) for t, e in self.events if e["event"] == kind]


@pytest.mark.slow
def test_a_long_all_reduce_reports_its_progress_about_once_a_second(slow_link):
    tensors = [torch.full((MIB // 4,), float(i)) for i in range(14)]  # 14 MiB: about 3.5 s
    emitted = Timed()
    monitor = RankMonitor(0, emitted)
    started = time.monotonic()
    comm.all_reduce_tensors(tensors, bucket_bytes=MIB)
    took = time.monotonic() - started
    monitor.stop()
    assert all(torch.equal(t, torch.full_like(t, 2.0 * i)) for i, t in enumerate(tensors))

    flying = [(t, e) for t, e in emitted.of("link") if e["in_flight"]]
    assert len(flying) >= 2, emitted.events
    shares = [e["done"] for _, e in flying]
    assert all(a < b for a, b in zip(shares, shares[1:])), shares  # progress moves each second
    assert 0 < shares[0] and shares[-1] < 1
    assert all(e["bytes_total"] == 14 * MIB and e["bytes_done"] == round(e["done"] * 14 * MIB)
               for _, e in flying)
    gaps = [b - a for (a, _), (b, _) in zip(flying, flying[1:])]
    assert all(0.7 < gap < 2.5 for gap in gaps), gaps  # about once a second
    link_bps = 8 * slow_link.bytes_per_s
    achieved = 8 * 14 * MIB / took  # under the link's rate on a busy machine
    for _, e in flying:  # the rate of the pieces done so far
        assert 0.7 * achieved < e["rate_bps"] <= 1.02 * link_bps, (e, achieved, link_bps)
    last = emitted.of("link")[-1][1]  # after it ended: the last figures
    assert not last["in_flight"] and last["done"] is None
    assert last["sent_bytes"] == comm.comm_bytes() == 14 * MIB
    assert last["rate_bps"] == pytest.approx(achieved, rel=0.05)  # its bytes over its time
    assert len(emitted.of("system")) >= len(flying)  # the host, at each report too


def test_an_asynchronous_all_reduce_is_in_flight_until_its_handle_is_waited_for(slow_link):
    slow_link.bytes_per_s = 1024 * MIB
    progress = comm.link_progress()
    before = progress.snapshot().bytes_finished
    tensors = [torch.ones(1000) for _ in range(5)]
    handle = comm.all_reduce_tensors(tensors, bucket_bytes=8000, async_op=True)
    flying = progress.snapshot()
    assert flying.in_flight == 1 and flying.bytes_total == comm.comm_bytes() == 20_000
    assert flying.bytes_done == 0 and flying.done == 0.0
    handle.wait()
    after = progress.snapshot()
    assert after.in_flight == 0 and after.bytes_finished - before == 20_000
    # a handle dropped unwaited (its rank left the run) ends its collective all the same
    handle = comm.all_reduce_tensors(tensors, async_op=True)
    assert progress.snapshot().in_flight == 1
    del handle
    gc.collect()
    assert progress.snapshot().in_flight == 0


def test_progress_counts_what_the_byte_counters_count_for_every_wire_type(slow_link):
    slow_link.bytes_per_s = 1024 * MIB
    progress = comm.link_progress()
    tensors = [torch.randn(3000), torch.randn(50, 40), torch.randn(7)]
    for dtype in (None, "bfloat16", "int8", "int4"):
        comm.reset_counters()
        before = progress.snapshot().bytes_finished
        comm.all_reduce_tensors(tensors, dtype=dtype, bucket_bytes=4096)
        comm.broadcast(tensors[2])
        comm.all_gather([torch.empty(7), torch.empty(7)], tensors[2])
        assert progress.snapshot().bytes_finished - before == comm.comm_bytes(), dtype
    assert progress.snapshot().in_flight == 0


def test_the_monitor_stops_within_a_report_and_a_failing_sampler_stops_only_itself(capfd):
    emitted = Timed()
    monitor = RankMonitor(3, emitted, interval_s=0.05)
    time.sleep(0.3)
    started = time.monotonic()
    monitor.stop()
    assert time.monotonic() - started < 2.0  # its bound: a report's time and two seconds
    assert not monitor.running
    count = len(emitted.events)
    assert count >= 2 and all(e["rank"] == 3 for _, e in emitted.events)
    time.sleep(0.2)
    assert len(emitted.events) == count  # nothing after it stopped

    class Refused(SystemSampler):
        def sample(self):
            raise PermissionError("/proc is not readable here")

    broken = RankMonitor(4, emitted, interval_s=0.05, sampler=Refused())
    time.sleep(0.3)
    assert not broken.running
    broken.stop()
    assert "rank 4: the monitor stopped (PermissionError" in capfd.readouterr().err


def test_the_monitors_of_ranks_packed_in_a_process_share_one_thread():
    """512 packed ranks had 512 monitor threads, each waking once a second for the
    interpreter's lock while one rank computed: a process's ranks share one, which
    reports for each of them at every interval and ends with the last of them."""
    from exogym.run.monitor import MonitorTicker

    ticks: dict[int, int] = {}

    class Counted(RankMonitor):
        def tick(self) -> None:
            ticks[self.rank] = ticks.get(self.rank, 0) + 1
            super().tick()

    emitted = Timed()
    before = threading.active_count()
    ticker = MonitorTicker(0.05)
    monitors = [Counted(rank, emitted, interval_s=0.05, ticker=ticker) for rank in range(8)]
    assert threading.active_count() == before + 1
    time.sleep(0.4)
    assert all(monitor.running for monitor in monitors)
    assert {e["rank"] for _, e in emitted.of("system")} == {0}  # one rank samples the host
    for monitor in monitors:
        monitor.stop()
    assert sorted(ticks) == list(range(8)) and min(ticks.values()) >= 3, ticks
    assert not any(monitor.running for monitor in monitors)
    deadline = time.monotonic() + 2.0
    while ticker.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not ticker.running  # no monitor left: its thread ended
    count = len(emitted.events)
    time.sleep(0.2)
    assert len(emitted.events) == count


def test_the_monitors_interval_comes_from_its_variable():
    assert monitor_interval({}) == 1.0
    assert monitor_interval({INTERVAL_ENV: "0.25"}) == 0.25
    assert monitor_interval({INTERVAL_ENV: "0"}) == 0.0
    for bad in ("fast", "-1", "inf"):
        with pytest.raises(ValueError, match=f"{INTERVAL_ENV}='{bad}' must be a number"):
            monitor_interval({INTERVAL_ENV: bad})


def test_the_system_sampler_reads_this_hosts_real_figures_and_flags_low_memory():
    sampler = SystemSampler()
    busy = threading.Thread(target=lambda: sum(i * i for i in range(3_000_000)))
    busy.start()
    busy.join()
    sample = sampler.sample()
    memory = psutil.virtual_memory()
    assert sample["pid"] == os.getpid() and sample["cores"] == psutil.cpu_count()
    assert 0 < sample["cpu_percent"] <= 100  # it computed: the host was not idle
    rss = psutil.Process().memory_info().rss
    assert 0.8 * rss < sample["rss_bytes"] < 1.25 * rss
    assert sample["mem_total_bytes"] == memory.total
    assert 0 < sample["mem_available_bytes"] <= memory.total
    assert abs(sample["mem_available_bytes"] - memory.available) < 0.1 * memory.total
    assert sample["low_memory"] == (sample["mem_available_bytes"] < 0.1 * memory.total)
    assert "gpu" not in sample  # a CPU rank has no GPU figures
    wary = SystemSampler(low_memory_bytes=2 * memory.total).sample()
    assert wary["low_memory"] is True
    assert SystemSampler(low_memory_bytes=0).sample()["low_memory"] is False


class Recorder:
    """A progress sink that keeps every event of a fit."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def on_event(self, event: dict) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass

    def finish(self, summary: dict, title: str = "run summary") -> None:
        pass


@pytest.mark.slow
def test_a_simulation_sends_each_ranks_link_and_its_hosts_figures(monkeypatch, tmp_path):
    from exogym.data.digits import DigitsMLP, digits_datasets

    monkeypatch.setenv(INTERVAL_ENV, "0.2")
    train, val = digits_datasets()
    trainer = LocalTrainer(DigitsMLP(), train, val)
    recorder = Recorder()
    trainer.fit(strategy=DiLoCoStrategy(H=5), num_nodes=2, max_steps=400, batch_size=32,
                val_size=0, logger="csv", log_dir=tmp_path, progress=recorder)
    links = [e for e in recorder.events if e["event"] == "link"]
    systems = [e for e in recorder.events if e["event"] == "system"]
    assert {e["rank"] for e in links} == {e["rank"] for e in systems} == {0, 1}
    assert len({e["pid"] for e in systems}) == 2  # a process per rank, each its own figures
    for rank in (0, 1):
        done = trainer.rank_stats[rank]
        mine = [e for e in links if e["rank"] == rank]
        # the last report counts every byte the rank sent, as its counters do
        assert mine[-1]["sent_bytes"] == done["comm_bytes"] > 0
        assert all(e["rate_bps"] is None or e["rate_bps"] > 0 for e in mine)
    assert all(0 <= e["cpu_percent"] <= 100 and e["rss_bytes"] > 10 * MIB for e in systems)
    assert all(k not in e for e in trainer.history for k in ("in_flight", "cpu_percent"))
    history = (next(tmp_path.iterdir()) / "history.csv").read_text()
    assert "cpu_percent" not in history and "rate_bps" not in history  # steps only


@pytest.mark.slow
def test_a_gloo_all_reduce_over_a_slow_real_link_moves_bucket_by_bucket(tmp_path):
    from netns import namespaces, netns_available

    reason = netns_available()
    if reason:
        pytest.skip(reason)
    port = free_port()
    script = str(ROOT / "tests" / "scripts" / "link_progress_rank.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GLOO_SOCKET_IFNAME", None)
    with namespaces(2, subnet="10.231.41", rate="40mbit") as (names, addresses):
        procs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, script, str(rank),
                                   addresses[0], str(port)], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank, ns in enumerate(names)]
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for output in outputs:
        events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
        assert events[-1] == {"event": "result", "exact": True, "comm_bytes": 16 * MIB}, output
        flying = [e for e in events if e["event"] == "link" and e["in_flight"]]
        assert len(flying) >= 2, output
        shares = [e["done"] for e in flying]
        assert shares == sorted(shares) and shares[-1] > shares[0], shares
        assert all(e["bytes_total"] == 16 * MIB for e in flying)
        gaps = [b["t"] - a["t"] for a, b in zip(flying, flying[1:])]
        assert all(0.7 < gap < 2.5 for gap in gaps), gaps  # about once a second
        whole = [e for e in events if e["event"] == "link"][-1]  # its bytes over its time
        assert not whole["in_flight"] and 10e6 < whole["rate_bps"] < 41e6, whole  # 40 Mbit/s
        rates = [e["rate_bps"] for e in flying if e["rate_bps"] is not None]
        assert rates and all(0.7 * whole["rate_bps"] < r < 41e6 for r in rates), (rates, whole)


def test_the_progress_bar_says_once_that_this_machine_runs_low_on_memory():
    out = io.StringIO()
    reporter = RunReporter(2, console=Console(file=out, width=120))
    for rank, available in ((0, 5.0), (1, 0.9), (0, 0.5)):
        reporter.on_event({"event": "system", "rank": rank, "mem_total_bytes": 16 * 2**30,
                           "mem_available_bytes": int(available * 2**30),
                           "low_memory": available < 1.6})
    assert out.getvalue().splitlines() == ["this machine has 0.9 GiB of 16 GiB memory left"]


def test_with_a_simulated_network_the_waiting_share_is_the_simulated_time_in_collectives():
    board = HealthBoard()
    for n in range(1, 4):  # each step: 0.3 s of simulated compute, 0.9 s on the network
        board.on_event({"event": "step", "rank": 0, "step": n, "comm_s": 0.001,
                        "compute_s": 0.3, "sim_comm_s": 0.9, "sim_time_s": 1.2 * n,
                        "wall_s": 0.01 * n}, "local")
    (host,) = board.hosts()
    assert host.waiting == pytest.approx(0.75)
    assert not board.reporting  # steps alone: no link or host figures yet
