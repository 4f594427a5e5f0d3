"""Tensor-parallel linear layers; each parameter's weight_loader knows its own shard.

`shards`/`rank` are the width and rank of the group the layer is split over (attn_tp for
attention projections, tp for the MLP), so one class serves both groups. Every loader takes
the checkpoint tensor's FULL shape, checks it, and copies only this rank's slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dspark_launch.comm import all_reduce

from .gemm import Packs, dense
from .weights import check_shape, copy_into, narrow, new_param, read_all


def _split(total: int, shards: int, what: str) -> int:
    assert total % shards == 0, f"{what}={total} is not divisible by {shards} shards"
    return total // shards


class ColumnParallelLinear(Packs, nn.Module):
    """y = x W^T + b with W's output rows split: each rank produces out/shards features."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, shards: int,
                 rank: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.in_features, self.shards, self.rank = in_features, shards, rank
        self.out_local = self._local_rows(out_features, shards)
        self.weight = new_param((self.out_local, in_features), dtype, device, self.load)
        self.bias = new_param((self.out_local,), dtype, device, self.load) if bias else None
        self.full_out = out_features

    @staticmethod
    def _local_rows(out_features: int, shards: int) -> int:
        return _split(out_features, shards, "out_features")

    def load(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        assert shard_id is None, "a plain column-parallel layer has no sub-shards"
        check_shape(loaded, (self.full_out, *param.shape[1:]))
        copy_into(param.data, narrow(loaded, 0, self.rank * self.out_local, self.out_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out_local]
        return dense(x, self.weight, self.bias, self.packed)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up): shard_id = index."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], *, bias: bool,
                 shards: int, rank: int, dtype: torch.dtype, device: torch.device | str
                 ) -> None:
        self.out_sizes = tuple(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias=bias, shards=shards, rank=rank,
                         dtype=dtype, device=device)

    def load(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        assert isinstance(shard_id, int), "merged layers are loaded one sub-matrix at a time"
        full = self.out_sizes[shard_id]
        check_shape(loaded, (full, *param.shape[1:]))
        local = full // self.shards
        offset = sum(n // self.shards for n in self.out_sizes[:shard_id])
        copy_into(param.data[offset:offset + local], narrow(loaded, 0, self.rank * local, local))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; shard_id in {"q", "k", "v"}.

    Query heads split evenly. KV heads split when num_kv_heads >= shards; otherwise each
    rank holds one replicated KV head, the one its query heads read: with q heads
    [r*Hq/s, (r+1)*Hq/s) and group size Hq/Hkv, that is KV head r*Hkv//s (the same formula
    also gives the first head of an even split).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, *,
                 bias: bool, shards: int, rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.q_heads = _split(num_heads, shards, "num_attention_heads")
        self.kv_heads = max(1, num_kv_heads // shards)
        assert num_kv_heads % shards == 0 or shards % num_kv_heads == 0, (
            f"num_key_value_heads={num_kv_heads} and {shards} shards do not divide each other")
        self.kv_start = rank * num_kv_heads // shards
        local_out = (self.q_heads + 2 * self.kv_heads) * head_dim
        super().__init__(hidden_size, local_out * shards, bias=bias, shards=shards, rank=rank,
                         dtype=dtype, device=device)

    @property
    def q_size(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def load(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        hd = self.head_dim
        if shard_id == "q":
            full, start, offset, rows = self.num_heads * hd, self.rank * self.q_size, 0, \
                self.q_size
        elif shard_id in ("k", "v"):
            full, start, rows = self.num_kv_heads * hd, self.kv_start * hd, self.kv_size
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
        else:
            raise AssertionError(f"QKV shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        check_shape(loaded, (full, *param.shape[1:]))
        copy_into(param.data[offset:offset + rows], narrow(loaded, 0, start, rows))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # [T, (Hq + 2 Hkv) hd] -> q [T, Hq*hd], k [T, Hkv*hd], v [T, Hkv*hd] (local heads)
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(Packs, nn.Module):
    """y = sum_r x_r W_r^T (+ b): input features split, partial sums all-reduced over `group`.

    The bias is replicated and added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, shards: int,
                 rank: int, group: dist.ProcessGroup | None, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.in_local = _split(in_features, shards, "in_features")
        self.full_in, self.rank, self.group = in_features, rank, group
        self.weight = new_param((out_features, self.in_local), dtype, device, self.load)
        self.bias = new_param((out_features,), dtype, device, self.load) if bias else None

    def load(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        assert shard_id is None
        if param.dim() == 1:  # bias: replicated
            check_shape(loaded, tuple(param.shape))
            copy_into(param.data, read_all(loaded))
            return
        check_shape(loaded, (param.shape[0], self.full_in))
        copy_into(param.data, narrow(loaded, 1, self.rank * self.in_local, self.in_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in_local] -> [T, out]
        y = all_reduce(dense(x, self.weight, None, self.packed), self.group)
        return y if self.bias is None else y + self.bias
