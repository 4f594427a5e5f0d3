"""Triton attention kernels and fp32 torch references.

The Triton kernels are imported lazily: `triton.jit` decides at decoration time whether to
use the interpreter, so TRITON_INTERPRET must be set before these modules load, and
torch-only users should not pay for (or be affected by) importing triton.
"""

from __future__ import annotations

import importlib

from .reference import ref_decode, ref_extend, ref_store, store_kv_torch

_LAZY = {
    "store_kv": "store_kv",
    "paged_decode_attention": "decode_attention",
    "choose_num_splits": "decode_attention",
    "extend_attention": "extend_attention",
    "choose_extend_splits": "extend_attention",
    "merge_splits": "lse_merge",
}

__all__ = ["ref_decode", "ref_extend", "ref_store", "store_kv_torch", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        # Importing submodule `store_kv` binds the module object to this package's
        # `store_kv` attribute; rebind the function (and its module's other exports, e.g.
        # `extend_attention` when `choose_extend_splits` came first) so imports get functions.
        for other, mod in _LAZY.items():
            if mod == _LAZY[name]:
                globals()[other] = getattr(module, other)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
