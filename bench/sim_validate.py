"""Hold the simulated clock against real runs on shaped links: is ``sim_time_s`` right?

Run as root from the project root::

    python bench/sim_validate.py --quick        # small model, 100mbit and 1gbit, 3 rounds
    python bench/sim_validate.py --rates 100mbit --strategies ddp,diloco:100 --repeat 5

For every rate, on the network-namespace test bed of ``bench/netbed.py`` (2
hosts, each pinned to its own core, its uplink shaped with tc tbf):

1. The link is measured as ``bench/multihost.py`` measures it (payload goodput
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

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from multihost import Bench, Window  # noqa: E402
from netbed import Testbed, rate_bits  # noqa: E402
from project_speedup import StrategyCase, parse_strategies  # noqa: E402
from recommend_check import bench_arguments, on_bed  # noqa: E402

from exogym.io import atomic_write_json, atomic_write_text  # noqa: E402


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
    clock = {(r["rank"], r["step"]): r["sim_time_s"] for r in trainer.history}
    per_rank = [(clock[(rank, window.s1)] - clock[(rank, window.s0)]) / window.steps
                for rank in range(hosts)]
    return sum(per_rank) / hosts


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
    lines = ["| link | candidate | simulated s/step | measured s/step (range) | error |",
             "|---|---|---:|---:|---:|"]
    worst = 0.0
    for block in rates:
        for r in block["rows"]:
            worst = max(worst, abs(r["error"]))
            lines.append(f"| {r['rate']} | {r['label']} | {r['simulated_step_s'] * 1e3:.1f} ms | "
                         f"{r['real_step_s'] * 1e3:.1f} ms ({min(r['real']) * 1e3:.1f}-"
                         f"{max(r['real']) * 1e3:.1f}) | {r['error']:+.1%} |")
    lines.append("")
    for block in rates:
        lines.append(f"- {block['rate']}: fitted link {block['goodput_bits_per_s'] / 1e6:.1f} "
                     f"Mbit/s, latency {block['rtt_s'] / 2 * 1e6:.0f} us (half the round trip)")
    verdict = "every row within" if worst <= tolerance else "NOT every row within"
    lines.append(f"- largest error {worst:.1%}: {verdict} {tolerance:.0%}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100mbit,1gbit", help="link rates (tc syntax)")
    parser.add_argument("--strategies", default="ddp,diloco:10,diloco:100,sparta",
                        help="candidates (multihost.py's syntax)")
    parser.add_argument("--profile", default="chargpt-bench")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--quick", action="store_true",
                        help="a small model (n_layer=2, n_embd=128) and 30-step windows")
    parser.add_argument("--window", type=int, default=None, help="fewest timed steps per job")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per rate (medians)")
    parser.add_argument("--probe-seconds", type=float, default=3.0)
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--out", default=str(ROOT / "runs" / "sim-validate"))
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    bench_args = bench_arguments(args, parser)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for rate in rates:
        rate_bits(rate)
    cases = parse_strategies(args.strategies)
    out = Path(args.out).resolve()
    started = time.monotonic()

    def measure(bed: Testbed) -> int:
        bench = Bench(bed, bench_args, out)
        blocks = [measure_rate(bed, bench, rate, cases, args.repeat, args.probe_seconds)
                  for rate in rates]
        table = markdown(blocks, args.tolerance)
        atomic_write_json(out / "results.json", {
            "created": time.strftime("%Y-%m-%d %H:%M:%S"), "rates": blocks,
            "settings": {"profile": args.profile, "set": args.set, "repeat": args.repeat,
                         "window": bench_args.window, "tolerance": args.tolerance},
            "minutes": (time.monotonic() - started) / 60})
        atomic_write_text(out / "table.md", table)
        print()
        print(table)
        worst = max(abs(r["error"]) for b in blocks for r in b["rows"])
        return 0 if worst <= args.tolerance else 1

    return on_bed("bench/sim_validate.py", bench_args, measure)


if __name__ == "__main__":
    sys.exit(main())
