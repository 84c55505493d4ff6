"""Muon for the hidden weight matrices, AdamW for the rest: one optimizer object.

MuLoCo (Thérien et al. 2025, arXiv 2505.23725) runs DiLoCo with Muon as the
inner optimizer. Muon orthogonalizes each 2-D weight matrix's momentum with a
few Newton-Schulz iterations; it is meant for the *hidden* matrices only. The
rule used here, Muon's usual one:

- **Muon**: every trainable 2-D parameter, except those below;
- **AdamW**: the parameters of ``nn.Embedding`` / ``nn.EmbeddingBag`` modules
  (so also a head whose weight is tied to an embedding), the output head (every
  ``nn.Linear`` whose name ends in ``head``, and the last ``nn.Linear`` the model
  registers, which is where nanoGPT-style models and classifiers keep it),
  and every parameter that is not 2-D: biases, norms, convolution kernels
  (``torch.optim.Muon`` takes 2-D parameters only).

:class:`MuonAdamW` steps both optimizers as one, so a strategy, a learning-rate
schedule and a checkpoint see one object: its ``param_groups`` are the two
optimizers' groups (Muon's first), and a schedule scales both. Name it
``inner_optim='muon'`` or ``OptimSpec('muon', lr=..., adamw_lr=...)``.

Cost: ``torch.optim.Muon`` runs its Newton-Schulz iterations in bfloat16, which
is fast on GPUs and slow on most CPUs: on chargpt's eight 128-wide matrices a
step took about 1 s on one CPU thread here, against 1 ms for AdamW.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["MuonAdamW", "muon_param_groups"]


def muon_param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The model's trainable parameters as a Muon group and an AdamW group (rule above)."""
    embedded = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                for p in m.parameters()}
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    heads = [m for name, m in linears if name.split(".")[-1].endswith("head")]
    if linears:
        heads.append(linears[-1][1])
    head_params = {id(p) for m in heads for p in m.parameters()}
    muon, adamw = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        hidden = p.ndim == 2 and id(p) not in embedded and id(p) not in head_params
        (muon if hidden else adamw).append(p)
    return [{"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}]


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the hidden 2-D matrices, ``torch.optim.AdamW`` on the rest.

    Built from a model (``OptimSpec('muon').build(model)``, which a strategy does)
    the split follows :func:`muon_param_groups`. Given parameters directly, a group
    may say ``{"params": [...], "use_muon": True}``; plain tensors go to Muon when
    they are 2-D.

    With the default ``adjust_lr_fn='match_rms_adamw'`` Muon scales its update to
    AdamW's size (Moonshot's rule), so one learning rate serves both; for Keller
    Jordan's original scaling give ``adjust_lr_fn='original'`` and a larger Muon
    rate, e.g. ``OptimSpec('muon', lr=0.02, adamw_lr=3e-3, adjust_lr_fn='original')``.
    A strategy's ``lr=`` sets ``lr`` (and AdamW's too unless ``adamw_lr`` is given).

    Args:
        params: parameters or parameter groups (see above).
        lr: Muon's learning rate (and AdamW's when ``adamw_lr`` is None).
        weight_decay: decoupled weight decay of both (AdamW's unless ``adamw_weight_decay``).
        momentum: Muon's momentum.
        nesterov: Nesterov momentum for Muon.
        ns_steps: Newton-Schulz iterations per Muon step.
        adjust_lr_fn: ``'match_rms_adamw'`` or ``'original'`` (see above).
        adamw_lr: AdamW's learning rate (default: ``lr``).
        adamw_betas: AdamW's betas.
        adamw_eps: AdamW's epsilon.
        adamw_weight_decay: AdamW's weight decay (default: ``weight_decay``).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
    ):
        if adjust_lr_fn not in ("match_rms_adamw", "original"):
            raise ValueError(f"adjust_lr_fn must be 'match_rms_adamw' or 'original', "
                             f"got {adjust_lr_fn!r}")
        muon_groups, adamw_groups = [], []
        for group in params:
            if isinstance(group, dict):
                group = dict(group)
                use_muon = group.pop("use_muon", None)
                tensors = list(group["params"])
                if use_muon is None:
                    muon_groups.append({**group, "params": [t for t in tensors if t.ndim == 2]})
                    adamw_groups.append({**group, "params": [t for t in tensors if t.ndim != 2]})
                else:
                    (muon_groups if use_muon else adamw_groups).append({**group, "params": tensors})
            else:
                (muon_groups if group.ndim == 2 else adamw_groups).append({"params": [group]})
        muon_groups = [g for g in muon_groups if g["params"]]
        adamw_groups = [g for g in adamw_groups if g["params"]]
        for group in muon_groups:
            bad = [tuple(t.shape) for t in group["params"] if t.ndim != 2]
            if bad:
                raise ValueError(f"Muon takes 2-D parameters only; got shapes {bad} in a "
                                 "use_muon group: put them in a group with use_muon=False")
        self.muon = torch.optim.Muon(
            muon_groups, lr=lr, weight_decay=weight_decay, momentum=momentum,
            nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
        ) if muon_groups else None
        adamw_kwargs = dict(lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas),
                            eps=adamw_eps,
                            weight_decay=weight_decay if adamw_weight_decay is None
                            else adamw_weight_decay)
        self.adamw = _adamw(adamw_groups, adamw_kwargs) if adamw_groups else None
        parts = [o for o in (self.muon, self.adamw) if o is not None]
        if not parts:
            raise ValueError("MuonAdamW got no parameters")
        defaults = dict(lr=lr, adamw_lr=adamw_kwargs["lr"])
        super().__init__([t for o in parts for g in o.param_groups for t in g["params"]], defaults)
        # The inner optimizers' own group dicts: a schedule that sets group["lr"] sets theirs.
        self.param_groups = [g for o in parts for g in o.param_groups]
        self._built = True

    def _parts(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Muon step on the hidden matrices and one AdamW step on the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self._parts():
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self._parts():
            optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_built", False):
            raise NotImplementedError("MuonAdamW cannot take parameter groups after it is built; "
                                      "build a new one with every group")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict() if self.muon is not None else None,
                "adamw": self.adamw.state_dict() if self.adamw is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name in ("muon", "adamw"):
            optimizer, saved = getattr(self, name), state_dict.get(name)
            if (optimizer is None) != (saved is None):
                raise ValueError(f"this MuonAdamW {'has no' if optimizer is None else 'has an'} "
                                 f"{name} part but the saved state {'has' if saved else 'lacks'} "
                                 "one: it was saved for another model")
            if optimizer is not None:
                optimizer.load_state_dict(saved)
        # Loading gives the inner optimizers new group dicts: share those again.
        self.param_groups = [g for o in self._parts() for g in o.param_groups]


def _adamw(groups: list[dict[str, Any]], kwargs: dict[str, Any]) -> torch.optim.AdamW:
    """AdamW, with the fused CPU kernel where every parameter is a CPU float tensor."""
    tensors = [t for g in groups for t in g["params"]]
    if all(t.device.type == "cpu" and t.is_floating_point() for t in tensors):
        try:
            return torch.optim.AdamW(groups, **kwargs, fused=True)
        except (RuntimeError, ValueError, TypeError):
            pass
    return torch.optim.AdamW(groups, **kwargs)
