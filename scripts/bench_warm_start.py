"""What a run's drain costs a speculative engine, with and without warm-started ladders.

    python scripts/bench_warm_start.py [--batch 16] [--temperature 0] [--num-prompts 128]
        [--repeats 3] [--algorithms NGRAM DFLASH DSPARK]
        [--out docs/bench/bench_warm_start.json]

The verify ladder is per batch size (spec/policy.py: VerifyPolicy._ladder). When a run
drains (its last requests finish a few steps apart, as a speculative engine's do), each
smaller batch meets a ladder of its own for the first time. Such a ladder starts where the
nearest larger batch's ladder that left plain decoding stands (ALG), or, as before round 39,
at plain decoding (ALG/cold: policy.warm_start off on that engine). Beside NONE and its twin
NONE/2 (the noise band), the same harness as scripts/bench_serving.py: engines taking turns,
a warm-up pass, each repeat's ratio to NONE, medians.

Two ratios per engine: decode (every decode step, the drain included: what the README's
table shows) and full (only the steps with all `--batch` slots decoding). Their quotient,
decode over full, is what the drain costs the engine against NONE, whose equal-length
requests finish together and never drain: measured inside one engine's run, it does not
carry the few percent by which two engines' runs scatter (NONE/2).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_plain_cost import write_medians
from bench_serving import TWIN, cpu_model, side_by_side

from dspark_launch.engine.params import SamplingParams

COLD = "/cold"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--algorithms", nargs="+", default=["NGRAM", "DFLASH", "DSPARK"],
                    choices=("NGRAM", "DFLASH", "DSPARK"))
    ap.add_argument("--out", default="docs/bench/bench_warm_start.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from dspark_launch.args import resolve_config
    from dspark_launch.parallel import destroy_parallel_runtime, init_parallel_runtime

    init_parallel_runtime(resolve_config(["--device", "cpu"], world_size=1))
    names = ["NONE", TWIN] + [n for a in args.algorithms for n in (a, a + COLD)]
    ratios: dict[str, list[float]] = {n: [] for n in names}
    full: dict[str, list[float]] = {n: [] for n in names}
    drain: dict[str, list[float]] = {n: [] for n in names}  # decode over full, over NONE's
    taus: dict[str, list[float]] = {n: [] for n in names}
    ladders: dict[str, dict] = {}
    policies = {}
    try:
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature)

        def adjust(name: str, engine) -> None:
            if engine.policy is not None:
                engine.policy.warm_start = not name.endswith(COLD)
                policies[name] = engine.policy

        for rep, done in side_by_side(names, args.batch, args.num_prompts, params, args.warmup,
                                      args.repeats, adjust):
            none = done["NONE"]
            if rep >= 0:
                for name, r in done.items():
                    ratios[name].append(r["decode_tok_s"] / none["decode_tok_s"])
                    full[name].append(r["full_tok_s"] / none["full_tok_s"])
                    drain[name].append(ratios[name][-1] / full[name][-1])
                    taus[name].append(r["tau"] or 1.0)
            label = "warm-up" if rep < 0 else f"repeat {rep}"
            print(f"{label}: NONE {none['decode_tok_s']:.1f} tok/s; over it (decode / full): "
                  + ", ".join(f"{n} {r['decode_tok_s'] / none['decode_tok_s']:.3f} / "
                              f"{r['full_tok_s'] / none['full_tok_s']:.3f}"
                              for n, r in done.items() if n != "NONE"), flush=True)
        for name, policy in policies.items():  # where each ladder ended: (cap, model, steps)
            ladders[name] = {cls: [lad.current.cap, lad.current.model, lad.steps]
                             for cls, lad in policy.ladders.items()}
    finally:
        destroy_parallel_runtime()
    for n in names:
        print(f"{n}: full {statistics.median(full[n]):.3f}x NONE, decode over full "
              f"{statistics.median(drain[n]):.3f} (per repeat "
              f"{' / '.join(f'{x:.3f}' for x in drain[n])})")
    out = {"meta": {"cpu": cpu_model(), "torch": torch.__version__, **vars(args)},
           "results": {n: {"speedup_vs_none": statistics.median(ratios[n]), "runs": ratios[n],
                           "full_speedup_vs_none": statistics.median(full[n]),
                           "full_runs": full[n],
                           "decode_over_full": statistics.median(drain[n]),
                           "decode_over_full_runs": drain[n],
                           "tau": statistics.median(taus[n]),
                           **({"ladders": ladders[n]} if n in ladders else {})}
                       for n in names}}
    write_medians(names, ratios, taus, out, args.out)


if __name__ == "__main__":
    main()
