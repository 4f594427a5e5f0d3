"""Attention backends (torch SDPA / Triton kernels) and per-forward metadata."""

from .backend import BACKEND_NAMES, AttentionBackend, make_backend
from .metadata import MASK_MODES, ForwardMetadata, build_metadata, upload

__all__ = [
    "BACKEND_NAMES",
    "MASK_MODES",
    "AttentionBackend",
    "ForwardMetadata",
    "build_metadata",
    "make_backend",
    "upload",
]
