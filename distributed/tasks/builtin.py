"""Built-in training tasks: what a profile's ``task`` key names.

A task is a function returning ``(model, train_dataset, val_dataset)``; its
keyword arguments come from the profile. Every host builds the task itself
from the same profile and seed, so nothing but the profile's name travels.
Built in:

- ``digits``: a small classifier on scikit-learn's 8x8 digits (shipped with
  scikit-learn, no download).
- ``chargpt``: a small character-level GPT on a text file; by default on the
  Python standard library's own source text, present on every install.
- ``whisper``: Whisper fine-tuning (see ``distributed.tasks.whisper.task``).
- ``gpt``: a GPT-2 style model on synthetic tokens, at the sizes users train
  (23M parameters by default, 124M as GPT-2 small; ``distributed.tasks.tokens``).

Any ``package.module:function`` with the same contract works too.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from exogym.data.digits import DigitsCNN, DigitsMLP, digits_datasets

from . import BUILTIN_TASK_NAMES
from .extras import install_command, require_extra
from .tokens import TokenGPT

TaskResult = tuple[nn.Module, Dataset, Dataset]


# -- digits ------------------------------------------------------------------------


def digits_task(hidden: int = 128, model: str = "mlp", val_fraction: float = 0.2,
                seed: int = 0) -> TaskResult:
    """A digits classifier (``exogym.data.digits``) with its train and validation sets.

    Args:
        hidden: hidden layer width of the MLP (channels of the CNN's first layer).
        model: ``'mlp'`` or ``'cnn'``.
        val_fraction: share of the 1797 images held out for validation.
        seed: seed of the model's initial weights and of the split.
    """
    if model not in ("mlp", "cnn"):
        raise ValueError(f"digits model must be 'mlp' or 'cnn', got {model!r}")
    train, val = digits_datasets(val_fraction, seed)
    torch.manual_seed(seed)
    net = DigitsMLP(hidden) if model == "mlp" else DigitsCNN(hidden)
    return net, train, val


# -- chargpt -----------------------------------------------------------------------

DEFAULT_CORPUS_MODULES = ("argparse", "textwrap", "difflib", "string", "shlex", "calendar",
                          "configparser", "fractions", "statistics", "heapq")


def default_corpus() -> str:
    """Text present on every Python install: source files of the standard library."""
    parts = []
    for name in DEFAULT_CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            continue
        parts.append(Path(spec.origin).read_text(encoding="utf-8"))
    return "\n".join(parts)


class CharDataset(Dataset):
    """Windows of ``block_size`` characters and the same shifted by one.

    Args:
        data: the text encoded as a 1-D tensor of token ids.
        block_size: context length.
        stride: step between window starts.
    """

    def __init__(self, data: torch.Tensor, block_size: int, stride: int):
        if len(data) <= block_size:
            raise ValueError(f"text of {len(data)} characters is shorter than block_size={block_size}")
        self.data = data
        self.block_size = block_size
        self.starts = range(0, len(data) - block_size - 1, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        s = self.starts[i]
        chunk = self.data[s:s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharGPT(TokenGPT):
    """A small GPT over characters, its output layer apart from the embedding;
    ``forward((x, y))`` returns the next-character loss.

    Args:
        vocab_size: number of distinct characters.
        block_size: context length.
        n_layer, n_head, n_embd: depth, attention heads, width.
    """

    def __init__(self, vocab_size: int, block_size: int = 64, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 128):
        super().__init__(vocab_size, block_size, n_layer, n_head, n_embd, tie_head=False)


def chargpt_task(text_file: str | None = None, block_size: int = 64, n_layer: int = 2,
                 n_head: int = 4, n_embd: int = 128, stride: int | None = None,
                 val_fraction: float = 0.1, seed: int = 0) -> TaskResult:
    """A character-level GPT on a text file (default: standard-library source text).

    Args:
        text_file: UTF-8 text to train on; None for the built-in corpus.
        block_size: context length.
        n_layer, n_head, n_embd: model shape (n_layer=4, n_embd=256 is about 3M parameters).
        stride: step between training windows (default block_size // 2).
        val_fraction: the text's tail held out for validation.
        seed: seed of the initial weights.
    """
    if text_file:
        path = Path(text_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"chargpt text_file {str(path)!r} does not exist")
        text = path.read_text(encoding="utf-8")
    else:
        text = default_corpus()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    split = int(len(data) * (1 - val_fraction))
    stride = stride or max(1, block_size // 2)
    train = CharDataset(data[:split], block_size, stride)
    val = CharDataset(data[split:], block_size, block_size)
    torch.manual_seed(seed)
    model = CharGPT(len(chars), block_size, n_layer, n_head, n_embd)
    model.corpus_sha256 = hashlib.sha256(text.encode()).hexdigest()[:16]
    return model, train, val


# -- registry ----------------------------------------------------------------------


def _whisper_task(**kwargs: Any) -> TaskResult:
    require_extra("whisper")
    try:
        from .whisper.task import build_whisper_task, collate_whisper_batch
    except ImportError as exc:
        raise ImportError(f"the whisper task could not be loaded ({exc}); reinstall its "
                          f"extra from the project's folder: {install_command('whisper')}"
                          ) from exc
    model, train, val = build_whisper_task(**kwargs)
    for dataset in (train, val):  # labels differ in length: the trainer must pad them
        dataset.collate_fn = collate_whisper_batch
    return model, train, val


def _gpt_task(**kwargs: Any) -> TaskResult:
    from .tokens import gpt_task

    return gpt_task(**kwargs)


BUILTIN_TASKS: dict[str, Callable[..., TaskResult]] = dict(zip(
    BUILTIN_TASK_NAMES, (digits_task, chargpt_task, _whisper_task, _gpt_task), strict=True))


def _beside(module_name: str, folders: Sequence[Path]) -> Path | None:
    """The first of ``folders`` that holds ``module_name``'s top-level module or package."""
    top = module_name.partition(".")[0]
    for folder in folders:
        if (folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file():
            return folder
    return None


def resolve_task(name: str, near: Sequence[Path] = ()) -> Callable[..., TaskResult]:
    """The task function for a built-in name or ``package.module:function``.

    A module Python cannot import as it stands is looked for in ``near`` (the folder of
    the profile that names it, then the current folder, say): a person's task module
    beside their ``config.ini`` is found from the ``exogym`` command as from ``python -m``.
    """
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    if ":" not in name:
        raise ValueError(f"unknown task {name!r}: use one of {', '.join(BUILTIN_TASKS)} "
                         "or 'package.module:function'")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        folder = _beside(module_name, near) if exc.name == module_name.partition(".")[0] \
            else None
        if folder is None:
            looked = "".join(f", nor in {f}" for f in dict.fromkeys(str(f) for f in near))
            raise ValueError(f"task {name!r}: cannot import module {module_name!r} "
                             f"({exc}{looked})") from exc
        sys.path.append(str(folder))
        try:
            module = importlib.import_module(module_name)
        except ImportError as again:
            raise ValueError(f"task {name!r}: cannot import module {module_name!r} from "
                             f"{folder} ({again})") from again
    except ImportError as exc:
        raise ValueError(f"task {name!r}: cannot import module {module_name!r} ({exc})") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"task {name!r}: {module_name!r} has no function {attr!r}")
    return fn


def task_arg_names(fn: Callable[..., Any]) -> set[str] | None:
    """Keyword names a task function accepts; None when it takes ``**kwargs``."""
    if fn is _whisper_task:
        try:
            from .whisper.task import build_whisper_task
        except ImportError:
            return None
        fn = build_whisper_task
    elif fn is _gpt_task:
        from .tokens import gpt_task

        fn = gpt_task
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters of a model."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

