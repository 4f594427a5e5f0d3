"""Paged decode attention: split-K stage 1 (online softmax per split) + the LSE merge.

One query per sequence. A program of stage 1 owns (sequence, KV head, block of its query
heads, split): the GQA group shares every K/V tile load, and the group's BLOCK_H query
rows go through tl.dot. LSEs are kept in base 2 (exp2 is the native instruction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lse_merge import choose_splits, merge_splits, split_workspace
from .utils import dot_precision, interpreting, mma, pow2

MAX_SPLITS = 8
_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_splits"])  # runtime: one compile for every count
def _decode_stage1(
    Q,  # [B, HQ, D]
    K,  # [rows, HKV, D]
    V,  # [rows, HKV, DV]
    KvIndptr,  # [B+1] int64
    KvIndices,  # [nnz] int64
    AttOut,  # [B, HQ, >=num_splits, DV] fp32, per-split normalized partial output
    AttLse,  # [B, HQ, >=num_splits] fp32, per-split log2-sum-exp2 (-inf if empty)
    qk_scale,  # sm_scale * log2(e)
    stride_qb, stride_qh,
    stride_kr, stride_kh,
    stride_vr, stride_vh,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    num_splits,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1) // HEAD_BLOCKS
    hblk = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    kv_start = tl.load(KvIndptr + b)
    kv_len = tl.load(KvIndptr + b + 1) - kv_start
    # Splits are whole BLOCK_N tiles so only the sequence's last tile is partial.
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)

    offs_g = hblk * BLOCK_H + tl.arange(0, BLOCK_H)  # head index inside the group
    h_mask = offs_g < GROUP
    offs_h = kh * GROUP + offs_g  # query head
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(
        Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        n_mask = n < hi
        rows = tl.load(KvIndices + kv_start + n, mask=n_mask, other=0)  # int64 pool rows
        k = tl.load(
            K + rows[:, None] * stride_kr + kh * stride_kh + offs_d[None, :],
            mask=n_mask[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        s = mma(q, tl.trans(k), DOT_PREC, UPCAST) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile holds >= 1 valid column (start < hi), so m_new is finite: no NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(
            V + rows[:, None] * stride_vr + kh * stride_vh + offs_dv[None, :],
            mask=n_mask[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC, UPCAST)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(
        AttOut + b * stride_ob + offs_h[:, None] * stride_oh + split * stride_os
        + offs_dv[None, :],
        out,
        mask=h_mask[:, None] & (offs_dv[None, :] < DV),
    )
    tl.store(AttLse + b * stride_lb + offs_h * stride_lh + split, lse, mask=h_mask)


def choose_num_splits(batch: int, num_kv_heads: int, avg_kv_len: float, device) -> int:
    """Decode splits: one program per (sequence, KV head) before splitting."""
    return choose_splits(batch * num_kv_heads, avg_kv_len, MAX_SPLITS, device)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [rows, Hkv, D]
    v_cache: torch.Tensor,  # [rows, Hkv, Dv]
    kv_indptr: torch.Tensor,  # [B+1] int64
    kv_indices: torch.Tensor,  # [nnz] int64
    sm_scale: float,
    num_splits: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,  # (att_out, att_lse)
) -> torch.Tensor:  # [B, Hq, Dv]
    batch, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[-1]
    assert hq % hkv == 0, f"Hq={hq} must be a multiple of Hkv={hkv}"
    assert k_cache.shape[-1] == d and kv_indptr.shape == (batch + 1,)
    out = q.new_empty((batch, hq, dv))
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(batch, hkv, kv_indices.numel() / batch, q.device)
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits must be in 1..{MAX_SPLITS}"
    if workspace is None:
        att_out, att_lse = split_workspace(batch, hq, num_splits, dv, q.device)
    else:  # caller-preallocated (e.g. for graph capture); may be larger than needed
        att_out, att_lse = workspace
        assert att_out.shape[1:] == (hq, att_out.shape[2], dv) and att_out.shape[2] >= num_splits
        assert att_lse.shape[0] >= batch and att_out.shape[0] >= batch
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = hq // hkv
    block_h = pow2(min(group, 64))
    head_blocks = triton.cdiv(group, block_h)
    _decode_stage1[(batch, hkv * head_blocks, num_splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, att_out, att_lse,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        att_out.stride(0), att_out.stride(1), att_out.stride(2),
        att_lse.stride(0), att_lse.stride(1),
        num_splits,
        GROUP=group, HEAD_BLOCKS=head_blocks, D=d, DV=dv,
        BLOCK_H=block_h, BLOCK_N=32, BLOCK_D=pow2(d), BLOCK_DV=pow2(dv),
        DOT_PREC=dot_precision(q.dtype), UPCAST=interpreting(),
    )
    merge_splits(att_out, att_lse, out, num_splits)
    return out
