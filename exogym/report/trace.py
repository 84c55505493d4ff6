"""A run's trace: what each rank's steps cost, for replaying the run on another cluster.

A :class:`TraceWriter` takes the run's metric events (:mod:`exogym.report.metrics`)
in the process that sees every rank's: the parent of a simulation, the
launcher of a run across hosts. It writes ``trace.jsonl``: one JSON object per
line, each with a ``kind`` (the format, line by line: ``docs/trace.md``):

- ``run``: the header: format version, source (``simulation`` or ``hosts``),
  the run's config, ``num_nodes``, its identity, start time;
- ``step``: one rank's step: compute and communication seconds (simulated
  ones when the run has a clock), bytes sent, samples, ``sim_time_s``, and the
  balancer's share and speed estimate when ``balance`` is on;
- ``steps``: past :data:`FULL_STEPS` lines of a rank, one line per
  :data:`BLOCK_STEPS` of its steps: sums, medians and maxima;
- ``eval``: a rank's validation losses at an evaluation;
- ``membership``, ``host``, ``hand_over``, ``fault``: ranks and hosts coming
  and going, with the time and step;
- ``link``: per rank, what its collectives achieved (bytes over seconds in
  them) and, across hosts, what is known of its host's link;
- ``end``: how the run ended (``ok`` or ``failed``, with the error).

Cheap by construction: lines go into a buffered temporary file beside the
trace (no flush or sync per line), each event costs a few dictionary lookups
and one small ``json`` encoding, and nothing grows with the model. The file
appears under its final name only when the run ends (a rename, also after a
failure, then with a failed ``end`` line); a process killed outright leaves
only its hidden temporary file, never half a trace under the final name.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from exogym.base.io import usual_file_mode
from exogym.base.untrusted import MAX_TRACE_BYTES, TooDeepJSON, json_loads, open_regular

__all__ = ["BLOCK_STEPS", "FORMAT_VERSION", "FULL_STEPS", "READABLE_VERSIONS", "TRACE_FILE",
           "TraceWriter", "read_trace", "trace_path"]

#: The trace's file name in a run folder.
TRACE_FILE = "trace.jsonl"
#: The version of the format written. 2: across hosts, the header's ``hosts`` and the
#: ``link`` lines carry each host's pre-flight ``link_rate_bps`` and ``latency_s``.
FORMAT_VERSION = 2
#: The versions :func:`read_trace` reads; it refuses any other.
READABLE_VERSIONS = (1, 2)
#: Steps of each rank written one line each; beyond them, blocks of :data:`BLOCK_STEPS`.
FULL_STEPS = 1000
#: Steps of a rank summarised by one ``steps`` line once it is past :data:`FULL_STEPS`.
BLOCK_STEPS = 50
#: What a rank's step event may carry from the balancer (``fit(balance=...)``).
BALANCE_KEYS = ("batch_size", "inner_steps", "measured_speed")

_encode = json.JSONEncoder(separators=(",", ":"), default=repr).encode


def trace_path(target: str | os.PathLike[str]) -> Path:
    """Where ``fit(trace=target)`` writes: ``target`` itself when it ends in ``.jsonl``,
    else ``target/trace.jsonl`` (a folder, made when the run starts)."""
    path = Path(target).expanduser()
    return path if path.suffix == ".jsonl" else path / TRACE_FILE


def _seconds(value: float) -> float:
    return round(value, 6)


def _plain(value: Any) -> Any:
    """JSON has no NaN or infinity: such a float is written as a string, as events are."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class _Rank:
    """What the writer keeps of one rank: the last cumulative counters and the open block."""

    __slots__ = ("bytes", "samples", "lines", "comm_bytes", "comm_s", "block", "last_step")

    def __init__(self) -> None:
        self.bytes: int | None = None  # comm_bytes of its last step (None: not known)
        self.samples: int | None = None
        self.lines = 0  # step lines written
        self.comm_bytes = 0  # totals, for its link line
        self.comm_s = 0.0
        self.block: dict[str, Any] | None = None
        self.last_step = 0


class TraceWriter:
    """Writes one run's ``trace.jsonl`` from its metric events.

    Made before the run's folder is known (the launcher's event stream may be
    wired first); :meth:`start` opens the file, events before it are ignored.

    Args:
        full_steps: step lines per rank before blocks begin (default :data:`FULL_STEPS`).
        block_steps: steps per ``steps`` line beyond them (default :data:`BLOCK_STEPS`).
    """

    def __init__(self, full_steps: int | None = None, block_steps: int | None = None) -> None:
        self.full_steps = FULL_STEPS if full_steps is None else int(full_steps)
        self.block_steps = BLOCK_STEPS if block_steps is None else int(block_steps)
        if self.full_steps < 0 or self.block_steps < 1:
            raise ValueError(f"full_steps must be >= 0 and block_steps >= 1, got "
                             f"{self.full_steps} and {self.block_steps}")
        self.path: Path | None = None
        self._file: IO[str] | None = None
        self._tmp: str | None = None
        self._started = 0.0
        self._ranks: dict[int, _Rank] = {}
        self._watched: dict[int, list[float | None]] = {}  # step -> [t, sim_time_s]
        self.lines = 0

    @property
    def started(self) -> bool:
        """True between :meth:`start` and :meth:`end`."""
        return self._file is not None

    # -- opening -------------------------------------------------------------------

    def start(self, path: str | os.PathLike[str], *, source: str, num_nodes: int,
              config: Mapping[str, Any], run: Mapping[str, Any] | None = None,
              append: bool = False, **header: Any) -> None:
        """Open the trace's temporary file beside ``path`` and write the ``run`` line.

        Args:
            path: the trace's final name (its folder is made if need be).
            source: ``'simulation'``, ``'hosts'`` (the launcher's) or ``'rank'`` (one rank's own).
            num_nodes: the run's ranks.
            config: the run's settings (``RunSpec.config()``, or a profile's values).
            run: the run's identity (profile, fingerprint, start), if it has one.
            append: begin with the lines of the trace already at ``path`` (a resumed run
                continues the trace of the run it resumes).
            header: more fields of the ``run`` line (e.g. ``hosts``).
        """
        if self._file is not None:
            raise RuntimeError(f"the trace is already being written to {self.path}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp",
                                         dir=self.path.parent)
        self._file = os.fdopen(fd, "w", encoding="utf-8", buffering=1 << 16)
        resumed = append and self.path.is_file()
        if resumed:
            with open(self.path, encoding="utf-8") as earlier:
                shutil.copyfileobj(earlier, self._file)
        self._started = time.monotonic()
        self._write({"kind": "run", "version": FORMAT_VERSION, "source": source,
                     "num_nodes": num_nodes,
                     "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "run": dict(run) if run is not None else None,
                     "full_steps": self.full_steps, "block_steps": self.block_steps,
                     "resumed": resumed,
                     **header, "config": dict(config)})
        # Empty the buffer now: ranks forked from this process inherit it (they never
        # write to it, and leave with os._exit, but a buffer they hold is a copy of nothing).
        self._file.flush()

    def _write(self, line: dict[str, Any]) -> None:
        self._file.write(_encode(line) + "\n")  # type: ignore[union-attr]
        self.lines += 1

    def _t(self) -> float:
        return round(time.monotonic() - self._started, 3)

    # -- events --------------------------------------------------------------------

    def on_event(self, event: Mapping[str, Any]) -> None:
        """Take one metric event of any rank (others than those traced are ignored)."""
        if self._file is None:
            return
        kind = event.get("event")
        if kind == "step":
            self._step(event)
        elif kind == "membership":
            self._write({"kind": "membership", "t": self._t(),
                         **{k: event.get(k) for k in ("step", "ranks", "hosts", "reason")}})
        elif kind == "host":
            self._write({"kind": "host", "t": self._t(),
                         **{k: event.get(k) for k in ("rank", "host", "state", "reason")}})
        elif kind == "fault":  # an injected fault (distributed.launch.injector)
            self._write({"kind": "fault", "t": self._t(),
                         **{k: _plain(v) for k, v in event.items() if k != "event"}})
        elif kind == "hand_over":
            self._write({"kind": "hand_over", "t": self._t(),
                         **{k: event.get(k) for k in ("rank", "step", "source", "joiners",
                                                      "bytes")},
                         "seconds": _seconds(event.get("seconds") or 0.0)})

    def _step(self, event: Mapping[str, Any]) -> None:
        rank, step = event["rank"], event["step"]
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = _Rank()
        if step == 1:  # a fresh rank: its counters start at zero
            state.bytes = state.samples = 0
        comm_bytes = event.get("comm_bytes", 0)
        samples = event.get("samples", 0)
        sent = comm_bytes - state.bytes if state.bytes is not None and \
            comm_bytes >= state.bytes else None
        took = samples - state.samples if state.samples is not None and \
            samples >= state.samples else None
        state.bytes, state.samples, state.last_step = comm_bytes, samples, step
        sim = event.get("sim_time_s")
        wall_comm = event.get("comm_s", 0.0)
        comm = event.get("sim_comm_s", wall_comm) if sim is not None else wall_comm
        compute = event.get("compute_s")
        state.comm_bytes = comm_bytes
        state.comm_s += wall_comm
        watched = self._watched.get(step)
        if watched is not None:
            watched[0] = self._t()
            if sim is not None and (watched[1] is None or sim > watched[1]):
                watched[1] = sim
        if state.lines < self.full_steps:
            # the most frequent line: formatted by hand, as the encoder would (a third the time)
            text = f'{{"kind":"step","rank":{rank},"step":{step}'
            if compute is not None:
                text += f',"compute_s":{round(compute, 6)!r}'
            text += f',"comm_s":{round(comm, 6)!r}'
            if sim is not None:
                text += f',"wall_comm_s":{round(wall_comm, 6)!r}'
            if sent is not None:
                text += f',"bytes":{sent}'
            text += f',"comm_bytes":{comm_bytes}'
            if took is not None:
                text += f',"samples":{took}'
            if sim is not None:
                text += f',"sim_time_s":{round(sim, 6)!r}'
            if "wall_s" in event:
                text += f',"wall_s":{round(event["wall_s"], 4)!r}'
            for key in BALANCE_KEYS:
                if key in event:
                    text += f',"{key}":{_encode(event[key])}'
            if event.get("idle"):
                text += ',"idle":true'
            self._file.write(text + "}\n")  # type: ignore[union-attr]
            self.lines += 1
            state.lines += 1
        else:
            self._add_to_block(state, rank, step, compute, comm, wall_comm, sent, took, sim,
                               event)
        if "val_loss" in event:
            line = {"kind": "eval", "rank": rank, "step": step}
            for key, value in event.items():
                if key.startswith("val_"):
                    line[key] = _plain(value)
            if sim is not None:
                line["sim_time_s"] = _seconds(sim)
            self._write(line)

    def _add_to_block(self, state: _Rank, rank: int, step: int, compute: float | None,
                      comm: float, wall_comm: float, sent: int | None, took: int | None,
                      sim: float | None, event: Mapping[str, Any]) -> None:
        block = state.block
        if block is not None and step != block["last"] + 1:
            # the rank was away (or started again): a block holds consecutive steps only,
            # so that a reader sees which steps it trained
            self._close_block(state)
            block = None
        if block is None:
            block = state.block = {"rank": rank, "first": step, "compute": [], "comm": [],
                                   "wall_comm": 0.0, "bytes": 0, "samples": 0, "idle": 0}
        block["last"] = step
        if compute is not None:
            block["compute"].append(compute)
        block["comm"].append(comm)
        block["wall_comm"] += wall_comm
        block["bytes"] += sent or 0
        block["samples"] += took or 0
        block["comm_bytes"] = event.get("comm_bytes", 0)
        block["idle"] += bool(event.get("idle"))
        if sim is not None:
            block["sim_time_s"] = sim
        if "wall_s" in event:
            block["wall_s"] = event["wall_s"]
        for key in BALANCE_KEYS:
            if key in event:
                block[key] = event[key]
        if len(block["comm"]) >= self.block_steps:
            self._close_block(state)

    def _close_block(self, state: _Rank) -> None:
        block, state.block = state.block, None
        if block is None:
            return
        line: dict[str, Any] = {"kind": "steps", "rank": block["rank"], "first": block["first"],
                                "last": block["last"], "count": len(block["comm"])}
        for name, key in (("compute", "compute_s"), ("comm", "comm_s")):
            values = block[name]
            if values:
                line[key] = _seconds(math.fsum(values))
                line[f"{key}_median"] = _seconds(statistics.median(values))
                line[f"{key}_max"] = _seconds(max(values))
        if "sim_time_s" in block:
            line["wall_comm_s"] = _seconds(block["wall_comm"])
        line["bytes"] = block["bytes"]
        line["comm_bytes"] = block["comm_bytes"]
        line["samples"] = block["samples"]
        if "sim_time_s" in block:
            line["sim_time_s"] = _seconds(block["sim_time_s"])
        if "wall_s" in block:
            line["wall_s"] = round(block["wall_s"], 4)
        for key in BALANCE_KEYS:
            if key in block:
                line[key] = block[key]
        if block["idle"]:
            line["idle"] = block["idle"]
        self._write(line)

    # -- what the events do not say ------------------------------------------------

    def watch(self, steps: Iterable[int]) -> None:
        """Note when the ranks finish each of ``steps``, for :meth:`scheduled` lines
        (a simulation knows its membership changes before they happen)."""
        for step in steps:
            self._watched.setdefault(int(step), [None, None])

    def scheduled(self, kind: str, step: int, **fields: Any) -> None:
        """A ``membership`` or ``fault`` line of a change at the start of ``step``, timed by
        when the ranks finished the step before (:meth:`watch` it first): ``t`` and,
        with a clock, the latest rank's ``sim_time_s``."""
        if self._file is None:
            return
        t, sim = self._watched.get(step - 1, [None, None]) if step > 1 else (0.0, 0.0)
        line: dict[str, Any] = {"kind": kind, "t": t, "step": step}
        if sim is not None:
            line["sim_time_s"] = _seconds(sim)
        self._write({**line, **fields})

    def fault(self, **fields: Any) -> None:
        """A ``fault`` line now (e.g. the rank whose failure ended the run)."""
        if self._file is not None:
            self._write({"kind": "fault", "t": self._t(), **fields})

    # -- closing -------------------------------------------------------------------

    def end(self, failed: bool = False, error: str | None = None,
            links: Mapping[int, Mapping[str, Any]] | None = None) -> Path | None:
        """Close every open block, write the ``link`` and ``end`` lines and rename the
        file to its final name; returns that name (None when never started).

        Args:
            failed: the run failed (or was stopped).
            error: why, in a line.
            links: per rank, what is known of its host's link (host, interface, ...),
                written into its ``link`` line.
        """
        if self._file is None:
            return None
        for state in self._ranks.values():
            self._close_block(state)
        links = links or {}
        for rank in sorted(set(self._ranks) | set(links)):
            state = self._ranks.get(rank) or _Rank()
            line: dict[str, Any] = {"kind": "link", "rank": rank, **links.get(rank, {}),
                                    "comm_bytes": state.comm_bytes,
                                    "comm_s": _seconds(state.comm_s)}
            line["achieved_bytes_per_s"] = (round(state.comm_bytes / state.comm_s)
                                            if state.comm_s > 0 else None)
            self._write(line)
        end: dict[str, Any] = {"kind": "end", "t": self._t(),
                               "status": "failed" if failed else "ok",
                               "steps": max((s.last_step for s in self._ranks.values()),
                                            default=0)}
        if error:
            end["error"] = error
        self._write(end)
        file, self._file = self._file, None
        try:
            file.close()
            os.chmod(self._tmp, usual_file_mode())  # type: ignore[arg-type]
            os.replace(self._tmp, self.path)  # type: ignore[arg-type]
        except BaseException:
            try:
                os.unlink(self._tmp)  # type: ignore[arg-type]
            except OSError:
                pass
            raise
        return self.path

    def abandon(self) -> None:
        """Close and remove the temporary file without publishing it."""
        if self._file is not None:
            file, self._file = self._file, None
            file.close()
            try:
                os.unlink(self._tmp)  # type: ignore[arg-type]
            except OSError:
                pass


#: Fields every line of a kind must carry, each a whole number >= 0.
_REQUIRED_COUNTS = {"steps": ("rank", "first", "last"), "eval": ("rank", "step"),
                    "link": ("rank",)}
#: Fields that, where a line carries them, are whole numbers >= 0.
_COUNTS = ("rank", "first", "last", "count", "step", "steps", "bytes", "comm_bytes", "samples",
           "idle")
#: Fields that, where a line carries them, are finite numbers.
_NUMBERS = ("t", "wall_s", "sim_time_s", "compute_s", "comm_s", "wall_comm_s",
            "achieved_bytes_per_s")


def trace_line_problem(line: Any) -> str | None:
    """What is wrong with one parsed line of a trace, None when nothing: a trace is read
    from a run folder, which anyone may have written, so its lines are checked before
    anything reads a field of them."""
    if not isinstance(line, dict):
        return f"is a JSON {type(line).__name__}, not an object"
    kind = line.get("kind")
    if not isinstance(kind, str):
        return "has no \"kind\""
    for key in _REQUIRED_COUNTS.get(kind, ()):
        if key not in line:
            return f"(a {kind!r} line) has no {key!r}"
    for key in _COUNTS:
        value = line.get(key)
        if key in line and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return f"has {key}={value!r}: a whole number >= 0 was expected"
    for key in _NUMBERS:
        value = line.get(key)
        if key in line and value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value)):
            return f"has {key}={value!r}: a finite number was expected"
    return None


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The lines of a trace, parsed and checked (:func:`trace_line_problem`).

    Raises:
        ValueError: a ``run`` line of a format version this code does not know
            (:data:`READABLE_VERSIONS`), a line that is not JSON, or one whose fields are
            not what the format says, naming the file and the line; a line nested
            deeper than can be read (:class:`~exogym.base.untrusted.TooDeepJSON`).
        OSError: ``path`` is not a regular file (a FIFO, a device) or is over
            :data:`~exogym.base.untrusted.MAX_TRACE_BYTES`; nothing waits or fills memory.
    """
    lines = []
    with io.TextIOWrapper(open_regular(path, MAX_TRACE_BYTES), encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                try:
                    line = json_loads(text, f"{path}: line {number}")
                except TooDeepJSON:
                    raise
                except ValueError as exc:
                    raise ValueError(f"{path}: line {number} is not JSON ({exc})") from None
                problem = trace_line_problem(line)
                if problem is not None:
                    raise ValueError(f"{path}: line {number} {problem}")
                if line.get("kind") == "run" and line.get("version") not in READABLE_VERSIONS:
                    raise ValueError(f"{path}: trace format version {line.get('version')!r}; "
                                     f"this code reads versions "
                                     f"{', '.join(map(str, READABLE_VERSIONS))}")
                lines.append(line)
    return lines
