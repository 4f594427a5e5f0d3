"""Which attention backend a run uses."""

from __future__ import annotations

import torch

from .backend import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


def make_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """"auto" picks triton on CUDA and torch elsewhere."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from .torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(device)
    if name == "triton":
        # Imported lazily: triton must see TRITON_INTERPRET before its first import.
        from .triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKEND_NAMES}")
