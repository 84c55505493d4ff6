"""Low-rank adapters (LoRA, via peft) for Whisper.

With :func:`apply_lora` only the adapter matrices require grad. Strategies communicate
only parameters that require grad, so a DiLoCo round then sends
``4 bytes x count_trainable(model)`` per direction instead of the full model: for
tiny.en with rank 8 on ``q_proj``/``v_proj`` that is 147,456 adapter parameters instead
of 37.8M.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .wrapper import (
    WhisperModelWrapper,
    is_peft,
    merge_and_save,
    merged_whisper,
    unwrap_whisper,
)

__all__ = ["apply_lora", "count_trainable", "is_peft", "merge_and_save", "merged_whisper"]


def count_trainable(model: nn.Module) -> int:
    """Number of parameter elements that require grad (shared tensors counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def apply_lora(
    model_or_wrapper: nn.Module,
    rank: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    dropout: float = 0.0,
    seed: int | None = 0,
) -> nn.Module:
    """Add LoRA adapters and freeze everything else.

    Args:
        model_or_wrapper: A :class:`WhisperModelWrapper` (its ``model`` is replaced by the
            peft model and the wrapper is returned) or a ``WhisperForConditionalGeneration``
            (the peft model is returned).
        rank: Rank ``r`` of each adapter (>= 1).
        alpha: LoRA scaling numerator; the update is ``(alpha / rank) * B @ A``.
        target_modules: Names of the linear layers that get adapters (the last part of the
            module name: ``q_proj`` hits encoder self-attention, decoder self- and
            cross-attention). A wrapper built with ``freeze_encoder=True`` gets adapters in
            the decoder only.
        dropout: Dropout on the adapter input.
        seed: Seeds the adapters' random initialisation, so every rank builds identical
            adapters without a broadcast; ``None`` uses the global generator.

    Returns:
        The wrapper, or the peft model.
    """
    from peft import LoraConfig, get_peft_model

    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be an integer >= 1, got {rank!r}.")
    if not target_modules:
        raise ValueError("target_modules is empty; name at least one linear layer, e.g. q_proj.")
    inner = model_or_wrapper.model if isinstance(model_or_wrapper, WhisperModelWrapper) \
        else model_or_wrapper
    if is_peft(inner):
        raise ValueError("the model already has adapters; apply_lora once per model.")
    unwrap_whisper(inner)
    linears = [name for name, m in inner.named_modules() if isinstance(m, nn.Linear)]
    present = {name.rsplit(".", 1)[-1] for name in linears}
    unknown = [t for t in target_modules if t not in present]
    if unknown:
        raise ValueError(
            f"target_modules {unknown} match no linear layer of the model; known names: "
            f"{', '.join(sorted(present))}."
        )
    skip_encoder = getattr(model_or_wrapper, "freeze_encoder", False)
    targets = [name for name in linears if name.rsplit(".", 1)[-1] in target_modules
               and not (skip_encoder and ".encoder." in f".{name}.")]
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                        lora_dropout=dropout, bias="none")
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        peft_model = get_peft_model(inner, config)
    if isinstance(model_or_wrapper, WhisperModelWrapper):
        model_or_wrapper.model = peft_model
        return model_or_wrapper
    return peft_model
