#!/usr/bin/env python
"""Benchmark the Triton paged attention kernels against torch SDPA over contiguous KV.

On CUDA: paged split-K decode and extend at Qwen3-8B head shapes (32 q / 8 kv heads,
head_dim 128, bf16), achieved GB/s next to the device's peak, a side-by-side table, and
the verify case (a 9-row causal block after a long prefix: the extend kernel's split-K
path vs the same kernel unsplit vs the torch backend), written as JSON to --out (default
docs/bench/bench_attention.json). Without CUDA it says so and exits 0, or with --smoke
runs tiny shapes of every case through the Triton interpreter (JSON only with --out).

    python scripts/bench_attention.py --quick
    python scripts/bench_attention.py --smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

# Peak HBM bandwidth in GB/s by device-name substring (first match wins; SXM parts).
PEAK_GBPS = [
    ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("H800", 3350.0),
    ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0), ("A800", 2039.0), ("L40S", 864.0), ("L40", 864.0), ("A10", 600.0),
    ("L4", 300.0), ("RTX 4090", 1008.0), ("RTX 3090", 936.0), ("V100", 900.0),
]
HQ, HKV, HEAD_DIM = 32, 8, 128  # Qwen3-8B
PAGE_SIZE = 16
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "docs", "bench",
                           "bench_attention.json")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few shapes, few iterations")
    p.add_argument("--smoke", "--cpu-smoke", dest="smoke", action="store_true",
                   help="without CUDA: tiny shapes of every case via TRITON_INTERPRET=1")
    p.add_argument("--out", help="write results as JSON to this file (on CUDA default: "
                   "docs/bench/bench_attention.json; smoke runs write only when given)")
    p.add_argument("--peak-gbps", type=float, help="device peak HBM GB/s if not known")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 8192, 32768])
    p.add_argument("--max-tokens", type=int, default=1 << 21,
                   help="skip decode cases with batch*context above this (memory)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--verify-q", type=int, default=9, help="verify block rows (block size + 1)")
    p.add_argument("--verify-contexts", type=int, nargs="*", default=[4096, 32768])
    p.add_argument("--verify-batches", type=int, nargs="*", default=[1, 8])
    return p.parse_args()


def peak_for(name: str, override: float | None) -> float | None:
    if override:
        return override
    for key, gbps in PEAK_GBPS:
        if key.lower() in name.lower():
            return gbps
    return None


def timeit(fn, iters: int, device: torch.device) -> float:
    """Median seconds per call."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def paged_layout(batch: int, ctx: int, device, gen) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Shuffled pages: kv_indptr [B+1], kv_indices [B*ctx], rows (row 0 = dummy)."""
    pages_per = math.ceil(ctx / PAGE_SIZE)
    num_pages = batch * pages_per + 1
    perm = torch.randperm(num_pages - 1, generator=gen) + 1
    table = perm.view(batch, pages_per)
    pos = torch.arange(ctx)
    rows = table[:, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE  # [B, ctx]
    indptr = torch.arange(batch + 1, dtype=torch.int64) * ctx
    return indptr.to(device), rows.reshape(-1).to(device), num_pages * PAGE_SIZE


def bench_decode(k, batch, ctx, dtype, device, iters, gen) -> dict:
    indptr, indices, rows = paged_layout(batch, ctx, device, gen)
    kc = torch.randn(rows, HKV, HEAD_DIM, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    q = torch.randn(batch, HQ, HEAD_DIM, dtype=dtype, device=device)
    scale = HEAD_DIM**-0.5
    splits = k.choose_num_splits(batch, HKV, ctx, device)
    t_tri = timeit(lambda: k.paged_decode_attention(q, kc, vc, indptr, indices, scale, splits),
                   iters, device)
    # Baseline: the same KV already gathered contiguous [B, Hkv, ctx, D].
    kb = kc[indices].view(batch, ctx, HKV, HEAD_DIM).transpose(1, 2).contiguous()
    vb = vc[indices].view(batch, ctx, HKV, HEAD_DIM).transpose(1, 2).contiguous()
    qb = q.unsqueeze(2)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(
        qb, kb, vb, scale=scale, enable_gqa=True)
    t_ref = timeit(sdpa, iters, device)
    err = (k.paged_decode_attention(q, kc, vc, indptr, indices, scale, splits).float()
           - sdpa().squeeze(2).float()).abs().max().item()
    nbytes = 2 * batch * ctx * HKV * HEAD_DIM * kc.element_size()  # K and V reads dominate
    return dict(kind="decode", batch=batch, ctx=ctx, q_len=1, splits=splits, bytes=nbytes,
                triton_s=t_tri, sdpa_s=t_ref, max_abs_err=err)


def bench_extend(k, batch, ctx, q_len, dtype, device, iters, gen) -> dict:
    indptr, indices, rows = paged_layout(batch, ctx, device, gen)
    kc = torch.randn(rows, HKV, HEAD_DIM, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    q = torch.randn(batch * q_len, HQ, HEAD_DIM, dtype=dtype, device=device)
    q_indptr = torch.arange(batch + 1, dtype=torch.int64, device=device) * q_len
    scale = HEAD_DIM**-0.5
    run = lambda: k.extend_attention(q, kc, vc, q_indptr, indptr, indices, scale,
                                     max_q_len=q_len)
    t_tri = timeit(run, iters, device)
    kb = kc[indices].view(batch, ctx, HKV, HEAD_DIM).transpose(1, 2).contiguous()
    vb = vc[indices].view(batch, ctx, HKV, HEAD_DIM).transpose(1, 2).contiguous()
    qb = q.view(batch, q_len, HQ, HEAD_DIM).transpose(1, 2)
    if q_len == ctx:  # pure prefill: SDPA's fast causal path
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
    else:  # prefix + new tokens: bottom-right causal needs an explicit mask
        mask = torch.arange(ctx, device=device)[None, :] <= (
            ctx - q_len + torch.arange(q_len, device=device)[:, None])
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
    t_ref = timeit(sdpa, iters, device)
    err = (run().float() - sdpa().transpose(1, 2).reshape_as(q).float()).abs().max().item()
    nbytes = 2 * batch * ctx * HKV * HEAD_DIM * kc.element_size() + 2 * q.numel() * 2
    return dict(kind="extend", batch=batch, ctx=ctx, q_len=q_len, splits=None, bytes=nbytes,
                triton_s=t_tri, sdpa_s=t_ref, max_abs_err=err)


def bench_verify(k, batch, ctx, q_len, dtype, device, iters, gen, splits=None) -> dict:
    """A causal q_len-row block whose keys end at ctx (prefix ctx - q_len): split-K vs the
    unsplit extend kernel (attention only), and both backends' forward (store + attention)."""
    from dspark_launch.attention import build_metadata, make_backend

    indptr, indices, rows = paged_layout(batch, ctx, device, gen)
    kc = torch.randn(rows, HKV, HEAD_DIM, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    q = torch.randn(batch * q_len, HQ, HEAD_DIM, dtype=dtype, device=device)
    q_indptr = torch.arange(batch + 1, dtype=torch.int64, device=device) * q_len
    scale = HEAD_DIM**-0.5
    if splits is None:
        splits = k.choose_extend_splits(batch, HKV, q_len, ctx, device)

    def kernel(n):
        return lambda: k.extend_attention(q, kc, vc, q_indptr, indptr, indices, scale,
                                          max_q_len=q_len, num_splits=n)

    t_split, t_plain = timeit(kernel(splits), iters, device), timeit(kernel(1), iters, device)
    table = indices.view(batch, ctx)  # req_to_token: the request's rows, position-major
    meta = build_metadata(table, list(range(batch)), [ctx - q_len] * batch, [q_len] * batch,
                          "causal", device=device)
    new_k, new_v = kc[meta.out_rows], vc[meta.out_rows]  # re-storing them changes nothing
    outs, times = {}, {}
    for name in ("torch", "triton"):
        backend = make_backend(name, device)
        backend.prepare(meta)
        run = lambda b=backend: b.forward(q, new_k, new_v, kc, vc, meta, scale)
        times[name], outs[name] = timeit(run, iters, device), run().float()
    split_out = kernel(splits)().float()
    nbytes = 2 * batch * ctx * HKV * HEAD_DIM * kc.element_size()
    return dict(
        kind="verify", batch=batch, ctx=ctx, q_len=q_len, splits=splits, bytes=nbytes,
        split_s=t_split, plain_s=t_plain, torch_backend_s=times["torch"],
        triton_backend_s=times["triton"],
        triton_backend_splits=meta.backend_state["triton"].num_splits,
        split_gbps=nbytes / t_split / 1e9, plain_gbps=nbytes / t_plain / 1e9,
        speedup_vs_plain=t_plain / t_split, speedup_vs_torch=times["torch"] / t_split,
        max_abs_err_vs_plain=(split_out - kernel(1)().float()).abs().max().item(),
        max_abs_err_vs_torch=(split_out - outs["torch"]).abs().max().item(),
    )


def print_verify_table(results: list[dict], peak: float | None) -> None:
    head = (f"{'verify':<7}{'B':>5}{'ctx':>7}{'q':>4}{'spl':>4} | {'split us':>9}{'GB/s':>7}"
            f"{'%peak':>7} | {'plain us':>9} | {'torch be us':>11}{'triton be':>10} | "
            f"{'x plain':>7}{'x torch':>8}{'err':>9}")
    print(head)
    print("-" * len(head))
    for r in results:
        pct = f"{100 * r['split_gbps'] / peak:6.1f}%" if peak else "     ?"
        print(f"{'':<7}{r['batch']:>5}{r['ctx']:>7}{r['q_len']:>4}{r['splits']:>4} | "
              f"{r['split_s'] * 1e6:>9.1f}{r['split_gbps']:>7.0f}{pct:>7} | "
              f"{r['plain_s'] * 1e6:>9.1f} | {r['torch_backend_s'] * 1e6:>11.1f}"
              f"{r['triton_backend_s'] * 1e6:>10.1f} | {r['speedup_vs_plain']:>7.2f}"
              f"{r['speedup_vs_torch']:>8.2f}{r['max_abs_err_vs_torch']:>9.1e}")


def print_table(results: list[dict], peak: float | None) -> None:
    head = (f"{'kind':<7}{'B':>5}{'ctx':>7}{'q':>6}{'spl':>4} | {'triton us':>10}{'GB/s':>8}"
            f"{'%peak':>7} | {'sdpa us':>10}{'GB/s':>8} | {'sdpa/tri':>8}{'err':>9}")
    print(head)
    print("-" * len(head))
    for r in results:
        g_tri, g_ref = r["bytes"] / r["triton_s"] / 1e9, r["bytes"] / r["sdpa_s"] / 1e9
        r.update(triton_gbps=g_tri, sdpa_gbps=g_ref, speedup=r["sdpa_s"] / r["triton_s"])
        pct = f"{100 * g_tri / peak:6.1f}%" if peak else "     ?"
        print(f"{r['kind']:<7}{r['batch']:>5}{r['ctx']:>7}{r['q_len']:>6}"
              f"{r['splits'] or '-':>4} | {r['triton_s'] * 1e6:>10.1f}{g_tri:>8.0f}{pct:>7} | "
              f"{r['sdpa_s'] * 1e6:>10.1f}{g_ref:>8.0f} | {r['speedup']:>8.2f}"
              f"{r['max_abs_err']:>9.1e}")


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        if not args.smoke:
            print("bench_attention: no CUDA device found; nothing to benchmark. "
                  "Use --smoke for a tiny Triton-interpreter run.")
            return 0
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from dspark_launch import kernels as k

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    results: list[dict] = []
    verify: list[dict] = []
    out_path = args.out
    if device.type == "cpu":
        global HQ, HKV, HEAD_DIM
        HQ, HKV, HEAD_DIM = 4, 2, 64
        name, peak, dtype = "cpu (Triton interpreter)", args.peak_gbps, torch.float32
        results.append(bench_decode(k, 2, 40, dtype, device, 2, gen))
        results.append(bench_extend(k, 2, 40, 8, dtype, device, 2, gen))
        # One interpreter "SM" never asks for a split; force 3 so the path runs.
        for ctx in (300, 600):
            verify.append(bench_verify(k, 1, ctx, args.verify_q, dtype, device, 2, gen, 3))
    else:
        out_path = out_path or DEFAULT_OUT
        name = torch.cuda.get_device_name(device)
        peak, dtype = peak_for(name, args.peak_gbps), torch.bfloat16
        batches = [1, 32, 256] if args.quick else args.batches
        contexts = [1024, 8192] if args.quick else args.contexts
        iters = 5 if args.quick else args.iters
        for ctx in contexts:
            for batch in batches:
                if batch * ctx <= args.max_tokens:
                    results.append(bench_decode(k, batch, ctx, dtype, device, iters, gen))
        for ctx in contexts:
            results.append(bench_extend(k, 1, min(ctx, 8192), min(ctx, 8192), dtype, device,
                                        iters, gen))  # prefill
            for batch in [1, 32] if args.quick else [1, 8, 32]:  # verify blocks of 16
                if batch * ctx <= args.max_tokens:
                    results.append(bench_extend(k, batch, ctx, 16, dtype, device, iters, gen))
            torch.cuda.empty_cache()
        for ctx in args.verify_contexts:
            for batch in [1] if args.quick else args.verify_batches:
                if batch * ctx <= args.max_tokens:
                    verify.append(bench_verify(k, batch, ctx, args.verify_q, dtype, device,
                                               iters, gen))
            torch.cuda.empty_cache()
    peak_txt = f"{peak:.0f} GB/s" if peak else "unknown (pass --peak-gbps to get %peak)"
    print(f"device: {name}; peak HBM: {peak_txt}; Hq={HQ} Hkv={HKV} D={HEAD_DIM} {dtype}")
    print_table(results, peak)
    print_verify_table(verify, peak)
    if out_path:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(dict(device=name, peak_gbps=peak, dtype=str(dtype), heads=[HQ, HKV],
                           head_dim=HEAD_DIM, page_size=PAGE_SIZE, results=results,
                           verify=verify), f, indent=2)
        print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
