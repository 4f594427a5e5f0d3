"""fp32 torch references for the attention kernels (slow, explicit, for tests).

Also hosts the torch fallback of store_kv, so CPU users never import triton.
"""

from __future__ import annotations

import torch


def store_kv_torch(
    k_cache: torch.Tensor,  # [rows, H, D]
    v_cache: torch.Tensor,  # [rows, H, Dv]
    k: torch.Tensor,  # [T, H, D]
    v: torch.Tensor,  # [T, H, Dv]
    rows: torch.Tensor,  # [T] int64, < 0 = skip
    rows_valid: bool | None = None,  # True: caller checked that no row is < 0
) -> None:
    # The check is a host sync; a caller storing every layer of one forward does it once.
    if not rows_valid:
        keep = rows >= 0
        if not bool(keep.all()):
            rows, k, v = rows[keep], k[keep], v[keep]
    k_cache.index_copy_(0, rows, k.to(k_cache.dtype))
    v_cache.index_copy_(0, rows, v.to(v_cache.dtype))


def ref_store(k_cache, v_cache, k, v, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place reference: returns updated copies, loop over tokens."""
    kc, vc = k_cache.clone(), v_cache.clone()
    for t, r in enumerate(rows.tolist()):
        if r >= 0:
            kc[r] = k[t].to(kc.dtype)
            vc[r] = v[t].to(vc.dtype)
    return kc, vc


def _attend(q, k, v, mask, sm_scale) -> torch.Tensor:
    """q [Q, Hq, D], k [K, Hkv, D], v [K, Hkv, Dv], mask [Q, K] bool -> [Q, Hq, Dv] fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * sm_scale
    s = s.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
    return torch.einsum("hqk,khd->qhd", p, v)


def ref_decode(q, k_cache, v_cache, kv_indptr, kv_indices, sm_scale) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, Dv] fp32."""
    ptr = kv_indptr.tolist()
    out = q.new_zeros((q.shape[0], q.shape[1], v_cache.shape[-1]), dtype=torch.float32)
    for b in range(q.shape[0]):
        rows = kv_indices[ptr[b] : ptr[b + 1]]
        mask = torch.ones(1, len(rows), dtype=torch.bool, device=q.device)
        out[b] = _attend(q[b : b + 1], k_cache[rows], v_cache[rows], mask, sm_scale)[0]
    return out


def ref_extend(
    q, k_cache, v_cache, q_indptr, kv_indptr, kv_indices, sm_scale,
    mask_mode: str = "causal", custom_mask=None, mask_indptr=None,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, Dv] fp32; see kernels.extend_attention for semantics."""
    qp, kp = q_indptr.tolist(), kv_indptr.tolist()
    out = q.new_zeros((q.shape[0], q.shape[1], v_cache.shape[-1]), dtype=torch.float32)
    for b in range(len(qp) - 1):
        ql, kl = qp[b + 1] - qp[b], kp[b + 1] - kp[b]
        if ql == 0:
            continue
        rows = kv_indices[kp[b] : kp[b + 1]]
        if mask_mode == "causal":
            i = torch.arange(ql)[:, None]
            j = torch.arange(kl)[None, :]
            mask = j <= (kl - ql) + i
        elif mask_mode == "none":
            mask = torch.ones(ql, kl, dtype=torch.bool)
        else:
            start = int(mask_indptr[b])
            mask = custom_mask[start : start + ql * kl].reshape(ql, kl).bool().cpu()
        out[qp[b] : qp[b + 1]] = _attend(
            q[qp[b] : qp[b + 1]], k_cache[rows], v_cache[rows], mask.to(q.device), sm_scale
        )
    return out
