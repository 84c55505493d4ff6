"""Make the API reference see names a package exports lazily.

``exogym`` and ``exogym.strategy`` list their public names in ``__all__`` but
import them on first use (a module ``__getattr__``), so ``import exogym`` stays
light. Griffe reads source statically and cannot follow such an import, so
``::: exogym.Trainer`` would not be found. After a package is loaded, this
extension imports each module that exports a name griffe did not see, asks
Python where that name really lives (``__module__``, ``__qualname__``), and
adds an alias to it: the docs name only the public paths, and keep working when
the defining modules move.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import griffe


class LazyExports(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for module in _modules(pkg):
            missing = [name for name in module.exports or () if name not in module.members]
            if not missing:
                continue
            runtime = importlib.import_module(module.path)
            for name in missing:
                value = getattr(runtime, name)
                if inspect.ismodule(value):
                    target = value.__name__
                elif hasattr(value, "__module__") and hasattr(value, "__qualname__"):
                    target = f"{value.__module__}.{value.__qualname__}"
                else:
                    continue  # a constant: nothing says where it is defined, and no page names one
                module.set_member(name, griffe.Alias(name, target, parent=module))


def _modules(module: griffe.Module):
    yield module
    for member in module.modules.values():
        if not member.is_alias:
            yield from _modules(member)
