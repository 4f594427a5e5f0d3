"""RMSNorm exactly as transformers computes it (fp32 math, cast back, then x weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .weights import new_param


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed in fp32 and cast back, WITHOUT the weight.

    One fused F.rms_norm call instead of pow/mean/add/rsqrt/mul (each a separate eager op,
    which dominates at decode sizes); in fp32 it is bitwise equal to HF's formula.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], None, eps)
    return F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param((dim,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        if x.dtype == torch.float32 == self.weight.dtype:
            # fp32: the weight can ride inside the fused kernel (same rounding as below).
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        # Cast back BEFORE the weight multiply: that is HF's rounding order in bf16.
        return self.weight * rms_normalize(x, self.eps)
