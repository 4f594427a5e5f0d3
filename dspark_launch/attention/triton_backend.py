"""Triton backend: store_kv + paged split-K decode or extend kernels.

Short extends (verify and draft blocks, <= 32 rows) at long context take the extend
kernel's split-K path; longer ones (prefill chunks) have query blocks enough to fill the GPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from dspark_launch.errors import ConfigError

from .backend import AttentionBackend
from .metadata import ForwardMetadata

logger = logging.getLogger("dspark_launch")


@dataclass
class _TritonState:
    decode: bool
    avg_kv_len: float  # decode split heuristic input (Hkv is only known in forward)
    max_kv_len: int  # extend split heuristic input
    max_q_len: int  # extend only; known on host, so the kernel launch needs no sync
    # Chosen at the first layer's forward, reused by the rest: a speed choice only (every
    # split count computes the same attention, up to rounding).
    num_splits: int | None = None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        if self.device.type != "cuda":
            if os.environ.get("TRITON_INTERPRET", "0") != "1":
                raise ConfigError(
                    "--attention-backend triton needs CUDA; on CPU it only runs through "
                    "the Triton interpreter: set TRITON_INTERPRET=1 before starting (before "
                    "triton is imported) or use --attention-backend torch"
                )
            logger.warning(
                "triton attention backend on %s runs through the Triton interpreter "
                "(TRITON_INTERPRET=1): correct but very slow; use --attention-backend torch "
                "for speed",
                self.device,
            )
        # Import after the checks: triton.jit picks the interpreter at decoration time.
        from dspark_launch import kernels

        self._k = kernels

    def prepare(self, meta: ForwardMetadata) -> None:
        if meta.num_tokens == 0:
            meta.backend_state[self.name] = None
            return
        meta.backend_state[self.name] = _TritonState(
            decode=meta.is_decode,
            avg_kv_len=sum(meta.kv_lens) / meta.num_requests,
            max_kv_len=max(meta.kv_lens),
            max_q_len=max(meta.q_lens),
        )

    def forward(self, q, k, v, k_cache, v_cache, meta, sm_scale):
        if q.shape[0] == 0:
            return self._empty_out(q, v_cache)
        state = self._prepared(meta)
        self._k.store_kv(k_cache, v_cache, k, v, meta.out_rows)
        hkv = k_cache.shape[1]
        if state.decode:
            if state.num_splits is None:
                state.num_splits = self._k.choose_num_splits(
                    meta.num_requests, hkv, state.avg_kv_len, q.device
                )
            return self._k.paged_decode_attention(
                q, k_cache, v_cache, meta.kv_indptr, meta.kv_indices, sm_scale,
                num_splits=state.num_splits,
            )
        if state.num_splits is None:
            state.num_splits = self._k.choose_extend_splits(
                meta.num_requests, hkv, state.max_q_len, state.max_kv_len, q.device
            )
        return self._k.extend_attention(
            q, k_cache, v_cache, meta.q_indptr, meta.kv_indptr, meta.kv_indices, sm_scale,
            mask_mode=meta.mask_mode, custom_mask=meta.custom_mask,
            mask_indptr=meta.mask_indptr, max_q_len=state.max_q_len,
            num_splits=state.num_splits,
        )
