"""A replay's report: the recorded run beside its replays, as JSON, as a page and as
terminal tables.

:class:`ReplayResult` holds the figures (:class:`~.timelines.Timeline`) of the recorded
run and of each replay; :meth:`ReplayResult.to_dict` is the comparison as one JSON
object (``replay --json``, ``replay.json``), which :func:`write_outputs` writes with
its page (``replay.html``), and :func:`replay_tables` draws the same object as the
terminal's tables. The what-ifs are ranked by the simulated time they take to reach
the recorded run's final validation loss, or said never to reach it within the
run's samples.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exogym.base.escapes import printable
from exogym.base.plural import plural
from exogym.sim.network import Network

from .recording import Recording
from .timelines import Timeline, replayed_change, rounded, time_to_loss
from .variants import Variant

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["REPLAY_FOLDER", "ReplayResult", "ReplayTables", "describe_cluster", "replay_tables",
           "write_outputs"]

#: The replays' folder inside the run's folder (``--out`` replaces it).
REPLAY_FOLDER = "replay"


@dataclass
class ReplayResult:
    """A replay and what it is compared with.

    Args:
        recording: the recorded run.
        real: its figures.
        replays: per variant (the run as recorded first), its figures.
        cluster: the cluster's settings the replays ran with (``rank_failures`` too).
        target: the recorded run's final validation loss.
    """

    recording: Recording
    real: Timeline
    replays: list[tuple[Variant, Timeline]]
    cluster: dict[str, Any]
    target: float | None

    @property
    def replay(self) -> Timeline:
        """The figures of the run as recorded, replayed."""
        return self.replays[0][1]

    def ranking(self) -> list[dict[str, Any]]:
        """Every replay, by simulated time to the recorded final validation loss (the ones
        that never reach it last, by their final loss)."""
        rows = []
        for variant, figures in self.replays:
            reach = time_to_loss(figures.evaluations, self.target) \
                if self.target is not None else None
            rows.append({"label": variant.label, "strategy": variant.strategy,
                         "settings": variant.settings, "recorded": variant.recorded,
                         "time_to_target_s": rounded(reach), "reaches_target": reach is not None,
                         "wall_s": rounded(figures.wall_s),
                         "round_s_median": rounded(figures.round_s_median),
                         "final_val_loss": figures.final_val_loss,
                         "evaluations": [[s, v] for s, v, _ in figures.evaluations]})
        rows.sort(key=lambda r: (not r["reaches_target"], r["time_to_target_s"] or 0.0,
                                 r["final_val_loss"] if r["final_val_loss"] is not None
                                 else math.inf))
        for place, row in enumerate(rows, 1):
            row["place"] = place
        return rows

    def timelines(self) -> dict[str, dict[int, float]]:
        """Seconds at each step: ``real``, then each replay by its label (``replay`` for the
        run as recorded)."""
        out = {"real": dict(self.real.times)}
        for variant, figures in self.replays:
            out["replay" if variant.recorded else variant.label] = dict(figures.times)
        return out

    def ratios(self) -> dict[str, Any]:
        """Replay over real: total time, median round, each evaluation's loss."""
        real, rep = self.real, self.replay
        losses = dict((s, v) for s, v, _ in rep.evaluations)
        return {"wall_s": _ratio(rep.wall_s, real.wall_s),
                "round_s_median": _ratio(rep.round_s_median, real.round_s_median),
                "val_loss": [[s, _ratio(losses.get(s), v)] for s, v, _ in real.evaluations]}

    def to_dict(self) -> dict[str, Any]:
        """The comparison as one JSON object: ``real``, ``replay``, ``ratios``, the
        cluster replayed, and the what-ifs' ranking."""
        rec = self.recording
        return {"run_dir": str(rec.folder), "profile": rec.profile.name,
                "strategy": rec.profile.strategy, "source": rec.source,
                "num_nodes": rec.num_nodes, "steps": rec.steps,
                "target_val_loss": self.target,
                "real": self.real.to_dict(), "replay": self.replay.to_dict(),
                "ratios": self.ratios(), "cluster": self.cluster,
                "what_if": self.ranking() if len(self.replays) > 1 else []}


def describe_cluster(cluster: Mapping[str, Any]) -> str:
    """The cluster a replay ran on, in words: its links, the ranks' speeds, who left and
    came back, and what evaluations and hand-overs added (a report's ``cluster``)."""
    net = cluster.get("network")
    if isinstance(net, Mapping):
        links = Network.coerce(dict(net)).describe() + f" (from {cluster['links_from']})"
    elif net:
        links = f"{net} (from {cluster['links_from']})"
    else:
        links = f"no network: {cluster['links_from'].split(': ', 1)[-1]}"
    speeds = cluster.get("rank_speeds") or []
    if speeds and max(speeds) - min(speeds) > 1e-3:
        pace = ("ranks at " + ", ".join(f"{s:.2f}" for s in speeds) + " of the fastest's "
                f"speed ({cluster['compute_time_s']:.3g} s a step)")
    else:
        pace = f"every rank {cluster['compute_time_s']:.3g} s a step"
    failures = cluster.get("rank_failures") or []
    away = "no rank left" if not failures else "; ".join(
        f"rank {rank} away from step {at}" + (f" to {back}" if back is not None else "")
        for rank, at, back in failures)
    evals = cluster.get("eval_s") or {}
    parts = [links, pace, away]
    if evals.get("round_end") or evals.get("mid_round"):
        parts.append(f"an evaluation {evals.get('round_end', 0):.3g} s at a round's end, "
                     f"{evals.get('mid_round', 0):.3g} s inside one")
    hand_overs = cluster.get("hand_over_s") or []
    if hand_overs:
        parts.append("hand-overs of " + ", ".join(f"{h:.3g}" for h in hand_overs) + " s")
    return "; ".join(parts)


def write_outputs(result: ReplayResult, folder: Path) -> tuple[dict[str, Any], str]:
    """Write ``replay.json`` (the comparison) and ``replay.html`` (its page) into
    ``folder``, each atomically; returns the comparison and the page."""
    from exogym.base.io import atomic_write_bytes

    from ..web.replay_page import replay_html

    report = result.to_dict()
    page = replay_html(report, result.timelines())
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / "replay.json",
                       (json.dumps(report, indent=1) + "\n").encode("utf-8"))
    atomic_write_bytes(folder / "replay.html", page.encode("utf-8"))
    return report, page


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 6)



@dataclass
class ReplayTables:
    """A report (:meth:`ReplayResult.to_dict`) for a terminal, in the order it is shown.

    Args:
        comparison: real against replay: total time, rounds, what each membership
            change cost, the validation loss at each evaluation.
        cluster: one line, the cluster replayed (:func:`describe_cluster`).
        what_if: the replays ranked by time to the recorded final validation loss;
            None without a what-if.
    """

    comparison: Table
    cluster: str
    what_if: Table | None


def _cell(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def replay_tables(report: Mapping[str, Any]) -> ReplayTables:
    """The report's tables: real against replay, the cluster replayed, and the what-ifs."""
    from rich.table import Table

    from exogym.base.terminal import shown

    real, rep, ratios = report["real"], report["replay"], report["ratios"]
    table = Table(title=shown(f"{report['profile']}: real ({real['clock']} clock) and replay"),
                  title_justify="left")
    for column in ("", "real", "replay", "replay / real"):
        table.add_column(column, justify="left" if not column else "right")
    table.add_row("total time (s)", _cell(real["wall_s"]), _cell(rep["wall_s"]),
                  _cell(ratios["wall_s"], 3))
    table.add_row(f"round of {plural(real['round_steps'], 'step')}, median (s)",
                  _cell(real["round_s_median"]), _cell(rep["round_s_median"]),
                  _cell(ratios["round_s_median"], 3))
    table.add_row("round, 10th - 90th percentile (s)",
                  f"{_cell(real['round_s_p10'])} - {_cell(real['round_s_p90'])}",
                  f"{_cell(rep['round_s_p10'])} - {_cell(rep['round_s_p90'])}", "")
    replayed = {m["step"]: m for m in rep["membership"]}
    for change in real["membership"]:
        if change["step"] > 1:
            table.add_row(shown(f"lost to step {change['step']}: {change['reason']} (s)"),
                          _cell(change.get("lost_s")),
                          _cell(replayed_change(replayed, change).get("lost_s")), "")
    losses = dict((s, v) for s, v in rep["evaluations"])
    for (step, value), (_, ratio) in zip(real["evaluations"], ratios["val_loss"]):
        table.add_row(f"val loss at step {step}", _cell(value), _cell(losses.get(step)),
                      _cell(ratio, 4))
    ranking = None
    if report["what_if"]:
        ranking = Table(title=f"What if: time to the recorded final val loss "
                              f"{_cell(report['target_val_loss'])}", title_justify="left")
        for column in ("#", "replay", "time to it (s)", "total (s)", "median round (s)",
                       "final val loss"):
            ranking.add_column(column, justify="left" if column == "replay" else "right")
        for row in report["what_if"]:
            ranking.add_row(str(row["place"]), shown(row["label"]),
                            _cell(row["time_to_target_s"]) if row["reaches_target"]
                            else "never (within the run's samples)",
                            _cell(row["wall_s"]), _cell(row["round_s_median"]),
                            _cell(row["final_val_loss"]))
    return ReplayTables(table, printable(f"replayed with: {describe_cluster(report['cluster'])}"),
                        ranking)
