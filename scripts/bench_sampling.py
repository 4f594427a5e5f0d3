#!/usr/bin/env python
"""Benchmark the sampling filters (spec/sampling.py target_probs) against sorting the vocabulary.

A sampled row's distribution is built at every verify row and, for a block drafter, at every
draft slot. Until round 41 a top_k or top_p on any row sorted every row of the whole
vocabulary (two sorts with both), which at Qwen3's 151 936 tokens costs ~11 ms a row on one
CPU thread; Qwen3's generation_config.json asks for top_k 20 and top_p 0.95. target_probs now
takes the k-th logit from a top-k of the largest k asked and sorts only the rows with a top_p,
over their top-k where each has one. Side by side in one run, per case: the full-sort filters
(`sorted_filters` below, the former code) and target_probs, the median of --repeats timings
of each, and the largest difference between their probabilities. JSON to --out.

    python scripts/bench_sampling.py [--vocab 151936] [--rows 8 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from bench_serving import cpu_model

from dspark_launch.engine.params import SamplingParams
from dspark_launch.spec.sampling import SamplingRows, target_probs

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "docs", "bench",
                           "bench_sampling.json")
CASES = {
    "T=1": dict(temperature=1.0),
    "top_k=20": dict(temperature=1.0, top_k=20),
    "top_p=0.9": dict(temperature=1.0, top_p=0.9),
    "top_k=20 top_p=0.95 (Qwen3's defaults)": dict(temperature=0.6, top_k=20, top_p=0.95),
    "one row top_k=20, the rest T=1": None,  # a batch where a single request filters
}


def sorted_filters(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """The filters as they were: every row sorted for top-k, and again for top-p."""
    x = logits.float() / rows.temperature[:, None]
    if bool((rows.top_k > 0).any()):
        k = rows.top_k.clamp(0, x.shape[-1])
        kth = torch.sort(x, dim=-1, descending=True).values.gather(
            1, (k - 1).clamp_min(0)[:, None])
        x = x.masked_fill((k[:, None] > 0) & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if bool((rows.top_p < 1).any()):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= rows.top_p[:, None]
        drop[:, 0] = False
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def timed(fn, logits: torch.Tensor, rows: SamplingRows, repeats: int) -> float:
    fn(logits, rows)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(logits, rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    results = []
    for n in args.rows:
        logits = torch.randn(n, args.vocab, generator=gen) * 4
        for name, fields in CASES.items():
            params = [SamplingParams(**fields)] * n if fields else \
                [SamplingParams(temperature=1.0, top_k=20)] + [SamplingParams()] * (n - 1)
            rows = SamplingRows.build(params, list(range(n)), [0] * n, "cpu")
            before = timed(sorted_filters, logits, rows, args.repeats)
            now = timed(target_probs, logits, rows, args.repeats)
            diff = float((sorted_filters(logits, rows) - target_probs(logits, rows)).abs().max())
            results.append({"rows": n, "case": name, "sort_ms": before * 1e3,
                            "target_probs_ms": now * 1e3, "speedup": before / now,
                            "max_abs_diff": diff})
            print(f"rows {n:3d}  {name:40s} sort {before * 1e3:8.1f} ms  now "
                  f"{now * 1e3:8.1f} ms  x{before / now:6.1f}  max |diff| {diff:.1e}",
                  flush=True)
    meta = {"vocab": args.vocab, "repeats": args.repeats, "threads": args.threads,
            "torch": torch.__version__, "cpu": cpu_model(), "statistic": "median"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
