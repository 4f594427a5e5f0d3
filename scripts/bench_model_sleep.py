"""What a policy saves by sleeping: the "model" policy between the probes of a drafter it wrote
off, or (--policy adaptive) a verify ladder settled at plain decoding (its dormant steps).

    python scripts/bench_model_sleep.py [--policy model|adaptive] [--batch 16]
        [--temperature 1] [--num-prompts 512] [--repeats 3] [--algorithms DFLASH DSPARK]
        [--out docs/bench/bench_model_sleep.json]

`--speculative-policy model` probes a drafter that drafts nothing every 32 to 512 steps; once
its probes are spaced past 32 it plans nothing before the next one, and its steps up to
WAKE_AHEAD before it leave their rows out of the draft's context (spec/policy.py:
_model_asleep). Beside NONE and its twin NONE/2 (the noise band) each algorithm runs under
the model policy as it is (ALG) and kept awake (ALG/awake: the same policy, its sleep
switched off on that engine, so its steps write the draft's context as before). The same
harness as scripts/bench_serving.py: engines taking turns, a warm-up pass, decode time only,
each repeat's ratio to NONE, medians; dormant steps per engine go into the JSON.

What sleeping saves is small beside the noise band of engines taking turns, so each engine's
draft-context writes are also timed where they happen (the draft model's materialize, prefill
rows included) over the repeats: context_share, their seconds over the engine's wall seconds,
and context_rows, the rows written.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_plain_cost import write_medians
from bench_serving import TWIN, cpu_model, side_by_side

from dspark_launch.engine.params import SamplingParams

AWAKE = "/awake"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policy", choices=("model", "adaptive"), default="model")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--algorithms", nargs="+", default=["DFLASH", "DSPARK"],
                    choices=("DFLASH", "DSPARK"))  # (NGRAM writes no draft context)
    ap.add_argument("--out", default="docs/bench/bench_model_sleep.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from dspark_launch.args import resolve_config
    from dspark_launch.parallel import destroy_parallel_runtime, init_parallel_runtime

    init_parallel_runtime(resolve_config(["--device", "cpu"], world_size=1))
    names = ["NONE", TWIN] + [n for a in args.algorithms for n in (a, a + AWAKE)]
    ratios: dict[str, list[float]] = {n: [] for n in names}
    taus: dict[str, list[float]] = {n: [] for n in names}
    policies = {}  # name -> its engine's policy (its metrics outlive the engine)
    context = {}  # name -> [seconds, rows] of its draft-context writes in the repeats
    wall = {n: 0.0 for n in names}  # seconds each engine ran in the repeats
    measuring = [False]
    try:
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature)

        def adjust(name: str, engine) -> None:
            if engine.policy is None:
                return
            policy = engine.policy
            if args.policy == "model":
                policy.mode = "model"  # before its first step: its ladders are one arm
            if name.endswith(AWAKE):  # every step writes the draft's context
                plan = policy.plan

                def awake(*a, plan=plan, policy=policy, **kw):
                    lengths = plan(*a, **kw)
                    policy.dormant = False
                    return lengths

                policy.plan = awake
            policies[name] = engine.policy
            context[name] = [0.0, 0]
            draft = engine.proposer.draft
            write = draft.materialize

            def timed(features, *rest, **kw):
                t0 = time.perf_counter()
                write(features, *rest, **kw)
                if measuring[0]:
                    context[name][0] += time.perf_counter() - t0
                    context[name][1] += features.shape[0]

            draft.materialize = timed

        passes = side_by_side(names, args.batch, args.num_prompts, params, args.warmup,
                              args.repeats, adjust)
        measuring[0] = args.warmup == 0
        for rep, done in passes:
            measuring[0] = rep + 1 >= 0  # the pass after this one is a repeat
            base = done["NONE"]["decode_tok_s"]
            if rep >= 0:
                for name, r in done.items():
                    ratios[name].append(r["decode_tok_s"] / base)
                    taus[name].append(r["tau"] or 1.0)
                    wall[name] += r["wall_s"]
            label = "warm-up" if rep < 0 else f"repeat {rep}"
            print(f"{label}: NONE {base:.1f} tok/s; over it: " + ", ".join(
                f"{n} {r['decode_tok_s'] / base:.3f}" for n, r in done.items() if n != "NONE"),
                flush=True)
    finally:
        destroy_parallel_runtime()
    out = {"meta": {"cpu": cpu_model(), "torch": torch.__version__, **vars(args)},
           "results": {n: {"speedup_vs_none": statistics.median(ratios[n]), "runs": ratios[n],
                           "tau": statistics.median(taus[n]),
                           **({"dormant_steps": policies[n].metrics.dormant_steps,
                               "skipped_draft_steps": policies[n].metrics.skipped_drafts,
                               "context_share": context[n][0] / wall[n],
                               "context_rows": context[n][1]}
                              if n in policies else {})}
                       for n in names}}
    for n in policies:
        print(f"{n}: draft-context writes {100 * context[n][0] / wall[n]:.2f}% of its wall "
              f"time, {context[n][1]} rows; {policies[n].metrics.dormant_steps} dormant steps")
    write_medians(names, ratios, taus, out, args.out)


if __name__ == "__main__":
    main()
