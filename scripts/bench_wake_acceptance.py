"""How well drafts are accepted after a dormant stretch: the draft block skipping the positions
dormant steps left out of its context (Request.draft_gaps), against reading their rows as
before round 42, and against plain steps that wrote their context (awake).

    python scripts/bench_wake_acceptance.py [--algorithms DFLASH DSPARK] [--batch 16]
        [--temperature 0] [--num-prompts 128] [--max-new-tokens 96] [--sleep 40 140]
        [--window 100] [--out docs/bench/bench_wake_acceptance.json]

One engine per (algorithm, mode), the embedded model and draft, requests kept at a concurrency
of `batch` (the built-in prompts, as scripts/bench_serving.py stretches them). The verify
policy is replaced by a schedule of its steps (a step: one plan() call): every request drafts
its whole block at every step, except the steps in [--sleep), where nobody drafts. In `awake`
those are plain steps that write their anchors' draft context; in `sleep` and `read` they are
dormant (the anchors' draft context is not written, as a ladder settled at plain decoding runs
them). `read` records no gaps (Request.leave_out_context does nothing), so its drafts attend to
the rows left out, which hold what a page's last owner left there: the engine before round 42
(which also kept those pages out of the prefix cache; here the cache takes them).
Reported per mode: the mean accepted drafts per drafting round over the `--window` steps after
the wake, and over the whole run. Every mode runs the same steps on the same requests (greedy
outputs are checked equal), so the modes differ only in the context the drafts after the wake
see. Acceptance only: no timing, so one run is the number.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from bench_serving import cpu_model, embedded_engine, load_prompts

from dspark_launch.args import RunConfig
from dspark_launch.engine.inputs import BUILTIN_PROMPTS
from dspark_launch.engine.params import SamplingParams
from dspark_launch.engine.request import Request, RequestSpec
from dspark_launch.parallel import init_parallel_runtime

ROOT = Path(__file__).resolve().parent.parent
MODES = ("awake", "sleep", "read")


def run(algorithm: str, mode: str, prompts: list[str], args) -> dict:
    """One engine through the whole prompt list under the schedule; accepted drafts per round."""
    engine = embedded_engine(algorithm, args.batch)
    policy, cap = engine.policy, engine.proposer.max_drafts
    first, last = args.sleep
    steps, window, every = [0], [], []

    def plan(keys, classes, limits, base_tokens):
        steps[0] += 1
        plain = first <= steps[0] < last
        policy.dormant = plain and mode != "awake"
        return [0] * len(limits) if plain else list(limits)

    record = policy.record

    def counted(index, cls, width, accepted):
        every.append(accepted)
        if last <= steps[0] < last + args.window:
            window.append(accepted)
        record(index, cls, width, accepted)

    policy.plan, policy.pick, policy.record = plan, (lambda classes: cap), counted
    # Every draft verified: lengths the cost model cut (DSpark's choose()) follow step times.
    policy.choose = lambda keys, classes, limits, *rest: list(limits)
    leave_out = Request.leave_out_context
    if mode == "read":
        Request.leave_out_context = lambda self: None
    try:
        ids = [engine.tokenizer.encode(t).ids for t in prompts]
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                                ignore_eos=True)
        pending, live, outputs = list(range(len(ids))), set(), {}
        while pending or live:
            while pending and len(live) < args.batch:
                i = pending.pop(0)
                engine.add_request(RequestSpec(index=i, rid=str(i), prompt_ids=tuple(ids[i]),
                                               params=params))
                live.add(i)
            for out in engine.step():
                if out.finished:
                    live.discard(out.index)
                    outputs[out.index] = list(out.output_ids)
    finally:
        Request.leave_out_context = leave_out
        engine.shutdown()
    return {"window_rounds": len(window), "window_accepted": statistics.fmean(window),
            "rounds": len(every), "accepted": statistics.fmean(every), "steps": steps[0],
            "outputs": [outputs[i] for i in range(len(ids))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--algorithms", nargs="+", default=["DFLASH", "DSPARK"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--sleep", type=int, nargs=2, default=[40, 140], metavar=("FIRST", "END"))
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "bench_wake_acceptance.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    init_parallel_runtime(RunConfig(device="cpu"))
    prompts = load_prompts(str(BUILTIN_PROMPTS), args.num_prompts)[:args.num_prompts]
    cells = {}
    for algorithm in args.algorithms:
        runs = {mode: run(algorithm, mode, prompts, args) for mode in MODES}
        if args.temperature == 0:  # lossless: every mode commits plain greedy decoding's tokens
            assert all(r["outputs"] == runs["awake"]["outputs"] for r in runs.values())
        for mode, r in runs.items():
            r.pop("outputs")
            cells[f"{algorithm}/{mode}"] = r
            print(f"{algorithm:7s} {mode:6s} after the wake: {r['window_accepted']:.3f} accepted "
                  f"drafts per round ({r['window_rounds']} rounds); whole run {r['accepted']:.3f}"
                  f" ({r['rounds']} rounds, {r['steps']} steps)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": vars(args), "cpu": cpu_model(),
                                          "cells": cells}, indent=1) + "\n")


if __name__ == "__main__":
    main()
