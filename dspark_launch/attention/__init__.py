"""Attention backends (torch SDPA / Triton kernels) and per-forward metadata."""

from .backend import AttentionBackend
from .context import ForwardContext
from .factory import BACKEND_NAMES, make_backend
from .metadata import MASK_MODES, ForwardMetadata, build_metadata, upload

__all__ = [
    "BACKEND_NAMES",
    "MASK_MODES",
    "AttentionBackend",
    "ForwardContext",
    "ForwardMetadata",
    "build_metadata",
    "make_backend",
    "upload",
]
