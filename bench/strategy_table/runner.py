"""Runs in parallel: ``--jobs`` worker processes, each training one K-rank simulation at a time.

Workers come from a fork server, so each imports torch once and starts clean
(no thread, no CUDA context of the parent's). What a finished run makes
possible (a strategy's final seeds, once its sweep is done) is handed back by
the caller's ``on_done`` and queued at once, so no worker waits for a phase to
end. Every wait is bounded: when no run finishes for ``stall_s`` seconds the
workers are stopped and :class:`Stalled` names the runs in flight.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.strategy_table import child

Spec = dict[str, Any]


class Stalled(RuntimeError):
    """No run finished within the bound; the message names the runs that were in flight."""


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (a worker's ranks), read from ``/proc``."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            tree.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(
                int(entry.name))
    found, todo = [], list(tree.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(tree.get(child, []))
    return found


def _stop(pool: cf.ProcessPoolExecutor) -> None:
    """Stop the pool's worker processes and the ranks they started, by their ids, and drop
    what is queued."""
    workers = [p for p in list(getattr(pool, "_processes", {}).values()) if p.is_alive()]
    for process in workers:
        for pid in _descendants(process.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        process.terminate()
    pool.shutdown(wait=False, cancel_futures=True)


def run_all(first: list[Spec], on_done: Callable[[Spec, dict[str, Any]], list[Spec]],
            jobs: int, stall_s: float) -> None:
    """Run ``first`` and whatever ``on_done(spec, result)`` returns, ``jobs`` at a time.

    Raises:
        Stalled: no run finished for ``stall_s`` seconds.
        KeyboardInterrupt: passed on after the workers are stopped.
    """
    pool = cf.ProcessPoolExecutor(max_workers=jobs,
                                  mp_context=multiprocessing.get_context("forkserver"))
    pending: dict[cf.Future, Spec] = {}
    queued: set[str] = set()

    def submit(specs: list[Spec]) -> None:
        for spec in specs:
            if spec["key"] not in queued:
                queued.add(spec["key"])
                pending[pool.submit(child.run, spec)] = spec

    try:
        submit(first)
        last_finish = time.monotonic()
        while pending:
            done, _ = cf.wait(pending, timeout=min(5.0, stall_s),
                              return_when=cf.FIRST_COMPLETED)
            if not done:
                if time.monotonic() - last_finish > stall_s:
                    running = [s["key"] for f, s in pending.items() if f.running()]
                    raise Stalled(f"no run finished in {stall_s:.0f} s (--stall-s); in flight: "
                                  f"{', '.join(running) or 'none started'}")
                continue
            last_finish = time.monotonic()
            for future in done:
                spec = pending.pop(future)
                try:
                    result = future.result()
                except Exception as exc:  # the worker itself died (killed, out of memory)
                    result = {"status": "failed", "error": f"worker lost: {exc!r}"}
                submit(on_done(spec, result))
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown(wait=True)
