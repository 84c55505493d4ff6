"""SIGTERM ends a run as Ctrl-C does.

``kill``, systemd, SLURM and container runtimes stop a process with SIGTERM, whose
default ends Python at once: no ``finally`` runs, so the trace stays a temporary
file, the ranks are left to die on their own and no resume command is printed.
:func:`sigterm_as_interrupt` turns SIGTERM into :class:`Terminated`, a
``KeyboardInterrupt``, raised in the main thread, so every path that handles
Ctrl-C handles it too; :func:`exit_status` tells the two apart for the exit code
(128 + the signal's number: 130 for SIGINT, 143 for SIGTERM).
:func:`interruptions_deferred` holds both back over a few lines that must not be
cut in two (a message taken off a pipe and not yet kept).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Terminated", "exit_status", "interruptions_deferred", "sigterm_as_interrupt",
           "stop_on_sigterm"]


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM."""

    def __init__(self) -> None:
        super().__init__("stopped by SIGTERM")


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


def _raise_terminated_once(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the way out
    raise Terminated


def stop_on_sigterm() -> None:
    """From now on, the first SIGTERM raises :class:`Terminated` in this process's main
    thread, and later ones are ignored: a rank's process leaves through its ``finally``
    blocks (removing, e.g., the temporary file of a checkpoint it was writing) even when
    its whole process group and then its parent each send one. A rank stuck where Python
    cannot run the handler is killed by its parent after a grace period."""
    signal.signal(signal.SIGTERM, _raise_terminated_once)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread.

    Does nothing off the main thread (Python runs handlers there only) or when SIGTERM
    already has a handler of the program's own (e.g. an enclosing block's).
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def interruptions_deferred() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM wait: the first reaches the handler it had as
    the block ends; a second one while it waits reaches it at once (a block stuck on
    something must not hold the way out). Blocking the signals would not do: the kernel
    may hand one to another thread, and Python still runs its handler in the main thread
    at once. Does nothing off the main thread (Python runs handlers there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = [s for s in (signal.SIGINT, signal.SIGTERM)
            if signal.getsignal(s) not in (signal.SIG_IGN, None)]
    handlers = {signum: signal.getsignal(signum) for signum in held}
    caught: list[tuple[int, Any]] = []

    def deliver(signum: int, frame: Any) -> None:
        handler = handlers[signum]
        if callable(handler):
            handler(signum, frame)
        else:  # SIG_DFL: as if it came now
            signal.signal(signum, handler)
            signal.raise_signal(signum)

    def hold(signum: int, frame: Any) -> None:
        if caught:  # asked again while held
            caught.clear()
            deliver(signum, frame)
        else:
            caught.append((signum, frame))

    for signum in held:
        signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum in held:
            signal.signal(signum, handlers[signum])
        for signum, frame in caught:
            deliver(signum, frame)


def exit_status(error: BaseException) -> int:
    """The exit status for an interruption: 143 when SIGTERM caused it (anywhere in its
    chain of causes), else 130 (Ctrl-C)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, Terminated):
            return 128 + signal.SIGTERM
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return 128 + signal.SIGINT
