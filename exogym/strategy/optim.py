"""OptimSpec: an optimizer class and its arguments, built later on a model.

A strategy is configured before any rank exists, so it holds a recipe rather
than an optimizer; each rank builds the optimizer on its own model copy.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from exogym.base.plural import plural_noun

from .muon import MuonAdamW, muon_param_groups

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
    "adamax": torch.optim.Adamax,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
    "muon": MuonAdamW,  # Muon on hidden matrices, AdamW on the rest
}


def _accepted_kwargs(cls: type) -> set[str] | None:
    """Keyword names ``cls(params, ...)`` accepts, or None if it takes ``**kwargs``."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {name for name in params if name not in ("self", "params")}


class OptimSpec:
    """A recipe for an optimizer: the class plus its keyword arguments.

    Args:
        cls: a ``torch.optim.Optimizer`` subclass (default AdamW), or a name such
            as ``'adam'``, ``'adamw'``, ``'sgd'``, ``'muon'`` (:class:`MuonAdamW`: Muon
            on the hidden matrices, AdamW on the rest; ``adamw_lr=`` and the other
            ``adamw_*`` arguments set the AdamW part).
        **kwargs: arguments for the optimizer (``lr``, ``weight_decay``, ...);
            checked against the optimizer's signature now, not on first use.
    """

    def __init__(self, cls: type[torch.optim.Optimizer] | str = torch.optim.AdamW, **kwargs: Any):
        if isinstance(cls, str):
            cls = optimizer_class(cls)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(f"OptimSpec needs a torch.optim.Optimizer subclass, got {cls!r}")
        accepted = _accepted_kwargs(cls)
        if accepted is not None:
            unknown = sorted(set(kwargs) - accepted)
            if unknown:
                raise TypeError(
                    f"{cls.__name__} got unknown {plural_noun(len(unknown), 'argument')} "
                    f"{', '.join(unknown)}; "
                    f"accepted: {', '.join(sorted(accepted))}"
                )
        check_optimizer_args(cls, kwargs)
        self.cls = cls
        self.kwargs = dict(kwargs)

    @classmethod
    def from_string(cls, name: str, **kwargs: Any) -> OptimSpec:
        """Build a spec from an optimizer name (``'adam'``, ``'adamw'``, ``'sgd'``, ...)."""
        return cls(optimizer_class(name), **kwargs)

    def with_overrides(self, **kwargs: Any) -> OptimSpec:
        """A copy with some arguments replaced (e.g. ``lr``)."""
        return OptimSpec(self.cls, **{**self.kwargs, **kwargs})

    def build(self, model_or_params) -> torch.optim.Optimizer:
        """Create the optimizer over the trainable parameters of a model (or a param list).

        ``MuonAdamW`` built from a model splits it by :func:`muon_param_groups`.
        """
        if isinstance(model_or_params, torch.nn.Module) and self.cls is MuonAdamW:
            params = muon_param_groups(model_or_params)
            if not any(group["params"] for group in params):
                params = []
        elif isinstance(model_or_params, torch.nn.Module):
            params = [p for p in model_or_params.parameters() if p.requires_grad]
        else:
            params = list(model_or_params)
        if not params:
            raise ValueError("the model has no trainable parameters (none has requires_grad=True)")
        fast = _cpu_implementation(self.cls, self.kwargs, params)
        if fast:
            try:
                return self.cls(params, **self.kwargs, **fast)
            except (RuntimeError, ValueError, TypeError):
                pass  # e.g. a dtype the fused kernel lacks: torch's own default below
        return self.cls(params, **self.kwargs)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"OptimSpec({self.cls.__name__}{', ' + args if args else ''})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OptimSpec) and (self.cls, self.kwargs) == (other.cls, other.kwargs)

    def __config__(self) -> dict[str, Any]:
        return {"optimizer": self.cls.__name__, **{k: _plain(v) for k, v in self.kwargs.items()}}


#: Optimizer arguments checked by name: (lowest, whether the lowest is allowed, highest
#: or None, whether the highest is allowed).
_RANGES: dict[str, tuple[float, bool, float | None, bool]] = {
    "lr": (0.0, False, None, False),
    "adamw_lr": (0.0, False, None, False),
    "momentum": (0.0, True, 1.0, False),
    "dampening": (0.0, True, 1.0, True),
    "weight_decay": (0.0, True, None, False),
    "adamw_weight_decay": (0.0, True, None, False),
    "eps": (0.0, True, None, False),
    "adamw_eps": (0.0, True, None, False),
    "alpha": (0.0, True, None, False),
    "rho": (0.0, True, 1.0, True),
}


def _range_text(low: float, low_in: bool, high: float | None, high_in: bool) -> str:
    if high is None:
        return f"a number > {low:g}" if not low_in else f"a number >= {low:g}"
    return (f"a number in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}")


def check_number(name: str, value: Any, low: float, low_in: bool, high: float | None,
                  high_in: bool, cls_name: str) -> None:
    """Refuse ``value`` unless it is a finite real number (not a flag) within ``low``..``high``
    (each end in or out of the range as ``low_in``/``high_in`` say; ``high`` None: no upper
    end), naming ``cls_name`` and ``name`` and the range."""
    import math

    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value >= low if low_in else value > low) and (
            high is None or (value <= high if high_in else value < high))
    if not ok:
        raise ValueError(f"{cls_name}: {name} must be {_range_text(low, low_in, high, high_in)}, "
                         f"got {value!r}")


def check_optimizer_args(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> None:
    """Refuse an optimizer argument out of its range, naming it, before any optimizer exists.

    ``lr``, ``momentum``, ``weight_decay``, ``eps``, ``betas`` and the other common ones are
    checked by name; a torch optimizer is then built over one stand-in parameter, so that
    whatever else torch would refuse on first use is refused now, with the arguments named.

    Raises:
        ValueError: naming the optimizer, the argument and its valid range.
    """
    name = cls.__name__
    for key, value in kwargs.items():
        if key in _RANGES:
            check_number(key, value, *_RANGES[key], name)
        elif key in ("betas", "adamw_betas"):
            if not (isinstance(value, (tuple, list)) and len(value) == 2):
                raise ValueError(f"{name}: {key} must be two numbers in [0, 1), got {value!r}")
            for i, beta in enumerate(value):
                check_number(f"{key}[{i}]", beta, 0.0, True, 1.0, False, name)
    if cls.__module__.startswith("torch.optim"):
        try:
            cls([torch.zeros(1, requires_grad=True)], **kwargs)
        except (ValueError, TypeError, RuntimeError) as exc:
            args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            raise ValueError(f"{name}({args}) is refused by torch: {exc}") from None


def _cpu_implementation(cls: type, kwargs: dict[str, Any], params: list) -> dict[str, Any]:
    """The fastest implementation of ``cls`` for CPU parameters, when the user chose none.

    On the CPU torch defaults to a Python loop of small operations per tensor;
    the fused kernel (Adam, AdamW, SGD, Adagrad) does one pass per tensor, and
    ``foreach`` batches the loop's operations. Both compute the same update
    (the fused kernel rounds differently in the last bits). An explicit
    ``fused=`` or ``foreach=`` is always honoured, and other devices keep
    torch's own choice.
    """
    if "fused" in kwargs or "foreach" in kwargs or kwargs.get("differentiable"):
        return {}
    tensors = []
    for p in params:
        group = p.get("params") if isinstance(p, dict) else [p]
        if isinstance(group, torch.Tensor):
            group = [group]
        if not isinstance(group, (list, tuple)):
            return {}  # e.g. a generator: reading it here would leave the optimizer none
        tensors.extend(group)
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point()
               for t in tensors):
        return {}
    accepted = _accepted_kwargs(cls) or set()
    if "fused" in accepted:
        return {"fused": True}
    if "foreach" in accepted:
        return {"foreach": True}
    return {}


def _plain(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class for a name such as ``'adamw'``; a clear error lists the names."""
    try:
        return OPTIMIZERS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown optimizer {name!r}; use one of {', '.join(sorted(OPTIMIZERS))} "
            "or pass an OptimSpec(torch.optim.X, ...)"
        ) from None


def ensure_optim_spec(
    spec: OptimSpec | str | type | None, default: OptimSpec | None = None, **kwargs: Any
) -> OptimSpec | None:
    """Normalise ``spec`` (a spec, a name, an optimizer class, or None for ``default``)."""
    if spec is None:
        return default
    if isinstance(spec, OptimSpec):
        return spec.with_overrides(**kwargs) if kwargs else spec
    if isinstance(spec, str):
        return OptimSpec.from_string(spec, **kwargs)
    if isinstance(spec, type) and issubclass(spec, torch.optim.Optimizer):
        return OptimSpec(spec, **kwargs)
    raise TypeError(
        f"expected an OptimSpec, an optimizer name or an optimizer class, got {spec!r}"
    )
