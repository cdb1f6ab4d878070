"""A tiny causal Transformer language model in plain ``torch.nn``, sized to train on a laptop CPU.

It is a GPT-style decoder: token plus learned position embeddings, pre-LayerNorm blocks of causal self-attention and
a GELU MLP, a final LayerNorm, and an output head tied to the token embedding. The default configuration has about
half a million parameters and runs in float32 or, after ``model.double()``, float64 (useful for checking gradients
to high precision).

No attention padding mask is needed for right-padded batches: attention is causal, so real positions never see the
padding that follows them, and padded positions are excluded from the loss by their ``-100`` labels.

Example:
    >>> model = TinyLM(LMConfig(), seed=0)
    >>> logits = model(batch["input_ids"])
    >>> loss = masked_lm_loss(logits, batch["labels"])
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class LMConfig:
    """Shape of a ``TinyLM``.

    Attributes:
        vocab_size: number of token ids (256 bytes plus PAD, BOS, EOS for the byte-level corpus).
        max_len: the longest input the learned position embedding covers.
        d_model: the residual stream's width.
        n_heads: attention heads per block; must divide ``d_model``.
        n_layers: Transformer blocks.
        dropout: dropout on embeddings, attention weights and residual branches (0 keeps training deterministic).
    """

    vocab_size: int = 259
    max_len: int = 640
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.0


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Run the body with the CPU RNG seeded to ``seed``, restoring the global RNG state afterwards; no-op for None."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position ``t`` only attends to positions ``<= t``.

    Args:
        config: the model's shape.
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        if config.d_model % config.n_heads:
            raise ValueError(f"`d_model` ({config.d_model}) must be divisible by `n_heads` ({config.n_heads}).")
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: Tensor) -> Tensor:
        """Attend causally over ``x`` of shape ``[B, T, d_model]``."""
        b, t, d = x.shape
        # [B, T, 3, H, D/H] -> three [B, H, T, D/H] tensors
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        # The fused kernel applies the causal mask without materialising it and supports float64 on the CPU.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """A pre-LayerNorm Transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``.

    Args:
        config: the model's shape.
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
        )
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block to ``x`` of shape ``[B, T, d_model]``."""
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    """A small causal Transformer language model.

    Args:
        config: the model's shape; the defaults suit the byte-level standard library corpus.
        seed: when given, the weights are initialised from this seed without touching the global RNG state, so
            the same seed gives the same model whatever ran before. ``None`` draws from the global RNG.
    """

    def __init__(self, config: LMConfig | None = None, seed: int | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else LMConfig()
        c = self.config
        # The layers' default initialisation also draws random numbers, so the seeded scope covers construction.
        with _seeded(seed):
            self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
            self.pos_emb = nn.Embedding(c.max_len, c.d_model)
            self.drop = nn.Dropout(c.dropout)
            self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
            self.ln_f = nn.LayerNorm(c.d_model)
            self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
            # Tying saves vocab_size * d_model parameters, a large share of a model this small.
            self.head.weight = self.tok_emb.weight
            self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), with residual output projections scaled down by depth."""
        for name, param in self.named_parameters():
            if param.dim() < 2 and name.endswith("weight"):
                nn.init.ones_(param)  # LayerNorm gains: start as the identity
            elif param.dim() < 2:
                nn.init.zeros_(param)
            elif name.endswith(("attn.proj.weight", "mlp.2.weight")):
                # Each block adds two branches to the residual stream; shrinking them keeps its variance bounded.
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * self.config.n_layers))
            else:
                nn.init.normal_(param, std=0.02)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Predict the next token at every position.

        Args:
            input_ids: ``LongTensor[B, T]`` with ``T <= config.max_len``.

        Returns:
            Logits ``[B, T, vocab_size]`` in the model's dtype; position ``t`` depends only on ``input_ids[:, :t+1]``.
        """
        t = input_ids.shape[1]
        if t > self.config.max_len:
            raise ValueError(f"Input length {t} exceeds `max_len` ({self.config.max_len}).")
        positions = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def masked_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over the positions whose label is not ``-100``.

    A batch without any valid label gives NaN (0/0); the token-mean strategy weights each micro-batch by its count,
    so such a batch contributes nothing.

    Args:
        logits: ``[B, T, V]``.
        labels: ``[B, T]``, ``-100`` where a position is not a target.

    Returns:
        A 0-dim tensor.
    """
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
