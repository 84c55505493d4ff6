"""What each rank's monitor costs: the same simulation with and without it.

Workload: the digits DiLoCo simulation (``digits-diloco``'s strategy: H=20, outer lr
0.7, outer momentum 0.9; the 128-wide MLP, batch 32, no evaluation), K ranks
of one thread each. Runs with the monitor (a ``link`` and a ``system`` event per rank
about once a second, ``EXOGYM_MONITOR_S`` unset) and without (``EXOGYM_MONITOR_S=0``)
alternate (ABBA: neither always first); the figures are the ratios of their median
wall times and of the CPU time their rank processes used (which a busy machine moves
less than the wall time). Then the parts' own costs, the fastest of many loops: what a
collective pays to keep its progress (begin, a piece, end), what one report reads (a
link figure, a host sample with psutil), and a whole report with its two events
written as a host writes them (JSON lines): its share of a core at one a second is
the monitor's cost, whatever else the machine is doing.

    python -m bench.monitor_overhead                     # K=2, 1500 steps, 5 runs each
    python -m bench.monitor_overhead --nodes 4 --steps 3000 --repeat 7
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
import timeit

from bench.harness.tables import print_table

ENV = "EXOGYM_MONITOR_S"


def children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended (the ranks of past fits)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_fit(nodes: int, steps: int, monitor: bool) -> tuple[float, float]:
    """Wall seconds of one digits DiLoCo fit, with the ranks' monitors or without, and the
    CPU seconds its rank processes used."""
    import torch

    from exogym import Trainer
    from exogym.data.digits import DigitsMLP, digits_datasets
    from exogym.strategy import DiLoCoStrategy

    if monitor:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = "0"  # the ranks are started from here: they read it
    train, val = digits_datasets()
    torch.manual_seed(0)
    trainer = Trainer(DigitsMLP(128), train, val)
    strategy = DiLoCoStrategy(H=20, outer_lr=0.7, outer_momentum=0.9)
    started, cpu = time.perf_counter(), children_cpu_s()
    trainer.fit(strategy=strategy, num_nodes=nodes, max_steps=steps, batch_size=32,
                val_size=0, logger=None, progress=False, num_threads=1)
    return time.perf_counter() - started, children_cpu_s() - cpu


def fastest_us(call, number: int, repeat: int = 50) -> float:
    """Microseconds of one ``call()``: the fastest of ``repeat`` loops of ``number``."""
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6


def part_costs_us() -> tuple[float, float, float, float]:
    """Microseconds of a collective's progress (begin, a piece, end), of reading a link's
    figures, of sampling the host, and of a whole report written out as JSON lines."""
    from exogym.comm.in_flight import LinkProgress
    from exogym.report.metrics import encode_event
    from exogym.run.monitor import LinkMeter, RankMonitor
    from exogym.run.system_sampler import SystemSampler

    progress, meter, sampler = LinkProgress(), LinkMeter(), SystemSampler()

    def collective() -> None:
        token = progress.begin(4096)
        progress.advance(token, 4096)
        progress.end(token)

    clock = iter(range(10**9))
    collective()
    costs = (fastest_us(collective, 2000),
             fastest_us(lambda: meter.read(progress.snapshot(), float(next(clock))), 2000),
             fastest_us(sampler.sample, 20))
    with open(os.devnull, "w") as sink:
        monitor = RankMonitor(0, lambda event: sink.write(encode_event(event) + "\n"),
                              interval_s=3600.0, progress=progress, sampler=sampler)

        def report() -> None:
            collective()  # a link that moved since the last report: both events go out
            monitor.tick()

        try:
            return (*costs, fastest_us(report, 20))
        finally:
            monitor.stop(last=False)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.monitor_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs with and without the monitor each, alternating")
    args = parser.parse_args()
    if args.repeat < 1 or args.steps < 1 or args.nodes < 1:
        parser.error("--nodes, --repeat and --steps must be >= 1")

    kept = os.environ.get(ENV)
    try:
        one_fit(args.nodes, min(args.steps, 40), False)  # warm: imports, caches
        without, with_monitor = [], []
        for i in range(args.repeat):  # ABBA: neither goes first every time
            for monitor in ((False, True) if i % 2 == 0 else (True, False)):
                (with_monitor if monitor else without).append(
                    one_fit(args.nodes, args.steps, monitor))
    finally:
        if kept is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = kept
    rows = []
    for name, index in (("wall s", 0), ("ranks' CPU s", 1)):
        plain = statistics.median(run[index] for run in without)
        watched = statistics.median(run[index] for run in with_monitor)
        rows.append((name, f"{plain:.2f}", f"{watched:.2f}", f"{watched / plain:.3f}",
                     " ".join(f"{run[index]:.2f}" for run in without),
                     " ".join(f"{run[index]:.2f}" for run in with_monitor)))
    print_table(f"monitor overhead: digits DiLoCo (H=20), K={args.nodes}, batch 32, "
                f"{args.steps} steps, median of {args.repeat} alternating runs each",
                ("", "without", "with", "ratio with/without", "runs without", "runs with"),
                rows, left={""}, width=160)
    collective, link, host, report = part_costs_us()
    print(f"a collective keeps its progress in {collective:.1f} µs (begin, one piece, end); "
          f"a report reads its link in {link:.1f} µs and samples its host in {host:.0f} µs; "
          f"a whole report, its two events written out, takes {report:.0f} µs: at one a "
          f"second, {report / 1e4:.3f}% of a core per rank")


if __name__ == "__main__":
    main()
