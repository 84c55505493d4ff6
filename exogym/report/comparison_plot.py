"""The comparison plot: validation loss against steps, bytes sent and simulated time.

Drawn for ``exogym.compare`` and the CLI's ``compare`` alike, from results that each
have a ``strategy`` (its label), a ``curve`` of ``(step, bytes sent per node, val loss)``
and a ``sim_curve`` of ``(simulated seconds, val loss)`` (empty without a clock).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exogym.base.install_mode import install_extra
from exogym.base.io import atomic_write_bytes

__all__ = ["check_plotting", "comparison_figure", "plot_comparison"]


def check_plotting() -> None:
    """Raise ``ImportError`` naming the extra when matplotlib is missing (call it before
    spending minutes on runs whose plot could not be drawn)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(f"the comparison plot needs matplotlib: {install_extra('examples')}")


def comparison_figure(results: Sequence[Any], title: str | None = None,
                      network: str | None = None) -> Any:
    """A matplotlib figure: validation loss against step and against bytes sent, one line
    per strategy. Bytes sent are drawn as they are, 0 included, on a symmetric-log axis
    (linear from 0 to the decade of the smallest count sent), which the axis label says.
    When the runs kept a simulated clock, a third panel draws the loss against the
    simulated time on ``network`` (its name labels the axis).

    Raises:
        ImportError: when matplotlib is not installed (the message names the install line).
    """
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    timed = any(r.sim_curve for r in results)
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(16 if timed else 11, 4.4))
    by_step, by_bytes = axes[0], axes[1]
    # Linear from 0 up to the decade of the smallest count sent, logarithmic above it.
    sent_counts = [b for r in results for _, b, _ in r.curve if b > 0]
    linear_below = 10.0 ** math.floor(math.log10(min(sent_counts))) if sent_counts else 1.0
    for r in results:
        if not r.curve:
            continue
        steps, sent, loss = zip(*r.curve)
        by_step.plot(steps, loss, marker="o", markersize=3, label=r.strategy)
        by_bytes.plot(sent, loss, marker="o", markersize=3, label=r.strategy)
    by_step.set_xlabel("step")
    by_bytes.set_xscale("symlog", linthresh=linear_below)
    top = max(sent_counts, default=linear_below)
    decades = range(round(math.log10(linear_below)), math.ceil(math.log10(top)) + 1)
    by_bytes.set_xticks([0.0, *(10.0 ** k for k in decades)])
    by_bytes.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    by_bytes.set_xlim(-0.15 * linear_below, 10.0 ** decades[-1])  # room for the markers at 0
    by_bytes.set_xlabel(f"bytes sent per node\n(symlog axis, linear below {linear_below:g} B: "
                        "0 means nothing sent yet)")
    if timed:
        by_time = axes[2]
        for r in results:
            if r.sim_curve:
                seconds, loss = zip(*r.sim_curve)
                by_time.plot(seconds, loss, marker="o", markersize=3, label=r.strategy)
        by_time.set_xlabel("simulated time (s)" + (f" on {network}" if network else ""))
    for ax in axes:
        ax.set_ylabel("validation loss")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_comparison(results: Sequence[Any], path: str | Path,
                    title: str | None = None, network: str | None = None) -> Path:
    """Draw :func:`comparison_figure` and write the PNG atomically to ``path``.

    Raises:
        ImportError: when matplotlib is not installed (the message names the install line).
    """
    import matplotlib.pyplot as plt

    fig = comparison_figure(results, title, network)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(path, buffer.getvalue())
