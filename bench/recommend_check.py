"""Hold ``recommend`` against measured speedups on shaped links: is its pick the fastest?

Run as root from the project root::

    python -m bench.recommend_check --quick              # small model, 100mbit and 1gbit
    python -m bench.recommend_check --rates 100mbit --strategies ddp,diloco:10,diloco:100

For every rate, on the network-namespace test bed of :mod:`netbed` (2
hosts, each pinned to its own core, its uplink shaped with tc tbf):

1. ``recommend`` does what it does on real hosts (``distributed.app.recommend``):
   times the profile's step here and on both hosts through the launcher, measures
   the link between the hosts with a TCP transfer, and predicts every candidate
   with the planner.
2. ``bench.multihost``'s own functions measure the candidates' speedup: the
   baselines (every host alone; one host doing both hosts' work), then each
   strategy on both hosts over SSH, time per step from the ranks' step events.
3. It prints, per rate and candidate, the predicted and the measured speedup, the
   error, and whether recommend's pick (among the candidates measured) is the one
   of highest measured throughput. Candidates measured within ``--tie`` of the
   best count as equally fast: this machine's noise is larger than that.

A job's step time varies by 10-20% from one launch to the next here (two hosts
share two cores with the launcher and the kernel's bridge), so each rate is
measured ``--repeat`` times, each round timing its baselines right before its
candidates; a candidate's measured speedup is the median of its rounds' speedups,
each against its own round's reference, and the table shows their range.

Writes ``results.json`` and ``table.md`` into ``--out`` (atomically).
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import ROOT
from bench.harness.jobs import Bench
from bench.harness.session import add_sweep_arguments, on_bed, settle_sweep
from bench.harness.tables import markdown_table
from bench.multihost.rounds import merge_rounds, model_facts, run_round
from exogym.base.io import atomic_write_json, atomic_write_text
from tests.netbed import Testbed


def hosts_file(bed: Testbed, port: int) -> Path:
    """A hosts file for the bed's hosts: host 0 is the master, all over SSH as root."""
    return atomic_write_json(bed.workdir / "hosts.json", bed.hosts_config(port))


def run_recommend(bed: Testbed, args: argparse.Namespace, port: int) -> dict[str, Any]:
    """``recommend`` on the bed's hosts at the current rate; its JSON object."""
    from rich.console import Console

    from distributed.app.recommend import recommend
    from distributed.app.run import TrainRequest, parse_overrides

    request = TrainRequest(
        profile=args.profile, overrides=parse_overrides([f"batch_size={args.batch_size}",
                                                         "num_threads=1", *args.set]),
        hosts=hosts_file(bed, port), known_hosts=str(bed.known_hosts),
        ssh_config=str(bed.ssh_config),
        launcher_options={"master_local": False, "allow_agent": False, "look_for_keys": False,
                          "env": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    console = Console(file=io.StringIO(), width=160)
    rec = recommend(request, console, steps=args.recommend_steps, link_seconds=args.link_seconds)
    return rec.to_dict()


def compare(rate: str, answer: dict[str, Any], runs: list[dict[str, Any]],
            tie: float) -> list[dict[str, Any]]:
    """Per measured candidate: predicted and measured speedup, error, pick and measured best."""
    from distributed.app.recommend import Candidate, pick

    predicted = {c["label"]: c for c in answer["candidates"]}
    measured = {r["label"]: r for r in runs if r["rate"] == rate}
    both = [label for label in measured if label in predicted]
    fields = Candidate.__dataclass_fields__
    chosen = pick([Candidate(**{k: v for k, v in predicted[label].items() if k in fields})
                   for label in both]).label
    best = max(measured[label]["speedup"] for label in both)
    rows = []
    for label in both:
        p, m = predicted[label]["speedup"], measured[label]["speedup"]
        rows.append({"rate": rate, "label": label, "predicted_speedup": p,
                     "measured_speedup": m, "error": p / m - 1, "pick": label == chosen,
                     "measured_range": measured[label].get("speedup_range", [m, m]),
                     "measured_best": m >= best * (1 - tie), "fastest": m == best})
    return rows


def markdown(rows: list[dict[str, Any]], answers: dict[str, dict[str, Any]], tie: float) -> str:
    """The table the report quotes."""
    lines = markdown_table(
        ("link", "candidate", "predicted speedup", "measured speedup (range)", "error",
         "recommend's pick", "measured best"),
        [(r["rate"], r["label"], f"{r['predicted_speedup']:.2f}x",
          f"{r['measured_speedup']:.2f}x ({r['measured_range'][0]:.2f}-"
          f"{r['measured_range'][1]:.2f})", f"{r['error']:+.1%}", "pick" if r["pick"] else "",
          "yes" if r["fastest"] else ("tie" if r["measured_best"] else ""))
         for r in rows], left=("link", "candidate", "recommend's pick", "measured best"))
    lines.append("")
    for rate, answer in answers.items():
        m = answer["measurements"]
        picked = [r for r in rows if r["rate"] == rate and r["pick"]]
        ok = bool(picked) and picked[0]["measured_best"]
        lines.append(f"- {rate}: link measured {m['mbit_per_s']:.1f} Mbit/s; hosts' step "
                     + ", ".join(f"{t['step_s'] * 1000:.0f} ms" for t in m["host_steps"])
                     + f"; recommend says: {answer['reason']}. Pick among those measured "
                     f"{'IS' if ok else 'is NOT'} the measured best (ties within {tie:.0%}).")
    worst = max((abs(r["error"]) for r in rows), default=0.0)
    lines.append(f"- largest speedup error: {worst:.1%}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recommend_check",
                                     description=__doc__.split("\n\n")[0])
    add_sweep_arguments(parser, rates="100mbit,1gbit", strategies="ddp,diloco:10,diloco:100,sparta",
                        repeat=3, subnet="10.213.77", quick_window=30)
    parser.add_argument("--recommend-steps", type=int, default=10,
                        help="steps recommend times on every host")
    parser.add_argument("--link-seconds", type=float, default=2.0)
    parser.add_argument("--tie", type=float, default=0.03,
                        help="measured speedups this close to the best count as the best")
    parser.add_argument("--out", default=str(ROOT / "runs" / "recommend-check"))
    parser.set_defaults(hosts=2)
    args = parser.parse_args(argv)
    cases = settle_sweep(args, parser)
    rates = args.rates
    out = Path(args.out).resolve()

    def measure(bed: Testbed) -> int:
        bench = Bench(bed, args, out)
        model = model_facts(args.profile, list(args.set))
        answers: dict[str, dict[str, Any]] = {}
        rows: list[dict[str, Any]] = []
        for number, rate in enumerate(rates):
            bed.shape(rate)
            print(f"{rate}: recommend", flush=True)
            answers[rate] = run_recommend(bed, args, 29400 + number)
            print(f"  {answers[rate]['reason']}", flush=True)
            rounds = []
            for round_number in range(1, args.repeat + 1):
                print(f"{rate}: round {round_number} of {args.repeat}", flush=True)
                rounds.append(run_round(bench, cases, [{"rate": rate, "overhead": 0.0}],
                                        model))
            _, measured = merge_rounds(rounds)
            rows += compare(rate, answers[rate], measured, args.tie)
        table = markdown(rows, answers, args.tie)
        atomic_write_json(out / "results.json", {
            "created": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows,
            "recommend": answers, "settings": {"profile": args.profile, "set": args.set,
                                               "rates": rates, "tie": args.tie,
                                               "repeat": args.repeat, "window": args.window}})
        atomic_write_text(out / "table.md", table)
        print()
        print(table)
        return 0

    return on_bed("python -m bench.recommend_check", measure, hosts=2, subnet=args.subnet,
                  queue=args.queue)


if __name__ == "__main__":
    sys.exit(main())
