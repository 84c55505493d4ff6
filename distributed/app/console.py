"""What the two faces share: the console they print to, how a long task shows its stages,
and one way of reporting errors.

``cli_typer.py`` and ``wizard.py`` print through :func:`make_console` and wrap
each command in :func:`reported_errors`, so an error a person can fix (a bad
profile, hosts file, option or host) ends with one readable paragraph and exit
code 2, a run that started and failed with exit code 1, and only ``--debug``
shows a traceback. Imports only typer and rich at first, so ``--help`` stays fast.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn, TextIO

import typer
from rich.console import Console

from exogym.base.escapes import printable
from exogym.base.plural import plural as plural  # the faces count with it (they import app only)
from exogym.base.stop_signal import exit_status as exit_status
from exogym.base.stop_signal import sigterm_as_interrupt as sigterm_as_interrupt
from exogym.base.terminal import output_console
from exogym.base.terminal import shown as shown  # run folders' text, in cells and lines

#: Told as each stage of a long task starts: what it does, stages done, stages in all.
StageReport = Callable[[str, int, int], None]


def plain(value: object, *, lines: bool = False) -> str:
    """``value`` with its control characters written as escapes (:func:`shown`), for a
    message printed with ``markup=False``; ``lines`` keeps its line breaks."""
    return printable(str(value), keep="\n" if lines else "")


def make_console(*, stderr: bool = False) -> Console:
    """Standard output (or error); when it is not a terminal (a log, a pipe), lines and
    tables are printed whole, never folded at 80 columns
    (:func:`exogym.base.terminal.output_console`)."""
    return output_console(stderr=stderr, highlight=False)


@contextlib.contextmanager
def stage_progress(console: Console, title: str,
                   log_prefix: str | None = None) -> Iterator[StageReport]:
    """Show a long task's stages as they start.

    In a terminal: a spinner, the title and the stage, a bar, the count and the time
    (rich's progress display, as training's), gone when the task ends. Elsewhere (a log,
    a pipe): one line per stage after ``log_prefix``, or nothing without one.

    Yields:
        What the task calls as each stage starts: ``report(what, done, total)``.
    """
    if not console.is_terminal:
        def log(what: str, done: int, total: int) -> None:
            if log_prefix is not None and done < total:
                console.print(f"{log_prefix} {what} ({done + 1} of {total})", markup=False,
                              highlight=False)

        yield log
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task(title, total=None)

        def show(what: str, done: int, total: int) -> None:
            bar.update(task, description=f"{title}: {what}", completed=done, total=total)

        yield show


def fail(message: str, code: int, debug: bool, exc: BaseException | None = None) -> NoReturn:
    """Print one readable paragraph on stderr (and the traceback with --debug), then exit."""
    err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
    if debug and exc is not None:
        err.print(plain("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                        lines=True), markup=False, end="")
    err.print(f"error: {plain(message, lines=True)}", markup=False, style="red")
    raise typer.Exit(code)


#: Libraries whose own log lines (tracebacks included) a person sees only with --debug.
QUIET_LOGGERS = ("paramiko",)


def quiet_library_logs(debug: bool) -> None:
    """Silence the log output of :data:`QUIET_LOGGERS` (Python's last-resort handler would
    print their warnings, tracebacks included, on stderr); with ``debug``, show it on stderr."""
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if getattr(handler, "_exogym", False):
                logger.removeHandler(handler)
        handler = logging.StreamHandler() if debug else logging.NullHandler()
        handler._exogym = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False


def _our_folders() -> tuple[Path, ...]:
    """The folders of this project's packages (exogym may be installed elsewhere)."""
    folders = [Path(__file__).resolve().parents[1]]
    spec = importlib.util.find_spec("exogym")
    if spec is not None and spec.origin:
        folders.append(Path(spec.origin).resolve().parent)
    return tuple(folders)


_default_showwarning = warnings.showwarning


def plain_warnings(debug: bool) -> None:
    """Show a warning raised from this project's code as one plain line on stderr
    (``warning: ...`` in yellow, without Python's file, line and source line); with
    ``debug``, and for other libraries' warnings, Python's usual form."""
    ours = _our_folders()

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        try:
            mine = any(Path(filename).resolve().is_relative_to(f) for f in ours)
        except (OSError, ValueError):
            mine = False
        if debug or not mine:
            _default_showwarning(message, category, filename, lineno, file, line)
            return
        Console(stderr=True, highlight=False, soft_wrap=True, emoji=False).print(
            f"warning: {plain(message, lines=True)}", style="yellow", markup=False)

    warnings.showwarning = show


@contextlib.contextmanager
def reported_errors(ctx: typer.Context, debug: bool) -> Iterator[bool]:
    """Turn the errors a person can fix into exit code 2, a failed run into 1.

    Yields whether tracebacks are shown (``--debug`` on the command or the app).
    """
    # Here rather than at the top: these modules load rich tables and the profiles, which a
    # bare ``--help`` does not need (python -m bench.cli_help_time keeps it under half a second).
    from exogym.base.io import DiskFullError

    from ..hosts.hostsfile import HostsFileError
    from ..hosts.preflight import PreflightError
    from ..hosts.sync import NoSFTPError
    from ..profiles.profile import ProfileError
    from .run import RunFailedError

    debug = debug or bool((ctx.obj or {}).get("debug"))
    quiet_library_logs(debug)
    plain_warnings(debug)
    try:
        yield debug
    except typer.Exit:
        raise
    except KeyboardInterrupt as exc:
        fail("interrupted (any ranks already started were stopped)", exit_status(exc), debug,
             exc)
    except RunFailedError as exc:
        fail(f"the run failed: {exc}", 1, debug, exc)
    except DiskFullError as exc:
        fail(f"{exc}; free some space there and run again", 1, debug, exc)
    except (ProfileError, HostsFileError, PreflightError, NoSFTPError) as exc:
        fail(str(exc), 2, debug, exc)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        fail(str(exc), 2, debug, exc)
    except Exception as exc:  # noqa: BLE001 - anything else still deserves one readable paragraph
        hint = "" if debug else " (run again with --debug for the traceback)"
        fail(f"{type(exc).__name__}: {exc}{hint}", 1, debug, exc)
