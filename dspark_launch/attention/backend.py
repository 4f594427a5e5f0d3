"""The attention backend interface (the factory is attention/factory.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .metadata import ForwardMetadata


class AttentionBackend(ABC):
    """Stores the new tokens' K/V and attends over the paged cache.

    All head counts are this rank's LOCAL heads (the model already sharded by attn_tp).
    """

    name: str = "base"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    @abstractmethod
    def prepare(self, meta: ForwardMetadata) -> None:
        """Called once per model forward, before any layer runs (ForwardContext.prepare is
        the one caller in the engine): derive whatever every layer reuses from `meta` and
        keep it in meta.backend_state. Fresh metadata per forward; never prepared twice."""

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
        """This backend's per-forward state (prepare() must have run for this metadata)."""
        assert self.name in meta.backend_state, (
            f"{self.name} backend: forward() before prepare() for this metadata")
        return meta.backend_state[self.name]

    @staticmethod
    def _empty_out(q: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return q.new_empty((0, q.shape[1], v_cache.shape[-1]))
