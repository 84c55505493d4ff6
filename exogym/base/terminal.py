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
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console, JustifyMethod
from rich.rule import Rule
from rich.style import Style
from rich.text import Text

__all__ = ["RULE_WIDTH", "UNFOLDED_WIDTH", "output_console", "printable", "unprintable"]

#: Width given to output that is not a terminal: more than any table or line here needs,
#: so none is folded (a table takes its natural width, never this one).
UNFOLDED_WIDTH = 10_000
#: Width of a rule printed off a terminal.
RULE_WIDTH = 80


def unprintable(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on rather than show: control
    characters (NUL, escape, newline, ...) and format characters (the bidirectional
    overrides that reorder what follows, zero-width ones), as ``\\x1b``, ``\\u202e``."""
    return [_escaped(c) for c in text if unicodedata.category(c) in ("Cc", "Cf")]


def printable(text: str) -> str:
    """``text`` with every character :func:`unprintable` names written as its escape, so
    that text from elsewhere (the LAN, a file) shows as it is and cannot move the cursor,
    hide what follows or reorder it."""
    return "".join(_escaped(c) if unicodedata.category(c) in ("Cc", "Cf") else c
                   for c in text)


def _escaped(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 \
        else f"\\U{code:08x}"


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
