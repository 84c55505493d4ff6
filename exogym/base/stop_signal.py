"""SIGTERM ends a run as Ctrl-C does.

``kill``, systemd, SLURM and container runtimes stop a process with SIGTERM, whose
default ends Python at once: no ``finally`` runs, so the trace stays a temporary
file, the ranks are left to die on their own and no resume command is printed.
:func:`sigterm_as_interrupt` turns SIGTERM into :class:`Terminated`, a
``KeyboardInterrupt``, raised in the main thread, so every path that handles
Ctrl-C handles it too; :func:`exit_status` tells the two apart for the exit code
(128 + the signal's number: 130 for SIGINT, 143 for SIGTERM).
:func:`interruptions_deferred` holds both back over a few lines that must not be
cut in two (a message taken off a pipe and not yet kept); :func:`done_whole` does so
for a block that any thread of a process may run, such as a file's rename and the
message that announces it, and :func:`finish_whole_blocks` lets a process that leaves
with ``os._exit`` wait for those under way first.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Terminated", "done_whole", "exit_status", "finish_whole_blocks",
           "interruptions_deferred", "sigterm_as_interrupt", "stop_on_sigterm"]


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM."""

    def __init__(self) -> None:
        super().__init__("stopped by SIGTERM")


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


def _raise_terminated_once(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the way out
    raise Terminated


#: Handlers that act on the first signal only (later ones are ignored): while one is
#: held, a repeat is not a person asking again but the same stop sent twice.
_ONE_SHOT: set[Any] = {_raise_terminated_once}


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
    something must not hold the way out), except where that handler acts on the first
    only (:func:`stop_on_sigterm`'s: a rank gets SIGTERM from its process group and again
    from its parent, and its parent kills it if it is stuck). Blocking the signals would
    not do: the kernel may hand one to another thread, and Python still runs its handler
    in the main thread at once. Does nothing off the main thread (Python runs handlers
    there only)."""
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
        if not caught:
            caught.append((signum, frame))
        elif handlers[signum] not in _ONE_SHOT:  # asked again while held
            caught.clear()
            deliver(signum, frame)

    if held and all(handlers[signum] in _ONE_SHOT for signum in held):
        _ONE_SHOT.add(hold)  # a block inside this one holds a repeat as this one does
    try:
        for signum in held:  # in the try: one that lands between two still restores both
            signal.signal(signum, hold)
        yield
    finally:
        for signum in held:
            signal.signal(signum, handlers[signum])
        _ONE_SHOT.discard(hold)
        for signum, frame in caught:
            deliver(signum, frame)


class _WholeBlocks:
    """The :func:`done_whole` blocks under way in this process, and whether new ones may
    begin."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.running = 0
        self.closed = False


_whole = _WholeBlocks()


@contextlib.contextmanager
def done_whole() -> Iterator[None]:
    """A block that is done whole or not begun: on the main thread, interruptions wait
    until it ends (:func:`interruptions_deferred`); on any thread, a process that is
    about to leave waits for it (:func:`finish_whole_blocks`), and once that has begun
    the block never begins (its thread waits, until the process leaves)."""
    whole = _whole
    with interruptions_deferred():
        with whole.changed:
            while whole.closed:
                whole.changed.wait()
            whole.running += 1
        try:
            yield
        finally:
            with whole.changed:
                whole.running -= 1
                whole.changed.notify_all()


def finish_whole_blocks(timeout_s: float) -> bool:
    """Before this process leaves (``os._exit``): let no :func:`done_whole` block begin
    any more, and wait up to ``timeout_s`` for those under way in other threads to end.
    False when one was still running at the deadline. Call it from a thread that is not
    inside such a block."""
    with _whole.changed:
        _whole.closed = True
        return _whole.changed.wait_for(lambda: _whole.running == 0, timeout_s)


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
