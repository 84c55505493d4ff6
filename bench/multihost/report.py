"""What ``bench.multihost`` writes: ``results.json``, ``table.md`` and ``speedup.png``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from bench.harness.tables import markdown_table
from bench.project_speedup import inputs_from_results, markdown_projection, validation_rows
from exogym.base.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from tests.netbed import rate_bits


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
        f"Measured {results['created']} by `python -m bench.multihost`: {hosts} network namespaces "
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
    ]
    lines += markdown_table(
        ("link", "goodput per host", "round trip", "protocol overhead"),
        [(link["rate"], f"{link['goodput_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s",
          f"{link['rtt_s'] * 1e6:.0f} us", f"{link['overhead']:.1%}")
         for link in results["links"]], left=("link",))
    lines += ["", "No communication, every host on its own, measured before every rate's "
              "runs (median time per step): "
              + "; ".join(f"{k} {v['step_s']:.3f} s" for k, v in base.items()
                          if k != "reference")
              + f"; reference (one host doing the work of {hosts}: {hosts} minibatches "
                f"per step) {base['reference']['step_s']:.3f} s.", ""]
    rows = []
    for run in results["runs"]:
        val = "-" if run["val_loss"] is None else f"{run['val_loss']:.3f} @{run['window'][2]}"
        ratio = "-" if run["wire_ratio"] is None else f"{run['wire_ratio']:.3f}"
        low, high = run.get("speedup_range", [run["speedup"]] * 2)
        spread = f" ({low:.2f}-{high:.2f})" if run.get("repeats", 1) > 1 else ""
        rows.append((run["label"], run["rate"], f"{run['step_s']:.3f} s",
                     f"{run['comm_fraction']:.0%}", f"{run['wire_bytes_per_step'] / 1e3:,.1f}",
                     f"{run['formula_bytes_per_step'] / 1e3:,.1f}", ratio,
                     f"**{run['speedup']:.2f}x**{spread}", val, f"{run['train_loss']:.3f}",
                     f"{run['other_cores']:.2f}", _cores(run["affinity"])))
    lines += markdown_table(
        ("strategy", "link", "time/step", "comm share", "wire kB/host/step", "formula kB",
         "wire / expected", "speedup", "val loss @steps", "train loss", "other load", "cores"),
        rows, left=("strategy", "link", "cores"))
    repeats = results["settings"].get("repeat", 1)
    lines += ["", "wire / expected = wire bytes / (formula x (1 + the link's protocol overhead)); "
              "other load = cores busy with other processes during the timed window; "
              "cores = rank:CPUs it may run on."
              + (f" Figures are medians of {repeats} rounds; the speedup's range follows it."
                 if repeats > 1 else ""), ""]
    lines += ["## Projection check (2 hosts)", ""]
    lines += markdown_table(
        ("strategy", "link", "predicted step", "measured", "error", "predicted speedup",
         "measured", "error"),
        [(row["label"], row["rate"], f"{row['predicted_step_s']:.3f} s",
          f"{row['measured_step_s']:.3f} s", f"{row['step_error']:+.1%}",
          f"{row['predicted_speedup']:.2f}x", f"{row['measured_speedup']:.2f}x",
          f"{row['speedup_error']:+.1%}") for row in validation_rows(results)],
        left=("strategy", "link"))
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
