"""Speech data for Whisper fine-tuning: an audio-folder dataset, its collator, offline speech, WER.

- :class:`AudioFolderDataset` reads the Hugging Face "audiofolder" layout: a folder with
  audio files and a ``metadata.csv`` whose ``file_name`` column names each file (relative
  to the folder) and whose ``transcription`` column holds its text. Audio is decoded with
  soundfile, mixed to mono and resampled to 16 kHz; log-mel features are computed in
  ``__getitem__``, i.e. on the data-loading side, never in the model's ``forward``.
  The whole folder is checked when the dataset is built, and every problem is reported
  at once, so a bad file cannot stop a run in the middle of an epoch.
- :class:`WhisperCollator` stacks features and pads labels with -100.
- :func:`synthesize_speech_folder` makes such a folder offline with ``espeak-ng``.
- :func:`word_error_rate` scores transcriptions.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from exogym.base.io import atomic_write_text, new_temp_dir_beside, publish_dir
from exogym.base.plural import plural, plural_noun

if TYPE_CHECKING:
    from transformers import WhisperFeatureExtractor, WhisperProcessor

SAMPLE_RATE = 16_000
METADATA_FILE = "metadata.csv"
MANIFEST_FILE = "synthesis.json"
LABEL_PAD_ID = -100
# What decoding a bad file raises: soundfile's LibsndfileError is a RuntimeError; a file
# that vanished is an OSError; odd headers surface as ValueError or EOFError.
AUDIO_READ_ERRORS = (RuntimeError, OSError, ValueError, EOFError)

# Short English sentences for demos and tests. Project words (DiLoCo, exogym, FedAvg, LoRA,
# AllReduce, PyTorch, Nesterov, ...) are ones Whisper tiny.en does not know, and each appears
# in several sentences, so a model fine-tuned on some sentences can show what it learned on
# held-out ones.
DEFAULT_SENTENCES: tuple[str, ...] = (
    "DiLoCo synchronizes the workers every few hundred steps.",
    "We trained the model with DiLoCo on two laptops.",
    "The outer optimizer of DiLoCo uses Nesterov momentum.",
    "DiLoCo sends far fewer bytes than AllReduce.",
    "Exogym simulates many nodes on a single machine.",
    "Install exogym and run the example script.",
    "The exogym trainer spawns a process for each rank.",
    "Researchers compare strategies with exogym on a laptop.",
    "SPARTA shares a small random slice of the parameters.",
    "With SPARTA each step sends only a tiny fraction of the weights.",
    "We combined SPARTA with DiLoCo in one strategy.",
    "FedAvg averages the models after local training.",
    "The FedAvg run used many islands of workers.",
    "AllReduce averages the gradients at every step.",
    "A plain AllReduce baseline is the simplest strategy.",
    "LoRA trains small adapters instead of the full model.",
    "With LoRA the workers exchange only the adapter weights.",
    "Merge the LoRA adapters before saving the model.",
    "PyTorch runs the training loop on each worker.",
    "The PyTorch process group connects the ranks over TCP.",
    "Nesterov momentum helps the outer step converge.",
    "Whisper transcribes speech into English text.",
    "We fine tune Whisper on synthetic speech.",
    "The Whisper encoder reads log mel features.",
    "DeMo compresses the momentum before sending it.",
    "The DeMo optimizer keeps most of the signal local.",
    "Espeak generates the speech for our tests.",
    "The launcher starts a rank on every host over SSH.",
    "Each host reads the same config file.",
    "The dashboard shows the loss of every rank.",
    "Validation loss went down after fine tuning.",
    "The word error rate dropped on held out sentences.",
    "A pair of nodes trained the model overnight.",
    "Gradient accumulation saves memory on small machines.",
    "The coordinator collects metrics from each worker.",
    "Checkpoints are written to a temporary file first.",
    "The Mac mini joined the cluster over the local network.",
    "Our strategy communicates only the parameters that train.",
    "Typer builds the command line interface.",
    "The wizard asks which hosts to use.",
)

DEFAULT_VOICES: tuple[str, ...] = ("en-us", "en-gb", "en-gb-x-rp")
DEFAULT_SPEEDS: tuple[int, ...] = (150, 175)


# --------------------------------------------------------------------------- audio


def load_audio(path: str | os.PathLike, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Read an audio file as mono float32 at ``sample_rate`` Hz.

    Args:
        path: Any format libsndfile reads (wav, flac, ogg, mp3 with recent libsndfile).
        sample_rate: Target rate; the audio is resampled with a polyphase filter.

    Raises:
        RuntimeError: (from soundfile) when the file cannot be decoded.
    """
    import soundfile as sf

    audio, rate = sf.read(str(path), dtype="float32", always_2d=True)
    return resample(audio.mean(axis=1), rate, sample_rate)


def resample(audio: np.ndarray, from_rate: int, to_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Resample a mono signal with scipy's polyphase filter (exact rational ratio).

    Args:
        audio: 1-D float array.
        from_rate: Its sample rate in Hz.
        to_rate: Wanted sample rate in Hz.
    """
    if from_rate == to_rate:
        return np.ascontiguousarray(audio, dtype=np.float32)
    from scipy.signal import resample_poly

    ratio = Fraction(to_rate, from_rate)
    out = resample_poly(audio, ratio.numerator, ratio.denominator)
    return np.ascontiguousarray(out, dtype=np.float32)


def label_text(transcription: str) -> str:
    """The text that becomes a label: stripped, with one leading space.

    Whisper's vocabulary marks word starts with a leading space, and the model begins its
    transcripts with one (`` The``, not ``The``); labels in the same form keep fine-tuning
    from first having to unlearn that habit.
    """
    return " " + transcription.strip()


# --------------------------------------------------------------------------- dataset


class AudioFolderError(ValueError):
    """An audio folder that cannot be used; ``problems`` lists each problem on its own."""

    def __init__(self, folder: Path, problems: list[str]):
        self.folder = folder
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"audio folder {folder} has {plural(len(problems), 'problem')}:\n{lines}\n"
            f"Fix each listed row of {folder / METADATA_FILE} (or the file it names) and run "
            "again; nothing was trained."
        )


def _split_processor(
    processor: Any, feature_extractor: Any, tokenizer: Any
) -> tuple[WhisperFeatureExtractor, Any]:
    if processor is not None:
        feature_extractor = feature_extractor or processor.feature_extractor
        tokenizer = tokenizer or processor.tokenizer
    if feature_extractor is None or tokenizer is None:
        raise TypeError(
            "AudioFolderDataset needs a WhisperProcessor, or both feature_extractor= and "
            "tokenizer=; got "
            f"feature_extractor={type(feature_extractor).__name__}, "
            f"tokenizer={type(tokenizer).__name__}."
        )
    return feature_extractor, tokenizer


class AudioFolderDataset(Dataset):
    """Utterances of an audio folder as Whisper training samples.

    Each item is ``{"input_features": FloatTensor[n_mels, 3000], "labels": LongTensor[L]}``.
    Labels are the tokenizer's ids of the transcription (with a leading space, see
    :func:`label_text`) *without* the decoder start token, which the model prepends itself
    when it shifts labels right; they end with ``<|endoftext|>``.

    Args:
        folder: Folder holding ``metadata.csv`` and the audio files.
        processor: A ``WhisperProcessor``; or pass ``feature_extractor`` and ``tokenizer``.
        feature_extractor: A ``WhisperFeatureExtractor`` (overrides the processor's).
        tokenizer: A Whisper tokenizer (overrides the processor's).
        text_column: Column with the transcription.
        preload: Keep the decoded 16 kHz audio in memory (about 64 kB per second of
            speech). If false, files are decoded again in every ``__getitem__``.
        max_label_tokens: Longest label allowed (Whisper's decoder has 448 positions).

    Raises:
        AudioFolderError: listing every missing file, unreadable or empty or too long
            audio, empty or too long transcription and missing column found in the folder.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        processor: WhisperProcessor | None = None,
        *,
        feature_extractor: WhisperFeatureExtractor | None = None,
        tokenizer: Any = None,
        text_column: str = "transcription",
        preload: bool = True,
        max_label_tokens: int = 448,
    ):
        self.feature_extractor, self.tokenizer = _split_processor(
            processor, feature_extractor, tokenizer
        )
        self.folder = Path(folder)
        self.text_column = text_column
        self.sample_rate = int(self.feature_extractor.sampling_rate)
        self.max_seconds = float(self.feature_extractor.n_samples) / self.sample_rate
        self.preload = preload
        self.file_names: list[str] = []
        self.transcriptions: list[str] = []
        self._labels: list[list[int]] = []
        self._audio: list[np.ndarray | None] = []
        self._validate_and_load(max_label_tokens)

    def _read_metadata(self) -> list[tuple[int, dict[str, str | None]]]:
        if not self.folder.is_dir():
            raise AudioFolderError(self.folder, [
                (f"the folder does not exist; create it with audio files and a {METADATA_FILE}, "
                 "or make one with synthesize_speech_folder()")])
        meta = self.folder / METADATA_FILE
        if not meta.is_file():
            raise AudioFolderError(self.folder, [
                (f"{METADATA_FILE} is missing; add one with the columns file_name and "
                 f"{self.text_column} (one row per audio file)")])
        try:
            text = meta.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as err:
            raise AudioFolderError(self.folder, [
                f"{METADATA_FILE} cannot be read as UTF-8 text ({err}); save it as UTF-8 CSV",
            ]) from err
        reader = csv.DictReader(io.StringIO(text))
        columns = reader.fieldnames or []
        missing = [c for c in ("file_name", self.text_column) if c not in columns]
        if missing:
            raise AudioFolderError(self.folder, [
                (f"{METADATA_FILE} lacks the {plural_noun(len(missing), 'column')} "
                 f"{', '.join(missing)} (found: "
                 f"{', '.join(columns) or 'no header'}); its first line must name the columns, "
                 f"e.g. file_name,{self.text_column}")])
        rows = [(reader.line_num, row) for row in reader]
        if not rows:
            raise AudioFolderError(self.folder, [
                f"{METADATA_FILE} has a header but no rows; add one row per audio file",
            ])
        return rows

    def _validate_and_load(self, max_label_tokens: int) -> None:
        problems: list[str] = []
        for line, row in self._read_metadata():
            name = (row.get("file_name") or "").strip()
            text = row.get(self.text_column)
            where = f"line {line}"
            if None in row or any(v is None for v in row.values()):
                problems.append(f"{where}: the row has a different number of fields than the "
                                "header; quote values that contain commas")
                continue
            if not name:
                problems.append(f"{where}: file_name is empty; name the audio file of this row")
                continue
            where = f"line {line} ({name})"
            path = self.folder / name
            if not path.is_file():
                problems.append(f"{where}: audio file not found at {path}; add the file or "
                                "remove the row")
                continue
            if text is None or not text.strip():
                problems.append(f"{where}: the {self.text_column} is empty; write what is said "
                                "in the clip or remove the row")
                continue
            try:
                audio = load_audio(path, self.sample_rate)
            except AUDIO_READ_ERRORS as err:
                problems.append(f"{where}: unreadable audio ({type(err).__name__}: {err}); "
                                "re-export it as WAV or FLAC, or remove the row")
                continue
            seconds = len(audio) / self.sample_rate
            if len(audio) == 0:
                problems.append(f"{where}: the audio has no samples; re-record it or remove "
                                "the row")
                continue
            if seconds > self.max_seconds:
                problems.append(f"{where}: the audio lasts {seconds:.1f} s, more than Whisper's "
                                f"{self.max_seconds:.0f} s window; cut it into shorter clips")
                continue
            labels = self._encode(text)
            if len(labels) > max_label_tokens:
                problems.append(f"{where}: the transcription is {len(labels)} tokens, more than "
                                f"the decoder's {max_label_tokens}; split the clip")
                continue
            self.file_names.append(name)
            self.transcriptions.append(text.strip())
            self._labels.append(labels)
            self._audio.append(audio if self.preload else None)
        if problems:
            raise AudioFolderError(self.folder, problems)

    def _encode(self, text: str) -> list[int]:
        ids = list(self.tokenizer(label_text(text)).input_ids)
        start = self.tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
        if ids and ids[0] == start:
            ids = ids[1:]  # the model prepends the decoder start token itself
        return ids

    def __len__(self) -> int:
        return len(self.file_names)

    def audio(self, index: int) -> np.ndarray:
        """The 16 kHz mono waveform of utterance ``index``."""
        cached = self._audio[index]
        if cached is not None:
            return cached
        path = self.folder / self.file_names[index]
        try:
            return load_audio(path, self.sample_rate)
        except AUDIO_READ_ERRORS as err:
            raise RuntimeError(
                f"{path} could be read when the dataset was built but not now ({err}); was the "
                "folder changed during training? Build the dataset with preload=True to keep "
                "the audio in memory."
            ) from err

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        features = self.feature_extractor(
            self.audio(index), sampling_rate=self.sample_rate, return_tensors="np"
        ).input_features[0]
        return {
            "input_features": torch.from_numpy(np.asarray(features, dtype=np.float32)),
            "labels": torch.tensor(self._labels[index], dtype=torch.long),
        }

    def subset(self, indices: Sequence[int]) -> AudioFolderDataset:
        """A dataset of the given utterances that shares this one's decoded audio."""
        part = object.__new__(AudioFolderDataset)
        part.__dict__.update(self.__dict__)
        part.file_names = [self.file_names[i] for i in indices]
        part.transcriptions = [self.transcriptions[i] for i in indices]
        part._labels = [self._labels[i] for i in indices]
        part._audio = [self._audio[i] for i in indices]
        return part

    @property
    def collator(self) -> WhisperCollator:
        """A collator that also strips this tokenizer's decoder start token if present."""
        return WhisperCollator(
            decoder_start_token_id=self.tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
        )


# --------------------------------------------------------------------------- collation


class WhisperCollator:
    """Batch Whisper samples: stack ``input_features``, pad ``labels`` with -100.

    If ``decoder_start_token_id`` is given and every label row starts with it, it is
    removed (as transformers' speech seq2seq collators do): the model prepends it when
    shifting labels right, and a second copy would teach it to predict the start token.
    Other tensor keys of equal shape (e.g. ``attention_mask``) are stacked.

    Args:
        decoder_start_token_id: The model's ``config.decoder_start_token_id``, or ``None``
            when the labels are known not to start with it.
        label_pad_id: Value for padded label positions, ignored by the loss.

    Returns (when called): a ``dict[str, Tensor]`` ready for ``WhisperModelWrapper``.
    """

    def __init__(self, decoder_start_token_id: int | None = None, label_pad_id: int = LABEL_PAD_ID):
        self.decoder_start_token_id = decoder_start_token_id
        self.label_pad_id = label_pad_id

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("WhisperCollator got an empty list of samples.")
        labels = [torch.as_tensor(s["labels"], dtype=torch.long) for s in samples]
        start = self.decoder_start_token_id
        if start is not None and all(len(row) > 0 and int(row[0]) == start for row in labels):
            labels = [row[1:] for row in labels]
        width = max(len(row) for row in labels)
        padded = torch.full((len(labels), width), self.label_pad_id, dtype=torch.long)
        for i, row in enumerate(labels):
            padded[i, : len(row)] = row
        batch = {"labels": padded}
        for key in samples[0]:
            if key == "labels":
                continue
            batch[key] = torch.stack([torch.as_tensor(s[key]) for s in samples])
        return batch


collate_whisper_batch = WhisperCollator()
"""Default collate function for samples whose labels do not start with the decoder start
token (as :class:`AudioFolderDataset` makes them): ``DataLoader(..., collate_fn=collate_whisper_batch)``."""


def split_by_transcription(
    transcriptions: Sequence[str], val_fraction: float, seed: int = 0
) -> tuple[list[int], list[int]]:
    """Split utterance indices so no sentence is in both parts.

    All utterances of one (normalized) transcription go to the same side, so validation
    measures sentences the model has never heard, not new voices of known sentences.

    Args:
        transcriptions: One text per utterance.
        val_fraction: Share of distinct sentences held out, in (0, 1).
        seed: Shuffling seed; the same seed gives the same split on every rank.

    Returns:
        ``(train_indices, val_indices)``, each sorted.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}.")
    groups: dict[str, list[int]] = {}
    for i, text in enumerate(transcriptions):
        groups.setdefault(" ".join(normalize_words(text)), []).append(i)
    keys = sorted(groups)
    if len(keys) < 2:
        raise ValueError(
            f"need at least 2 distinct transcriptions to hold some out, got {len(keys)}; add "
            "more sentences."
        )
    random.Random(seed).shuffle(keys)
    n_val = min(len(keys) - 1, max(1, round(len(keys) * val_fraction)))
    val = sorted(i for k in keys[:n_val] for i in groups[k])
    train = sorted(i for k in keys[n_val:] for i in groups[k])
    return train, val


# --------------------------------------------------------------------------- synthesis


def espeak_binary() -> str:
    """Path of ``espeak-ng``; raises ``FileNotFoundError`` saying how to install it."""
    path = shutil.which("espeak-ng")
    if path is None:
        raise FileNotFoundError(
            "espeak-ng is not installed, so speech cannot be synthesized. Install the system "
            "package: apt-get install espeak-ng (Debian/Ubuntu), brew install espeak-ng (macOS), "
            "or pass data_dir= with your own recordings."
        )
    return path


def _espeak_version(binary: str) -> str:
    result = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.strip()


def installed_voices(binary: str | None = None) -> set[str]:
    """Lowercased names espeak-ng accepts for ``-v``: languages, voice names and voice files."""
    binary = binary or espeak_binary()
    result = subprocess.run([binary, "--voices"], capture_output=True, text=True, check=False)
    names: set[str] = set()
    for line in result.stdout.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 5:  # Pty Language Age/Gender VoiceName File [Other languages]
            names.update({fields[1], fields[3], fields[4], fields[4].rsplit("/", 1)[-1]})
    return {n.lower() for n in names}


def _check_voices(binary: str, voices: Sequence[str]) -> None:
    # espeak-ng quietly falls back to a near match for unknown names (e.g. "no-such-voice"
    # speaks Norwegian), so names are checked against its own list first.
    known = installed_voices(binary)
    unknown = [v for v in voices if v.split("+", 1)[0].lower() not in known]
    if unknown:
        english = sorted(n for n in known if n.startswith("en"))
        raise ValueError(
            f"espeak-ng has no voice {', '.join(map(repr, unknown))}; English voices here: "
            f"{', '.join(english)}. List all with: espeak-ng --voices"
        )


def _manifest(sentences: Sequence[str], voices: Sequence[str], speeds: Sequence[int],
              version: str) -> dict[str, Any]:
    return {"sentences": list(sentences), "voices": list(voices),
            "speeds": [int(s) for s in speeds], "espeak": version}


def speech_folder_key(sentences: Sequence[str], voices: Sequence[str],
                      speeds: Sequence[int]) -> str:
    """A short hash naming a synthesized folder by what it contains (for cache paths)."""
    blob = json.dumps(_manifest(sentences, voices, speeds, ""), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def synthesize_speech_folder(
    sentences: Sequence[str],
    out_dir: str | os.PathLike,
    voices: Sequence[str] = DEFAULT_VOICES,
    speeds: Sequence[int] = DEFAULT_SPEEDS,
    overwrite: bool = False,
) -> Path:
    """Speak every sentence with every voice and speed into an audio folder, offline.

    Writes ``<out_dir>/s<sentence>_<voice>_<speed>.wav`` files, a ``metadata.csv``
    (``file_name``, ``transcription``, ``voice``, ``speed``) and ``synthesis.json``
    recording what was asked. The folder is built under a temporary name and renamed
    into place when complete. If ``out_dir`` already holds a folder synthesized with the
    same arguments, it is reused as is, so concurrent callers share one result.

    Args:
        sentences: Texts to speak (non-empty), e.g. :data:`DEFAULT_SENTENCES`.
        out_dir: Destination folder.
        voices: espeak-ng voice names, e.g. ``"en-us"``, ``"en-gb"``, ``"en-gb-x-rp"``.
        speeds: Words per minute (espeak-ng ``-s``; 80 to 450).
        overwrite: Replace an existing ``out_dir`` that was synthesized with other arguments.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    sentences = [s.strip() for s in sentences]
    empty = [i for i, s in enumerate(sentences) if not s]
    if not sentences or empty:
        raise ValueError(f"sentences must be non-empty texts; empty at positions {empty}.")
    bad_speeds = [s for s in speeds if not 80 <= int(s) <= 450]
    if not voices or not speeds or bad_speeds:
        raise ValueError(
            f"need at least one voice and one speed between 80 and 450 words per minute; got "
            f"voices={list(voices)}, speeds={list(speeds)}."
        )
    binary = espeak_binary()
    _check_voices(binary, voices)
    out = Path(out_dir)
    manifest = _manifest(sentences, voices, speeds, _espeak_version(binary))
    existing = _read_manifest(out)
    if existing == manifest and (out / METADATA_FILE).is_file():
        return out
    existed = out.exists()
    if existed and any(out.iterdir()) and not overwrite:
        what = "was synthesized with other arguments" if existing else "is not empty"
        raise FileExistsError(
            f"{out} {what}; pass overwrite=True to replace it, or choose another out_dir."
        )
    tmp = new_temp_dir_beside(out)
    try:
        rows = []
        for index, sentence in enumerate(sentences):
            for voice in voices:
                for speed in speeds:
                    name = f"s{index:03d}_{_safe(voice)}_{int(speed)}.wav"
                    _speak(binary, sentence, voice, int(speed), tmp / name)
                    rows.append({"file_name": name, "transcription": sentence,
                                 "voice": voice, "speed": int(speed)})
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=["file_name", "transcription", "voice", "speed"],
                                lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(tmp / METADATA_FILE, buffer.getvalue())
        atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Only a folder that was there before we started is replaced; if another process
    # published the same folder meanwhile, theirs is kept (a reader may be using it).
    kept_other = not publish_dir(tmp, out, replace=existed)
    if kept_other and _read_manifest(out) != manifest:
        raise FileExistsError(f"{out} was created concurrently with other contents.")
    return out


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _safe(voice: str) -> str:
    return "".join(c if c.isalnum() or c in "-" else "_" for c in voice)


def _speak(binary: str, text: str, voice: str, speed: int, path: Path) -> None:
    # Text goes through stdin, so a sentence starting with "-" is never read as an option.
    result = subprocess.run(
        [binary, "-v", voice, "-s", str(speed), "-w", str(path), "--stdin"],
        input=text, capture_output=True, text=True, check=False,
    )
    if result.returncode != 0 or not path.is_file() or path.stat().st_size <= 44:
        detail = (result.stderr or result.stdout).strip() or f"exit status {result.returncode}"
        raise RuntimeError(
            f"espeak-ng could not speak {text!r} with voice {voice!r} at speed {speed}: "
            f"{detail}. List the installed voices with: espeak-ng --voices=en"
        )


# --------------------------------------------------------------------------- WER


def normalize_words(text: str) -> list[str]:
    """Lowercase, drop apostrophes, turn other punctuation into spaces, split into words."""
    text = text.lower().replace("'", "").replace("\u2019", "")
    return "".join(c if c.isalnum() else " " for c in text).split()


def word_edit_distance(reference: Sequence[str], hypothesis: Sequence[str]) -> int:
    """Levenshtein distance between two word lists (substitutions, insertions, deletions)."""
    previous = list(range(len(hypothesis) + 1))
    for i, ref_word in enumerate(reference, start=1):
        current = [i] + [0] * len(hypothesis)
        for j, hyp_word in enumerate(hypothesis, start=1):
            current[j] = min(
                previous[j] + 1,  # reference word deleted
                current[j - 1] + 1,  # hypothesis word inserted
                previous[j - 1] + (ref_word != hyp_word),  # match or substitution
            )
        previous = current
    return previous[-1]


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Corpus word error rate: total word edits divided by total reference words.

    Texts are compared after :func:`normalize_words` (case and punctuation are ignored).

    Args:
        references: The true transcriptions.
        hypotheses: The model's transcriptions, in the same order.

    Raises:
        ValueError: The lists differ in length, or the references hold no words at all.
    """
    if isinstance(references, str) or isinstance(hypotheses, str):
        raise TypeError("word_error_rate takes lists of texts, not single strings.")
    if len(references) != len(hypotheses):
        raise ValueError(
            f"got {len(references)} references but {len(hypotheses)} hypotheses; pass one "
            "hypothesis per reference."
        )
    edits = words = 0
    for ref, hyp in zip(references, hypotheses):
        ref_words = normalize_words(ref)
        edits += word_edit_distance(ref_words, normalize_words(hyp))
        words += len(ref_words)
    if words == 0:
        raise ValueError("the references contain no words, so the word error rate is undefined.")
    return edits / words

