"""What the first steps after a change of arm cost: the verify ladder's one-step tries.

    python scripts/bench_switch.py [--algorithm DFLASH] [--cap 3] [--batch 16]
        [--num-prompts 128] [--repeats 2] [--run 4] [--out docs/bench/bench_switch.json]

The ladder (spec/ladder.py) scores a neighbour by one step played between steps of its current
arm. That is fair only if a step's speed does not depend on the arm of the steps before it.
This measures whether it does: one engine plays the drafting arm `--cap` (fixed) and plain
decoding in alternating runs of `--run` steps, a NONE engine beside it in the same turns (as
bench_serving.py runs them), and every step at a full batch is timed (the seconds the ladder is
told: forward and draft) and counted (tokens committed), by its place in its run: the 1st
step after a change of arm, the 2nd, ... A one-step try is the 1st; steady play is the last.
NONE's steps are plain decoding as it runs without any switch. JSON, one row per place.

The alternation is forced on the engine's own ladders (their pick and move replaced): a
diagnostic of the policy's measurements, not a way to run the engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_serving import cpu_model, embedded_engine, load_prompts, run_interleaved

from dspark_launch.args import resolve_config
from dspark_launch.engine.heap import freeze_heap
from dspark_launch.engine.inputs import BUILTIN_PROMPTS
from dspark_launch.engine.params import SamplingParams
from dspark_launch.parallel import destroy_parallel_runtime, init_parallel_runtime


def force_alternation(engine, cap: int, run: int) -> None:
    """Every ladder of the engine plays `run` steps of the fixed arm `cap`, then `run` of
    plain decoding, and so on; it never moves (its tries and judgements are left out)."""
    make = engine.policy._ladder

    def ladder_for(cls: str, requests: int):
        ladder = make(cls, requests)
        if not getattr(ladder, "forced", False):
            arm = next(j for j, a in enumerate(ladder.arms)
                       if a.cap == min(cap, max(x.cap for x in ladder.arms)) and not a.model)

            def pick(predict=None, ladder=ladder, arm=arm):
                ladder.steps += 1
                return arm if (ladder.steps // run) % 2 else 0

            ladder.pick, ladder.forced = pick, True
            ladder.quiet = lambda horizon: False  # the draft's context stays written
        return ladder

    engine.policy._ladder = ladder_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--algorithm", default="DFLASH", choices=("NGRAM", "DFLASH", "DSPARK"))
    ap.add_argument("--cap", type=int, default=3, help="drafts verified in the drafting runs")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="measured passes (after one warm-up)")
    ap.add_argument("--run", type=int, default=4, help="steps per run of one arm")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/bench/bench_switch.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    init_parallel_runtime(resolve_config(["--device", "cpu"], world_size=1))

    try:
        # The first engine built runs slower (bench_serving.py): a spare takes its place.
        spare = embedded_engine("NONE", args.batch)
        engines = {name: embedded_engine(name, args.batch) for name in ("NONE", args.algorithm)}
        force_alternation(engines[args.algorithm], args.cap, args.run)
        freeze_heap()
        # (engine, drafted, place in its run) -> per step (seconds told, tokens, context s)
        steps: dict[tuple, list[tuple[float, int, float]]] = defaultdict(list)
        measuring = [False]
        for name, engine in engines.items():
            def step(inner=engine.step, engine=engine, name=name):
                outs = inner()
                stats = engine.last_step
                if measuring[0] and not stats.prefill_tokens \
                        and stats.decode_requests == args.batch:
                    played = engine.policy._played if engine.policy is not None else None
                    # the step's place in its run (pick() counted it; runs start at multiples)
                    place = played.ladder.steps % args.run + 1 if played is not None else 0
                    # What the ladder scores: forward and draft. The draft's context rows
                    # written in the step for earlier steps are in neither (engine.step):
                    # kept apart.
                    forward_us, draft_us, context_us = engine._timing
                    steps[(name, bool(stats.drafted), place)].append(
                        ((forward_us + draft_us) * 1e-6, sum(len(o.new_token_ids) for o in outs),
                         context_us * 1e-6))
                return outs
            engine.step = step
        prompts = [engines["NONE"].tokenizer.encode(t).ids
                   for t in load_prompts(str(BUILTIN_PROMPTS), args.num_prompts)]
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature)
        index, t0 = 0, time.time()
        for rep in range(1 + args.repeats):
            measuring[0] = rep > 0
            run_interleaved(engines, prompts, args.batch, params, index)
            index += len(engines) * len(prompts)
        for engine in [*engines.values(), spare]:
            engine.shutdown()
    finally:
        destroy_parallel_runtime()
    plain = statistics.median(s for s, _, _ in steps[("NONE", False, 0)])
    rows = []
    print(f"batch {args.batch}, T={args.temperature:g}: {args.algorithm} cap {args.cap} and "
          f"plain decoding in runs of {args.run}; NONE's plain step {plain * 1e3:.2f} ms")
    for (name, drafted, place), v in sorted(steps.items()):
        secs = statistics.median(s for s, _, _ in v)
        tokens = statistics.mean(n for _, n, _ in v)
        context = statistics.mean(c for _, _, c in v)
        row = {"engine": name, "arm": f"cap {args.cap}" if drafted else "plain",
               "place": place, "steps": len(v), "median_ms": round(secs * 1e3, 3),
               "tokens_per_step": round(tokens, 3),
               "tok_s": round(sum(n for _, n, _ in v) / sum(s for s, _, _ in v), 1),
               "seconds_over_none_plain": round(secs / plain, 4),
               "context_ms_mean": round(context * 1e3, 3)}
        rows.append(row)
        print(f"  {name:7s} {row['arm']:6s} step {place} after a switch: {len(v):4d} steps, "
              f"{row['median_ms']:.2f} ms ({row['seconds_over_none_plain']:.3f}x NONE's), "
              f"{tokens:.2f} tokens, {row['tok_s']:.0f} tok/s, context writes "
              f"{row['context_ms_mean']:.2f} ms")
    meta = {"cpu": cpu_model(), "torch": torch.__version__, "algorithm": args.algorithm,
            "cap": args.cap, "batch": args.batch, "temperature": args.temperature,
            "run": args.run, "num_prompts": args.num_prompts, "repeats": args.repeats,
            "wall_s": round(time.time() - t0, 1),
            "statistic": "median seconds told to the ladder (forward + draft) per step at a "
                         "full batch, by the step's place after a change of arm; the draft's "
                         "context writes for earlier steps (in neither) as their mean"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
