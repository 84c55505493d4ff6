"""Make the docstrings render in the API reference as they read in the source.

Two things stand between a docstring and its Markdown page:

- Sphinx roles (``:class:`Strategy```, ``:mod:`exogym.run.balance```), which Markdown
  would print as they are. Each becomes inline code (`` `Strategy` ``): code
  rather than a link, since many name internal modules, and a link to a page that
  does not exist would fail the strict build.
- Class attributes documented by ``#:`` comments: the reference reads the
  imported objects (see ``mkdocs.yml``), where such an attribute (``balance_modes
  = ()``) has no docstring of its own and would show its value's type's (``tuple``'s
  "Built-in immutable sequence"). Those borrowed docstrings are dropped, and
  the attribute is left out like any undocumented member.
"""

from __future__ import annotations

import builtins
import inspect
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj|const):`~?([^`]+)`")
BUILTIN_DOCSTRINGS = {
    inspect.cleandoc(value.__doc__)
    for value in vars(builtins).values()
    if isinstance(value, type) and value.__doc__
} | {inspect.cleandoc(type(None).__doc__ or "")}


class CleanDocstrings(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        _clean(pkg, set())


def _clean(obj: griffe.Object, seen: set[str]) -> None:
    if obj.path in seen:
        return
    seen.add(obj.path)
    if obj.docstring is not None:
        if obj.is_attribute and inspect.cleandoc(obj.docstring.value) in BUILTIN_DOCSTRINGS:
            obj.docstring = None
        else:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)
    for member in obj.members.values():
        if not member.is_alias:
            _clean(member, seen)
