"""Torch SDPA backend: gathers each request's cache rows and runs SDPA (the CPU path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark_launch.kernels.reference import store_kv_torch

from .backend import AttentionBackend
from .metadata import ForwardMetadata

# Pad the whole batch into one SDPA call unless padding would multiply the work by more
# than this (e.g. one long prefill next to many decodes): then loop per request.
_MAX_PAD_WASTE = 4.0
_PAD_SLACK = 4096


@dataclass
class _Padded:
    tok: torch.Tensor  # [B, maxQ] int64 token index into q (0 where padded)
    kv_idx: torch.Tensor  # [B, maxK] int64 cache rows (0 = dummy where padded)
    mask: torch.Tensor  # [B, 1, maxQ, maxK] bool, True = may attend
    row_ok: torch.Tensor  # [B, 1, maxQ, 1] bool, False = fully masked -> output 0
    flat_pos: torch.Tensor  # [T] int64 position of each token in the B*maxQ padded grid


@dataclass
class _PerRequest:
    q_start: int
    q_end: int
    rows: torch.Tensor  # [kv_len] int64
    mask: torch.Tensor | None  # [q_len, kv_len] bool; None = attend to all


def _request_mask(meta: ForwardMetadata, b: int, device: torch.device) -> torch.Tensor | None:
    ql, kl = meta.q_lens[b], meta.kv_lens[b]
    if meta.mask_mode == "none":
        return None
    if meta.mask_mode == "causal":
        if ql == 1:
            return None  # the last position sees everything
        i = torch.arange(ql, device=device)[:, None]
        j = torch.arange(kl, device=device)[None, :]
        return j <= (kl - ql) + i
    assert meta.custom_mask is not None and meta.mask_indptr is not None
    start = int(meta.mask_indptr[b])
    mask = meta.custom_mask[start : start + ql * kl].view(ql, kl)
    return mask.to(device=device, dtype=torch.bool)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, meta: ForwardMetadata) -> None:
        if meta.num_tokens == 0:
            meta.backend_state[self.name] = None
            return
        dev = self.device
        work = sum(q * k for q, k in zip(meta.q_lens, meta.kv_lens))
        b, max_q, max_k = meta.num_requests, max(meta.q_lens), max(meta.kv_lens)
        if b * max_q * max_k > _MAX_PAD_WASTE * work + _PAD_SLACK:
            meta.backend_state[self.name] = self._prepare_per_request(meta, dev)
        else:
            meta.backend_state[self.name] = self._prepare_padded(meta, dev, b, max_q, max_k)

    @staticmethod
    def _prepare_per_request(meta: ForwardMetadata, dev: torch.device) -> list[_PerRequest]:
        qp, kp = meta.q_indptr.tolist(), meta.kv_indptr.tolist()
        kv_indices = meta.kv_indices.to(dev)
        return [
            _PerRequest(
                qp[b], qp[b + 1], kv_indices[kp[b] : kp[b + 1]], _request_mask(meta, b, dev)
            )
            for b in range(meta.num_requests)
        ]

    @staticmethod
    def _prepare_padded(
        meta: ForwardMetadata, dev: torch.device, b: int, max_q: int, max_k: int
    ) -> _Padded:
        q_lens = torch.tensor(meta.q_lens, device=dev)
        kv_lens = torch.tensor(meta.kv_lens, device=dev)
        q_ptr, kv_ptr = meta.q_indptr.to(dev), meta.kv_indptr.to(dev)
        kv_indices = meta.kv_indices.to(dev)
        qi = torch.arange(max_q, device=dev)
        kj = torch.arange(max_k, device=dev)
        q_ok = qi[None, :] < q_lens[:, None]  # [B, maxQ]
        k_ok = kj[None, :] < kv_lens[:, None]  # [B, maxK]
        tok = torch.where(q_ok, q_ptr[:-1, None] + qi[None, :], 0)
        flat_k = (kv_ptr[:-1, None] + kj[None, :]).clamp(max=max(kv_indices.numel() - 1, 0))
        kv_idx = torch.where(k_ok, kv_indices[flat_k], 0)
        mask = q_ok[:, :, None] & k_ok[:, None, :]  # [B, maxQ, maxK]
        if meta.mask_mode == "causal":
            prefix = (kv_lens - q_lens)[:, None, None]
            mask &= kj[None, None, :] <= prefix + qi[None, :, None]
        elif meta.mask_mode == "custom":
            custom = torch.zeros_like(mask)
            for r in range(b):
                m = _request_mask(meta, r, dev)
                custom[r, : meta.q_lens[r], : meta.kv_lens[r]] = m
            mask &= custom
        batch_of_tok = torch.repeat_interleave(torch.arange(b, device=dev), q_lens)
        pos_in_req = torch.arange(meta.num_tokens, device=dev) - q_ptr[batch_of_tok]
        return _Padded(
            tok=tok,
            kv_idx=kv_idx,
            mask=mask[:, None],
            row_ok=mask.any(-1)[:, None, :, None],
            flat_pos=batch_of_tok * max_q + pos_in_req,
        )

    def forward(self, q, k, v, k_cache, v_cache, meta, sm_scale):
        if q.shape[0] == 0:
            return self._empty_out(q, v_cache)
        store_kv_torch(k_cache, v_cache, k, v, meta.out_rows)
        state = meta.backend_state.get(self.name)
        if state is None:
            self.prepare(meta)
            state = meta.backend_state[self.name]
        gqa = q.shape[1] != k_cache.shape[1]
        if isinstance(state, list):
            out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))
            for r in state:
                qr = q[r.q_start : r.q_end].transpose(0, 1)  # [Hq, q_len, D]
                kr = k_cache[r.rows].transpose(0, 1).to(q.dtype)  # [Hkv, kv_len, D]
                vr = v_cache[r.rows].transpose(0, 1).to(q.dtype)  # [Hkv, kv_len, Dv]
                o = F.scaled_dot_product_attention(
                    qr, kr, vr, attn_mask=r.mask, scale=sm_scale, enable_gqa=gqa
                )
                if r.mask is not None:
                    o = torch.where(r.mask.any(-1)[None, :, None], o, 0.0)
                out[r.q_start : r.q_end] = o.transpose(0, 1)
            return out
        qp = q[state.tok].transpose(1, 2)  # [B, Hq, maxQ, D]
        kp = k_cache[state.kv_idx].transpose(1, 2).to(q.dtype)  # [B, Hkv, maxK, D]
        vp = v_cache[state.kv_idx].transpose(1, 2).to(q.dtype)  # [B, Hkv, maxK, Dv]
        o = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=state.mask, scale=sm_scale, enable_gqa=gqa
        )  # [B, Hq, maxQ, Dv]
        o = torch.where(state.row_ok, o, 0.0).transpose(1, 2)  # [B, maxQ, Hq, Dv]
        return o.reshape(-1, q.shape[1], v_cache.shape[-1])[state.flat_pos]
