"""One model's K/V buffers: per layer [rows, H_local, head_dim], row 0 the padding dummy.

H_local comes from the geometry, which reads the live attn_tp_size, so the pool holds
exactly what the budget priced; self_check() in budget.py proves it from the buffers.
"""

from __future__ import annotations

import torch

from dspark_launch.memory.geometry import KVGeometry
from dspark_launch.parallel import get_parallel


class KVPool:
    def __init__(self, geometry: KVGeometry, rows: int, device) -> None:
        if rows < 2:
            raise ValueError(f"{geometry.name} pool: rows={rows} must be >= 2 (row 0 is dummy)")
        self.geometry = geometry
        self.rows = rows
        # The shard the model's attention really holds, from the live width, deliberately
        # NOT geometry.kv_heads_per_rank(): the pool must not inherit a pricing bug, so the
        # self-check can catch one.
        self.heads_local = max(1, geometry.num_kv_heads // get_parallel().attn_tp_size)
        self.device = torch.device(device)
        g = geometry
        self.k: list[torch.Tensor] = [
            torch.zeros((rows, self.heads_local, g.head_dim), dtype=g.dtype, device=device)
            for _ in range(g.num_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros((rows, self.heads_local, g.v_head_dim), dtype=g.dtype, device=device)
            for _ in range(g.num_layers)
        ]

    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def bytes_per_token(self) -> float:
        """Measured from the real buffers, not recomputed from the geometry."""
        return self.total_bytes() / self.rows

    def __repr__(self) -> str:
        return (
            f"KVPool({self.geometry.name}, rows={self.rows}, heads_local={self.heads_local}, "
            f"layers={self.geometry.num_layers}, dtype={self.geometry.dtype})"
        )
