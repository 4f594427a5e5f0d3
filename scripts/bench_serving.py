"""Serving benchmark: decode throughput and tau per algorithm, side by side in one run.

    python scripts/bench_serving.py [--model DIR --dflash DIR --dspark DIR] [--prompts FILE]
        [--batches 1 16] [--max-new-tokens 64] [--algorithms NONE NGRAM DFLASH DSPARK]
        [--hf] [--out bench_serving.json] [--plot bench_serving.png]

Every configuration runs through the real entry point (`dspark_launch.__main__.main`, a world of
one, tp1) on the same prompts, and the engine's own summary gives output tokens/s (decode
wall time, loading excluded) and mean tau. `--hf` adds HF transformers `generate()` (greedy,
same checkpoint, same prompts) as an outside baseline. Ratios are computed against NONE at the
same batch size, measured in this same process, so machine load shifts both sides alike.
Defaults: the embedded tiny model and its drafts, the built-in held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dspark_launch.__main__ import main as engine_main
from dspark_launch.engine.inputs import BUILTIN_PROMPTS
from dspark_launch.engine.runner import ASSETS


def run_engine(args, algorithm: str, batch: int, prompts: Path, workdir: Path) -> dict:
    metrics = workdir / f"{algorithm}-{batch}.json"
    out = workdir / f"{algorithm}-{batch}.jsonl"
    argv = ["--model", args.model, "--speculative-algorithm", algorithm,
            "--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens),
            "--max-running-requests", str(batch), "--metrics-json", str(metrics),
            "--output", str(out), "--overwrite", "--kv-cache-memory", args.kv_cache_memory,
            "--attention-backend", args.attention_backend, "--log-level", "WARNING"]
    if algorithm in ("DFLASH", "DSPARK"):
        argv += ["--draft", args.dflash if algorithm == "DFLASH" else args.dspark]
    if args.block_size:
        argv += ["--block-size", str(args.block_size)]
    if algorithm != "NONE":
        argv += ["--speculative-policy", args.speculative_policy]
    rc = engine_main(argv)
    if rc != 0:
        raise SystemExit(f"{algorithm} batch {batch} failed with exit code {rc}")
    summary = json.loads(metrics.read_text())
    outputs = [json.loads(line)["output_ids"] for line in out.read_text().splitlines()]
    return {"tok_s": summary["output_tokens_per_s"], "tau": summary["mean_tau"],
            "output_tokens": summary["output_tokens"], "wall_s": summary["wall_s"],
            "outputs": outputs}


def run_hf(args, batch: int, prompts: list[str]) -> dict:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    # fp32 like the engine's CPU default, so both sides do the same arithmetic.
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    pad = eos if isinstance(eos, int) else (eos[0] if eos else 0)
    ids = [tok.encode(p).ids for p in prompts]
    produced = 0
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            group = ids[i:i + batch]
            width = max(map(len, group))
            # Left padding, so every row's last prompt token is at the same column.
            input_ids = torch.tensor([[pad] * (width - len(g)) + g for g in group])
            mask = torch.tensor([[0] * (width - len(g)) + [1] * len(g) for g in group])
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=args.max_new_tokens, pad_token_id=pad)
            for row in out[:, width:].tolist():
                stop = [j for j, t in enumerate(row) if eos is not None and t in
                        ([eos] if isinstance(eos, int) else eos)]
                produced += (stop[0] + 1) if stop else len(row)
    wall = time.perf_counter() - start
    return {"tok_s": produced / wall, "output_tokens": produced, "wall_s": wall}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({int(b) for b in results})
    names = sorted({name for b in results.values() for name in b},
                   key=lambda n: ["HF", "NONE", "NGRAM", "DFLASH", "DSPARK"].index(n))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(batches))]
        ys = [results[str(b)].get(name, {}).get("tok_s") or 0 for b in batches]
        bars = ax.bar(xs, ys, width, label=name)
        for bar, b in zip(bars, batches):
            ratio = results[str(b)].get(name, {}).get("speedup_vs_none")
            if ratio:
                ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(batches))])
    ax.set_xticklabels([f"batch {b}" for b in batches])
    ax.set_ylabel("output tokens / s (CPU, tp1)")
    ax.set_title("decode throughput; labels: speedup over NONE at the same batch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=str(ASSETS / "target"))
    ap.add_argument("--dflash", default=str(ASSETS / "dflash"))
    ap.add_argument("--dspark", default=str(ASSETS / "dspark"))
    ap.add_argument("--prompts", default=str(BUILTIN_PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--algorithms", nargs="+", default=["NONE", "NGRAM", "DFLASH", "DSPARK"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--speculative-policy", choices=("adaptive", "fixed"), default="adaptive",
                    help="verify-length policy of every speculative algorithm")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--hf", action="store_true", help="add HF transformers generate() baseline")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads for every configuration (default 1: on a small or "
                    "shared CPU more threads mostly spin against each other)")
    ap.add_argument("--out", default="bench_serving.json")
    ap.add_argument("--plot", default=None, help="PNG path (needs matplotlib)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line]
    rows = rows[:args.num_prompts]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        prompts = workdir / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for batch in args.batches:
            results[str(batch)] = {}
            for algorithm in args.algorithms:
                r = run_engine(args, algorithm, batch, prompts, workdir)
                results[str(batch)][algorithm] = r
                print(f"batch {batch:3d} {algorithm:7s} {r['tok_s']:8.1f} tok/s  "
                      f"tau {r['tau'] or 0:.2f}", flush=True)
            if args.hf:
                r = run_hf(args, batch, [r["prompt"] for r in rows])
                results[str(batch)]["HF"] = r
                print(f"batch {batch:3d} HF      {r['tok_s']:8.1f} tok/s", flush=True)
    for by_alg in results.values():
        base = by_alg.get("NONE")
        for r in by_alg.values():
            if base and r.get("tok_s"):
                r["speedup_vs_none"] = r["tok_s"] / base["tok_s"]
            if base and "outputs" in r:
                r["lossless_vs_none"] = r["outputs"] == base["outputs"]
        for r in by_alg.values():
            r.pop("outputs", None)
    print("\nbatch  algorithm   tok/s    tau   speedup-vs-NONE  lossless")
    for batch, by_alg in results.items():
        for name, r in by_alg.items():
            tau = f"{r['tau']:.2f}" if r.get("tau") else "  - "
            lossless = r.get("lossless_vs_none", "-")
            print(f"{batch:>5}  {name:9s} {r['tok_s']:7.1f}  {tau:>5}   "
                  f"{r.get('speedup_vs_none', 0):6.2f}x          {lossless}")
    meta = {"torch_threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
            "num_prompts": len(rows), "model": args.model,
            "speculative_policy": args.speculative_policy}
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")
    if args.plot:
        plot(results, Path(args.plot))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
