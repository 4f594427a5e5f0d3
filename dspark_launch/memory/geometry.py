"""One model's KV shape, priced from the LIVE parallel state.

Sits below models/ in the import order: it reads HF config.json dicts, never model classes.
Head counts here are TOTAL (whole model); the per-rank share is computed on demand from
`get_parallel().attn_tp_size`, so a pool and the budget that prices it can never disagree
about the width (see DESIGN.md, "The bug this project must never have").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_launch.errors import ConfigError
from dspark_launch.parallel import get_parallel

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVGeometry:
    name: str  # "target" | "draft"
    num_layers: int
    num_kv_heads: int  # total, not per rank
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_dim", "v_head_dim"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{self.name} KV geometry: {field_name}={value!r} must be >= 1")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"{self.name} KV geometry: dtype={self.dtype!r} is not a torch.dtype")

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    def kv_heads_per_rank(self) -> int:
        # Heads are sharded over attention TP; replicated when there are fewer heads than
        # attn_tp ranks. Always the live width, never cfg.tp_size.
        return max(1, self.num_kv_heads // get_parallel().attn_tp_size)

    def cell_bytes(self) -> int:
        """Bytes one token occupies in this model's pool on this rank (K and V, all layers)."""
        return (
            self.kv_heads_per_rank()
            * (self.head_dim + self.v_head_dim)
            * self.num_layers
            * self.itemsize
        )

    def terms(self) -> str:
        """Every factor of cell_bytes, for error messages and plans."""
        return (
            f"kv_heads_per_rank={self.kv_heads_per_rank()} (num_kv_heads={self.num_kv_heads}, "
            f"attn_tp_size={get_parallel().attn_tp_size}), head_dim={self.head_dim}, "
            f"v_head_dim={self.v_head_dim}, layers={self.num_layers}, "
            f"dtype={str(self.dtype).removeprefix('torch.')} itemsize={self.itemsize}"
        )


def _int_key(config: dict, key: str, name: str) -> int:
    if key not in config:
        raise ConfigError(f"{name} config.json has no {key!r}")
    return int(config[key])


def geometry_from_config(name: str, config: dict, dtype: torch.dtype) -> KVGeometry:
    """KV geometry from an HF config.json dict (Qwen3/Llama targets, DFlash/DSpark drafts).

    num_hidden_layers is the model's own layer count (a draft's is its few layers).
    head_dim: the explicit key when present (Qwen3 sets it), else hidden_size // heads.
    """
    layers = _int_key(config, "num_hidden_layers", name)
    heads = _int_key(config, "num_attention_heads", name)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = config.get("head_dim")
    if head_dim is None:
        hidden = _int_key(config, "hidden_size", name)
        if hidden % heads:
            raise ConfigError(
                f"{name} config.json: hidden_size={hidden} is not divisible by "
                f"num_attention_heads={heads} and there is no head_dim key"
            )
        head_dim = hidden // heads
    v_head_dim = int(config.get("v_head_dim") or head_dim)
    return KVGeometry(name, layers, kv_heads, int(head_dim), v_head_dim, dtype)
