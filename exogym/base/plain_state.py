"""A nested training state as JSON plus a list of tensors: loading it runs no code.

Checkpoints and the state handed to a rank that rejoins are dicts, lists and tuples
of tensors, numbers and strings (a model's, an optimizer's, a strategy's, the random
generators'). Unpickling such a state would let whoever wrote the file, or sent the
bytes, run code on the reader. Here it is split instead into a JSON description and
the tensors it holds: the description names only the kinds below, and reading it
back builds nothing else.

- ``None``, booleans, ints, floats (``inf`` and ``nan`` too), strings: as JSON has them;
- a list: a JSON list; a tuple: ``{"t": [...]}``;
- a dict (any plain keys, their order kept): ``{"d": [[key, value], ...]}``, an
  ``OrderedDict`` with the ``_metadata`` torch's ``state_dict`` carries: ``"meta"``;
- a tensor: ``{"x": index}`` into the tensor list (:func:`to_plain`'s caller decides
  what the index means); a NumPy array: ``{"np": index}``, a tensor too;
- a NumPy scalar: its Python number; a ``torch.dtype``: ``{"dtype": "float32"}``;
  a ``torch.Size``: ``{"size": [...]}``.

Anything else (a namedtuple, a set, an object) is refused when the state is written,
naming where it stands, so that a state that saves is one that loads.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

#: A description deeper than this is refused when read (a state nests a few levels).
MAX_DEPTH = 64


class PlainStateError(ValueError):
    """A state holds something that cannot be written as plain data, or a description
    read back is not one this module writes."""


def to_plain(value: Any, on_tensor: Callable[[torch.Tensor], int], where: str = "state"
             ) -> Any:
    """``value`` as JSON-able data; each tensor is replaced by ``{"x": on_tensor(t)}``.

    Raises:
        PlainStateError: naming the place of a value that is not plain data.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and type(value) in (int, bool):
        return value
    if type(value) is float:
        return value
    if isinstance(value, torch.Tensor):
        return {"x": on_tensor(value)}
    if isinstance(value, np.ndarray):
        return {"np": on_tensor(torch.from_numpy(np.ascontiguousarray(value)))}
    if isinstance(value, np.generic):
        return to_plain(value.item(), on_tensor, where)
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if type(value) is list:
        return [to_plain(v, on_tensor, f"{where}[{i}]") for i, v in enumerate(value)]
    if type(value) is tuple:
        return {"t": [to_plain(v, on_tensor, f"{where}[{i}]") for i, v in enumerate(value)]}
    if type(value) in (dict, OrderedDict):
        pairs = []
        for k, v in value.items():
            if not (k is None or isinstance(k, (bool, int, float, str))) or \
                    isinstance(k, np.generic):
                raise PlainStateError(f"{where} has a key {k!r} of type {type(k).__name__}: "
                                      "a state's keys must be strings, numbers or None")
            pairs.append([k, to_plain(v, on_tensor, f"{where}[{k!r}]")])
        out: dict[str, Any] = {"d": pairs}
        meta = getattr(value, "_metadata", None)
        if meta is not None:
            out["meta"] = to_plain(meta, on_tensor, f"{where}._metadata")
        return out
    raise PlainStateError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}: "
                          "a state to save or hand over may hold only tensors, NumPy arrays, "
                          "numbers, strings, None, dtypes and lists, tuples and dicts of them; "
                          "return such values from state_dict()")


def from_plain(data: Any, tensor_at: Callable[[int], Any], depth: int = 0,
               numpy_of: Callable[[Any], Any] = lambda t: t.numpy()) -> Any:
    """The value :func:`to_plain` described, with tensor ``i`` from ``tensor_at(i)`` (and a
    NumPy array from ``numpy_of(tensor_at(i))``).

    Raises:
        PlainStateError: ``data`` holds anything :func:`to_plain` does not write.
    """
    if depth > MAX_DEPTH:
        raise PlainStateError(f"the state nests deeper than {MAX_DEPTH} levels")
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [from_plain(v, tensor_at, depth + 1, numpy_of) for v in data]
    if not isinstance(data, dict) or len(data) not in (1, 2):
        raise PlainStateError(f"not a state description: {type(data).__name__} {_short(data)}")
    if "d" in data and set(data) <= {"d", "meta"}:
        pairs = data["d"]
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and
                (p[0] is None or isinstance(p[0], (bool, int, float, str))) for p in pairs):
            raise PlainStateError(f"not a state description: a dict as {_short(pairs)}")
        items = [(k, from_plain(v, tensor_at, depth + 1, numpy_of)) for k, v in pairs]
        if "meta" not in data:
            return dict(items)
        out = OrderedDict(items)
        out._metadata = from_plain(data["meta"], tensor_at, depth + 1, numpy_of)  # type: ignore[attr-defined]
        return out
    if len(data) != 1:
        raise PlainStateError(f"not a state description: {_short(data)}")
    (tag, value), = data.items()
    if tag == "t" and isinstance(value, list):
        return tuple(from_plain(v, tensor_at, depth + 1, numpy_of) for v in value)
    if tag in ("x", "np") and type(value) is int:
        tensor = tensor_at(value)
        return numpy_of(tensor) if tag == "np" else tensor
    if tag == "dtype":
        return dtype_named(value)
    if tag == "size" and isinstance(value, list) and all(type(v) is int for v in value):
        return torch.Size(value)
    raise PlainStateError(f"not a state description: {_short(data)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def dtype_named(name: Any) -> torch.dtype:
    """The ``torch.dtype`` called ``name`` (``float32``).

    Raises:
        PlainStateError: no dtype has that name.
    """
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise PlainStateError(f"not a state description: unknown dtype {_short(name)}")
    return dtype


def dumps(data: Any) -> bytes:
    """A description as UTF-8 JSON (``inf`` and ``nan`` as JSON's ``Infinity``, ``NaN``)."""
    return json.dumps(data, separators=(",", ":")).encode("utf-8")


def loads(raw: bytes) -> Any:
    """A description from :func:`dumps`'s bytes.

    Raises:
        PlainStateError: the bytes are not such JSON (or nest without end).
    """
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PlainStateError(f"not a state description: {exc}") from None


def split(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``state`` as a JSON description and the tensors it holds, in order."""
    tensors: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> int:
        tensors.append(t)
        return len(tensors) - 1

    return dumps(to_plain(state, keep)), tensors


def join(description: bytes, tensors: list[torch.Tensor]) -> Any:
    """The state :func:`split` took apart.

    Raises:
        PlainStateError: the description is not one :func:`split` writes, or names a
            tensor that is not there.
    """

    def at(i: int) -> torch.Tensor:
        if not 0 <= i < len(tensors) or not isinstance(tensors[i], torch.Tensor):
            raise PlainStateError(f"the state description names tensor {i} of "
                                  f"{len(tensors)}")
        return tensors[i]

    return from_plain(loads(description), at)
