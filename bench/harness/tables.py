"""Tables of figures: printed with rich in the terminal, or as markdown lines for a report.

Columns named in ``left`` are aligned left, the others (figures) right.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any


def rich_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], *,
               left: Collection[str] = (), no_wrap: bool | Collection[str] = False,
               **options: Any) -> Any:
    """A ``rich.table.Table`` of ``rows`` (each cell as ``str``).

    Args:
        no_wrap: True, or the columns whose cells must stay on one line.
        options: for ``Table`` itself (``title_justify="left"``).
    """
    from rich.table import Table

    table = Table(title=title, **options)
    for name in columns:
        keep = no_wrap if isinstance(no_wrap, bool) else name in no_wrap
        table.add_column(name, justify="left" if name in left else "right", no_wrap=keep)
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    return table


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], *,
                left: Collection[str] = (), no_wrap: bool | Collection[str] = False,
                width: int | None = None, console: Any = None, **options: Any) -> None:
    """Print :func:`rich_table` on ``console`` (a new one ``width`` wide when not given)."""
    if console is None:
        from rich.console import Console

        console = Console(width=width)
    console.print(rich_table(title, columns, rows, left=left, no_wrap=no_wrap, **options))


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *,
                   left: Collection[str] = ()) -> list[str]:
    """The lines of a markdown table: the header, the alignment row, one line per row."""
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "".join("---|" if name in left else "---:|" for name in columns)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines
