"""Attention backend interface and factory."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .metadata import ForwardMetadata

BACKEND_NAMES = ("auto", "torch", "triton")


class AttentionBackend(ABC):
    """Stores the new tokens' K/V and attends over the paged cache.

    All head counts are this rank's LOCAL heads (the model already sharded by attn_tp).
    """

    name: str = "base"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    @abstractmethod
    def prepare(self, meta: ForwardMetadata) -> None:
        """Called once per model forward, before any layer runs."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq_local, D]
        k: torch.Tensor,  # [T, Hkv_local, D]
        v: torch.Tensor,  # [T, Hkv_local, Dv]
        k_cache: torch.Tensor,  # [rows, Hkv_local, D]
        v_cache: torch.Tensor,  # [rows, Hkv_local, Dv]
        meta: ForwardMetadata,
        sm_scale: float,
    ) -> torch.Tensor:  # [T, Hq_local, Dv]
        """Store k/v at meta.out_rows, then attend. T == 0 returns an empty tensor."""

    def _prepared(self, meta: ForwardMetadata):
        """This backend's per-forward state, preparing it if the caller did not."""
        if meta.backend_state.get(self.name) is None:
            self.prepare(meta)
        return meta.backend_state[self.name]

    @staticmethod
    def _empty_out(q: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return q.new_empty((0, q.shape[1], v_cache.shape[-1]))


def make_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """"auto" picks triton on CUDA and torch elsewhere."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from .torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(device)
    if name == "triton":
        # Imported lazily: triton must see TRITON_INTERPRET before its first import.
        from .triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKEND_NAMES}")
