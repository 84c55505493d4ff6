"""Hold the simulated clock against real runs on shaped links: is ``sim_time_s`` right?

Run as root from the project root::

    python -m bench.sim_validate --quick        # small model, 100mbit and 1gbit, 3 rounds
    python -m bench.sim_validate --rates 100mbit --strategies ddp,diloco:100 --repeat 5

For every rate, on the network-namespace test bed of :mod:`netbed` (2
hosts, each pinned to its own core, its uplink shaped with tc tbf):

1. The link is measured as ``bench.multihost`` measures it (payload goodput
   while both directions are busy, round trip of a 1-byte message), and the
   simulator's network is fitted to it: ``Network(bandwidth=goodput,
   latency_s=round trip / 2)``.
2. Every candidate runs for real: both hosts over SSH, the launcher, gloo over
   the shaped link; time per step over the timed window (``Bench.run_job``).
3. The same profile, settings and steps run in the simulator on this machine
   (two ranks, one compute thread each, while the bed idles) with
   ``network=`` the fitted link; simulated time per step over the same window,
   from the ranks' ``sim_time_s``.

Each rate is measured ``--repeat`` times, the real and the simulated run of a
candidate back to back; the table gives medians (and the real runs' range) and
the error of the simulated time per step against the measured one.

Writes ``results.json`` and ``table.md`` into ``--out`` (atomically).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import ROOT
from bench.harness.jobs import Bench
from bench.harness.session import add_sweep_arguments, on_bed, settle_sweep
from bench.harness.strategies import StrategyCase
from bench.harness.tables import markdown_table
from bench.harness.timing import Window, steps_by_rank
from exogym.base.io import atomic_write_json, atomic_write_text
from tests.netbed import Testbed


def simulate(bench: Bench, case: StrategyCase, window: Window, network: dict[str, Any],
             hosts: int) -> float:
    """Simulated seconds per step of ``case`` over ``window``, on this machine."""
    from distributed.profiles.profile import load_profile, parse_overrides
    from distributed.worker.run_profile import run_profile

    overrides = [*bench.common_overrides(window, bench.args.batch_size, f"sim-{case.slug}"),
                 *case.overrides(), f"num_nodes={hosts}", "logger=None",
                 f"network={network!r}"]
    plan = load_profile(bench.args.profile, overrides=parse_overrides(overrides))
    trainer = run_profile(plan, progress=False, local=True)
    return window.mean_per_step(steps_by_rank(trainer.history), "sim_time_s")


def measure_rate(bed: Testbed, bench: Bench, rate: str, cases: list[StrategyCase],
                 repeat: int, probe_seconds: float) -> dict[str, Any]:
    """One rate: the fitted link, then ``repeat`` rounds of every candidate, real then simulated."""
    bed.shape(rate)
    link = bed.measure_link(probe_seconds)
    network = {"bandwidth": link.goodput_bytes_per_s * 8.0, "latency_s": link.rtt_s / 2.0}
    bench.say(f"{rate}: link {link.goodput_bytes_per_s * 8 / 1e6:.1f} Mbit/s, round trip "
              f"{link.rtt_s * 1e6:.0f} us")
    hosts = bench.args.hosts
    rows = {case.label: {"rate": rate, "label": case.label, "real": [], "simulated": []}
            for case in cases}
    for number in range(1, repeat + 1):
        bench.say(f"{rate}: round {number} of {repeat}")
        for case in cases:
            window = Window.for_period(case.period, bench.args.warmup, bench.args.window,
                                       bench.args.periods)
            job = bench.run_job(f"{case.label} @ {rate}", hosts, [
                *bench.common_overrides(window, bench.args.batch_size, case.slug),
                *case.overrides()], window)
            simulated = simulate(bench, case, window, network, hosts)
            rows[case.label]["real"].append(job.step_s)
            rows[case.label]["simulated"].append(simulated)
            bench.say(f"    real {job.step_s * 1e3:.1f} ms per step, simulated "
                      f"{simulated * 1e3:.1f} ms ({simulated / job.step_s - 1:+.1%})")
    out = []
    for row in rows.values():
        real, sim = statistics.median(row["real"]), statistics.median(row["simulated"])
        out.append({**row, "real_step_s": real, "simulated_step_s": sim,
                    "error": sim / real - 1, "network": network})
    return {"rate": rate, "goodput_bits_per_s": link.goodput_bytes_per_s * 8,
            "rtt_s": link.rtt_s, "rows": out}


def markdown(rates: list[dict[str, Any]], tolerance: float) -> str:
    """The table the report quotes."""
    rows = [r for block in rates for r in block["rows"]]
    worst = max((abs(r["error"]) for r in rows), default=0.0)
    lines = markdown_table(
        ("link", "candidate", "simulated s/step", "measured s/step (range)", "error"),
        [(r["rate"], r["label"], f"{r['simulated_step_s'] * 1e3:.1f} ms",
          f"{r['real_step_s'] * 1e3:.1f} ms ({min(r['real']) * 1e3:.1f}-"
          f"{max(r['real']) * 1e3:.1f})", f"{r['error']:+.1%}") for r in rows],
        left=("link", "candidate"))
    lines.append("")
    for block in rates:
        lines.append(f"- {block['rate']}: fitted link {block['goodput_bits_per_s'] / 1e6:.1f} "
                     f"Mbit/s, latency {block['rtt_s'] / 2 * 1e6:.0f} us (half the round trip)")
    verdict = "every row within" if worst <= tolerance else "NOT every row within"
    lines.append(f"- largest error {worst:.1%}: {verdict} {tolerance:.0%}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_validate",
                                     description=__doc__.split("\n\n")[0])
    add_sweep_arguments(parser, rates="100mbit,1gbit", strategies="ddp,diloco:10,diloco:100,sparta",
                        repeat=3, subnet="10.213.77", quick_window=30)
    parser.add_argument("--probe-seconds", type=float, default=3.0)
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--out", default=str(ROOT / "runs" / "sim-validate"))
    parser.set_defaults(hosts=2)
    args = parser.parse_args(argv)
    cases = settle_sweep(args, parser)
    rates = args.rates
    out = Path(args.out).resolve()
    started = time.monotonic()

    def measure(bed: Testbed) -> int:
        bench = Bench(bed, args, out)
        blocks = [measure_rate(bed, bench, rate, cases, args.repeat, args.probe_seconds)
                  for rate in rates]
        table = markdown(blocks, args.tolerance)
        atomic_write_json(out / "results.json", {
            "created": time.strftime("%Y-%m-%d %H:%M:%S"), "rates": blocks,
            "settings": {"profile": args.profile, "set": args.set, "repeat": args.repeat,
                         "window": args.window, "tolerance": args.tolerance},
            "minutes": (time.monotonic() - started) / 60})
        atomic_write_text(out / "table.md", table)
        print()
        print(table)
        worst = max(abs(r["error"]) for b in blocks for r in b["rows"])
        return 0 if worst <= args.tolerance else 1

    return on_bed("python -m bench.sim_validate", measure, hosts=2, subnet=args.subnet,
                  queue=args.queue)


if __name__ == "__main__":
    sys.exit(main())
