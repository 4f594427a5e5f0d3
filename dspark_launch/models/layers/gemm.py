"""Dense projections on CPU: torch's default GEMM (MKL, in fp32), or a second copy of the
weight laid out for a faster kernel from some row count up: oneDNN's pre-packed blocked
layout, or the weight transposed ([in, out] row-major, read by MKL's GEMM without a transpose).

Why: a few rows through MKL's GEMM on the weight as stored ([out, in], multiplied transposed)
are slow on some CPUs, and a verify's rows paid for it.
- AMD EPYC (Zen 4, one thread, fp32), the engine's own start-up timings of the embedded
  target's forward plus its LM head (engine/gemm_choice.py; torch / oneDNN, ms): 1 token
  4.58 / 5.18, 4 tokens 6.08 / 5.35, 16 tokens 7.29 / 6.37, 64 tokens 13.44 / 11.90.
- Intel Xeon (one thread, fp32), the embedded target's 33 projections alone (torch /
  transposed, us): 1 row 669 / 655, 2 rows 680 / 775, 4 rows 956 / 826, 9 rows 1267 / 1059,
  17 rows 1912 / 1386, 64 rows 3916 / 3179 (oneDNN lost to torch's there at every count).
So the copy takes the verify blocks, batches and prefill chunks, and torch's GEMM keeps
single-token decoding. Which kernel wins, and from how many rows, is the CPU's (and its MKL
code path's), so the engine measures it at start-up and every copied layer of a model shares
that choice (PackPlan).

A layer keeps its plain weight (loaders fill it; inputs below the plan's row count, and every
device but the CPU, use it) and, once packed, one copy in the chosen kernel's layout.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NEVER = sys.maxsize  # PackPlan.from_rows that keeps every input on the plain kernel
KERNELS = ("onednn", "transposed")  # the copies a layer may keep (the start-up choice's order)


@dataclass
class PackPlan:
    """Inputs of at least `from_rows` rows take the packed kernel; shared by a model's layers
    so that one assignment switches them all (the start-up measurement does)."""

    from_rows: int = NEVER


@dataclass(frozen=True)
class Packed:
    weight: torch.Tensor  # the layer's weight in the kernel's layout
    plan: PackPlan
    kernel: str = "onednn"  # one of KERNELS
    shape: tuple = ()  # the source weight's (out, in, dtype): oneDNN's primitives are per shape


def packable(weight: torch.Tensor, kernel: str = "onednn") -> bool:
    """CPU fp32 matrices, and bf16 ones where oneDNN takes them: the CPU has bf16
    instructions (without them oneDNN refuses bf16 linears; the transposed copy's bf16 GEMM
    is oneDNN's too). On other devices the plain kernel is the device's own."""
    if kernel not in KERNELS:
        raise ValueError(f"GEMM kernel {kernel!r}: expected one of {KERNELS}")
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if kernel == "transposed" and weight.dtype == torch.float32:
        return True
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def pack(weight: torch.Tensor, plan: PackPlan, kernel: str = "onednn") -> Packed | None:
    """weight [out, in] -> its copy for `kernel` (None where the kernel cannot take it)."""
    if not packable(weight, kernel):
        return None
    if kernel == "transposed":
        return Packed(weight.detach().t().contiguous(), plan, kernel)  # [in, out]
    # The batch-size hint only picks the blocked layout; every row count runs on it.
    blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 16)
    return Packed(blocked, plan, kernel, (*weight.shape, weight.dtype))


class FirstShapes:
    """The shapes oneDNN's copy has run in this process, and the seconds their first calls took.

    oneDNN makes a primitive (JIT code) the first time it meets a shape, rows included, and
    caches it for the process. On the AMD EPYC (one thread) a first call took ~0.2-0.5 ms
    more per weight shape, 2-3 ms for a step of the embedded target at batch 16, whose whole
    step takes ~5 ms. A verify's rows vary with its drafts, so a step at a row count not run
    before pays that once. The verify ladder (spec/ladder.py) times arms a step at a time,
    and it saw NGRAM's tries at batch 16 as 20-35% dearer than those arms run once their row
    counts are known. A cap-1 try's verify and commit took 10.1 ms for 24 rows; with every
    row count run beforehand they took 7.3 ms for 26 rows, and a plain step's 5.6 ms. Its
    ladder stayed with plain decoding or cap 1 (0.986x NONE) where, pinned at cap 2 in the
    same run, NGRAM ran 1.063x.

    So a shape's first call runs twice. The first run makes the primitive, and its whole time
    is booked here. The second is what the call costs from then on. steady_clock() leaves
    the booked time out, and the engine times its steps by it. The compile stays in the
    run's wall time (the benchmarks'), but no step's measured speed holds it. A shape the
    cache later evicts (it holds 1024) is not booked again: prefill chunks churn it, and a
    decode batch's row counts are its most recently used."""

    def __init__(self) -> None:
        self.seen: set[tuple] = set()  # (rows, Packed.shape, no bias)
        self.seconds = 0.0

    def first(self, key: tuple, call: Callable[[], object]) -> None:
        """Run `call` for a shape never run before, its whole time booked as compile."""
        t0 = time.perf_counter()
        call()
        self.seconds += time.perf_counter() - t0
        self.seen.add(key)


FIRST_SHAPES = FirstShapes()  # one per process, as oneDNN's primitive cache


def steady_clock() -> float:
    """time.perf_counter(), stopped while oneDNN made a primitive (FirstShapes): what a step
    takes once every shape it runs is known."""
    return time.perf_counter() - FIRST_SHAPES.seconds


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          packed: Packed | None = None) -> torch.Tensor:
    """x [N, in] -> x weight^T + bias [N, out], on the copy's kernel from the plan's rows."""
    if packed is not None and x.shape[0] >= packed.plan.from_rows:
        if packed.kernel == "transposed":
            w = packed.weight  # [in, out]
            return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)
        x = x.contiguous()
        key = (x.shape[0], packed.shape, bias is None)
        if key not in FIRST_SHAPES.seen:
            FIRST_SHAPES.first(key, lambda: torch.ops.mkldnn._linear_pointwise(
                x, packed.weight, bias, "none", [], ""))
        return torch.ops.mkldnn._linear_pointwise(x, packed.weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Packs:
    """A layer that projects through dense(x, weight, bias, self.packed): by default its own
    2-D `weight` (pack_source)."""

    packed: Packed | None = None
    kernels: tuple[str, ...] = KERNELS  # the kernels whose copy this layer takes

    def pack_source(self) -> torch.Tensor | None:
        """The matrix the packed copy holds (None: this layer keeps none)."""
        return self.weight

    def pack(self, plan: PackPlan, kernel: str = "onednn") -> int:
        source = self.pack_source() if kernel in self.kernels else None
        self.packed = None if source is None else pack(source, plan, kernel)
        return int(self.packed is not None)

    def unpack(self) -> None:
        self.packed = None


def pack_model(model: nn.Module, plan: PackPlan, kernel: str = "onednn") -> int:
    """Give every layer of `model` that projects through dense() its copy for `kernel`;
    -> how many copies were made."""
    return sum(module.pack(plan, kernel) for module in model.modules()
               if isinstance(module, Packs))


def unpack_model(model: nn.Module) -> None:
    """Drop every packed copy (the plain kernel won everywhere: no second copy kept)."""
    for module in model.modules():
        if isinstance(module, Packs):
            module.unpack()


def packable_bytes(model: nn.Module, kernel: str = "onednn") -> int:
    """What pack_model would copy (the bytes a copy adds, before oneDNN's padding)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Packs) and kernel in module.kernels \
                and (source := module.pack_source()) is not None and packable(source, kernel):
            total += source.numel() * source.element_size()
    return total
