"""What running the step in torch.inference_mode (Engine.step) gains over no_grad alone.

    python scripts/bench_grad_mode.py [--batch 1] [--temperature 0] [--num-prompts 128]
        [--repeats 3] [--algorithms NONE DSPARK] [--out docs/bench/bench_grad_mode.json]

Each algorithm runs twice, side by side: as the engine runs it (ALG) and with the step as it
was before inference mode (ALG/grad: the same step under the models' own no_grad only). The
same harness as scripts/bench_serving.py: a spare engine built first, engines taking turns of
bench_serving.TURN_S, a warm-up pass, decode time only, medians over repeats. Both engines
time their start-up forwards (GEMM choice, cost curve) in inference mode: ALG/grad's policy
corrects its curve from its own step times as it runs.

Reported per algorithm: ALG / ALG/grad (the gain), and, where NONE runs, each engine's ratio to
the NONE of its own mode (what a speculative ratio reads in either mode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import types
from pathlib import Path

import torch
from bench_serving import cpu_model, side_by_side

from dspark_launch.engine.engine import Engine
from dspark_launch.engine.params import SamplingParams

GRAD = "/grad"  # the suffix of an engine whose step runs under no_grad only


def step_without_inference_mode(engine) -> None:
    """This engine's step() as it ran before: the undecorated step (torch's decorator keeps
    it as __wrapped__), its models still under their own no_grad."""
    engine.step = types.MethodType(Engine.step.__wrapped__, engine)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--algorithms", nargs="+", default=["NONE", "DSPARK"],
                    choices=("NONE", "NGRAM", "DFLASH", "DSPARK"))
    ap.add_argument("--out", default="docs/bench/bench_grad_mode.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from dspark_launch.args import resolve_config
    from dspark_launch.parallel import destroy_parallel_runtime, init_parallel_runtime

    init_parallel_runtime(resolve_config(["--device", "cpu"], world_size=1))

    names = [n for a in args.algorithms for n in (a, a + GRAD)]
    tok_s: dict[str, list[float]] = {n: [] for n in names}
    try:
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature)

        def adjust(name: str, engine) -> None:
            if name.endswith(GRAD):
                step_without_inference_mode(engine)

        for rep, done in side_by_side(names, args.batch, args.num_prompts, params, args.warmup,
                                      args.repeats, adjust):
            if rep >= 0:
                for name, r in done.items():
                    tok_s[name].append(r["decode_tok_s"])
            label = "warm-up" if rep < 0 else f"repeat {rep}"
            print(f"{label}: " + ", ".join(f"{n} {r['decode_tok_s']:.1f}"
                                           for n, r in done.items()) + " decode tok/s",
                  flush=True)
    finally:
        destroy_parallel_runtime()

    def ratio(a: str, b: str) -> dict:
        per = [x / y for x, y in zip(tok_s[a], tok_s[b])]
        return {"median": statistics.median(per), "runs": per}

    results = {}
    for a in args.algorithms:
        results[a] = {"decode_tok_s": statistics.median(tok_s[a]),
                      "grad_decode_tok_s": statistics.median(tok_s[a + GRAD]),
                      "runs": tok_s[a], "grad_runs": tok_s[a + GRAD],
                      "gain": ratio(a, a + GRAD)}
        if "NONE" in args.algorithms and a != "NONE":
            results[a]["vs_none"] = ratio(a, "NONE")
            results[a]["grad_vs_none"] = ratio(a + GRAD, "NONE" + GRAD)
        line = (f"{a:7s} {results[a]['decode_tok_s']:8.1f} tok/s, no_grad only "
                f"{results[a]['grad_decode_tok_s']:8.1f}: gain "
                f"{results[a]['gain']['median']:.3f}x")
        if "vs_none" in results[a]:
            line += (f"; over NONE {results[a]['vs_none']['median']:.3f}x "
                     f"(no_grad only: {results[a]['grad_vs_none']['median']:.3f}x)")
        print(line)
    out = {"meta": {"cpu": cpu_model(), "torch": torch.__version__, **vars(args)},
           "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
