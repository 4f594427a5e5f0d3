#!/usr/bin/env python
"""Prefix cache benchmark: many requests sharing a long prefix, with vs without the cache.

    python scripts/bench_prefix_cache.py                  # 64 x (512 shared + 32 own) tokens
    python scripts/bench_prefix_cache.py --smoke          # tiny sizes, a few seconds

Both sides run through the real entry point (`dspark_launch.__main__.main`, a world of one,
tp1, the embedded model and its DSPARK draft by default) on the same prompts in this same
process, one after the other (--repeats alternates them; medians are reported), so machine
load shifts both alike. Every request arrives at once. Reported per side, from the engine's
own summary: prefill tokens computed, TTFT p50, end-to-end output tokens/s (wall time of the
job, loading excluded), plus the ratios (without / with) against the goals of issue 17
(>= 5x fewer prefill tokens, >= 3x lower TTFT p50, >= 1.5x throughput) and whether the
outputs are identical. Writes JSON and a bar chart (PNG with matplotlib, else SVG) to
docs/bench/ by default.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

import torch

from dspark_launch.__main__ import main as engine_main
from dspark_launch.engine.build import ASSETS

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "bench"
GOALS = {"prefill_tokens": 5.0, "ttft_p50_s": 3.0, "throughput": 1.5}


def make_prompts(n: int, prefix: int, suffix: int, vocab: int, eos: int, seed: int
                 ) -> list[dict]:
    rng = random.Random(seed)

    def toks(k: int) -> list[int]:
        return [t for t in (rng.randrange(3, vocab) for _ in range(k * 2)) if t != eos][:k]

    shared = toks(prefix)
    return [{"input_ids": shared + toks(suffix), "id": f"req-{i}"} for i in range(n)]


def run_side(args, prompts: Path, workdir: Path, cache: bool, rep: int) -> dict:
    name = f"{'on' if cache else 'off'}-{rep}"
    metrics, out = workdir / f"{name}.json", workdir / f"{name}.jsonl"
    argv = ["--speculative-algorithm", args.algorithm, "--prompts", str(prompts),
            "--max-new-tokens", str(args.max_new_tokens), "--max-running-requests",
            str(args.max_running_requests), "--chunked-prefill-size", str(args.chunk),
            "--page-size", str(args.page_size), "--kv-cache-memory", args.kv_cache_memory,
            "--metrics-json", str(metrics), "--output", str(out), "--overwrite",
            "--device", "cpu", "--log-level", "WARNING",
            # A fixed verify length: the adaptive policy picks lengths from measured step times,
            # so its per-round accept lengths would differ run to run, cache or not.
            "--speculative-policy", "fixed"]
    if not cache:
        argv.append("--disable-prefix-cache")
    rc = engine_main(argv)
    if rc != 0:
        raise SystemExit(f"the {name} run failed with exit code {rc}")
    s = json.loads(metrics.read_text())
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return {"prefill_tokens": s["prefill_tokens"], "cached_tokens": s["cached_tokens"],
            "prefix_hit_rate": s["prefix_hit_rate"], "ttft_p50_s": s["ttft_p50_s"],
            "throughput": s["output_tokens_per_s"], "wall_s": s["wall_s"],
            "output_tokens": s["output_tokens"], "mean_tau": s["mean_tau"],
            "outputs": [r["output_ids"] for r in records],
            "accept_lens": [r["accept_lens"] for r in records]}


def median_side(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs)
           for k in ("prefill_tokens", "cached_tokens", "ttft_p50_s", "throughput", "wall_s")}
    out.update(output_tokens=runs[0]["output_tokens"], prefix_hit_rate=runs[0]["prefix_hit_rate"],
               mean_tau=runs[0]["mean_tau"], runs=[{k: v for k, v in r.items()
                                                   if k not in ("outputs", "accept_lens")}
                                                  for r in runs])
    return out


def ratios(off: dict, on: dict) -> dict:
    """Each as 'how many times better with the cache'."""
    return {"prefill_tokens": off["prefill_tokens"] / max(on["prefill_tokens"], 1),
            "ttft_p50_s": off["ttft_p50_s"] / on["ttft_p50_s"],
            "throughput": on["throughput"] / off["throughput"]}


def plot(result: dict, stem: Path) -> Path:
    labels = ["prefill tokens\ncomputed", "TTFT p50", "end-to-end\nthroughput"]
    values = [result["ratios"][k] for k in ("prefill_tokens", "ttft_p50_s", "throughput")]
    goals = [GOALS[k] for k in ("prefill_tokens", "ttft_p50_s", "throughput")]
    title = (f"prefix cache: {result['meta']['requests']} requests sharing "
             f"{result['meta']['prefix']} tokens (+{result['meta']['suffix']} own), CPU tp1")
    try:
        import matplotlib
    except ImportError:
        return _plot_svg(labels, values, goals, title, stem.with_suffix(".svg"))
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(range(3), values, color="#4c72b0", label="measured (without / with)")
    ax.scatter(range(3), goals, marker="_", s=900, color="#c44e52", label="goal", zorder=3)
    for bar, v in zip(bars, values):
        ax.annotate(f"{v:.1f}x", (bar.get_x() + bar.get_width() / 2, v), ha="center",
                    va="bottom")
    ax.set_xticks(range(3))
    ax.set_xticklabels(labels)
    ax.set_ylabel("times better with the cache")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    path = stem.with_suffix(".png")
    fig.savefig(path, dpi=120)
    return path


def _plot_svg(labels: list[str], values: list[float], goals: list[float], title: str,
              path: Path) -> Path:
    """The same bar chart as plain SVG (no plotting library installed)."""
    w, h, top, base = 560, 320, 40, 260
    scale = (base - top) / max(values + goals)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
             f'font-family="sans-serif" font-size="12">',
             f'<text x="{w / 2}" y="20" text-anchor="middle">{title}</text>',
             f'<line x1="40" y1="{base}" x2="{w - 20}" y2="{base}" stroke="black"/>']
    for i, (label, v, g) in enumerate(zip(labels, values, goals)):
        x = 80 + i * 160
        parts += [f'<rect x="{x}" y="{base - v * scale:.1f}" width="80" '
                  f'height="{v * scale:.1f}" fill="#4c72b0"/>',
                  f'<text x="{x + 40}" y="{base - v * scale - 4:.1f}" '
                  f'text-anchor="middle">{v:.1f}x</text>',
                  f'<line x1="{x - 10}" y1="{base - g * scale:.1f}" x2="{x + 90}" '
                  f'y2="{base - g * scale:.1f}" stroke="#c44e52" stroke-width="3"/>',
                  f'<text x="{x + 40}" y="{base + 18}" text-anchor="middle">'
                  f'{label.replace(chr(10), " ")}</text>']
    parts += [f'<text x="40" y="{h - 10}">bars: measured, without / with the cache; red '
              f'lines: goals</text>', "</svg>"]
    path.write_text("\n".join(parts))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=512, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=32, help="each request's own tokens")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--algorithm", default="DSPARK",
                    help="with the embedded model: NONE, NGRAM, DFLASH or DSPARK")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--repeats", type=int, default=1, help="alternating runs per side")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="8 requests x (64 + 8) tokens, 4 new: checks the script, not speed")
    ap.add_argument("--out", default=None,
                    help="JSON path (default docs/bench/bench_prefix_cache.json; the plot "
                    "goes next to it); --smoke writes only when given")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.prefix, args.suffix, args.max_new_tokens = 8, 64, 8, 4
    torch.set_num_threads(args.threads)
    cfg = json.loads((ASSETS / "target" / "config.json").read_text())
    rows = make_prompts(args.requests, args.prefix, args.suffix, cfg["vocab_size"],
                        cfg["eos_token_id"], args.seed)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        prompts = workdir / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for rep in range(args.repeats):
            for side in ("off", "on"):
                r = run_side(args, prompts, workdir, side == "on", rep)
                runs[side].append(r)
                print(f"{side:3s} #{rep}: prefill {r['prefill_tokens']:6d} tokens, TTFT p50 "
                      f"{r['ttft_p50_s'] * 1e3:8.1f} ms, {r['throughput']:7.1f} tok/s, wall "
                      f"{r['wall_s']:.2f} s", flush=True)
    identical = all(r["outputs"] == runs["off"][0]["outputs"] and
                    r["accept_lens"] == runs["off"][0]["accept_lens"]
                    for r in runs["off"] + runs["on"])
    off, on = median_side(runs["off"]), median_side(runs["on"])
    result = {
        "meta": {"requests": args.requests, "prefix": args.prefix, "suffix": args.suffix,
                 "max_new_tokens": args.max_new_tokens, "algorithm": args.algorithm,
                 "page_size": args.page_size, "chunked_prefill_size": args.chunk,
                 "max_running_requests": args.max_running_requests,
                 "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
                 "model": str(ASSETS / "target"), "device": "cpu", "tp": 1},
        "without_cache": off, "with_cache": on, "ratios": ratios(off, on), "goals": GOALS,
        "outputs_and_accept_lens_identical": identical,
    }
    result["meets_goals"] = {k: result["ratios"][k] >= g for k, g in GOALS.items()}
    print(f"\n{'':22s} {'without':>10s} {'with':>10s} {'ratio':>7s} {'goal':>6s}")
    for key, label, fmt in (("prefill_tokens", "prefill tokens", "{:10.0f}"),
                            ("ttft_p50_s", "TTFT p50 (s)", "{:10.3f}"),
                            ("throughput", "output tok/s", "{:10.1f}")):
        print(f"{label:22s} {fmt.format(off[key])} {fmt.format(on[key])} "
              f"{result['ratios'][key]:6.2f}x {GOALS[key]:5.1f}x")
    print(f"outputs and per-round accept lengths identical: {identical}")
    out = Path(args.out) if args.out else (None if args.smoke else
                                          OUT_DIR / "bench_prefix_cache.json")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out} and {plot(result, out.with_suffix(''))}")
    if not identical:
        raise SystemExit("outputs or accept lengths differ with the cache")


if __name__ == "__main__":
    main()
