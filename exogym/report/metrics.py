"""Metric events: the one format every rank reports in.

A rank emits one event per training step (plus a few lifecycle events). In a
local simulation events travel to the parent through a pipe of each rank's
own; from a remote host they travel as one JSON object per line on stdout,
behind ``METRIC_PREFIX``, and the launcher parses them back. The same dicts feed
``trainer.history``, the CSV and W&B loggers and the live dashboard. They never
travel over the training process group, so byte counts and timings stay clean.

Event kinds (the ``"event"`` key):

- ``"step"``: one per (rank, step) with ``rank``, ``step``, ``train_loss``,
  ``lr``, ``comm_bytes`` (cumulative), ``samples`` (cumulative),
  ``step_samples`` (the samples this step trained: 0 for an idle one), ``wall_s``,
  ``comm_s`` (the step's seconds inside counted collectives, waiting
  included) and ``compute_s`` (the step's own work: its wall time less
  ``comm_s``); eval steps add ``val_loss`` and ``val_global_loss``; with a
  simulated clock (``fit(network=...)``) every step adds ``sim_time_s``, and
  ``compute_s`` and ``sim_comm_s`` are what the clock charged the step; across
  hosts that come and go (``min_nodes``) every step adds ``store_trips``, the
  round trips to the run's store its training thread made since the last step.
- ``"start"``: a rank is ready (``rank``, ``max_steps``, ``host``); under a
  non-iid ``partition`` it adds ``labels`` (its samples per label), and rank 0
  ``labels_by_rank`` (every rank's).
- ``"done"``: a rank finished (``rank``, ``step``).
- ``"link"``: about once a second while the rank has a counted collective in flight
  (or bytes completed since its last one): ``in_flight``, ``done`` (the share of it
  done), ``bytes_done``, ``bytes_total``, ``elapsed_s``, ``rate_bps`` (payload bits
  per second achieved now) and ``sent_bytes`` (:class:`exogym.run.monitor.LinkMeter`).
- ``"system"``: about once a second, one rank per process: its host's
  ``cpu_percent`` and ``cores``, the process's ``pid`` and ``rss_bytes``,
  ``mem_available_bytes``, ``mem_total_bytes``, ``low_memory``, and on a GPU ``gpu``,
  ``gpu_bytes``, ``gpu_total_bytes``, ``gpu_percent``
  (:mod:`exogym.run.system_sampler`).

Consumers take the kinds they know and ignore the rest.
"""

from __future__ import annotations

import json
import math
from typing import Any

METRIC_PREFIX = "@@exogym-event "


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable
    return value


def encode_event(event: dict[str, Any]) -> str:
    """Return ``event`` as one line: the prefix, then compact JSON."""
    clean = {k: _jsonable(v) for k, v in event.items()}
    return METRIC_PREFIX + json.dumps(clean, separators=(",", ":"))


def decode_line(line: str) -> dict[str, Any] | None:
    """Parse a line written by :func:`encode_event`; ``None`` for any other line."""
    line = line.rstrip("\r\n")
    start = line.find(METRIC_PREFIX)
    if start < 0:
        return None
    try:
        event = json.loads(line[start + len(METRIC_PREFIX):])
    except json.JSONDecodeError:
        return None
    if not isinstance(event, dict):
        return None
    for key, value in event.items():
        if value in ("nan", "inf", "-inf"):
            event[key] = float(value)
    return event


def time_to_loss(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first time at which ``curve`` (``(time, loss)`` points in order) reaches
    ``target``, linear between points; None when it never does."""
    previous: tuple[float, float] | None = None
    for t, loss in curve:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return t
            t0, l0 = previous
            return t0 + (t - t0) * (l0 - target) / (l0 - loss)
        previous = (t, loss)
    return None
