"""The code blocks of the project's Markdown pages, for tests that run them as written.

A page's examples are tested from the page itself, so an example that stops working
fails a test and one that changes is tested as changed.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def code_block(page: str, after: str, lang: str) -> str:
    """The first ``lang`` code block after the text ``after`` (a heading or a sentence)
    in ``page``, a path from the project's root such as ``"docs/hosts.md"``."""
    text = (ROOT / page).read_text()
    if after not in text:
        raise AssertionError(f"{page} no longer says {after!r}: update the test that reads it")
    rest = text[text.index(after):]
    fence = f"```{lang}\n"
    if fence not in rest:
        raise AssertionError(f"{page} has no {lang} code block after {after!r}")
    block = rest[rest.index(fence) + len(fence):]
    return block[:block.index("```")]


def code_lines(page: str, after: str, lang: str) -> list[str]:
    """The non-blank lines of :func:`code_block`'s block."""
    return [line for line in code_block(page, after, lang).splitlines() if line.strip()]


if __name__ == "__main__":  # .ci/run reads the README's first command and a docs snippet with it
    import sys

    page, after, lang = sys.argv[1:]
    print(code_block(page, after, lang), end="")
