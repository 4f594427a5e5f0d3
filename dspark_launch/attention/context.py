"""One forward's context: what every layer reads besides its own input.

Built once per model forward (ForwardContext.prepare, which is also where the backend prepares
the metadata), then handed to every layer as one argument, so layer signatures stay
`layer(x, ctx)` and tensor-only otherwise (nano-vllm's per-step Context, passed explicitly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .backend import AttentionBackend
from .metadata import ForwardMetadata


@dataclass(frozen=True)
class ForwardContext:
    meta: ForwardMetadata
    backend: AttentionBackend
    kv: Any  # KVPool: .k[layer] / .v[layer] [rows, Hkv_local, D]
    cos: torch.Tensor  # [T, head_dim] rotary of meta.positions
    sin: torch.Tensor
    dp: Any = None  # models.layers.DPTokens: the target MLP's DP gather (None: the drafts')

    @classmethod
    def prepare(cls, meta: ForwardMetadata, backend: AttentionBackend, kv: Any,
                cos: torch.Tensor, sin: torch.Tensor, dp: Any = None) -> ForwardContext:
        backend.prepare(meta)  # the one place a forward prepares its metadata
        return cls(meta, backend, kv, cos, sin, dp)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sm_scale: float) -> torch.Tensor:  # -> [T, Hq_local, Dv]
        """Store this layer's new K/V at meta.out_rows and attend over its paged cache."""
        return self.backend.forward(q, k, v, self.kv.k[layer_id], self.kv.v[layer_id],
                                    self.meta, sm_scale)
