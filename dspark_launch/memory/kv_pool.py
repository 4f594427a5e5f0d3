"""One model's K/V buffers: per layer [rows, H_local, head_dim], row 0 the padding dummy.

H_local comes from the geometry, which reads the live attn_tp_size, so the pool holds
exactly what the budget priced; self_check() in budget.py proves it from the buffers.

Every row reads as zero, never as uninitialised memory: attention may read rows nobody
wrote (the dummy page, the tail of a page) and weight them by 0, and 0 * NaN is NaN. On CPU
the buffers live in anonymous memory maps, whose pages read as zero and take no RAM until
written, so a pool sized for the worst case costs only the rows a run really uses.
"""

from __future__ import annotations

import math
import mmap

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
        k_shape = (rows, self.heads_local, g.head_dim)
        v_shape = (rows, self.heads_local, g.v_head_dim)
        buffers = zeroed_buffers([k_shape, v_shape] * g.num_layers, g.dtype, self.device)
        self.k: list[torch.Tensor] = buffers[0::2]
        self.v: list[torch.Tensor] = buffers[1::2]

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


def zeroed_buffers(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
                   ) -> list[torch.Tensor]:
    """Zero tensors of the given shapes; on CPU views of one lazily backed anonymous map."""
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    sizes = [math.prod(shape) for shape in shapes]
    itemsize = torch.empty((), dtype=dtype).element_size()
    # Anonymous mappings are zero-filled by the kernel page by page, on first touch; the
    # tensor keeps the map alive (torch.frombuffer holds a reference to it).
    flat = torch.frombuffer(mmap.mmap(-1, sum(sizes) * itemsize), dtype=dtype)  # [sum]
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]
