"""The console every message and table is printed to: the terminal's width on a terminal,
and no folding at all elsewhere.

rich fits its output to 80 columns when it cannot find a terminal, so a log file,
a pipe or CI's output got tables folded cell by cell and long lines broken mid-path.
Off a terminal, :func:`output_console` prints text lines whole (soft wrap) and
gives tables the room their widest row needs; a rule (a heading line) stays 80
columns. ``COLUMNS``, when set, wins everywhere, as it does for rich itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console, JustifyMethod
from rich.rule import Rule
from rich.style import Style
from rich.text import Text

from .escapes import printable, unprintable

__all__ = ["RULE_WIDTH", "UNFOLDED_WIDTH", "output_console", "printable", "shown",
           "unprintable"]

#: Width given to output that is not a terminal: more than any table or line here needs,
#: so none is folded (a table takes its natural width, never this one).
UNFOLDED_WIDTH = 10_000
#: Width of a rule printed off a terminal.
RULE_WIDTH = 80


def shown(value: object) -> Text:
    """``value`` as text to print or put in a table cell, whoever wrote it (a run folder,
    a trace, an error from a host): its control characters written as escapes
    (``\\x1b``: no escape sequence reaches the terminal, no window title, link, clipboard
    write or cursor move) and its brackets shown as they are, never read as markup."""
    return Text(printable(str(value)))


class _UnfoldedConsole(Console):
    """A console for a file or a pipe: soft-wrapped lines, tables at their natural width,
    rules of :data:`RULE_WIDTH`."""

    def rule(self, title: str | Text = "", *, characters: str = "─",
             style: str | Style = "rule.line", align: JustifyMethod = "center") -> None:
        self.print(Rule(title=title, characters=characters, style=style, align=align),
                   width=RULE_WIDTH, soft_wrap=False)


def output_console(*, stderr: bool = False, **kwargs: Any) -> Console:
    """A rich ``Console`` on standard output (or error): the terminal's width on a
    terminal; off one, nothing folded (see the module's docstring).

    Args:
        stderr: print to standard error.
        **kwargs: more ``Console`` arguments (``highlight``, ...); not ``width``. Emoji
            codes are off unless asked for: ``:-1:`` in a person's value stays as written.
    """
    kwargs.setdefault("emoji", False)
    console = Console(stderr=stderr, **kwargs)
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return _UnfoldedConsole(stderr=stderr, width=UNFOLDED_WIDTH, soft_wrap=True, **kwargs)


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Within the block, what this process and the processes it starts write to standard
    output goes to standard error (a command whose output is one JSON object keeps its
    standard output for that object)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
