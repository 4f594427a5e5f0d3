"""Tensor-parallel building blocks shared by the target and the draft models."""

from .activation import silu_and_mul
from .dp_gather import DPTokens
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .gemm import Packed, PackPlan, Packs, dense, pack, pack_model, packable_bytes, unpack_model
from .linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from .norm import RMSNorm, rms_normalize
from .rotary import RotaryEmbedding, apply_rotary
from .weights import ShapeMismatch, default_weight_loader, new_param

__all__ = [
    "ColumnParallelLinear",
    "DPTokens",
    "MergedColumnParallelLinear",
    "PackPlan",
    "Packed",
    "Packs",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "ShapeMismatch",
    "VocabParallelEmbedding",
    "apply_rotary",
    "default_weight_loader",
    "dense",
    "new_param",
    "pack",
    "pack_model",
    "packable_bytes",
    "rms_normalize",
    "silu_and_mul",
    "unpack_model",
]
