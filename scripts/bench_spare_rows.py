"""What a drafting engine gains by keeping a verify's rejected rows (KVSpace.roll_back).

    python scripts/bench_spare_rows.py [--algorithm DSPARK] [--arms adaptive 4] [--batch 64]
        [--temperature 0] [--num-prompts 512] [--repeats 3]
        [--out docs/bench/bench_spare_rows.json]

A round reserves rows for its anchor and drafts and commits some of them. The rest used to be
truncated at once and reserved anew by the next round: with one row per page, every request's
rows ended up scattered among the others', and plain steps between drafting ones ran slower
than NONE's (spec/ladder.py, TRY_STEPS). Now they stay the request's, spare for its next round,
and go back to the allocator only when pages run short.

Beside NONE and its twin NONE/2 (the noise band), the algorithm runs once per arm as the engine
runs now and once with the old behaviour (ALG.../truncated: every round's rejected rows
truncated, as before round 30). An arm is "adaptive" (the default policy, as
scripts/bench_serving.py runs it) or a cap c (pinned to c drafts per request:
bench_plain_cost.pin). The same harness as bench_serving.py (a spare engine built first,
engines in turns, a warm-up pass, decode time only); each repeat's ratio to NONE, medians.
Greedy outputs must equal NONE's in every engine, or nothing is written.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_plain_cost import pin, write_medians
from bench_serving import TWIN, cpu_model, side_by_side

from dspark_launch.engine.params import SamplingParams

TRUNCATED = "/truncated"  # the suffix of an engine that truncates rejected rows every round
ADAPTIVE: dict[str, object] = {}  # name -> engine, for the adaptive arms: where ladders ended


def arm_name(algorithm: str, arm: str) -> str:
    return algorithm if arm == "adaptive" else f"{algorithm}/{arm}"


def adjust(name: str, engine) -> None:
    """ALG/c: pinned at cap c; .../truncated: KVSpace.roll_back truncates, as before."""
    parts = name.split("/")
    if name.startswith("NONE"):
        return
    if len(parts) > 1 and parts[1].isdigit():
        pin(engine, int(parts[1]))
    else:
        ADAPTIVE[name] = engine
    if name.endswith(TRUNCATED):
        space = engine.space
        space.roll_back = space.truncate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--algorithm", default="DSPARK", choices=("NGRAM", "DFLASH", "DSPARK"))
    ap.add_argument("--arms", nargs="+", default=["adaptive", "4"],
                    help="'adaptive' (the default policy) and/or caps >= 1 (pinned)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default="docs/bench/bench_spare_rows.json")
    args = ap.parse_args()
    bad = [a for a in args.arms if a != "adaptive" and not (a.isdigit() and int(a) >= 1)]
    if bad:
        ap.error(f"--arms {bad}: expected 'adaptive' or a cap of 1 draft or more")
    torch.set_num_threads(1)

    from dspark_launch.args import resolve_config
    from dspark_launch.parallel import destroy_parallel_runtime, init_parallel_runtime

    init_parallel_runtime(resolve_config(["--device", "cpu"], world_size=1))
    names = ["NONE", TWIN] + [arm_name(args.algorithm, a) + tail
                              for a in args.arms for tail in ("", TRUNCATED)]
    ratios: dict[str, list[float]] = {n: [] for n in names}
    taus: dict[str, list[float]] = {n: [] for n in names}
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature)
    try:
        for rep, done in side_by_side(names, args.batch, args.num_prompts, params, args.warmup,
                                      args.repeats, adjust):
            base = done["NONE"]
            if params.temperature == 0:
                differ = [n for n, r in done.items() if r["outputs"] != base["outputs"]]
                if differ:
                    raise SystemExit(f"greedy outputs of {differ} differ from NONE's; "
                                     f"nothing written")
            if rep >= 0:
                for name, r in done.items():
                    ratios[name].append(r["decode_tok_s"] / base["decode_tok_s"])
                    taus[name].append(r["tau"] or 1.0)
            label = "warm-up" if rep < 0 else f"repeat {rep}"
            print(f"{label}: NONE {base['decode_tok_s']:.1f} tok/s; over it: " + ", ".join(
                f"{n} {r['decode_tok_s'] / base['decode_tok_s']:.3f}"
                for n, r in list(done.items())[1:]), flush=True)
    finally:
        destroy_parallel_runtime()
    # Where each adaptive engine's verify ladders ended (per request class and batch size).
    ladders = {n: e.policy.report()["ladders"] for n, e in ADAPTIVE.items()}
    out = {"meta": {"cpu": cpu_model(), "torch": torch.__version__, **vars(args),
                    "statistic": "median over repeats of decode tok/s over NONE's"},
           "results": {n: {"speedup_vs_none": statistics.median(ratios[n]), "runs": ratios[n],
                           "tau": statistics.median(taus[n])} for n in names},
           "ladders": ladders}
    for n, by_class in ladders.items():
        print(f"{n} ladders ended at: " + ", ".join(
            f"{k}: cap {v['current']['cap']}{' (model)' if v['current']['model'] else ''}"
            for k, v in by_class.items()))
    write_medians(names, ratios, taus, out, args.out)


if __name__ == "__main__":
    main()
