"""The results file, the sweep's choice, each strategy's row and the Pareto front.

``results.json`` keeps every finished run under its key (written again, atomically,
after each one) and, recomputed each time, the rows of the table. The choice of a
strategy's setting (the **budget rule**): among its sweep values at the first
seed, those whose bytes are at most ``budget`` times DDP's; of these, the one
with the lowest final validation loss; when none is within the budget, the one
that sends the fewest bytes.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from bench.strategy_table.grid import (
    BY_NAME,
    FAST_NETWORK,
    NETWORK,
    RATES,
    Entry,
    Scale,
    describe,
    run_key,
    settings_of,
)
from exogym.base.io import atomic_write_json

VERSION = 1


class ResultsError(ValueError):
    """A results file that cannot be resumed or reported: the message says why."""


def load(path: Path, scale: Scale, budget: float | None) -> dict[str, Any]:
    """The results in ``path`` (empty when it does not exist); refuses another scale's."""
    if not path.exists():
        return {"version": VERSION, "scale": scale.to_dict(), "budget": budget, "runs": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ResultsError(f"{path} cannot be read as results ({exc})") from exc
    if data.get("version") != VERSION or not isinstance(data.get("runs"), dict):
        raise ResultsError(f"{path} is not a results file of version {VERSION}")
    if data.get("scale") != scale.to_dict():
        raise ResultsError(f"{path} holds runs of another scale or other settings "
                           f"({data.get('scale', {}).get('name')}, steps "
                           f"{data.get('scale', {}).get('steps')}); give another --out, or "
                           "the same --quick/--steps/--seeds as the run that wrote it")
    if budget is not None:
        data["budget"] = budget
    return data


def save(path: Path, data: dict[str, Any]) -> None:
    atomic_write_json(path, data)


def pareto(points: list[tuple[float, float]]) -> list[bool]:
    """Which ``(bytes, loss)`` points are on the front: no other point has fewer or as
    many bytes and as low or a lower loss, one of them strictly."""
    front = []
    for i, (b, loss) in enumerate(points):
        dominated = any(bo <= b and lo <= loss and (bo < b or lo < loss)
                        for j, (bo, lo) in enumerate(points) if j != i)
        front.append(not dominated)
    return front


def _ok(runs: dict[str, Any], key: str) -> dict[str, Any] | None:
    run = runs.get(key)
    return run if run is not None and run.get("status") == "ok" else None


def choose(data: dict[str, Any], scale: Scale, entry: Entry) -> dict[str, Any]:
    """The sweep of one strategy and its chosen value by the budget rule.

    Returns ``{"points": [...], "chosen": value or None, "done": bool}``; ``done`` once
    every sweep run and DDP's first seed have finished (well or not).
    """
    runs, seed = data["runs"], scale.seeds[0]
    ddp = _ok(runs, run_key(BY_NAME["ddp"], None, seed, NETWORK))
    points, finished = [], ddp is not None or run_key(BY_NAME["ddp"], None, seed, NETWORK) in runs
    for value in scale.sweeps[entry.name]:
        key = run_key(entry, value, seed, NETWORK)
        finished = finished and key in runs
        run = _ok(runs, key)
        if run is not None and ddp is not None:
            ratio = run["bytes"] / ddp["bytes"]
            points.append({"value": value, "val_loss": run["val_loss"], "bytes_ratio": ratio,
                           "within_budget": ratio <= data["budget"]})
    chosen = None
    if points:
        inside = [p for p in points if p["within_budget"]]
        best = (min(inside, key=lambda p: p["val_loss"]) if inside
                else min(points, key=lambda p: p["bytes_ratio"]))
        chosen = best["value"]
        for p in points:
            p["chosen"] = p is best
    return {"points": points, "chosen": chosen, "done": finished}


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def fast_time(run: dict[str, Any]) -> float:
    """The run's time on the fast network, derived from its clock: the network's share
    scales with 1/bandwidth, the rest does not (see :mod:`bench.strategy_table.child`)."""
    return run["sim_s"] - run["network_s"] * (1.0 - RATES[NETWORK] / RATES[FAST_NETWORK])


def row(data: dict[str, Any], scale: Scale, entry: Entry, value: Any,
        unavailable: str | None) -> dict[str, Any]:
    """One strategy's row from its finished runs at ``value`` (figures None until a run ends)."""
    out: dict[str, Any] = {"strategy": entry.name, "label": entry.label,
                           "setting": describe(entry, value), "value": value,
                           "settings": settings_of(scale, entry, value), "seeds": []}
    if unavailable:
        return {**out, "status": "not available in this checkout", "reason": unavailable}
    runs = data["runs"]
    done = [(s, r) for s in scale.seeds if (r := _ok(runs, run_key(entry, value, s, NETWORK)))]
    failed = [runs[k]["error"] for s in scale.seeds
              if (k := run_key(entry, value, s, NETWORK)) in runs and not _ok(runs, k)]
    if not done:
        return {**out, "status": f"failed: {failed[0]}" if failed else "not run yet"}
    overlaps = entry.overlaps(out["settings"])
    fast = ([r["sim_s"] for s, _ in done
             if (r := _ok(runs, run_key(entry, value, s, FAST_NETWORK)))] if overlaps
            else [fast_time(r) for _, r in done])
    rs = [r for _, r in done]
    stated = [r["stated_bytes"] for r in rs if r.get("stated_bytes") is not None]
    out.update(
        seeds=[s for s, _ in done],
        status="done" if len(done) == len(scale.seeds) else f"{len(done)} of "
        f"{len(scale.seeds)} seeds" + (f" ({failed[0]})" if failed else ""),
        val_loss=_spread([r["val_loss"] for r in rs]),
        bytes=statistics.fmean(r["bytes"] for r in rs),
        stated_bytes=statistics.fmean(stated) if stated else None,
        wall_s=statistics.fmean(r["wall_s"] for r in rs),
        sim_s={NETWORK: statistics.fmean(r["sim_s"] for r in rs),
               FAST_NETWORK: statistics.fmean(fast) if fast else None},
        fast_source="simulated" if overlaps else "derived",
        num_params=rs[0]["num_params"])
    return out


def rows(data: dict[str, Any], scale: Scale, entries: list[Entry],
         unavailable: dict[str, str]) -> list[dict[str, Any]]:
    """Every entry's row, with ratios to DDP and the Pareto front among the finished rows."""
    table, sweeps = [], {}
    for entry in entries:
        if entry.knob is None or entry.name in unavailable:
            value = None
        else:
            sweeps[entry.name] = choose(data, scale, entry)
            value = sweeps[entry.name]["chosen"]
            if value is None:
                table.append(row(data, scale, entry, None, None) | {
                    "setting": "", "status": "sweep not finished" if not
                    sweeps[entry.name]["done"] else "every sweep run failed"})
                continue
        table.append(row(data, scale, entry, value, unavailable.get(entry.name)))
    ddp = next((r for r in table if r["strategy"] == "ddp" and "val_loss" in r), None)
    measured = [r for r in table if "val_loss" in r]
    for r in measured:
        if ddp is not None:
            r["bytes_ratio"] = r["bytes"] / ddp["bytes"]
            r["loss_ratio"] = r["val_loss"]["mean"] / ddp["val_loss"]["mean"]
            if r["stated_bytes"] is not None and ddp["stated_bytes"]:
                r["stated_bytes_ratio"] = r["stated_bytes"] / ddp["stated_bytes"]
    if ddp is not None:
        flags = pareto([(r["bytes_ratio"], r["val_loss"]["mean"]) for r in measured])
        for r, flag in zip(measured, flags, strict=True):
            r["pareto"] = flag
    data["sweeps"] = sweeps
    return table


def fmt_ratio(x: float | None) -> str:
    """``0.0417`` as ``4.17%`` (``1/24.0``), small ones with their reduction factor."""
    if x is None or not math.isfinite(x):
        return "-"
    if x >= 0.999:
        return f"{x:.3g}"
    return f"{x:.3g} (1/{1 / x:.0f})" if x > 0 else "0"


def table_cells(r: dict[str, Any]) -> list[str]:
    """The printed cells of one row."""
    if "val_loss" not in r:
        return [r["label"], r.get("setting", ""), r["status"]] + ["-"] * 7
    loss = r["val_loss"]
    fast = r["sim_s"][FAST_NETWORK]
    return [r["label"], r["setting"] or "-", f"{len(r['seeds'])}",
            fmt_ratio(r.get("bytes_ratio")),
            f"{loss['mean']:.4f} ± {loss['std']:.4f} ({loss['min']:.4f}-{loss['max']:.4f})",
            f"{r['loss_ratio']:.3f}" if "loss_ratio" in r else "-",
            f"{r['wall_s']:.3g}", f"{r['sim_s'][NETWORK]:.4g}",
            "-" if fast is None else f"{fast:.4g}" + ("" if r["fast_source"] == "derived"
                                                      else " (sim)"),
            "yes" if r.get("pareto") else ""]


COLUMNS = ["strategy", "setting", "seeds", "bytes vs DDP", "val loss mean ± std (min-max)",
           "loss / DDP", "wall s", "sim s 100 Mbit/s", "sim s 1 Gbit/s", "Pareto"]
