"""Hold ``recommend`` against measured speedups on shaped links: is its pick the fastest?

Run as root from the project root::

    python bench/recommend_check.py --quick              # small model, 100mbit and 1gbit
    python bench/recommend_check.py --rates 100mbit --strategies ddp,diloco:10,diloco:100

For every rate, on the network-namespace test bed of ``bench/netbed.py`` (2
hosts, each pinned to its own core, its uplink shaped with tc tbf):

1. ``recommend`` does what it does on real hosts (``distributed.app.recommend``):
   times the profile's step here and on both hosts through the launcher, measures
   the link between the hosts with a TCP transfer, and predicts every candidate
   with the planner.
2. ``bench/multihost.py``'s own functions measure the candidates' speedup: the
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
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from multihost import (  # noqa: E402 - after the path set-up above
    Bench,
    BenchError,
    Interrupted,
    build_parser,
    merge_rounds,
    model_facts,
    run_round,
    signals_raise,
)
from project_speedup import parse_strategies  # noqa: E402

from exogym.io import atomic_write_json, atomic_write_text  # noqa: E402
from netbed import Testbed, TestbedError, check_requirements, rate_bits, reap_stale_beds  # noqa: E402


def hosts_file(bed: Testbed, port: int) -> Path:
    """A hosts file for the bed's hosts: host 0 is the master, all over SSH as root."""
    config = {"master": bed.hosts[0].address,
              "workers": [h.address for h in bed.hosts[1:]],
              "ssh_user": "root", "ssh_key_path": str(bed.key_path),
              "python_env": sys.executable, "project_path": str(ROOT), "master_port": port}
    return atomic_write_json(bed.workdir / "hosts.json", config)


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
    lines = ["| link | candidate | predicted speedup | measured speedup (range) | error | "
             "recommend's pick | measured best |", "|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        best = "yes" if r["fastest"] else ("tie" if r["measured_best"] else "")
        lines.append(f"| {r['rate']} | {r['label']} | {r['predicted_speedup']:.2f}x | "
                     f"{r['measured_speedup']:.2f}x ({r['measured_range'][0]:.2f}-"
                     f"{r['measured_range'][1]:.2f}) | {r['error']:+.1%} | "
                     f"{'pick' if r['pick'] else ''} | {best} |")
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


def bench_arguments(args: argparse.Namespace,
                    parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``bench/multihost.py``'s settings for this script's ``--profile``, ``--batch-size``,
    ``--set``, ``--quick`` (a small model, 30-step windows, no waiting for quiet) and
    ``--window``; ``--quick`` also adds its model settings to ``args.set``."""
    bench_args = build_parser().parse_args(["--profile", args.profile, "--batch-size",
                                            str(args.batch_size)])
    if args.quick:
        args.set = ["n_layer=2", "n_embd=128", "val_size=32", *args.set]
        bench_args.warmup, bench_args.window, bench_args.periods = 5, 30, 1
        bench_args.wait_max, bench_args.retry_cores = 0, math.inf
    if args.window is not None:
        if args.window < 1:
            parser.error(f"--window must be at least 1, got {args.window}")
        bench_args.window = args.window
    bench_args.set = list(args.set)
    return bench_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100mbit,1gbit", help="link rates (tc syntax)")
    parser.add_argument("--strategies", default="ddp,diloco:10,diloco:100,sparta",
                        help="candidates to measure (multihost.py's syntax)")
    parser.add_argument("--profile", default="chargpt-bench")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--recommend-steps", type=int, default=10,
                        help="steps recommend times on every host")
    parser.add_argument("--link-seconds", type=float, default=2.0)
    parser.add_argument("--tie", type=float, default=0.03,
                        help="measured speedups this close to the best count as the best")
    parser.add_argument("--quick", action="store_true",
                        help="a small model (n_layer=2, n_embd=128) and 30-step windows")
    parser.add_argument("--window", type=int, default=None,
                        help="fewest timed steps per job (longer: less noise; --quick: 30)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds per rate (baselines, then every candidate); medians are "
                             "reported")
    parser.add_argument("--out", default=str(ROOT / "runs" / "recommend-check"))
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    bench_args = bench_arguments(args, parser)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for rate in rates:
        rate_bits(rate)
    cases = parse_strategies(args.strategies)
    out = Path(args.out).resolve()

    def measure(bed: Testbed) -> int:
        bench = Bench(bed, bench_args, out)
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
                                               "repeat": args.repeat,
                                               "window": bench_args.window}})
        atomic_write_text(out / "table.md", table)
        print()
        print(table)
        return 0

    return on_bed("bench/recommend_check.py", bench_args, measure)


def on_bed(script: str, bench_args: argparse.Namespace,
           body: Callable[[Testbed], int]) -> int:
    """Run ``body`` on a fresh 2-host test bed (pinned hosts, shaped links) and tear it down.

    Returns ``body``'s exit code; 2 when this machine cannot host the bed, 130
    on Ctrl-C or SIGTERM, 1 on a bench or bed error (printed).
    """
    problems = check_requirements(True)
    if problems:
        print(f"{script} cannot run here:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    code = 0
    with signals_raise() as state:
        bed = None
        try:
            reap_stale_beds()
            bed = Testbed(2, bench_args.subnet, True, queue=bench_args.queue)
            bed.build()
            code = body(bed)
        except Interrupted as exc:
            print(f"\ninterrupted by {exc}", file=sys.stderr)
            code = 130
        except (BenchError, TestbedError, ValueError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            code = 1
        finally:
            state["cleaning"] = True
            if bed is not None:
                bed.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
