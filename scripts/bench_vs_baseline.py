"""This checkout against an older one, side by side in one run, through each one's own CLI.

    git worktree add --detach /tmp/baseline 7cf1a9e   # the engine before the step rebuild
    python scripts/bench_vs_baseline.py --baseline /tmp/baseline \
        [--num-prompts 128] [--batch 16] [--temperatures 0 1] [--algorithms NONE DSPARK]
        [--repeats 3] [--max-new-tokens 64] [--out docs/bench/bench_vs_baseline.json]

Each (checkout, algorithm, temperature) runs `python -m dspark_launch` as a world of one with
one intra-op thread on the same prompts file, alternating checkouts within each repeat so
machine load shifts both alike. Reported per cell: the median over repeats of output tok/s
(wall time of the decode loop, loading excluded, prefill included — the one measure both
versions report) and of the per-request TPOT p50 (time per output token after the first:
decode only), and from it the decode rate of the batch, batch / TPOT p50 (tokens/s that the
`batch` concurrent requests receive while decoding: prefill excluded). Extra flags for this
checkout only go after `--new-args` (e.g. the verify-length policy). Greedy outputs of every
run are checked equal to NONE of the same checkout. A PNG beside the JSON plots both rates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_serving import load_prompts  # noqa: E402

from dspark_launch.engine.inputs import BUILTIN_PROMPTS  # noqa: E402


def run(checkout: Path, algorithm: str, temperature: float, args, prompts: Path,
        work: Path, extra: list[str]) -> dict:
    tag = f"{checkout.name}-{algorithm}-{temperature}"
    metrics, out = work / f"{tag}.json", work / f"{tag}.jsonl"
    argv = [sys.executable, "-m", "dspark_launch", "--speculative-algorithm", algorithm,
            "--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens),
            "--max-running-requests", str(args.batch), "--temperature", str(temperature),
            "--metrics-json", str(metrics), "--output", str(out), "--overwrite",
            "--kv-cache-memory", args.kv_cache_memory, "--log-level", "WARNING", *extra]
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    subprocess.run(argv, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(metrics.read_text())
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return {"tok_s": summary["output_tokens_per_s"], "tpot_p50_s": summary["tpot_p50_s"],
            "tau": summary.get("mean_tau"),
            "outputs": [r["output_ids"] for r in sorted(records, key=lambda r: r["index"])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a checkout of the older version")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--algorithms", nargs="+", default=["NONE", "DSPARK"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "bench_vs_baseline.json"))
    ap.add_argument("--new-args", nargs=argparse.REMAINDER, default=[])
    args = ap.parse_args()

    checkouts = {"baseline": Path(args.baseline).resolve(), "new": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = work / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                                   for p in load_prompts(str(BUILTIN_PROMPTS),
                                                         args.num_prompts)))
        runs: dict[str, list[dict]] = {}
        for rep in range(args.repeats):
            for algorithm in args.algorithms:
                for temperature in args.temperatures:
                    for name, checkout in checkouts.items():
                        extra = args.new_args if name == "new" else []
                        key = f"{name}/{algorithm}/T={temperature:g}"
                        runs.setdefault(key, []).append(
                            run(checkout, algorithm, temperature, args, prompts, work, extra))
                        print(f"repeat {rep}: {key}: {runs[key][-1]['tok_s']:.1f} tok/s",
                              flush=True)
    cells = {}
    for key, rs in runs.items():
        tpot = statistics.median(r["tpot_p50_s"] for r in rs)
        cells[key] = {"tok_s_median": statistics.median(r["tok_s"] for r in rs),
                      "tpot_p50_s_median": tpot, "decode_tok_s": args.batch / tpot,
                      "tok_s": [r["tok_s"] for r in rs], "tau": rs[0]["tau"]}
    for name in checkouts:  # greedy outputs must equal NONE's in each checkout
        ref = runs.get(f"{name}/NONE/T=0")
        for key, rs in runs.items():
            if ref and key.startswith(f"{name}/") and key.endswith("/T=0"):
                cells[key]["greedy_equals_none"] = all(
                    r["outputs"] == ref[0]["outputs"] for r in rs)
    result = {"config": {k: v for k, v in vars(args).items() if k != "new_args"},
              "new_args": args.new_args, "cells": cells}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for key, c in cells.items():
        print(f"{key:28s} {c['tok_s_median']:8.1f} tok/s  TPOT p50 "
              f"{1000 * c['tpot_p50_s_median']:6.2f} ms  decode {c['decode_tok_s']:8.1f} tok/s"
              f"  tau {c['tau']}")
    plot(cells, list(checkouts), Path(args.out).with_suffix(".png"))


def plot(cells: dict, names: list[str], path: Path) -> None:
    """Bars per (algorithm, temperature): each checkout's decode rate and overall tok/s."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({key.split("/", 1)[1] for key in cells})  # "DSPARK/T=1"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(names)
    for ax, field, label in ((axes[0], "decode_tok_s", "decode tok/s (batch / TPOT p50)"),
                             (axes[1], "tok_s_median", "output tok/s (prefill included)")):
        for i, name in enumerate(names):
            ys = [cells.get(f"{name}/{g}", {}).get(field, 0) for g in groups]
            ax.bar([j + i * width for j in range(len(groups))], ys, width, label=name)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(groups))])
        ax.set_xticklabels(groups, fontsize=8)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("this checkout against the baseline (median of repeats)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
