"""Rotary position embedding, non-interleaved ("rotate_half") as in HF Llama/Qwen3.

cos/sin are computed in fp32 from the absolute positions of this forward's tokens and then
cast to the activation dtype, once per forward, and shared by every layer.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, device: torch.device | str) -> None:
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
        # Not a parameter and not in checkpoints (HF keeps inv_freq non-persistent too).
        self.register_buffer("inv_freq", 1.0 / (theta ** (exponent / head_dim)),
                             persistent=False)  # [hd/2] fp32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, hd] in `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, hd/2] fp32
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, hd], cos/sin [T, hd] -> [T, H, hd]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin
