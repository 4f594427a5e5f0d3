"""Extend / verify / draft-block attention over a paged KV cache.

Request b's q_len_b new queries are the last q_len_b of its kv_len_b cached positions
(their K/V were stored by store_kv first), so one walk over kv_indices covers prefix and
new tokens alike. A program owns (request, KV head, head block, BLOCK_Q tokens, KV split);
its BLOCK_M = BLOCK_Q * GP rows are (token, head-in-group) pairs, so every K/V tile load is
shared by the whole GQA group.

Split-K: a short block (verify, draft; <= VERIFY_MAX_Q rows) at long context has only
batch * Hkv programs, far too few to fill a GPU, each walking the whole context. With
num_splits > 1 (SPLIT_K) the visible key range is cut into num_splits chunks, each program
writes a normalized partial + LSE, and lse_merge (the decode kernel's merge) combines them.
num_splits is a runtime value so the counts a serving run meets share one compiled kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lse_merge import choose_splits, merge_splits, split_workspace
from .utils import dot_precision, interpreting, mma, pow2

MASK_MODES = {"causal": 0, "none": 1, "custom": 2}
VERIFY_MAX_Q = 32  # longest block that takes the split-K path (verify and draft blocks)
MAX_EXTEND_SPLITS = 32
_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_splits"])
def _extend_kernel(
    Q,  # [T, HQ, D]
    K,  # [rows, HKV, D]
    V,  # [rows, HKV, DV]
    Out,  # [T, HQ, DV] (not SPLIT_K)
    AttOut,  # [T, HQ, num_splits, DV] fp32 normalized partials (SPLIT_K)
    AttLse,  # [T, HQ, num_splits] fp32 log2-sum-exp2, -inf if the split saw no key
    QIndptr,  # [B+1] int64
    KvIndptr,  # [B+1] int64
    KvIndices,  # [nnz] int64
    Mask,  # [sum q_len*kv_len] uint8 (custom mode only; else any valid pointer)
    MaskIndptr,  # [B+1] int64 (custom mode only)
    qk_scale,  # sm_scale * log2(e)
    stride_qt, stride_qh,
    stride_kr, stride_kh,
    stride_vr, stride_vh,
    stride_ot, stride_oh,
    stride_at, stride_ah, stride_as,
    stride_lt, stride_lh,
    num_splits,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, GP: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, MASK_MODE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GP
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1) // HEAD_BLOCKS
    hblk = tl.program_id(1) % HEAD_BLOCKS
    qblk = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(QIndptr + b)
    q_len = tl.load(QIndptr + b + 1) - q_start
    if qblk * BLOCK_Q >= q_len:
        return  # the grid covers the batch's longest request; this one is shorter
    kv_start = tl.load(KvIndptr + b)
    kv_len = tl.load(KvIndptr + b + 1) - kv_start
    prefix = kv_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    tok = qblk * BLOCK_Q + offs_m // GP  # query index inside the request
    g = hblk * GP + offs_m % GP  # head index inside the GQA group
    m_valid = (tok < q_len) & (g < GROUP)
    head = kh * GROUP + g
    tok64 = q_start + tok  # int64 (q_start is): token row in Q / Out / the partials
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(
        Q + tok64[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=m_valid[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    hi = kv_len
    if MASK_MODE == 0:
        # Causal: nothing past the block's last query position is visible.
        last_tok = tl.minimum(qblk * BLOCK_Q + BLOCK_Q, q_len) - 1
        hi = tl.minimum(kv_len, prefix + last_tok + 1)
    # This program's split of [0, hi): whole BLOCK_N tiles, so only the last tile is
    # partial; with one split it is all of [0, hi).
    chunk = tl.cdiv(tl.cdiv(hi, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, hi)
    if MASK_MODE == 2:
        mask_start = tl.load(MaskIndptr + b)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        n_valid = n < hi
        rows = tl.load(KvIndices + kv_start + n, mask=n_valid, other=0)  # int64 pool rows
        k = tl.load(
            K + rows[:, None] * stride_kr + kh * stride_kh + offs_d[None, :],
            mask=n_valid[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        s = mma(q, tl.trans(k), DOT_PREC, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
        allowed = m_valid[:, None] & n_valid[None, :]
        if MASK_MODE == 0:
            allowed = allowed & (n[None, :] <= (prefix + tok)[:, None])
        if MASK_MODE == 2:
            bits = tl.load(
                Mask + mask_start + tok[:, None].to(tl.int64) * kv_len + n[None, :],
                mask=allowed,
                other=0,
            )  # [BLOCK_M, BLOCK_N]
            allowed = allowed & (bits != 0)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may have seen nothing yet (custom mask, padding rows): exp2(-inf - -inf)
        # would be NaN, so shift such rows by 0 instead; their p and alpha stay 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        v = tl.load(
            V + rows[:, None] * stride_vr + kh * stride_vh + offs_dv[None, :],
            mask=n_valid[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC, UPCAST)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]  # rows that saw no key -> 0
    if not SPLIT_K:
        tl.store(
            Out + tok64[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
            out.to(Out.dtype.element_ty),
            mask=m_valid[:, None] & (offs_dv[None, :] < DV),
        )
    else:
        # A row that saw no key in this split gets LSE -inf: weight 0 in the merge.
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(
            AttOut + tok64[:, None] * stride_at + head[:, None] * stride_ah
            + split * stride_as + offs_dv[None, :],
            out,
            mask=m_valid[:, None] & (offs_dv[None, :] < DV),
        )
        tl.store(AttLse + tok64 * stride_lt + head * stride_lh + split, lse, mask=m_valid)


def choose_extend_splits(
    batch: int, num_kv_heads: int, max_q_len: int, max_kv_len: int, device
) -> int:
    """Split-K only for short blocks (<= VERIFY_MAX_Q rows: one or two query blocks per
    request and KV head); longer blocks have query blocks enough to fill the GPU."""
    if max_q_len > VERIFY_MAX_Q:
        return 1
    return choose_splits(batch * num_kv_heads, max_kv_len, MAX_EXTEND_SPLITS, device)


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [rows, Hkv, D]
    v_cache: torch.Tensor,  # [rows, Hkv, Dv]
    q_indptr: torch.Tensor,  # [B+1] int64
    kv_indptr: torch.Tensor,  # [B+1] int64
    kv_indices: torch.Tensor,  # [nnz] int64
    sm_scale: float,
    mask_mode: str = "causal",
    custom_mask: torch.Tensor | None = None,  # [sum q_len*kv_len] bool, True = may attend
    mask_indptr: torch.Tensor | None = None,  # [B+1] int64
    max_q_len: int | None = None,  # pass it to avoid a device->host sync
    num_splits: int = 1,  # > 1: split-K over each block's keys (see choose_extend_splits)
) -> torch.Tensor:  # [T, Hq, Dv]
    t, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[-1]
    assert hq % hkv == 0, f"Hq={hq} must be a multiple of Hkv={hkv}"
    assert mask_mode in MASK_MODES, f"mask_mode must be one of {tuple(MASK_MODES)}"
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    out = q.new_empty((t, hq, dv))
    batch = q_indptr.numel() - 1
    if t == 0 or batch == 0:
        return out
    if max_q_len is None:
        max_q_len = int((q_indptr[1:] - q_indptr[:-1]).max())
    if mask_mode == "custom":
        assert custom_mask is not None and mask_indptr is not None, "custom mode needs a mask"
        mask_arg = custom_mask.to(torch.bool).view(torch.uint8)
        mask_ptr_arg = mask_indptr
    else:
        mask_arg, mask_ptr_arg = kv_indices, kv_indptr  # never read
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = hq // hkv
    gp = pow2(min(group, 64), 1)
    head_blocks = triton.cdiv(group, gp)
    block_q = max(1, 64 // gp)
    if num_splits > 1:
        att_out, att_lse = split_workspace(t, hq, num_splits, dv, q.device)
    else:  # never touched: the kernel stores straight into out
        att_out, att_lse = out.unsqueeze(2), out
    grid = (batch, hkv * head_blocks, triton.cdiv(max_q_len, block_q) * num_splits)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, att_out, att_lse,
        q_indptr, kv_indptr, kv_indices, mask_arg, mask_ptr_arg,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        att_out.stride(0), att_out.stride(1), att_out.stride(2),
        att_lse.stride(0), att_lse.stride(1),
        num_splits,
        GROUP=group, HEAD_BLOCKS=head_blocks, GP=gp, D=d, DV=dv,
        MASK_MODE=MASK_MODES[mask_mode], SPLIT_K=num_splits > 1,
        BLOCK_Q=block_q, BLOCK_N=32, BLOCK_D=pow2(d), BLOCK_DV=pow2(dv),
        DOT_PREC=dot_precision(q.dtype), UPCAST=interpreting(),
    )
    if num_splits > 1:
        merge_splits(att_out, att_lse, out, num_splits)
    return out
