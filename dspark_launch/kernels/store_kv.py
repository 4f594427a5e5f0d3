"""store_kv: scatter the new tokens' K/V into the paged pool (row < 0 = skip)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import pow2


@triton.jit
def _store_kv_kernel(
    K,  # [T, H, D]
    V,  # [T, H, DV]
    KC,  # [rows, H, D]
    VC,  # [rows, H, DV]
    Rows,  # [T] int64
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcr, stride_kch,
    stride_vcr, stride_vch,
    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(Rows + t)  # int64: pool rows can exceed 2**31 / stride
    # Skipping via the head bound (0 heads for padding rows) keeps every mask a block
    # compare; the interpreter rejects scalar-bool & block masks.
    h_lim = tl.where(row >= 0, H, 0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mk = (offs_h[:, None] < h_lim) & (offs_d[None, :] < D)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mk)
    tl.store(
        KC + row * stride_kcr + offs_h[:, None] * stride_kch + offs_d[None, :],
        k.to(KC.dtype.element_ty),
        mask=mk,
    )
    mv = (offs_h[:, None] < h_lim) & (offs_dv[None, :] < DV)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_dv[None, :], mask=mv)
    tl.store(
        VC + row * stride_vcr + offs_h[:, None] * stride_vch + offs_dv[None, :],
        v.to(VC.dtype.element_ty),
        mask=mv,
    )


def store_kv(
    k_cache: torch.Tensor,  # [rows, H, D]
    v_cache: torch.Tensor,  # [rows, H, Dv]
    k: torch.Tensor,  # [T, H, D]
    v: torch.Tensor,  # [T, H, Dv]
    rows: torch.Tensor,  # [T] int64; < 0 = skip (padding); 0 = dummy row
) -> None:
    t, h, d = k.shape
    dv = v.shape[-1]
    assert k_cache.shape[1:] == (h, d) and v_cache.shape[1:] == (h, dv), "cache/kv mismatch"
    assert rows.shape == (t,), "rows must be [T]"
    if t == 0:
        return
    # The kernel assumes unit stride on the last dim (pool buffers and q/k/v projections are).
    k, v = k.contiguous() if k.stride(-1) != 1 else k, v.contiguous() if v.stride(-1) != 1 else v
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, rows.to(torch.int64),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        H=h, D=d, DV=dv,
        BLOCK_H=pow2(h, 1), BLOCK_D=pow2(d, 1), BLOCK_DV=pow2(dv, 1),
    )
