"""Split-K LSE merge: combine per-split normalized partial outputs into one row.

Shared by the paged decode kernel and the split-K path of the extend kernel. A split's
partial is (out_s, lse_s) with out_s already normalized by its own sum and lse_s in base 2
(-inf when the split saw no key), so the merged row is sum_s w_s * out_s / sum_s w_s with
w_s = 2^(lse_s - max lse).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .utils import pow2, sm_count

MIN_SPLIT_KV = 256  # shorter splits cost more in partial writes + merge than they save


# num_splits is a runtime value (not constexpr, not specialized) so the split counts a
# serving run meets compile one kernel per power-of-two BLOCK_S, not one per count.
@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    AttOut,  # [R, H, >=num_splits, DV] fp32
    AttLse,  # [R, H, >=num_splits] fp32 (log2 domain)
    Out,  # [R, H, DV]
    stride_ar, stride_ah, stride_as,
    stride_lr, stride_lh,
    stride_or, stride_oh,
    num_splits,
    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_mask = offs_s < num_splits
    lse = tl.load(AttLse + r * stride_lr + h * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row that saw no key: all weights become 0
    w = tl.exp2(lse - m)  # [BLOCK_S]
    part = tl.load(
        AttOut + r * stride_ar + h * stride_ah + offs_s[:, None] * stride_as + offs_dv[None, :],
        mask=s_mask[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )  # [BLOCK_S, BLOCK_DV]
    denom = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(Out + r * stride_or + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty),
             mask=offs_dv < DV)


def choose_splits(programs: int, kv_len: float, max_splits: int, device) -> int:
    """Split count for a launch of `programs` programs per split over kv_len keys: enough
    to fill the GPU (~2 waves), never splits shorter than MIN_SPLIT_KV keys, so the count
    grows with the context length until the GPU is full or max_splits is reached."""
    want = math.ceil(2 * sm_count(torch.device(device)) / max(1, programs))
    by_len = math.ceil(kv_len / MIN_SPLIT_KV)
    return int(max(1, min(max_splits, want, by_len)))


def split_workspace(
    rows: int, heads: int, num_splits: int, dv: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh fp32 partials: out [rows, heads, num_splits, dv], lse [rows, heads, num_splits]."""
    att_out = torch.empty((rows, heads, num_splits, dv), dtype=torch.float32, device=device)
    att_lse = torch.empty((rows, heads, num_splits), dtype=torch.float32, device=device)
    return att_out, att_lse


def merge_splits(
    att_out: torch.Tensor,  # [>=R, H, >=S, DV] fp32
    att_lse: torch.Tensor,  # [>=R, H, >=S] fp32
    out: torch.Tensor,  # [R, H, DV], written in place
    num_splits: int,
) -> torch.Tensor:
    """Merge the first num_splits partials of each of out's R x H rows into out."""
    rows, heads, dv = out.shape
    _merge_kernel[(rows, heads)](
        att_out, att_lse, out,
        att_out.stride(0), att_out.stride(1), att_out.stride(2),
        att_lse.stride(0), att_lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        DV=dv, BLOCK_S=pow2(num_splits, 1), BLOCK_DV=pow2(dv, 1),
    )
    return out
