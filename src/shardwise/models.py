"""Public reference models: a small GPT and a BatchNorm CNN.

Part of the public API (``from shardwise.models import GPT, GPTConfig, SmallCNN``): the
demo, the tests, the benchmarks and the README's examples use them, so their names and
constructor arguments stay stable. They are ordinary ``nn.Module`` s written the way
users write models (nanoGPT style); shardwise itself does not depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. The defaults are the benchmark's reference workload."""

    vocab_size: int = 8192
    seq_len: int = 256
    n_layer: int = 6
    n_head: int = 8
    d_model: int = 512
    tie_weights: bool = True

    def __post_init__(self) -> None:
        # A negative n_layer built a GPT of no blocks (range(-1) is empty) and `shardwise
        # plan` planned it without a word. ValueError, not ShardwiseError: these models do
        # not depend on shardwise (the plan command words it as its own error).
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name}={value!r}: must be a positive int")


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        # No qkv bias (as in Llama): the key bias has an exactly-zero true gradient, so its
        # computed gradient is rounding noise that Adam turns into random +-lr steps. That
        # would make any two correct implementations with a different summation order drift.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A decoder-only language model whose output head is tied to its token embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Small initial weights: with a tied head, N(0, 1) embeddings give huge logits.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy loss when ``targets`` is given."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    """A small image classifier with BatchNorm (buffers that change in training)."""

    def __init__(self, channels: tuple[int, ...] = (3, 16, 32, 32), classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ConvBlock(a, b) for a, b in zip(channels, channels[1:]))
        self.head = nn.Linear(channels[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = F.max_pool2d(block(x), 2) if x.shape[-1] > 4 else block(x)
        return self.head(x.mean(dim=(2, 3)))


def gpt(**config: int | float) -> GPT:
    """A :class:`GPT` from :class:`GPTConfig` keyword arguments (for ``shardwise plan
    --model shardwise.models:gpt --kwargs '{"n_layer": 24}'``)."""
    return GPT(GPTConfig(**config))  # type: ignore[arg-type]
