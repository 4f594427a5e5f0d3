"""Small host-side helpers shared by the kernel launchers."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def pow2(n: int, minimum: int = 16) -> int:
    """Power-of-two block size >= n; tl.dot needs every dim >= 16 on GPU."""
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would silently run as tf32 on GPU; keep them exact so fp32 matches 1e-5.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: every extra program costs Python time, prefer few


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def mma(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with an fp32 result. The Triton 3.9 interpreter computes garbage for
    16-bit float dots, so under it (UPCAST) the operands are widened first; operands were
    already rounded to their storage dtype, so results still match the GPU path closely."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)
