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


def _held(settings: dict[str, Any]) -> str:
    share = settings.get("share")
    pinned = settings["pinned"]
    if share is None:  # results written before hosts were held to a share
        return ("each host pinned to its own core with one compute thread. " if pinned
                else "hosts NOT pinned. ")
    return (f"each host held to {share:g} of a core by a cgroup cpu quota (its sshd and every "
            "rank it starts), one compute thread" + (", pinned to its own core. " if pinned
                                                    else ". "))


def _f(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def target_line(results: dict[str, Any]) -> str:
    """Which loss the runs were timed to, and where it came from."""
    target = results.get("target") or {}
    if target.get("loss") is None:
        return "No target loss: the reference reported no validation loss."
    where = ("given with --target-loss" if target.get("given") else
             f"the reference's validation loss at step {target.get('step')}, the end of its "
             "window")
    return (f"Time to target: seconds of training (evaluations left out) until the validation "
            f"loss of the ranks' averaged model first reaches {target['loss']:.4f} ({where}), "
            "linear between evaluations; predicted = the steps the run took to it x the "
            "predicted time per step, and for the reference its steps x hosts x its time per "
            "minibatch.")


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
        + _held(results["settings"])
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
              "runs (median time per step, quota used, other load): "
              + "; ".join(f"{k} {v['step_s']:.3f} s ({_f(v.get('share_used'), '.0%')}, "
                          f"{v['other_cores']:.2f} cores)" for k, v in base.items()
                          if k != "reference")
              + f"; reference (one host doing the work of {hosts}: {hosts} minibatches "
                f"per step) {base['reference']['step_s']:.3f} s "
                f"({_f(base['reference'].get('share_used'), '.0%')}, "
                f"{base['reference']['other_cores']:.2f} cores).", ""]
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
                     _f(run.get("share_used"), ".0%"), f"{run['other_cores']:.2f}",
                     _cores(run["affinity"])))
    lines += markdown_table(
        ("strategy", "link", "time/step", "comm share", "wire kB/host/step", "formula kB",
         "wire / expected", "speedup", "val loss @steps", "train loss", "quota used",
         "other load", "cores"),
        rows, left=("strategy", "link", "cores"))
    repeats = results["settings"].get("repeat", 1)
    lines += ["", "wire / expected = wire bytes / (formula x (1 + the link's protocol overhead)); "
              "quota used = the cores the hosts' processes kept busy in the window over their "
              "quotas (hosts x share); "
              "other load = cores busy with other processes during the timed window; "
              "cores = rank:CPUs it may run on."
              + (f" Figures are medians of {repeats} rounds; the speedup's range follows it."
                 if repeats > 1 else ""), ""]
    lines += [f"## Projection check ({hosts} hosts)", ""]
    lines += markdown_table(
        ("strategy", "link", "predicted step", "measured", "error", "predicted speedup",
         "measured", "error", "time to target", "predicted", "speedup to target", "predicted",
         "other load"),
        [(row["label"], row["rate"], f"{row['predicted_step_s']:.3f} s",
          f"{row['measured_step_s']:.3f} s", f"{row['step_error']:+.1%}",
          f"{row['predicted_speedup']:.2f}x", f"{row['measured_speedup']:.2f}x",
          f"{row['speedup_error']:+.1%}", _f(run.get("time_to_target_s"), ".1f", " s"),
          _f(loss["time_s"], ".1f", " s"), _f(run.get("loss_speedup"), ".2f", "x"),
          _f(loss["speedup"], ".2f", "x"), f"{run['other_cores']:.2f}")
         for row, run in zip(validation_rows(results), results["runs"])
         for loss in [predicted_to_target(row, run, results["hosts"])]],
        left=("strategy", "link"))
    lines += ["", target_line(results), ""]
    lines += ["", markdown_projection(inputs_from_results(results), (2, 4, 8, 16, 32, 64))]
    return "\n".join(lines) + "\n"


def predicted_to_target(row: dict[str, Any], run: dict[str, Any],
                        hosts: int) -> dict[str, float | None]:
    """The projection's time to the target for ``run`` (its steps to the target x the
    predicted step) and the speedup to it (over the reference's steps x hosts x its time
    per minibatch); None where the run or the reference did not reach the target."""
    steps, ref_steps = run.get("steps_to_target"), run.get("reference_steps_to_target")
    if steps is None:
        return {"time_s": None, "speedup": None}
    time_s = steps * row["predicted_step_s"]
    if ref_steps is None or time_s <= 0:
        return {"time_s": time_s, "speedup": None}
    return {"time_s": time_s, "speedup": ref_steps * run["reference_s"] / time_s}


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
