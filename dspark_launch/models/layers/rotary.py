"""Rotary position embedding, non-interleaved ("rotate_half") as in HF Llama/Qwen3.

cos/sin are computed in fp32 from the absolute positions of this forward's tokens and then
cast to the activation dtype, once per forward, and shared by every layer. They come out
already shaped for apply_rotary ([T, 1, hd], broadcasting over heads) and with the sign of
rotate_half folded into sin, so each apply is four eager ops: x*cos + roll(x)*sin.
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
        """positions [T] int64 -> cos, sin [T, 1, hd] in `dtype`, for apply_rotary only.

        sin's first half is negated: rotate_half(x) * sin == cat(x2, x1) * [-sin, sin].
        Negation is exact, so the products equal HF's bit for bit in any dtype.
        """
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, hd/2] fp32
        cos = torch.cat([freqs, freqs], dim=-1).cos()  # [T, hd]
        sin = freqs.sin()
        sin = torch.cat([-sin, sin], dim=-1)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, hd], cos/sin [T, 1, hd] from RotaryEmbedding.cos_sin -> [T, H, hd]."""
    # roll by hd/2 swaps the halves (x2, x1); the minus of rotate_half lives in sin.
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
