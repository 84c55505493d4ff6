"""Counts in words: "1 rank", "2 ranks" -- the one helper every message uses for a number
of things, so that none reads "1 ranks on 1 nodes" or hedges with "rank(s)"."""

from __future__ import annotations

__all__ = ["plural", "plural_noun"]


def plural_noun(count: int | float, noun: str, plural_form: str | None = None) -> str:
    """``noun`` as ``count`` of them are called: the singular for exactly 1, else the plural.

    The plural is ``plural_form`` when given, else the English rule for regular nouns:
    ``-s``; ``-es`` after s, x, z, ch, sh (``process`` -> ``processes``); ``-ies`` for a
    consonant and ``y`` (``strategy`` -> ``strategies``).

    Args:
        count: how many there are.
        noun: the singular.
        plural_form: the plural of an irregular noun.
    """
    if count == 1:
        return noun
    if plural_form is not None:
        return plural_form
    if noun.endswith(("s", "x", "z", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and len(noun) > 1 and noun[-2].lower() not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def plural(count: int | float, noun: str, plural_form: str | None = None) -> str:
    """``count`` and its noun: ``plural(1, "rank")`` is ``"1 rank"``, ``plural(3, "host")``
    ``"3 hosts"``, ``plural(0, "strategy")`` ``"0 strategies"`` (see :func:`plural_noun`)."""
    return f"{count} {plural_noun(count, noun, plural_form)}"
