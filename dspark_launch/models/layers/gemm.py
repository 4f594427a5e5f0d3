"""Dense projections on CPU: torch's default GEMM (MKL, in fp32) or oneDNN with pre-packed
weights.

Why two: on an AMD EPYC (Zen 4, one thread, fp32) MKL's GEMM for a few rows is slow, and a
verify's rows paid for it. The engine's own start-up timings of the embedded target's forward
plus its LM head (engine/gemm_choice.py; torch / oneDNN, ms): 1 token 4.58 / 5.18, 4 tokens
6.08 / 5.35, 16 tokens 7.29 / 6.37, 64 tokens 13.44 / 11.90. So oneDNN takes the verify
blocks, batches and prefill chunks, and MKL keeps single-token decoding. Which kernel wins,
and from how many rows, is the CPU's (and its MKL code path's), so the engine measures it at
start-up and every packed layer of a model shares that choice (PackPlan).

A layer keeps its plain weight (loaders fill it; inputs below the plan's row count, and every
device but the CPU, use it) and, once packed, a copy in oneDNN's blocked layout.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NEVER = sys.maxsize  # PackPlan.from_rows that keeps every input on the plain kernel


@dataclass
class PackPlan:
    """Inputs of at least `from_rows` rows take the packed kernel; shared by a model's layers
    so that one assignment switches them all (the start-up measurement does)."""

    from_rows: int = NEVER


@dataclass(frozen=True)
class Packed:
    weight: torch.Tensor  # the layer's weight in oneDNN's layout
    plan: PackPlan


def packable(weight: torch.Tensor) -> bool:
    """oneDNN packs CPU fp32 matrices, and bf16 ones where the CPU has bf16 instructions
    (without them oneDNN refuses bf16 linears); on other devices the plain kernel is the
    device's own."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not (
            torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def pack(weight: torch.Tensor, plan: PackPlan) -> Packed | None:
    """weight [out, in] -> its packed copy (None where oneDNN cannot take it)."""
    if not packable(weight):
        return None
    # The batch-size hint only picks the blocked layout; every row count runs on it.
    blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 16)
    return Packed(blocked, plan)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: Packed | None = None) -> torch.Tensor:
    """x [N, in] -> x weight^T + bias [N, out], on the packed kernel from the plan's rows."""
    if packed is not None and x.shape[0] >= packed.plan.from_rows:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.weight, bias, "none",
                                                  [], "")
    return F.linear(x, weight, bias)


class Packs:
    """A layer that projects through dense(x, weight, bias, self.packed): by default its own
    2-D `weight` (pack_source)."""

    packed: Packed | None = None

    def pack_source(self) -> torch.Tensor | None:
        """The matrix the packed copy holds (None: this layer keeps none)."""
        return self.weight

    def pack(self, plan: PackPlan) -> int:
        source = self.pack_source()
        self.packed = None if source is None else pack(source, plan)
        return int(self.packed is not None)

    def unpack(self) -> None:
        self.packed = None


def pack_model(model: nn.Module, plan: PackPlan) -> int:
    """Pack every layer of `model` that projects through dense(); -> how many packed copies
    were made."""
    return sum(module.pack(plan) for module in model.modules() if isinstance(module, Packs))


def unpack_model(model: nn.Module) -> None:
    """Drop every packed copy (the plain kernel won everywhere: no second copy kept)."""
    for module in model.modules():
        if isinstance(module, Packs):
            module.unpack()


def packable_bytes(model: nn.Module) -> int:
    """What pack_model would copy (the bytes a packed copy adds, before oneDNN's padding)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Packs) and (source := module.pack_source()) is not None \
                and packable(source):
            total += source.numel() * source.element_size()
    return total
