"""Compile the attention kernels for sm_90 (Hopper) without a GPU: Triton lowers them to
PTX and the wheel's ptxas assembles a cubin. Run with TRITON_INTERPRET unset, in a fresh
process (kernels decorated under the interpreter cannot be compiled). The interpreter
accepts code the compiler rejects (early returns, dtype mixes), so this is the GPU-less
guard for those."""

import importlib

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ext = importlib.import_module("dspark_launch.kernels.extend_attention")
dec = importlib.import_module("dspark_launch.kernels.decode_attention")
mrg = importlib.import_module("dspark_launch.kernels.lse_merge")


def compile_sm90(jitfn, consts: dict, ptrs: dict, i64: tuple = ()) -> None:
    """Scalars are i32 except those named in i64 (a pool row stride past 2**31) and the fp32
    scale; pointers as given; the rest constexpr."""
    sig = {}
    for name in jitfn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = "*" + ptrs[name]
        else:
            sig[name] = "fp32" if name == "qk_scale" else ("i64" if name in i64 else "i32")
    triton.compile(ASTSource(fn=jitfn, signature=sig, constexprs=consts),
                   target=GPUTarget("cuda", 90, 32))
    print("compiled", jitfn.fn.__name__, {k: consts[k] for k in ("D", "MASK_MODE", "SPLIT_K")
                                          if k in consts})


IO = dict(Q="bf16", K="bf16", V="bf16", AttOut="fp32", AttLse="fp32", KvIndptr="i64",
          KvIndices="i64")
for mode, split, d in [(0, True, 128), (2, False, 256)]:  # split-K verify; custom-mask D=256
    compile_sm90(
        ext._extend_kernel,
        dict(GROUP=4, HEAD_BLOCKS=1, GP=4, D=d, DV=d, MASK_MODE=mode, SPLIT_K=split,
             BLOCK_Q=16, BLOCK_N=32, BLOCK_D=d, BLOCK_DV=d, DOT_PREC="tf32", UPCAST=False),
        dict(IO, Out="bf16", QIndptr="i64", Mask="u8", MaskIndptr="i64"),
        i64=("stride_kr", "stride_vr"),
    )
compile_sm90(
    dec._decode_stage1,
    dict(GROUP=4, HEAD_BLOCKS=1, D=128, DV=128, BLOCK_H=16, BLOCK_N=32, BLOCK_D=128,
         BLOCK_DV=128, DOT_PREC="tf32", UPCAST=False),
    IO,
)
compile_sm90(mrg._merge_kernel, dict(DV=128, BLOCK_S=32, BLOCK_DV=128),
             dict(AttOut="fp32", AttLse="fp32", Out="bf16"))
