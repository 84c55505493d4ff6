"""Argument checks shared by the trainer and the strategies.

An unknown keyword is a typo until proven otherwise: we raise a ``TypeError``
that names it, suggests the closest accepted name and lists all of them.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable

from exogym.base.plural import plural_noun


def unknown_args_error(owner: str, unknown: Iterable[str], accepted: Iterable[str]) -> TypeError:
    """Build the error for keywords ``owner`` does not accept."""
    unknown = sorted(unknown)
    accepted = sorted(set(accepted))
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, accepted, n=1)
        if close:
            hints.append(f"{name!r} (did you mean {close[0]!r}?)")
        else:
            hints.append(repr(name))
    return TypeError(
        f"{owner} got unknown {plural_noun(len(unknown), 'argument')} {', '.join(hints)}. "
        f"Accepted: {', '.join(accepted)}"
    )


def init_arg_names(cls: type) -> set[str]:
    """Named ``__init__`` parameters of ``cls`` and every class it inherits from."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in params:
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                names.add(p.name)
    return names
