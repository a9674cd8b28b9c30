"""A small frozen video tokenizer with BatchNorm3d statistics, and the failure it invites.

``shardwise demo`` and ``examples/frozen_tokenizer.py`` use it to re-enact the case that
motivated shardwise: a pretrained model with BatchNorm3d buffers, loaded under DeepSpeed
ZeRO-3 on rank 0 only, inside a gather that broadcasts parameters on exit but not
buffers. Every rank then holds the same weights but rank 0 alone holds the trained
``running_mean`` / ``running_var``, and the same clip becomes different tokens per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import save_file

CLIP = (3, 4, 16, 16)
"""Shape of one clip, (channels, frames, height, width); it becomes 2 x 4 x 4 = 32 tokens."""


class ConvBN3d(nn.Module):
    """Conv3d then BatchNorm3d (the buffers that matter here)."""

    def __init__(self, cin: int, cout: int, kernel: tuple[int, int, int],
                 stride: tuple[int, int, int] = (1, 1, 1), padding: int = 0) -> None:
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm3d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class VideoTokenizer(nn.Module):
    """Three Conv3d + BatchNorm3d layers, then the nearest codebook entry.

    (B, 3, T, H, W) -> (B, T/2 * H/4 * W/4) token ids in ``[0, codebook)``.
    """

    def __init__(self, channels: int = 16, codebook: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            ConvBN3d(3, channels, (3, 3, 3), padding=1),
            ConvBN3d(channels, channels, (2, 4, 4), stride=(2, 4, 4)),  # 2x4x4 patches
            ConvBN3d(channels, channels, (1, 1, 1)),
        ])
        self.codebook = nn.Parameter(torch.randn(codebook, channels))

    def features(self, video: torch.Tensor) -> torch.Tensor:
        """(B, L, C) normalised patch features, before quantisation."""
        x = video
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.blocks) - 1:
                x = torch.relu(x)
        return x.flatten(2).transpose(1, 2)

    @torch.no_grad()
    def forward(self, video: torch.Tensor) -> torch.Tensor:
        z = self.features(video)
        dist2 = (z.pow(2).sum(-1, keepdim=True) - 2 * z @ self.codebook.t()
                 + self.codebook.pow(2).sum(-1))
        return dist2.argmin(-1)


def clips(n: int, seed: int) -> torch.Tensor:
    """``n`` random clips with pixel values in [0, 1), the same for a given seed."""
    return torch.rand(n, *CLIP, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def write_pretrained(path: str, seed: int = 1234, batches: int = 8) -> VideoTokenizer:
    """Write a 'pretrained' tokenizer to a safetensors file, and return it (eval mode).

    The weights are random (seeded); the BatchNorm running statistics are trained for
    real: the exact mean and variance of each layer's inputs over ``batches`` batches of
    :func:`clips`, so they are far from the defaults (mean 0, variance 1) that an
    unloaded rank keeps.
    """
    with torch.random.fork_rng():  # seeded weights, the caller's RNG untouched
        torch.manual_seed(seed)
        tok = VideoTokenizer()
    bns = [m for m in tok.modules() if isinstance(m, nn.BatchNorm3d)]
    for bn in bns:
        bn.momentum = None  # a cumulative average over all batches, not an EMA
    tok.train()
    for i in range(batches):
        tok.features(clips(16, seed + 1 + i))
    for bn in bns:
        bn.momentum = 0.1
    save_file(tok.state_dict(), path)
    return tok.eval()


def load_on_rank0_only(tokenizer: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Re-enact the failure: rank 0 loads ``state``; then, as DeepSpeed's
    ``GatheredParameters(modifier_rank=0)`` does on exit, the parameters are broadcast
    from rank 0 but the buffers are not. Do not do this; it is what shardwise catches."""
    if dist.get_rank() == 0:
        tokenizer.load_state_dict(state)
    with torch.no_grad():
        for p in tokenizer.parameters():
            dist.broadcast(p.data, 0)
