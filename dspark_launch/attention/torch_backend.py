"""Torch SDPA backend: gathers each request's cache rows and runs SDPA (the CPU path)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dspark_launch.kernels.reference import store_kv_torch

from .backend import AttentionBackend
from .metadata import ForwardMetadata, upload

# Requests are padded into one SDPA call per group; a group closes once padding would multiply
# its work by more than this (a long prefill next to decodes, one 9-row verify block among
# 1-row ones): requests are grouped by (q_len, kv_len), so a step costs a few calls at most.
_MAX_PAD_WASTE = 2.0
_PAD_SLACK = 4096
# Masks of blocks up to this many rows per request (decode, and verify and draft blocks: 1 +
# the 16 drafts of the ladder's largest cap) are kept for the whole forward as additive fp32
# masks (_Padded.additive_mask). A prefill chunk's would be Q x group x K x 4 bytes held past
# its attention, beyond the step's priced transients (memory/transients.py: the engine's own
# run peaked 72 KB over them at a 32-row chunk), and its per-layer conversion is small next to
# the chunk's work.
ADDITIVE_MAX_Q = 17


@dataclass
class _Padded:
    """One padded SDPA call over a group of requests (the whole batch, or part of it)."""

    dest: torch.Tensor | None  # [T_g] int64 the group's tokens in q / out; None: all, in order
    kv_idx: torch.Tensor  # [B * maxK] int64 cache rows, request-major (0 = dummy padding)
    max_k: int
    # [B or 1, 1, maxQ or 1, maxK] bool, True = may attend (1 request row: one mask for the
    # batch); None = no mask (every query sees every key of its request, or `is_causal` below
    # does the masking)
    mask: torch.Tensor | None
    is_causal: bool  # SDPA's own causal mask (uniform q_len == kv_len: a fresh prefill)
    # Every query row of a request sees the same keys (mask_mode "none", or a decode batch):
    # then the query heads sharing a KV head can be folded into the query axis (see forward).
    shared_keys: bool
    # The rest is None in the common uniform case (every request of the group has the same
    # q_len, e.g. a decode batch or same-width verify/draft blocks): then the group's q is
    # simply viewed as [B, q_len, H, D] and the output needs no gather.
    tok: torch.Tensor | None  # [B, maxQ] int64 token index into the group's q (0 where padded)
    row_ok: torch.Tensor | None  # [B, 1, maxQ, 1] bool, False = fully masked -> output 0
    flat_pos: torch.Tensor | None  # [T_g] int64 position of each token in the B*maxQ grid
    # `mask` as SDPA's additive float mask, per (query heads per KV head, dtype): built by the
    # first layer, reused by the others (additive_mask)
    _additive: dict = field(default_factory=dict)

    def additive_mask(self, group: int, dtype: torch.dtype) -> torch.Tensor | None:
        """`mask` as an additive float mask (0 where a query may attend, -inf elsewhere),
        with GQA folded when group > 1: [B, 1, Q * group, K], row q * group + g, or the mask's
        own shape when one row serves every query. Once per forward, not once per layer: a
        boolean mask is converted by SDPA at every call, and the fold copies it (at q_len 2
        and a 200-token context, 20 us of a 31 us attention call; 11 us with this mask)."""
        if self.mask is None:
            return None
        key = (group, dtype)
        if key in self._additive:
            return self._additive[key]
        mask = self.mask  # [B, 1, Q or 1, K] bool
        b, _, n_q, max_k = mask.shape
        if group > 1 and n_q > 1:
            mask = mask.unsqueeze(3).expand(b, 1, n_q, group, max_k).reshape(
                b, 1, n_q * group, max_k)
        if n_q > ADDITIVE_MAX_Q:
            return mask  # a prefill chunk's: per layer, as SDPA takes it (see ADDITIVE_MAX_Q)
        self._additive[key] = torch.zeros(mask.shape, dtype=dtype,
                                          device=mask.device).masked_fill_(~mask, float("-inf"))
        return self._additive[key]


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


def _groups(q_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """Requests -> groups padded together: sorted by (q_len, kv_len), a group closes once its
    padded work (members x max q x max kv) would exceed _MAX_PAD_WASTE x its real work."""
    order = sorted(range(len(q_lens)), key=lambda b: (q_lens[b], kv_lens[b]))
    groups: list[list[int]] = []
    work = max_q = max_k = 0
    for b in order:
        q, k = q_lens[b], kv_lens[b]
        if groups:
            n, mq, mk = len(groups[-1]) + 1, max(max_q, q), max(max_k, k)
            if n * mq * mk <= _MAX_PAD_WASTE * (work + q * k) + _PAD_SLACK:
                groups[-1].append(b)
                work, max_q, max_k = work + q * k, mq, mk
                continue
        groups.append([b])
        work, max_q, max_k = q * k, q, k
    return groups


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, meta: ForwardMetadata) -> None:
        if meta.num_tokens == 0:
            meta.backend_state[self.name] = None
            return
        dev = self.device
        # store_kv skips rows < 0; check that once per forward, not once per layer.
        meta.backend_state[self.name + ".rows_valid"] = bool((meta.out_rows >= 0).all())
        b = meta.num_requests
        work = sum(q * k for q, k in zip(meta.q_lens, meta.kv_lens))
        if b * max(meta.q_lens) * max(meta.kv_lens) <= _MAX_PAD_WASTE * work + _PAD_SLACK:
            groups = [list(range(b))]
        elif meta.mask_mode == "custom":  # only tests build custom masks: keep it simple
            meta.backend_state[self.name] = self._prepare_per_request(meta, dev)
            return
        else:
            groups = _groups(meta.q_lens, meta.kv_lens)
        # Host-side offsets: reading the device indptrs would sync.
        qp = [0, *itertools.accumulate(meta.q_lens)]
        kp = [0, *itertools.accumulate(meta.kv_lens)]
        kv_indices = meta.kv_indices.to(dev)
        meta.backend_state[self.name] = [self._prepare_padded(meta, dev, g, qp, kp, kv_indices)
                                         for g in groups]

    @staticmethod
    def _prepare_per_request(meta: ForwardMetadata, dev: torch.device) -> list[_PerRequest]:
        qp = [0, *itertools.accumulate(meta.q_lens)]
        kp = [0, *itertools.accumulate(meta.kv_lens)]
        kv_indices = meta.kv_indices.to(dev)
        return [
            _PerRequest(
                qp[b], qp[b + 1], kv_indices[kp[b] : kp[b + 1]], _request_mask(meta, b, dev)
            )
            for b in range(meta.num_requests)
        ]

    @staticmethod
    def _prepare_padded(meta: ForwardMetadata, dev: torch.device, reqs: list[int],
                        qp: list[int], kp: list[int], kv_indices: torch.Tensor) -> _Padded:
        """One padded call over the requests `reqs` (qp / kp: the batch's host offsets)."""
        q_lens = [meta.q_lens[r] for r in reqs]
        kv_lens = [meta.kv_lens[r] for r in reqs]
        b, max_q, max_k = len(reqs), max(q_lens), max(kv_lens)
        whole = reqs == list(range(meta.num_requests))  # the batch, in its order
        dest = None if whole else upload(
            [t for r in reqs for t in range(qp[r], qp[r + 1])], torch.int64, dev)
        uniform_q = all(q == max_q for q in q_lens)
        uniform_k = all(k == max_k for k in kv_lens)
        # Every query row sees all its request's keys: no mask beyond key padding.
        shared = meta.mask_mode == "none" or (meta.mask_mode == "causal" and max_q == 1)
        if whole and uniform_q and uniform_k and (
                shared or (meta.mask_mode == "causal" and max_q == max_k)):
            # Nothing to pad or mask by hand (decode at equal lengths, one request, a fresh
            # prefill): the rows as they are and at most SDPA's built-in causal mask.
            return _Padded(None, kv_indices, max_k, None, not shared, shared, None, None, None)
        if whole and uniform_q and uniform_k and meta.mask_mode == "causal":
            # Verify blocks of one width over contexts of one length (a batch of one, above
            # all): one [Q, K] causal mask serves every request, broadcast over the batch.
            qi, kj = torch.arange(max_q, device=dev), torch.arange(max_k, device=dev)
            mask = (kj[None, :] <= (max_k - max_q) + qi[:, None])[None, None]  # [1, 1, Q, K]
            return _Padded(None, kv_indices, max_k, mask, False, False, None, None, None)

        lens = upload([q_lens, kv_lens, [kp[r] for r in reqs]], torch.int64, dev)
        q_len_t, kv_len_t, kv_start = lens.unbind(0)  # [B] each
        q_ptr = upload([0, *itertools.accumulate(q_lens)], torch.int64, dev)  # group-local
        qi = torch.arange(max_q, device=dev)
        kj = torch.arange(max_k, device=dev)
        q_ok = qi[None, :] < q_len_t[:, None]  # [B, maxQ]
        k_ok = kj[None, :] < kv_len_t[:, None]  # [B, maxK]
        flat_k = (kv_start[:, None] + kj[None, :]).clamp(max=max(kv_indices.numel() - 1, 0))
        kv_idx = torch.where(k_ok, kv_indices[flat_k], 0).reshape(-1)
        row_ok = None
        if shared:
            # Key padding only: rows that are query padding are dropped by flat_pos anyway.
            mask = None if uniform_k else k_ok[:, None, None, :]  # [B, 1, 1, maxK]
        else:
            mask = q_ok[:, :, None] & k_ok[:, None, :]  # [B, maxQ, maxK]
            if meta.mask_mode == "causal":
                prefix = (kv_len_t - q_len_t)[:, None, None]
                mask &= kj[None, None, :] <= prefix + qi[None, :, None]
            else:  # custom (a single group: the whole batch)
                custom = torch.zeros_like(mask)
                for i, r in enumerate(reqs):
                    custom[i, : q_lens[i], : kv_lens[i]] = _request_mask(meta, r, dev)
                mask &= custom
                # Only a custom mask can leave a real query row with no key (SDPA -> NaN).
                row_ok = mask.any(-1)[:, None, :, None]
            mask = mask[:, None]
        if uniform_q:
            return _Padded(dest, kv_idx, max_k, mask, False, shared, None, row_ok, None)
        tok = torch.where(q_ok, q_ptr[:-1, None] + qi[None, :], 0)
        n_tok = sum(q_lens)
        batch_of_tok = torch.repeat_interleave(torch.arange(b, device=dev), q_len_t,
                                               output_size=n_tok)
        pos_in_req = torch.arange(n_tok, device=dev) - q_ptr[batch_of_tok]
        return _Padded(dest, kv_idx, max_k, mask, False, shared, tok, row_ok,
                       batch_of_tok * max_q + pos_in_req)

    def forward(self, q, k, v, k_cache, v_cache, meta, sm_scale):
        if q.shape[0] == 0:
            return self._empty_out(q, v_cache)
        state = self._prepared(meta)
        store_kv_torch(k_cache, v_cache, k, v, meta.out_rows,
                       rows_valid=meta.backend_state[self.name + ".rows_valid"])
        if isinstance(state[0], _PerRequest):
            return self._per_request(q, k_cache, v_cache, state, meta.mask_mode, sm_scale)
        if state[0].dest is None:  # one group: the whole batch in order
            return self._padded(q, k_cache, v_cache, state[0], sm_scale)
        out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))
        for group in state:
            out.index_copy_(0, group.dest, self._padded(q.index_select(0, group.dest),
                                                        k_cache, v_cache, group, sm_scale))
        return out

    @staticmethod
    def _per_request(q, k_cache, v_cache, state: list[_PerRequest], mask_mode: str,
                     sm_scale: float) -> torch.Tensor:
        gqa = q.shape[1] != k_cache.shape[1]
        out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))
        for r in state:
            qr = q[r.q_start : r.q_end].transpose(0, 1)  # [Hq, q_len, D]
            # index_select, not k_cache[rows]: several times faster for row gathers on CPU.
            kr = k_cache.index_select(0, r.rows).transpose(0, 1).to(q.dtype)
            vr = v_cache.index_select(0, r.rows).transpose(0, 1).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qr, kr, vr, attn_mask=r.mask, scale=sm_scale, enable_gqa=gqa
            )  # [Hq, q_len, Dv]
            if mask_mode == "custom":  # only a custom mask can empty a row
                o = torch.where(r.mask.any(-1)[None, :, None], o, 0.0)
            out[r.q_start : r.q_end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _padded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                state: _Padded, sm_scale: float) -> torch.Tensor:
        """q [T_g, Hq, D]: one group's tokens -> [T_g, Hq, Dv]."""
        hq, hkv, d, dv = q.shape[1], k_cache.shape[1], q.shape[2], v_cache.shape[2]
        gqa = hq != hkv
        b, max_k = state.kv_idx.shape[0] // state.max_k, state.max_k
        kp = k_cache.index_select(0, state.kv_idx).view(b, max_k, hkv, d)
        vp = v_cache.index_select(0, state.kv_idx).view(b, max_k, hkv, dv)
        kp, vp = kp.transpose(1, 2).to(q.dtype), vp.transpose(1, 2).to(q.dtype)  # [B, Hkv, K, .]
        qp = q.view(b, -1, hq, d) if state.tok is None else q[state.tok]  # [B, Q, Hq, D]
        n_q, group = qp.shape[1], hq // hkv
        if gqa and not state.is_causal:
            # The `group` query heads of each KV head become extra query rows of one plain
            # (non-GQA) attention: [B, Hkv, Q * group, D], row q * group + g. SDPA's GQA path
            # is 2-3x slower on CPU at decode and verify sizes; the result is the same.
            qp = qp.reshape(b, n_q, hkv, group, d).transpose(1, 2).reshape(b, hkv, -1, d)
            o = F.scaled_dot_product_attention(qp, kp, vp,
                                               attn_mask=state.additive_mask(group, q.dtype),
                                               scale=sm_scale)  # [B, Hkv, Q * group, Dv]
            o = o.view(b, hkv, n_q, group, dv).transpose(1, 2)  # [B, Q, Hkv, group, Dv]
            if state.row_ok is not None:  # [B, 1, Q, 1]
                o = torch.where(state.row_ok.view(b, n_q, 1, 1, 1), o, 0.0)
        else:
            o = F.scaled_dot_product_attention(
                qp.transpose(1, 2), kp, vp, attn_mask=state.additive_mask(1, q.dtype),
                is_causal=state.is_causal,
                scale=sm_scale, enable_gqa=gqa,
            )  # [B, Hq, Q, Dv]
            if state.row_ok is not None:
                o = torch.where(state.row_ok, o, 0.0)
            o = o.transpose(1, 2)  # [B, Q, Hq, Dv]
        o = o.reshape(-1, hq, dv)  # [B * Q, Hq, Dv]
        return o if state.flat_pos is None else o[state.flat_pos]
