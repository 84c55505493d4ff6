"""What ``bench.balance_hosts`` prints at the end: one row per strategy and run, medians over
passes, and a sentence per balanced run against its unbalanced twin."""

from __future__ import annotations

import argparse
from typing import Any

from bench.balance_hosts.runs import SLOW, Case, fmt, joined
from bench.harness.tables import print_table
from bench.harness.timing import median_of

#: Figures given as medians over passes.
MEDIANS = ("throughput", "seconds_window", "samples_window", "speedup", "speedup_end_to_end",
           "eval_s", "final_val", "train_s", "wall_s", "loss_at_t1", "time_to_l1",
           "speedup_to_l1", "fast_step_s", "throttled_s", "launcher_cores", "other_cores")


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per strategy and run: medians over passes, the speedup's range."""
    rows = []
    for strategy, items in runs.items():
        for balance in dict.fromkeys(r["balance"] for r in items):
            mine = [r for r in items if r["balance"] == balance]
            row = {"strategy": strategy, "balance": balance, "passes": len(mine),
                   "shares": mine[-1]["shares"], "speeds": mine[-1]["speeds"],
                   "cgroups": mine[-1]["cgroups"],
                   "speedup_range": [min(r["speedup"] for r in mine),
                                     max(r["speedup"] for r in mine)]}
            row.update({key: median_of(mine, key) for key in MEDIANS})
            rows.append(row)
    return rows


def print_summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The rows as a rich table, then one plain sentence per balanced run."""
    body = []
    for row in rows:
        low, high = row["speedup_range"]
        spread = f" ({low:.2f}-{high:.2f})" if row["passes"] > 1 else ""
        slow = row["cgroups"].get(str(SLOW), {}).get("cpu", "not seen")
        body.append((
            f"DiLoCo H={args.H}" if row["strategy"] == "diloco" else "DDP",
            Case(row["strategy"], row["balance"]).label,
            f"{row['throughput']:.1f}", f"{row['speedup']:.2f}x{spread}",
            f"{row['speedup_end_to_end']:.2f}x", fmt(row["eval_s"], ".2f"),
            fmt(row["final_val"], ".3f"), f"{row['train_s']:.1f}",
            fmt(row["loss_at_t1"], ".3f"), fmt(row["time_to_l1"], ".1f", " s"),
            fmt(row["speedup_to_l1"], ".2f", "x"), joined(row["shares"]),
            joined(row["speeds"], ".2f"), fmt(row["fast_step_s"], ".3f"),
            slow if row["balance"] != "alone" else "-"))
    print_table(f"balance on 2 hosts, host 1 held to {args.slow:.0%} of its core (cgroup "
                f"cpu quota), links {args.rate}, medians of {args.repeat} pass(es)",
                ("strategy", "run", "samples/s", "speedup (range)", "end to end", "eval s",
                 "val loss", "train s", "loss @ T1", "time to L1", "speedup to L1", "shares",
                 "speeds", "rank 0 step", "slow rank's cpu group"), body,
                left=("strategy", "run", "slow rank's cpu group"), width=220)
    print("samples/s: all ranks' training samples per second in the timed window, "
          "evaluations left out; speedup: over the fast host alone's samples/s (ideal 1.5x); "
          "end to end: all samples over all of rank 0's loop time, the same ratio; eval s: "
          "what one evaluation took; train s: rank 0's loop time to the end, evaluations "
          "left out; T1, L1: the fast host alone's train s and final val loss (averaged "
          "model); loss @ T1: a run's val loss at T1 of training; time to L1: the training "
          "time a run takes to reach L1; speedup to L1: T1 over it; shares: inner steps per "
          "round (DiLoCo) or samples per step (DDP) of ranks 0/1 at the end; speeds: as the "
          "ranks measured them; rank 0 step: the fast rank's median step inside a round "
          "(DiLoCo: no communication), against the fast host alone's it shows what sharing "
          "this machine with a busy second host costs.")
    targets = {"steps": 1.4, "batch": 1.3}
    for row in rows:
        if row["balance"] not in targets:
            continue
        none = next(r for r in rows if r["strategy"] == row["strategy"]
                    and r["balance"] == "none")
        alone = next(r for r in rows if r["strategy"] == row["strategy"]
                     and r["balance"] == "alone")
        mode = row["balance"]
        print(f"{row['strategy']}: balance={mode} {row['speedup']:.2f}x the fast host "
              f"alone's samples per second (target {targets[mode]}x, ideal 1.5x; end to end "
              f"{row['speedup_end_to_end']:.2f}x), balance=none {none['speedup']:.2f}x; val "
              f"loss at T1 = {alone['train_s']:.1f} s of training: alone "
              f"{fmt(alone['final_val'], '.3f')}, none {fmt(none['loss_at_t1'], '.3f')}, "
              f"{mode} {fmt(row['loss_at_t1'], '.3f')}; time to reach L1: none "
              f"{fmt(none['time_to_l1'], '.1f', ' s')}, {mode} "
              f"{fmt(row['time_to_l1'], '.1f', ' s')} (alone's time over it "
              f"{fmt(row['speedup_to_l1'], '.2f', 'x')}, none's over it "
              f"{fmt(_ratio(none['time_to_l1'], row['time_to_l1']), '.2f', 'x')})")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
