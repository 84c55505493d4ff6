"""A model's loss on a batch: how every rank calls the model, and what it may return.

The trainer takes models as their authors wrote them:

- **How it is called.** ``model(batch)``, as exo gym's models are (``forward(batch)``);
  or ``model(**batch)`` for a batch of named tensors whose names are ``forward``'s
  parameters, as a Hugging Face ``PreTrainedModel`` is called
  (``forward(input_ids=..., attention_mask=..., labels=...)``). A batch is given by
  name when it is a dict whose keys ``forward`` accepts (each a parameter of its own,
  or taken by its ``**kwargs``), at least one of them a named parameter, and every
  parameter ``forward`` requires is among them; otherwise it is given whole.
- **What it returns.** The loss as a scalar tensor; an output object with a ``loss``
  field (a ``transformers`` ``ModelOutput``); a dict with a ``"loss"`` entry; or a
  tuple (or list) whose first item is the loss (a ``transformers`` model with
  ``return_dict=False``).

One function serves every place a model is called: a rank's step and evaluation,
the check ``fit`` makes before any rank starts, the memory probe of
``minibatch_size='auto'``, and stacked ranks (:mod:`exogym.run.stack`, which calls
the model through ``torch.func.functional_call`` with the same arguments).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LossError", "by_name", "call_arguments", "checked_loss", "loss_of", "model_loss"]

#: What a model may return, for the messages that refuse something else.
RETURNS = ("return the loss itself (e.g. torch.nn.functional.cross_entropy(logits, labels)), "
           "an output with a .loss field, a dict with a \"loss\" entry, or a tuple whose first "
           "item is the loss")


class LossError(TypeError):
    """A model's forward returned no loss the trainer can train on; the message says what
    it returned and what to return instead."""


_MISSING = object()
# forward's function, the batch's keys -> whether the batch is given by name
_BY_NAME: dict[tuple[Any, frozenset[str]], bool] = {}


def _takes_by_name(forward: Any, keys: frozenset[str]) -> bool:
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature: given whole
        return False
    named = {p.name for p in parameters
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)
    required = [p for p in parameters if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return (bool(keys & named)
            and all(p.name in keys and p.kind is not p.POSITIONAL_ONLY for p in required)
            and (keys <= named or any_keyword))


def by_name(model: torch.nn.Module, batch: Any) -> bool:
    """Whether ``batch`` is given to ``model`` by name (``model(**batch)``; see the module)."""
    if not isinstance(batch, Mapping) or not batch or \
            not all(isinstance(k, str) for k in batch):
        return False
    forward = model.forward
    function = getattr(forward, "__func__", forward)
    keys = frozenset(batch)
    found = _BY_NAME.get((function, keys))
    if found is None:
        found = _BY_NAME[(function, keys)] = _takes_by_name(forward, keys)
    return found


def call_arguments(model: torch.nn.Module, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments ``model`` is called with on ``batch``."""
    if by_name(model, batch):
        return (), dict(batch)
    return (batch,), {}


def loss_of(output: Any) -> Any:
    """The loss in what a forward returned (see the module), or what stands in its place
    (None for an output whose loss is None); ``output`` itself when it holds none."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    loss = getattr(output, "loss", _MISSING)  # a ModelOutput leaves a None field out of its keys
    if loss is not _MISSING:
        return loss
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    return output


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def checked_loss(output: Any, batch: Any, called: str = "model.forward(batch)",
                 where: str = "") -> torch.Tensor:
    """The scalar loss tensor in ``output`` (shape ``()``).

    Args:
        output: what the forward returned.
        batch: the batch it was given (named in an error).
        called: how the model was called, for an error.
        where: words an error adds after "but" (e.g. " on a batch of 2 training samples").

    Raises:
        LossError: naming what ``output`` holds instead, and (an output whose loss is
            None, from a batch without ``labels``) that a transformers model computes its
            loss from labels.
    """
    loss = loss_of(output)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    said = f"{called} must return the loss as a scalar tensor, but{where} it returned"
    if loss is None:
        hint = ""
        if isinstance(batch, Mapping) and "labels" not in batch:
            keys = ", ".join(map(str, batch)) or "none"
            hint = (f"; the batch has no \"labels\" (its keys: {keys}), and a transformers "
                    "model computes its loss only when given labels: give each sample "
                    "\"labels\" (for a causal language model, a copy of its input_ids)")
        raise LossError(f"{said} {_describe(output)} whose loss is None{hint}")
    if loss is output:
        fix = ": reduce it to one number (e.g. .mean() over the samples)" \
            if isinstance(loss, torch.Tensor) else f"; {RETURNS}"
        what = f"a {type(output).__name__} without a \"loss\" entry" \
            if isinstance(output, Mapping) else _describe(output)
        raise LossError(f"{said} {what}{fix}")
    part = "whose first item is" if isinstance(output, (tuple, list)) else "whose loss is"
    raise LossError(f"{said} {_describe(output)} {part} {_describe(loss)}; {RETURNS}")


def model_loss(model: torch.nn.Module, batch: Any, where: str = "") -> torch.Tensor:
    """``model``'s loss on ``batch`` as a scalar tensor (shape ``()``), the model called
    and its output read as the module says.

    Args:
        model: the model.
        batch: one minibatch as the data loader gives it.
        where: words an error adds after "but" (e.g. " on a batch of 2 training
            samples").

    Raises:
        LossError: the output holds no scalar loss.
    """
    args, kwargs = call_arguments(model, batch)
    called = "model.forward(**batch)" if kwargs else "model.forward(batch)"
    return checked_loss(model(*args, **kwargs), batch, called, where)
