"""Speedup across hosts on bandwidth-limited links: real processes, real SSH, real TCP.

Run as root from the project root::

    python bench/multihost.py                          # 2 hosts, 1gbit/100mbit/20mbit, 5 strategies
    python bench/multihost.py --rates 100mbit --strategies ddp,diloco:100
    python bench/multihost.py --quick                  # a small model, one rate, two strategies

What it does:

1. Builds ``--hosts`` hosts as network namespaces on one bridge, every host's
   outgoing link shaped by ``tc tbf`` (``bench/netbed.py``), each with its own
   ``sshd``. With pinning (the default), host ``i`` and everything started in
   it runs on core ``i`` alone, and every rank trains with one thread
   (``num_threads=1``), so hosts do not take each other's compute.
2. Measures every link rate: the payload goodput a host gets while sending to
   one peer and receiving from another at once (the ring pattern), the round
   trip, and the protocol overhead (wire bytes over payload bytes).
3. Runs the baselines through the same launcher, on every host at once with
   each host training alone, so that they see the same contention for the
   machine's memory bandwidth and caches as the multi-host runs: the compute
   time per step without communication (AdamW; SPARTA and DeMo with
   ``EXOGYM_COLLECTIVES=mirror``, which does all of their own work per step
   and sends nothing) and the reference, one host doing all ``N`` hosts' work.
4. For every rate and strategy, runs the profile (``chargpt-bench`` in
   ``config.ini``) through the real launcher, every rank over SSH, rank 0 in
   host 0's namespace.
5. Writes ``results.json``, ``table.md`` and ``speedup.png`` (atomically), and
   removes every namespace, link and process it created, also on SIGINT/SIGTERM.

Definitions:

- **time per step**: for each rank, the wall time (``wall_s`` of its step
  events) from step ``s0`` to step ``s1``, divided by ``s1 - s0``; averaged
  over ranks. ``s0`` is the first communication at or after ``--warmup``
  steps and ``s1`` a later one: the window holds whole communication periods
  (DiLoCo's ``H``), at least ``--periods`` of them and ``--window`` steps, and
  ranks, which run freely between communications, meet at both ends. The
  final evaluation comes after it.
- **comm share**: ``1 - t_compute / t_step``, with ``t_compute`` the same
  training with every host on its own (AdamW alone for DDP and DiLoCo; SPARTA
  and DeMo with mirrored collectives, so their local work per step is
  compute), measured just before the runs of each rate (this machine's speed
  drifts from minute to minute). It counts everything a step spends beyond
  that: transfers, waiting for the slower peer, DiLoCo's outer step.
- **wire bytes**: per host and step, the bytes the hosts' veths sent during
  the window (``ip -s link`` in each namespace), minus what went to the
  launcher (SSH output), divided by hosts and steps: payload, TCP/IP headers,
  acknowledgements, heartbeats. **formula**: the strategy's payload per host
  and step (``distributed.projection.bytes_per_step``); **wire / expected**
  divides the wire bytes by formula x (1 + the link's measured protocol overhead).
- **speedup**: the reference's time per step over the strategy's, i.e. the
  throughput of ``N`` hosts over that of one host doing the same total work at
  the same settings: each step, one host processes the ``N`` minibatches of
  ``batch_size`` samples the ``N`` hosts process, one after the other
  (``minibatch_size = batch_size``, gradient accumulation), with AdamW.
- **loss**: the validation loss of the ranks' averaged model after the last
  step, and the training loss averaged over the window's last 10 steps.
- **other load**: cores kept busy during the window by processes that are
  not this benchmark's (from ``/proc/stat`` and the ranks' CPU time). Before
  each job it waits until that falls under ``--quiet-cores``.

Latency is not emulated: this kernel has no ``netem``, so links have the
bandwidth they are given and the sub-millisecond delay of a veth.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import platform
import shutil
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from project_speedup import (  # noqa: E402
    StrategyCase,
    inputs_from_results,
    markdown_projection,
    parse_strategies,
    validation_rows,
)

from exogym.io import atomic_write_bytes, atomic_write_json, atomic_write_text  # noqa: E402
from netbed import (  # noqa: E402 - after the path set-up above
    Counters,
    Testbed,
    TestbedError,
    check_requirements,
    rate_bits,
    reap_stale_beds,
)

FORMAT = "exogym-multihost/1"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    """A job failed or gave no usable measurement; the message says which and why."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived: stop, clean up, exit."""


# --------------------------------------------------------------------------- CPU accounting


def _busy_ticks() -> int:
    """Clock ticks all cores have spent running processes since boot (``/proc/stat``).

    user + nice + system + steal: interrupt and softirq time is left out, since
    most of it here is the network stack carrying this benchmark's own traffic.
    """
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = (values + [0] * 8)[:8]
    return user + nice + system + steal


def _process_ticks(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(stat[11]) + int(stat[12])  # utime + stime, every thread of the process


@dataclass
class CpuSample:
    """Busy ticks of the machine and of this benchmark's processes at one moment."""

    busy: int
    ours: dict[int, int]
    at: float

    @classmethod
    def take(cls, bed: Testbed) -> CpuSample:
        pids = [os.getpid()] + [p for h in bed.hosts for p in bed.pids(h)]
        return cls(_busy_ticks(), {p: _process_ticks(p) for p in pids}, time.monotonic())

    def other_cores(self, later: CpuSample) -> float:
        """Cores kept busy by processes that are not ours between the two samples."""
        ours = sum(later.ours.get(p, t) - t for p, t in self.ours.items())
        ours += sum(t for p, t in later.ours.items() if p not in self.ours)
        seconds = later.at - self.at
        if seconds <= 0:
            return 0.0
        return max(0.0, (later.busy - self.busy - ours) / CLOCK_TICKS / seconds)


def wait_for_quiet(bed: Testbed, cores: float, budget: dict[str, float], say) -> float:
    """Wait (within ``budget['left']`` seconds) until others keep fewer than ``cores`` busy."""
    while True:
        first = CpuSample.take(bed)
        time.sleep(3.0)
        other = first.other_cores(CpuSample.take(bed))
        if other < cores or budget["left"] <= 0:
            if other >= cores:
                say(f"  other processes keep {other:.2f} cores busy; the waiting budget is "
                    "spent, measuring anyway (the table marks it)")
            return other
        say(f"  other processes keep {other:.2f} cores busy (load average "
            f"{os.getloadavg()[0]:.2f}); waiting for under {cores:.2f}")
        time.sleep(min(27.0, budget["left"]))
        budget["left"] -= 30.0


# --------------------------------------------------------------------------- one job


@dataclass(frozen=True)
class Window:
    """The timed steps of a job: ``(s0, s1]``, then up to ``max_steps`` (final evaluation)."""

    s0: int
    s1: int
    max_steps: int

    @classmethod
    def for_period(cls, period: int, warmup: int, window: int, periods: int) -> Window:
        """Whole periods, from the first communication at or after ``warmup`` steps.

        Ranks run freely between communications and meet at each one, so only
        windows that start and end at a communication time every rank alike.
        """
        start = math.ceil(warmup / period) * period
        length = math.ceil(max(window, periods * period) / period) * period
        return cls(start, start + length, start + length + 1)

    @property
    def steps(self) -> int:
        return self.s1 - self.s0


@dataclass
class JobResult:
    """What one launched job measured (see the module docstring for each figure)."""

    name: str
    hosts: int
    window: Window
    step_s: float
    rank_step_s: list[float]
    step_sd_s: float
    counted_bytes_per_step: float
    wire_bytes_per_step: float
    launcher_bytes_per_step: float
    train_loss: float
    val_loss: float | None
    other_cores: float
    load_before: float
    affinity: dict[int, list[int]]
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["window"] = [self.window.s0, self.window.s1, self.window.max_steps]
        out["affinity"] = {str(k): v for k, v in self.affinity.items()}
        return out


class Bench:
    """Runs jobs on a test bed and keeps what they measured."""

    def __init__(self, bed: Testbed, args: argparse.Namespace, out: Path) -> None:
        self.bed = bed
        self.args = args
        self.out = out
        self.jobs = 0
        self.budget = {"left": float(args.wait_max)}

    def say(self, text: str) -> None:
        print(text, flush=True)

    def common_overrides(self, window: Window, batch_size: int, slug: str) -> list[str]:
        return [f"batch_size={batch_size}", f"max_steps={window.max_steps}",
                f"val_interval={window.max_steps}", "num_threads=1",
                "checkpoint_interval=None",
                f"output_dir={self.bed.workdir / 'out' / slug}", *self.args.set]

    def run_job(self, name: str, hosts: int, overrides: list[str], window: Window,
                env: dict[str, str] | None = None) -> JobResult:
        """Launch ``hosts`` ranks of the profile with ``overrides`` and measure the window.

        ``env`` adds variables to every rank's environment. Retries once, after
        waiting for quiet, when other processes took more than ``--retry-cores``
        cores during the window.
        """
        for attempt in (1, 2):
            result = self._launch(name, hosts, overrides, window, env or {})
            if result.other_cores <= self.args.retry_cores or attempt == 2:
                return result
            self.say(f"  other processes took {result.other_cores:.2f} cores during the window; "
                     "measuring again")
        raise AssertionError("unreachable")

    def _launch(self, name: str, hosts: int, overrides: list[str], window: Window,
                env: dict[str, str]) -> JobResult:
        from rich.console import Console

        from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram, SSHOptions

        self.jobs += 1
        wait_for_quiet(self.bed, self.args.quiet_cores, self.budget, self.say)
        load_before = os.getloadavg()[0]
        chosen = self.bed.hosts[:hosts]
        config = {
            "master": chosen[0].address, "workers": [h.address for h in chosen[1:]],
            "ssh_user": "root", "ssh_key_path": str(self.bed.key_path),
            "python_env": sys.executable, "project_path": str(ROOT),
            "master_port": 29500 + self.jobs,
        }
        program = RankProgram.from_profile(self.args.profile, overrides=overrides, quiet=True)
        events: list[dict[str, Any]] = []
        marks: dict[int, tuple[Counters, CpuSample]] = {}
        affinity: dict[int, list[int]] = {}
        lines: deque[str] = deque(maxlen=60)

        def on_event(event: dict[str, Any]) -> None:
            events.append(event)
            if event.get("event") == "step" and event.get("rank") == 0 \
                    and event.get("step") in (window.s0, window.s1):
                marks[event["step"]] = (self.bed.counters(), CpuSample.take(self.bed))
                if event["step"] == window.s0:
                    affinity.update(self.bed.worker_affinity())

        run_dir = self.bed.workdir / "launch" / f"{self.jobs:02d}"
        console = Console(file=io.StringIO(), width=160)
        started = time.monotonic()
        self.say(f"  {name}: {hosts} host(s), steps {window.s0}..{window.s1} timed of "
                 f"{window.max_steps}")
        options = LaunchOptions(run_dir=run_dir, master_local=False, grace_period=3,
                                env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env})
        ssh = SSHOptions(known_hosts_path=self.bed.known_hosts,
                         ssh_config_path=self.bed.ssh_config, allow_agent=False,
                         look_for_keys=False)
        with Launcher(config, program, options=options, ssh=ssh, console=console,
                      on_output=lambda line: lines.append(str(line)), on_event=on_event) as job:
            result = job.run()
        self._keep_logs(run_dir, f"{self.jobs:02d}-{name.lower().replace(' ', '-')}")
        if result.interrupted:
            raise Interrupted(result.interrupted)
        if not result.ok:
            raise BenchError(f"{name}: {result.describe()}\nlauncher:\n"
                             + console.file.getvalue()[-3000:] + "\noutput:\n" + "\n".join(lines))
        if window.s0 not in marks or window.s1 not in marks:
            raise BenchError(f"{name}: rank 0 reported no step {window.s0} or {window.s1}; "
                             f"logs in {self.out / 'logs'}")
        return self._summarize(name, hosts, window, events, marks, affinity, load_before,
                               time.monotonic() - started)

    def _keep_logs(self, run_dir: Path, slug: str) -> None:
        target = self.out / "logs" / slug
        target.mkdir(parents=True, exist_ok=True)
        for log in list(run_dir.glob("rank*.log")) + list(run_dir.glob("launch.json")):
            shutil.copy2(log, target / log.name)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(self.bed.workdir / "out", ignore_errors=True)  # final models: not needed

    def _summarize(self, name: str, hosts: int, window: Window, events: list[dict[str, Any]],
                   marks: dict[int, tuple[Counters, CpuSample]], affinity: dict[int, list[int]],
                   load_before: float, wall_s: float) -> JobResult:
        steps: dict[int, dict[int, dict[str, Any]]] = {}
        for e in events:
            if e.get("event") == "step":
                steps.setdefault(int(e["rank"]), {})[int(e["step"])] = e
        if sorted(steps) != list(range(hosts)):
            raise BenchError(f"{name}: step events came from ranks {sorted(steps)}, "
                             f"expected 0..{hosts - 1}")
        rank_step_s, rank_sd_s, counted, losses = [], [], [], []
        for rank in range(hosts):
            mine = steps[rank]
            try:
                first, last = mine[window.s0], mine[window.s1]
            except KeyError as exc:
                raise BenchError(f"{name}: rank {rank} reported no step {exc}") from None
            rank_step_s.append((last["wall_s"] - first["wall_s"]) / window.steps)
            each = [mine[k]["wall_s"] - mine[k - 1]["wall_s"]
                    for k in range(window.s0 + 1, window.s1 + 1) if k in mine and k - 1 in mine]
            mean = sum(each) / len(each)
            rank_sd_s.append((sum((x - mean) ** 2 for x in each) / max(1, len(each) - 1)) ** 0.5)
            counted.append((last["comm_bytes"] - first["comm_bytes"]) / window.steps)
            losses += [mine[s]["train_loss"] for s in range(window.s1 - 9, window.s1 + 1)
                       if s in mine]
        final = steps[0].get(window.max_steps, {})
        (c0, cpu0), (c1, cpu1) = marks[window.s0], marks[window.s1]
        return JobResult(
            name=name, hosts=hosts, window=window,
            step_s=sum(rank_step_s) / hosts, rank_step_s=rank_step_s,
            step_sd_s=sum(rank_sd_s) / hosts,
            counted_bytes_per_step=sum(counted) / hosts,
            wire_bytes_per_step=c0.between_hosts(c1) / hosts / window.steps,
            launcher_bytes_per_step=c0.launcher_bytes(c1) / window.steps,
            train_loss=sum(losses) / len(losses),
            val_loss=final.get("val_global_loss", final.get("val_loss")),
            other_cores=cpu0.other_cores(cpu1),
            load_before=load_before, affinity=affinity, wall_s=wall_s)


# --------------------------------------------------------------------------- the benchmark


def model_facts(profile: str, overrides: list[str]) -> dict[str, Any]:
    """Parameter count and tensor shapes of the profile's model (built here, once)."""
    from distributed.profiles.profile import load_profile, parse_overrides

    loaded = load_profile(profile, overrides=parse_overrides(overrides))
    task_kwargs = loaded.resolved.task_kwargs
    model, _, _ = loaded.resolved.task_fn(**task_kwargs)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"profile": profile, "task": loaded.task, "task_settings": task_kwargs,
            "num_params": sum(p.numel() for p in trainable),
            "shapes": [list(p.shape) for p in trainable]}


def run_benchmark(bed: Testbed, args: argparse.Namespace, cases: list[StrategyCase],
                  out: Path) -> dict[str, Any]:
    """Measure links, then baselines and every (rate, strategy) ``--repeat`` times.

    Returns the results document: every round as measured, and the medians.
    """
    bench = Bench(bed, args, out)
    say = bench.say
    shutil.rmtree(out / "logs", ignore_errors=True)  # a previous benchmark's rank logs
    hosts = args.hosts
    model = model_facts(args.profile, list(args.set))
    say(f"model: {model['task']} with {model['num_params']:,} trainable parameters; "
        f"batch {args.batch_size} per host; {hosts} hosts"
        + (", each pinned to its own core" if bed.pin else ", NOT pinned (sharing cores)"))
    say("latency is not emulated (no netem in this kernel): links add bandwidth limits only")
    results: dict[str, Any] = {
        "format": FORMAT, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "hosts": hosts,
        "batch_size": args.batch_size, "model": model,
        "settings": {"rates": args.rates, "strategies": [c.label for c in cases],
                     "warmup": args.warmup, "window": args.window, "periods": args.periods,
                     "repeat": args.repeat, "queue": args.queue, "overrides": list(args.set),
                     "pinned": bed.pin},
        "machine": {"cores": os.cpu_count(), "kernel": platform.release(),
                    "python": platform.python_version(),
                    "load_at_start": list(os.getloadavg())},
        "links": [], "baselines": {}, "runs": [],
    }

    say("links:")
    wait_for_quiet(bed, args.quiet_cores, bench.budget, say)  # the probes need CPU too
    for rate in args.rates:
        bed.shape(rate)
        link = bed.measure_link(args.probe_seconds)
        results["links"].append({
            "rate": rate, "rate_bits": rate_bits(rate),
            "goodput_bytes_per_s": link.goodput_bytes_per_s, "rtt_s": link.rtt_s,
            "overhead": link.overhead})
        say(f"  {rate}: goodput {link.goodput_bytes_per_s * 8 / 1e6:.1f} Mbit/s per host "
            f"(both directions busy), round trip {link.rtt_s * 1e6:.0f} us, "
            f"protocol overhead {link.overhead:.1%}")

    results["rounds"] = []
    for number in range(1, args.repeat + 1):
        if args.repeat > 1:
            say(f"round {number} of {args.repeat}:")
        results["rounds"].append(run_round(bench, cases, results["links"], model))
    results["baselines"], results["runs"] = merge_rounds(results["rounds"])
    results["machine"]["load_at_end"] = list(os.getloadavg())
    return results


#: Overrides under which every host trains on its own: a DiLoCo round that never comes.
ALONE = ["strategy=diloco", "H=1000000000"]
#: Rank environment under which a strategy does its own work but sends nothing.
MIRROR = {"EXOGYM_COLLECTIVES": "mirror"}


def run_baselines(bench: Bench, cases: list[StrategyCase]) -> dict[str, Any]:
    """Figures without communication, every host at once: compute per step, and the reference.

    Every baseline runs on all hosts at once, each host training alone, and is
    averaged over the hosts: the hosts of this machine share its memory
    bandwidth and caches, so a host measured while the others idle would be
    faster than any host of the multi-host runs. AdamW's compute time (DDP's
    and DiLoCo's local work) and the reference train alone with
    :data:`ALONE`. SPARTA and DeMo run themselves with mirrored collectives
    (:data:`MIRROR`): their index selection, packing, compression and decoding
    are done every step, for ``N`` hosts, while nothing is sent and no host
    waits for another.
    """
    args, say, hosts = bench.args, bench.say, bench.args.hosts
    baselines: dict[str, Any] = {}
    say("  baselines, no communication:")
    plain = Window.for_period(1, args.warmup, args.window, 1)
    kinds: dict[str, tuple[list[str], dict[str, str]]] = {"adamw": (ALONE, {})}
    for case in cases:
        if case.compute != "adamw":
            kinds.setdefault(case.compute, (case.overrides(), MIRROR))
    for kind, (overrides, env) in kinds.items():
        job = bench.run_job(f"compute {kind}", hosts, [
            *bench.common_overrides(plain, args.batch_size, kind), *overrides], plain, env)
        baselines[kind] = job.to_dict()
        say(f"    {job.step_s:.3f} s per step (sd {job.step_sd_s:.3f} s)")
    job = bench.run_job("reference", hosts, [
        *bench.common_overrides(plain, hosts * args.batch_size, "reference"), *ALONE,
        f"minibatch_size={args.batch_size}"], plain)
    baselines["reference"] = {**job.to_dict(), "minibatches": hosts}
    say(f"    {job.step_s:.3f} s per step for {hosts} minibatches of {args.batch_size}")
    return baselines


def run_round(bench: Bench, cases: list[StrategyCase], links: list[dict[str, Any]],
              model: dict[str, Any]) -> dict[str, Any]:
    """One pass over every rate: its baselines, then every strategy on ``--hosts`` hosts.

    The baselines are measured again for every rate, just before its runs, and
    a run's speedup and comm share use them: this machine's speed drifts from
    minute to minute, and a baseline far away in time would carry that drift
    into the ratio.
    """
    from distributed.planning.projection import bytes_per_step

    args, say, hosts = bench.args, bench.say, bench.args.hosts
    blocks: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for link in links:
        rate = link["rate"]
        say(f"{rate}:")
        baselines = run_baselines(bench, cases)
        blocks.append({"rate": rate, "baselines": baselines})
        reference_s = baselines["reference"]["step_s"]
        bench.bed.shape(rate)
        say(f"  {hosts} hosts at {rate}:")
        for case in cases:
            window = Window.for_period(case.period, args.warmup, args.window, args.periods)
            job = bench.run_job(f"{case.label} @ {rate}", hosts, [
                *bench.common_overrides(window, args.batch_size, case.slug), *case.overrides()],
                window)
            compute = baselines[case.compute]
            formula = bytes_per_step(case.name, model["num_params"], hosts,
                                     **case.projection_settings(model["shapes"]))
            expected = formula * (1 + link["overhead"])
            run = {**job.to_dict(), "label": case.label, "strategy": case.name,
                   "settings": case.settings, "period": case.period, "compute": case.compute,
                   "rate": rate, "speedup": reference_s / job.step_s,
                   "comm_fraction": max(0.0, 1 - compute["step_s"] / job.step_s),
                   "compute_s": compute["step_s"], "compute_sd_s": compute["step_sd_s"],
                   "reference_s": reference_s,
                   "formula_bytes_per_step": formula,
                   "wire_ratio": job.wire_bytes_per_step / expected if expected else None}
            runs.append(run)
            say(f"    {job.step_s:.3f} s per step, speedup {run['speedup']:.2f}x, "
                f"comm {run['comm_fraction']:.0%}, wire {job.wire_bytes_per_step / 1e3:,.1f} kB "
                f"per host per step (formula {formula / 1e3:,.1f} kB), "
                f"val loss {job.val_loss if job.val_loss is None else round(job.val_loss, 3)}, "
                f"other load {job.other_cores:.2f} cores")
    return {"blocks": blocks, "runs": runs}


#: Figures that are combined over rounds by their median (the rest are taken from round 1,
#: except "other_cores", the largest).
MEDIAN_FIELDS = ("step_s", "step_sd_s", "counted_bytes_per_step", "wire_bytes_per_step",
                 "launcher_bytes_per_step", "speedup", "comm_fraction", "wire_ratio", "wall_s",
                 "compute_s", "compute_sd_s", "reference_s")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _merge(items: list[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(items[0])
    for key in MEDIAN_FIELDS:
        values = [item[key] for item in items if item.get(key) is not None]
        if values:
            merged[key] = _median(values)
    merged["other_cores"] = max(item["other_cores"] for item in items)
    merged["repeats"] = len(items)
    if "speedup" in merged:
        merged["speedup_range"] = [min(i["speedup"] for i in items),
                                   max(i["speedup"] for i in items)]
    merged["step_s_each"] = [item["step_s"] for item in items]
    return merged


def merge_rounds(rounds: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Baselines and runs over every round: medians, the speedup's range, every step time."""
    blocks = [block["baselines"] for r in rounds for block in r["blocks"]]
    baselines = {kind: _merge([b[kind] for b in blocks]) for kind in blocks[0]}
    runs = [_merge([r["runs"][i] for r in rounds]) for i in range(len(rounds[0]["runs"]))]
    return baselines, runs


# --------------------------------------------------------------------------- outputs


def _cores(affinity: dict[str, list[int]]) -> str:
    if not affinity:
        return "?"
    return " ".join(f"{rank}:{','.join(map(str, cpus))}" for rank, cpus in sorted(affinity.items()))


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown: settings, links, baselines, the table, the projection check."""
    model, machine, hosts = results["model"], results["machine"], results["hosts"]
    base = results["baselines"]
    lines = [
        f"# {hosts} hosts over shaped links: {model['task']}, {model['num_params']:,} parameters",
        "",
        f"Measured {results['created']} by `bench/multihost.py`: {hosts} network namespaces "
        f"on a bridge, each host's uplink shaped with tc tbf, ranks started over SSH by the "
        f"launcher; batch {results['batch_size']} per host; tbf queue "
        f"{results['settings'].get('queue', '50ms')}; "
        + ("each host pinned to its own core with one compute thread. "
           if results["settings"]["pinned"] else "hosts NOT pinned. ")
        + "Latency is not emulated (no netem in this kernel).",
        "",
        "Load average (1, 5, 15 min) at the start: "
        + ", ".join(f"{x:.2f}" for x in machine["load_at_start"])
        + "; at the end: " + ", ".join(f"{x:.2f}" for x in machine.get("load_at_end", [])),
        "",
        "| link | goodput per host | round trip | protocol overhead |",
        "|---|---:|---:|---:|",
    ]
    for link in results["links"]:
        lines.append(f"| {link['rate']} | {link['goodput_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s | "
                     f"{link['rtt_s'] * 1e6:.0f} us | {link['overhead']:.1%} |")
    lines += ["", "No communication, every host on its own, measured before every rate's "
              "runs (median time per step): "
              + "; ".join(f"{k} {v['step_s']:.3f} s" for k, v in base.items()
                          if k != "reference")
              + f"; reference (one host doing the work of {hosts}: {hosts} minibatches "
                f"per step) {base['reference']['step_s']:.3f} s.", ""]
    lines += [
        "| strategy | link | time/step | comm share | wire kB/host/step | formula kB | "
        "wire / expected | speedup | val loss @steps | train loss | other load | cores |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in results["runs"]:
        val = "-" if run["val_loss"] is None else f"{run['val_loss']:.3f} @{run['window'][2]}"
        ratio = "-" if run["wire_ratio"] is None else f"{run['wire_ratio']:.3f}"
        low, high = run.get("speedup_range", [run["speedup"]] * 2)
        spread = f" ({low:.2f}-{high:.2f})" if run.get("repeats", 1) > 1 else ""
        lines.append(
            f"| {run['label']} | {run['rate']} | {run['step_s']:.3f} s | "
            f"{run['comm_fraction']:.0%} | {run['wire_bytes_per_step'] / 1e3:,.1f} | "
            f"{run['formula_bytes_per_step'] / 1e3:,.1f} | {ratio} | "
            f"**{run['speedup']:.2f}x**{spread} | {val} | {run['train_loss']:.3f} | "
            f"{run['other_cores']:.2f} | {_cores(run['affinity'])} |")
    repeats = results["settings"].get("repeat", 1)
    lines += ["", "wire / expected = wire bytes / (formula x (1 + the link's protocol overhead)); "
              "other load = cores busy with other processes during the timed window; "
              "cores = rank:CPUs it may run on."
              + (f" Figures are medians of {repeats} rounds; the speedup's range follows it."
                 if repeats > 1 else ""), ""]
    lines += ["## Projection check (2 hosts)", "",
              "| strategy | link | predicted step | measured | error | predicted speedup | "
              "measured | error |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in validation_rows(results):
        lines.append(
            f"| {row['label']} | {row['rate']} | {row['predicted_step_s']:.3f} s | "
            f"{row['measured_step_s']:.3f} s | {row['step_error']:+.1%} | "
            f"{row['predicted_speedup']:.2f}x | {row['measured_speedup']:.2f}x | "
            f"{row['speedup_error']:+.1%} |")
    lines += ["", markdown_projection(inputs_from_results(results), (2, 4, 8, 16, 32, 64))]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]) -> bytes:
    """Speedup against bandwidth, one line per strategy (measured solid, projected dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    predicted = {(r["label"], r["rate"]): r["predicted_speedup"] for r in validation_rows(results)}
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    labels = list(dict.fromkeys(r["label"] for r in results["runs"]))
    for i, label in enumerate(labels):
        runs = sorted((r for r in results["runs"] if r["label"] == label),
                      key=lambda r: rate_bits(r["rate"]))
        x = [rate_bits(r["rate"]) / 1e6 for r in runs]
        color = f"C{i}"
        ax.plot(x, [r["speedup"] for r in runs], "o-", color=color, label=label)
        ax.plot(x, [predicted[(label, r["rate"])] for r in runs], ":", color=color)
    hosts = results["hosts"]
    ax.axhline(hosts, color="grey", lw=0.8, ls="--", label=f"{hosts}x: no communication cost")
    ax.axhline(1, color="grey", lw=0.8)
    ax.set_xscale("log")
    rates = sorted({rate_bits(r["rate"]) / 1e6 for r in results["runs"]})
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.minorticks_off()
    ax.set_xlabel("link rate per host (Mbit/s)")
    ax.set_ylabel(f"speedup of {hosts} hosts over one")
    ax.set_title(f"{results['model']['task']}, {results['model']['num_params'] / 1e6:.1f}M "
                 "parameters (dotted: projection)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def write_outputs(results: dict[str, Any], out: Path) -> list[Path]:
    """results.json, table.md and speedup.png in ``out``, each written atomically."""
    paths = [atomic_write_json(out / "results.json", results),
             atomic_write_text(out / "table.md", markdown(results))]
    if results["runs"]:
        paths.append(atomic_write_bytes(out / "speedup.png", plot(results)))
    return paths


# --------------------------------------------------------------------------- main


@contextlib.contextmanager
def signals_raise() -> Iterator[dict[str, bool]]:
    """SIGINT/SIGTERM raise ``Interrupted`` unless ``state['cleaning']`` (then they wait)."""
    state = {"cleaning": False}

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if state["cleaning"]:
            print(f"{name}: still removing namespaces and processes; one moment", flush=True)
            return
        raise Interrupted(name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield state
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="See the module docstring for every definition.")
    parser.add_argument("--hosts", type=int, default=2, help="hosts (default 2)")
    parser.add_argument("--rates", default="1gbit,100mbit,20mbit",
                        help="link rates, tc syntax (default 1gbit,100mbit,20mbit)")
    parser.add_argument("--strategies", default="ddp,diloco:10,diloco:100,sparta,demo",
                        help="ddp, diloco:H, sparta[:p], demo[:topk] (default: "
                             "ddp,diloco:10,diloco:100,sparta,demo)")
    parser.add_argument("--profile", default="chargpt-bench", help="profile in config.ini")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per host per step")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="profile override for every job (e.g. n_layer=2)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the timed window")
    parser.add_argument("--window", type=int, default=40, help="fewest timed steps")
    parser.add_argument("--periods", type=int, default=2,
                        help="fewest whole communication periods timed (DiLoCo rounds)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="passes over every job; the table shows medians (default 1)")
    parser.add_argument("--queue", default="100ms",
                        help="tbf queue of each link, as the time it takes to drain "
                             "(tc's latency; default 100ms: at 20mbit it holds 250 kB, more "
                             "than one DeMo burst; a burst that overflows the queue loses its "
                             "tail and TCP waits a 200 ms retransmission timeout)")
    parser.add_argument("--probe-seconds", type=float, default=3.0,
                        help="length of each link probe at its nominal rate")
    parser.add_argument("--quiet-cores", type=float, default=0.25,
                        help="before each job, wait until other processes keep fewer cores busy")
    parser.add_argument("--retry-cores", type=float, default=0.35,
                        help="measure a job again when others took more cores in its window")
    parser.add_argument("--wait-max", type=float, default=2400,
                        help="seconds in all to wait for a quiet machine (default 2400)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin hosts to cores (needed for more hosts than cores)")
    parser.add_argument("--subnet", default="10.213.77", help="the hosts' /24 (three octets)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "multihost"),
                        help="output folder (default runs/multihost)")
    parser.add_argument("--quick", action="store_true",
                        help="a small model, 100mbit, DDP and DiLoCo H=10, short windows")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rates, args.strategies = "100mbit", "ddp,diloco:10"
        args.set = ["n_layer=2", "n_embd=128", "val_size=32", *args.set]
        args.warmup, args.window, args.periods, args.probe_seconds = 5, 10, 1, 1.0
        args.wait_max, args.retry_cores = 0, math.inf
    problems = check_requirements(args.pin)
    if problems:
        print("bench/multihost.py cannot run here:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    try:
        args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
        for rate in args.rates:
            rate_bits(rate)
        cases = parse_strategies(args.strategies)
        if args.hosts < 2:
            raise ValueError(f"--hosts must be 2 or more, got {args.hosts}")
        if min(args.batch_size, args.window, args.periods, args.repeat) < 1 or args.warmup < 1:
            raise ValueError("--batch-size, --window, --periods, --repeat and --warmup must "
                             "be >= 1")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    out = Path(args.out).resolve()
    code = 0
    with signals_raise() as state:
        bed = None
        try:
            stale = reap_stale_beds()
            if stale:
                print("removed what an earlier benchmark left behind: " + ", ".join(stale),
                      flush=True)
            bed = Testbed(args.hosts, args.subnet, args.pin, queue=args.queue)
            print(f"building {args.hosts} hosts ({bed.bridge_ns}, ...)", flush=True)
            bed.build()
            results = run_benchmark(bed, args, cases, out)
            paths = write_outputs(results, out)
            print()
            print(markdown(results))
            print("wrote " + ", ".join(str(p) for p in paths))
        except Interrupted as exc:
            print(f"\ninterrupted by {exc}: stopping", file=sys.stderr, flush=True)
            code = 130
        except (BenchError, TestbedError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            code = 1
        finally:
            state["cleaning"] = True
            if bed is not None:
                bed.close()
                left = bed.leftovers()
                if left:
                    print("could not remove: " + ", ".join(left), file=sys.stderr)
                    code = code or 1
                else:
                    print(f"cleaned up: namespaces {bed.bridge_ns.rsplit('-', 1)[0]}-*, the "
                          "uplink, every sshd and rank are gone", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
