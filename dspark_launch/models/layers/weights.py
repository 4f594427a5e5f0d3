"""What a parameter's weight_loader receives, and how it checks and slices it.

A loader hands each parameter either a torch.Tensor or a lazy safetensors slice
(`safe_open(...).get_slice(name)`); both support `x[a:b]` / `x[:, a:b]`, so a rank
materialises only the rows/columns it owns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ShapeMismatch(ValueError):
    """A checkpoint tensor's full shape differs from what the parameter expects."""

    def __init__(self, expected: tuple[int, ...], got: tuple[int, ...]) -> None:
        super().__init__(f"expected shape {list(expected)}, checkpoint has {list(got)}")
        self.expected, self.got = expected, got


def full_shape(loaded: Any) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def check_shape(loaded: Any, expected: tuple[int, ...]) -> None:
    got = full_shape(loaded)
    if got != tuple(expected):
        raise ShapeMismatch(tuple(expected), got)


def narrow(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) as a tensor."""
    if dim == 0:
        return loaded[start:start + length]
    assert dim == 1, "only 1-D/2-D parameters are sharded"
    return loaded[:, start:start + length]


def read_all(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    assert dst.shape == src.shape, f"shard {tuple(src.shape)} != slot {tuple(dst.shape)}"
    dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


def default_weight_loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    """Replicated parameter (norms): every rank reads the whole tensor."""
    assert shard_id is None
    check_shape(loaded, tuple(param.shape))
    copy_into(param.data, read_all(loaded))


def new_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
              loader=default_weight_loader, zero: bool = False) -> nn.Parameter:
    """An inference-only parameter carrying its weight_loader."""
    make = torch.zeros if zero else torch.empty
    param = nn.Parameter(make(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    return param
