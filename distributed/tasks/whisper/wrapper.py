"""Whisper as a training-loop model: ``loss = model(batch)``, greedy transcription, saving.

Every strategy and both trainers train a model through one contract: ``forward(batch)``
returns a scalar loss. :class:`WhisperModelWrapper` gives a transformers
``WhisperForConditionalGeneration`` that contract. The batch is a plain
``dict[str, Tensor]`` (as :class:`distributed.speech_data.WhisperCollator` builds it) so the
trainer's generic device move handles it; the log-mel features are already in it, computed
on the data-loading side.

Labels are token ids padded with -100 and do not start with the decoder start token: the
model shifts them right and prepends that token itself, as transformers expects.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from exogym.base.io import new_temp_dir_beside, publish_dir

from .speech_data import (
    collate_whisper_batch,
    normalize_words,
    word_edit_distance,
)

if TYPE_CHECKING:
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

_FORWARD_KEYS = ("attention_mask", "decoder_input_ids", "decoder_attention_mask")


def strip_decoder_start(labels: torch.Tensor, decoder_start_token_id: int | None) -> torch.Tensor:
    """Drop the first label column if every row starts with the decoder start token.

    Args:
        labels: ``LongTensor[batch, length]``, padded with -100.
        decoder_start_token_id: The model's ``config.decoder_start_token_id``.
    """
    if (
        decoder_start_token_id is not None
        and labels.dim() == 2
        and labels.shape[1] > 0
        and bool((labels[:, 0] == decoder_start_token_id).all())
    ):
        return labels[:, 1:]
    return labels


def unwrap_whisper(model: nn.Module) -> WhisperForConditionalGeneration:
    """The transformers Whisper model inside a wrapper and/or a peft ``PeftModel``.

    With LoRA the returned model carries the adapter layers in place, so running it uses them.
    """
    if isinstance(model, WhisperModelWrapper):
        model = model.model
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        model = get_base()
    if not hasattr(model, "model") or not hasattr(model.model, "encoder"):
        raise TypeError(
            f"expected a WhisperForConditionalGeneration (or a wrapper of one), got "
            f"{type(model).__name__}."
        )
    return model


class WhisperModelWrapper(nn.Module):
    """A Whisper model whose ``forward(batch)`` returns the sequence-to-sequence loss.

    Args:
        whisper_model: A ``transformers.WhisperForConditionalGeneration`` (or a peft model
            wrapping one).
        processor: Its ``WhisperProcessor``; kept for :meth:`transcribe` and for saving.
        freeze_encoder: Train only the decoder. The encoder then runs without building a
            graph (faster on CPUs) and its weights, not requiring grad, are never sent by a
            strategy that communicates trainable parameters.
    """

    def __init__(
        self,
        whisper_model: nn.Module,
        processor: WhisperProcessor | None = None,
        freeze_encoder: bool = False,
    ):
        super().__init__()
        self.model = whisper_model
        self.processor = processor
        self.freeze_encoder = freeze_encoder
        unwrap_whisper(self)  # fail now, not at the first batch, if this is not Whisper
        if freeze_encoder:
            for param in unwrap_whisper(self).model.encoder.parameters():
                param.requires_grad_(False)

    @property
    def config(self) -> Any:
        """The transformers ``WhisperConfig``."""
        return unwrap_whisper(self).config

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Return the mean token cross-entropy of ``batch``.

        Args:
            batch: ``input_features`` ``FloatTensor[B, n_mels, frames]`` and ``labels``
                ``LongTensor[B, L]`` padded with -100; optionally ``attention_mask``,
                ``decoder_input_ids``, ``decoder_attention_mask``.
        """
        missing = [k for k in ("input_features", "labels") if k not in batch]
        if missing:
            raise KeyError(
                f"Whisper batch lacks {', '.join(missing)}; got keys {sorted(batch)}. Build "
                "batches with WhisperCollator from samples of AudioFolderDataset."
            )
        labels = batch["labels"]
        if "decoder_input_ids" not in batch:
            labels = strip_decoder_start(labels, self.config.decoder_start_token_id)
        extra = {k: batch[k] for k in _FORWARD_KEYS if k in batch}
        out = self.model(input_features=batch["input_features"], labels=labels, **extra)
        return out.loss

    def transcribe(self, features: torch.Tensor, **kwargs: Any) -> list[str]:
        """Greedy transcription of ``features``; see :func:`transcribe`."""
        return transcribe(self, features, **kwargs)

    def metric_sums(self, batch: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
        """Word errors and reference words of ``batch``: the trainer logs ``val_wer``
        next to the validation loss."""
        if self.processor is None:
            return {}
        tokenizer = self.processor.tokenizer
        labels = batch["labels"].clone()
        labels[labels < 0] = tokenizer.pad_token_id
        references = tokenizer.batch_decode(labels, skip_special_tokens=True)
        hypotheses = transcribe(self, batch["input_features"], tokenizer=tokenizer)
        errors = words = 0
        for ref, hyp in zip(references, hypotheses):
            ref_words = normalize_words(ref)
            errors += word_edit_distance(ref_words, normalize_words(hyp))
            words += len(ref_words)
        return {"wer": (errors, words)}

    def save_merged(self, out_dir: str | os.PathLike) -> Path:
        """Save the full model (LoRA adapters merged in, if any) and the processor;
        see :func:`merge_and_save`."""
        return merge_and_save(self, out_dir, self.processor)


def _suppressed_ids(model: Any, tokenizer: Any, vocab_size: int) -> tuple[list[int], list[int]]:
    """Token ids never to emit, and ids not to emit first, when transcribing without timestamps."""
    gen = getattr(model, "generation_config", None)
    always = set(getattr(gen, "suppress_tokens", None) or [])
    eot = tokenizer.eos_token_id
    added = tokenizer.added_tokens_decoder  # rebuilt on every access: read it once
    always.update(i for i, tok in added.items() if tok.content.startswith("<|") and i != eot)
    always.update(i for i in tokenizer.all_special_ids if i != eot)
    # Timestamp tokens sit above the last special token; no-timestamp decoding never uses them.
    no_ts = tokenizer.convert_tokens_to_ids("<|notimestamps|>")
    if isinstance(no_ts, int) and no_ts >= 0:
        always.update(range(no_ts + 1, vocab_size))
    begin = set(getattr(gen, "begin_suppress_tokens", None) or [eot])
    return sorted(i for i in always if 0 <= i < vocab_size), sorted(begin)


@torch.no_grad()
def transcribe(
    model: nn.Module,
    features: torch.Tensor,
    tokenizer: Any = None,
    max_new_tokens: int = 96,
) -> list[str]:
    """Greedy-decode a batch of log-mel features into text.

    Decoding starts from the tokenizer's prefix (for tiny.en ``<|startoftranscript|>
    <|notimestamps|>``, the same prefix the training labels follow), suppresses special and
    timestamp tokens and the model's ``suppress_tokens``, and stops at ``<|endoftext|>``.
    The model is put in eval mode for the call and restored afterwards.

    Args:
        model: A :class:`WhisperModelWrapper`, a ``WhisperForConditionalGeneration`` or a
            peft model of one (LoRA adapters are used).
        features: ``FloatTensor[B, n_mels, frames]`` from the Whisper feature extractor.
        tokenizer: Whisper tokenizer; defaults to the wrapper's ``processor.tokenizer``.
        max_new_tokens: Most tokens generated per utterance.

    Returns:
        One stripped transcription per row of ``features``.
    """
    from transformers.modeling_outputs import BaseModelOutput

    if tokenizer is None:
        processor = getattr(model, "processor", None)
        if processor is None:
            raise ValueError("transcribe needs tokenizer= when the model carries no processor.")
        tokenizer = processor.tokenizer
    whisper = unwrap_whisper(model)
    was_training = whisper.training
    whisper.eval()
    try:
        device = next(whisper.parameters()).device
        dtype = next(whisper.parameters()).dtype
        features = features.to(device=device, dtype=dtype)
        batch = features.shape[0]
        config = whisper.config
        vocab = config.vocab_size
        always, begin = _suppressed_ids(whisper, tokenizer, vocab)
        always_t = torch.tensor(always, dtype=torch.long, device=device)
        begin_t = torch.tensor(begin, dtype=torch.long, device=device)
        eot = tokenizer.eos_token_id
        prefix = list(tokenizer.prefix_tokens)
        limit = min(max_new_tokens, config.max_target_positions - len(prefix))

        encoded = BaseModelOutput(last_hidden_state=whisper.model.encoder(features).last_hidden_state)
        tokens = torch.tensor([prefix] * batch, dtype=torch.long, device=device)
        step_input = tokens
        cache = None
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        generated: list[torch.Tensor] = []
        for step in range(limit):
            out = whisper(encoder_outputs=encoded, decoder_input_ids=step_input,
                          past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            logits[:, always_t] = float("-inf")
            if step == 0:
                logits[:, begin_t] = float("-inf")
            next_token = logits.argmax(dim=-1)
            next_token = torch.where(done, torch.full_like(next_token, eot), next_token)
            generated.append(next_token)
            done |= next_token == eot
            if bool(done.all()):
                break
            step_input = next_token[:, None]
    finally:
        whisper.train(was_training)
    if not generated:
        return [""] * batch
    rows = torch.stack(generated, dim=1).tolist()
    texts = []
    for row in rows:
        if eot in row:
            row = row[: row.index(eot)]
        texts.append(tokenizer.decode(row, skip_special_tokens=True).strip())
    return texts


def transcribe_dataset(
    model: nn.Module,
    dataset: Sequence[dict[str, torch.Tensor]],
    batch_size: int = 8,
    tokenizer: Any = None,
) -> tuple[list[str], list[str]]:
    """Transcribe every item of a Whisper dataset.

    References are decoded from each item's ``labels``, so any dataset yielding
    ``input_features`` and ``labels`` works.

    Args:
        model: What :func:`transcribe` accepts.
        dataset: Items as made by :class:`distributed.speech_data.AudioFolderDataset`.
        batch_size: Utterances decoded together.
        tokenizer: Defaults to the wrapper's ``processor.tokenizer``.

    Returns:
        ``(references, hypotheses)``.
    """
    from torch.utils.data import DataLoader

    if tokenizer is None:
        processor = getattr(model, "processor", None)
        if processor is None:
            raise ValueError("transcribe_dataset needs tokenizer= when the model has no processor.")
        tokenizer = processor.tokenizer
    references: list[str] = []
    hypotheses: list[str] = []
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False,
                        collate_fn=collate_whisper_batch)
    for batch in loader:
        labels = batch["labels"].clone()
        labels[labels < 0] = tokenizer.pad_token_id
        references += [t.strip() for t in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        hypotheses += transcribe(model, batch["input_features"], tokenizer=tokenizer)
    return references, hypotheses


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (LoRA adapters on a base model)."""
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def merged_whisper(model: nn.Module) -> nn.Module:
    """A standalone copy of the Whisper model with any LoRA adapters merged into its weights.

    The given model (and its adapters) is left unchanged, so training can go on.
    """
    inner = model.model if isinstance(model, WhisperModelWrapper) else model
    if is_peft(inner):
        merged = copy.deepcopy(inner).merge_and_unload()
    else:
        merged = copy.deepcopy(unwrap_whisper(inner))
    for param in merged.parameters():
        param.requires_grad_(True)
    merged.model.encoder.embed_positions.requires_grad_(False)  # fixed sinusoids in Whisper
    return merged


def merge_and_save(
    model: nn.Module, out_dir: str | os.PathLike, processor: WhisperProcessor | Any = None
) -> Path:
    """Save the full model, adapters merged, as a transformers checkpoint folder.

    The folder is written under a temporary name next to ``out_dir`` and renamed into
    place, replacing an existing ``out_dir``; it loads with :func:`load_whisper` or
    ``WhisperForConditionalGeneration.from_pretrained``.

    Args:
        model: A :class:`WhisperModelWrapper`, a peft model or a Whisper model.
        out_dir: Destination folder.
        processor: Saved alongside so the folder is self-contained; defaults to the
            wrapper's processor.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    if processor is None:
        processor = getattr(model, "processor", None)
    merged = merged_whisper(model)
    out = Path(out_dir)
    tmp = new_temp_dir_beside(out)
    try:
        merged.save_pretrained(tmp)
        if processor is not None:
            processor.save_pretrained(tmp)
            # preprocessor_config.json: also read by transformers releases before processor_config.json
            processor.feature_extractor.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, out, replace=True)
    return out
