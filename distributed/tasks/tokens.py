"""A GPT on synthetic tokens: models the size users train, with nothing to download.

``gpt`` builds a GPT-2 style language model (token and position embeddings, pre-norm
blocks, a head tied to the token embedding) over a vocabulary of ``vocab_size``
tokens, and trains it on a token stream this module generates from a seed: a
Markov chain in which each token is followed by one of a few tokens of its own,
so that the loss falls well below ``log(vocab_size)`` as the model learns the
chain. Every host generates the same stream from the same seed.

This module imports torch only (the blocks are the character GPT's too), so a
benchmark can build the same model beside another toolkit.

Sizes: the defaults (``vocab_size=8192, n_layer=6, n_embd=512``) give 23.1M
parameters, whose token embedding (8192 x 512 float32) is one 16 MiB tensor;
``vocab_size=50257, n_layer=12, n_head=12, n_embd=768, block_size=1024`` is
GPT-2 small's shape, 124M parameters.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then an MLP, each with a residual."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


#: Tokens that may follow each token in the synthetic stream.
FOLLOWERS = 4


class TokenWindows(Dataset):
    """Windows of ``block_size`` tokens and the same shifted by one.

    Args:
        tokens: the stream, a 1-D integer tensor.
        block_size: context length.
        stride: step between window starts.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int):
        if len(tokens) <= block_size + 1:
            raise ValueError(f"a stream of {len(tokens)} tokens is too short for "
                             f"block_size={block_size}")
        self.tokens = tokens
        self.block_size = block_size
        self.starts = range(0, len(tokens) - block_size - 1, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        s = self.starts[i]
        chunk = self.tokens[s:s + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def synthetic_tokens(count: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """``count`` tokens of a seeded Markov chain: each token is followed by one of
    :data:`FOLLOWERS` tokens of its own, chosen with fixed unequal odds."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    followers = torch.randint(0, vocab_size, (vocab_size, FOLLOWERS), generator=g)
    choices = torch.multinomial(torch.tensor([0.55, 0.25, 0.15, 0.05]), count, replacement=True,
                                generator=g)
    out = torch.empty(count, dtype=torch.int32)
    token = int(torch.randint(0, vocab_size, (1,), generator=g))
    table = followers.tolist()
    picks = choices.tolist()
    for i in range(count):
        out[i] = token
        token = table[token][picks[i]]
    return out


class TokenGPT(nn.Module):
    """A GPT-2 style language model; ``forward((x, y))`` returns the next-token loss.

    Args:
        vocab_size: tokens in the vocabulary.
        block_size: context length.
        n_layer, n_head, n_embd: depth, attention heads, width.
        tie_head: the output layer is the token embedding (GPT-2's choice), else a
            layer of its own (``head``).
    """

    def __init__(self, vocab_size: int = 8192, block_size: int = 128, n_layer: int = 6,
                 n_head: int = 8, n_embd: int = 512, tie_head: bool = True):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head) for _ in range(n_layer)))
        self.ln = nn.LayerNorm(n_embd)
        self.head = None if tie_head else nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        h = self.ln(self.blocks(x))
        return F.linear(h, self.tok.weight) if self.head is None else self.head(h)

    def forward(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self.logits(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def gpt_task(vocab_size: int = 8192, block_size: int = 128, n_layer: int = 6, n_head: int = 8,
             n_embd: int = 512, tokens: int = 200_000, stride: int | None = None,
             val_fraction: float = 0.05, seed: int = 0
             ) -> tuple[TokenGPT, TokenWindows, TokenWindows]:
    """A GPT on a synthetic token stream (see the module).

    Args:
        vocab_size: tokens in the vocabulary.
        block_size: context length.
        n_layer, n_head, n_embd: model shape (the defaults: 23.1M parameters).
        tokens: length of the generated stream.
        stride: step between training windows (default ``block_size``).
        val_fraction: the stream's tail held out for validation.
        seed: seed of the stream and of the initial weights.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction!r}")
    stream = synthetic_tokens(tokens, vocab_size, seed)
    split = int(len(stream) * (1 - val_fraction))
    stride = stride or block_size
    train = TokenWindows(stream[:split], block_size, stride)
    val = TokenWindows(stream[split:], block_size, block_size)
    torch.manual_seed(seed)
    return TokenGPT(vocab_size, block_size, n_layer, n_head, n_embd), train, val
