"""The picture: final validation loss against bytes sent, the Pareto front marked."""

from __future__ import annotations

import io
from typing import Any


def plot(table: list[dict[str, Any]], sweeps: dict[str, Any], title: str) -> bytes:
    """PNG bytes: one point per strategy (the mean over seeds, bars from the lowest to the
    highest seed), its sweep's other values as faint points, the front as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in table if "bytes_ratio" in r]
    fig, ax = plt.subplots(figsize=(10, 5), dpi=120)
    for i, r in enumerate(measured):
        color = f"C{i % 10}"
        loss = r["val_loss"]
        x = max(r["bytes_ratio"], 1e-9)
        ax.errorbar([x], [loss["mean"]],
                    yerr=[[loss["mean"] - loss["min"]], [loss["max"] - loss["mean"]]],
                    fmt="o", color=color, ms=7 if r.get("pareto") else 5, capsize=3,
                    mec="black" if r.get("pareto") else color,
                    label=f"{r['label']} {r['setting']}".strip())
        others = [p for p in sweeps.get(r["strategy"], {}).get("points", [])
                  if not p.get("chosen")]
        if others:
            ax.plot([max(p["bytes_ratio"], 1e-9) for p in others],
                    [p["val_loss"] for p in others], "x", color=color, alpha=0.45, ms=5)
    front = sorted((max(r["bytes_ratio"], 1e-9), r["val_loss"]["mean"])
                   for r in measured if r.get("pareto"))
    if front:
        xs, ys = zip(*front, strict=True)
        ax.step(xs, ys, where="post", color="black", ls="--", lw=1)
        ax.plot(xs, ys, "o", ms=13, mfc="none", mec="black", mew=1.2, ls="--", color="black",
                label="on the Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per rank, relative to DDP (log)")
    ax.set_ylabel("final validation loss (mean over seeds; bars: min-max)")
    ax.set_title(title + "\n(x: the sweep's other values, first seed)", fontsize=9)
    if measured:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3, which="both")
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
