"""RMSNorm exactly as transformers computes it (fp32 math, cast back, then x weight)."""

from __future__ import annotations

import torch
from torch import nn

from .weights import new_param


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param((dim,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back BEFORE the weight multiply: that is HF's rounding order in bf16.
        return self.weight * h.to(dtype)
