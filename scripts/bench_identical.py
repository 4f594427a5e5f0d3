"""A check of bench_serving's harness: identical engines side by side should run alike.

Builds `--copies` engines of one algorithm (NONE by default), optionally after a spare engine
that is kept but never run, and drives them through bench_serving.run_interleaved exactly as
the benchmark does. Prints each copy's decode speed over the first copy's, per repeat, and
their spread. Round 7 found with it that the first engine built ran 1.1-2.4% slower than the
copies built after it (`--no-spare`), and that the spread grows with the turn length at
batch 64 (`--turn-s`).

    python scripts/bench_identical.py --batch 1 --num-prompts 32 --repeats 3 --no-spare
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from bench_serving import TURN_S, embedded_engine, load_prompts, run_interleaved

from dspark_launch.engine.inputs import BUILTIN_PROMPTS
from dspark_launch.engine.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--algorithm", default="NONE", choices=("NONE", "NGRAM"))
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--turn-s", type=float, default=TURN_S)
    ap.add_argument("--no-spare", action="store_true",
                    help="build no spare engine first (the first copy is then the first built)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from dspark_launch.args import resolve_config
    from dspark_launch.parallel import destroy_parallel_runtime, init_parallel_runtime

    init_parallel_runtime(resolve_config(["--device", "cpu"], world_size=1))

    try:
        spare = None if args.no_spare else embedded_engine(args.algorithm, args.batch)
        engines = {f"copy {i}": embedded_engine(args.algorithm, args.batch)
                   for i in range(args.copies)}
        texts = load_prompts(str(BUILTIN_PROMPTS), args.num_prompts)
        prompts = [engines["copy 0"].tokenizer.encode(t).ids for t in texts]
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature)
        logs: dict[str, list[float]] = {}
        for rep in range(args.repeats):
            done = run_interleaved(engines, prompts, args.batch, params, rep * 100_000,
                                   turn_s=args.turn_s)
            base = done["copy 0"]["decode_tok_s"]
            for name, r in done.items():
                if name != "copy 0":
                    logs.setdefault(name, []).append(math.log(r["decode_tok_s"] / base))
            print(f"repeat {rep}: copy 0 {base:.1f} tok/s; over it: " + ", ".join(
                f"{name} {math.exp(v[-1]):.3f}" for name, v in logs.items()), flush=True)
        every = [x for v in logs.values() for x in v]
        print(f"log ratio to copy 0: mean {statistics.mean(every):+.4f}, "
              f"sd {statistics.pstdev(every):.4f} over {len(every)} (spare engine: "
              f"{'no' if spare is None else 'yes'}, turns of {args.turn_s} s)")
        for engine in [*engines.values(), *([spare] if spare else [])]:
            engine.shutdown()
    finally:
        destroy_parallel_runtime()


if __name__ == "__main__":
    main()
