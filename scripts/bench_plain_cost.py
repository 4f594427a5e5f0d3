"""What being a speculative engine costs where speculation does not pay, and what each fixed
verify cap would make of the cell.

    python scripts/bench_plain_cost.py [--batch 64] [--temperature 1] [--num-prompts 512]
        [--repeats 3] [--algorithms NGRAM DFLASH] [--caps 0 2 4m ...]
        [--out docs/bench/bench_plain_cost.json]

Beside NONE and its twin NONE/2 (the noise band), each algorithm runs twice: as the benchmark
runs it (the adaptive policy, whose verify ladder explores) and pinned to plain decoding
(ALG/plain: every step plans no draft and is dormant, so the draft's context is never written;
what is left is the engine's own per-step work: the policy's planning and bookkeeping). The
same harness as scripts/bench_serving.py: a spare engine built first, engines taking turns of
bench_serving.TURN_S, a warm-up pass, decode time only, each repeat's ratio to NONE, medians.

ALG/plain against NONE/2 is the engine's per-step cost; ALG against ALG/plain what its ladder's
tries, its wakes for them and the drains they leave cost. Where both are inside the band NONE/2
draws, the cell measures no cost at this precision.

--caps adds, per algorithm and cap c >= 1, ALG/c: pinned to the ladder's arm "at most c drafts
per request, every request" for every step (no tries, no model). The best of them is what the
ladder could reach in the cell at best with one arm (its arms are these caps, and the model
within them): a cell where no ALG/c clears NONE/2's band is a tie at plain decoding for any
fixed verify length on this machine, and one where some ALG/c beats ALG by more than the band
is speed the ladder left. ALG/cm (e.g. --caps 4m) pins the ladder's other arm at that cap: the
cost model chooses each request's drafts within c. Each pinned engine's verify lengths go into
the JSON (verified_lengths: request-rounds per number of drafts verified), and a run in which
one exceeded its cap writes nothing. Each ALG engine's ladders go in too (`ladders`: where
each ended, and its path of moves).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from bench_serving import TWIN, cpu_model, side_by_side

from dspark_launch.engine.params import SamplingParams
from dspark_launch.spec.ladder import Ladder

PLAIN = "/plain"  # the suffix of an engine pinned to plain decoding


def pin(engine, cap: int, model: bool = False) -> None:
    """Every step of this engine plays one arm of the ladder. At cap 0 no step drafts and each
    is dormant, its rows left out of the draft's context (what a ladder settled at plain
    decoding does between tries, for ever). At cap c >= 1 each request verifies at most c
    drafts: every ladder of the policy is a one-arm ladder at (c, model) that never moves,
    so the step runs the policy's own planning and bookkeeping of that arm (model off: every
    request verifies c; on: the cost model chooses within c)."""
    policy = engine.policy
    if cap == 0:
        # Not a one-arm ladder at cap 0: a ladder goes dormant only when no neighbour is due
        # (Ladder.quiet), and one without neighbours never would; its rows would be written.
        def plan(keys, classes, limits, base_tokens):
            policy.dormant = True
            return [0] * len(keys)

        policy.pick = lambda classes: 0
        policy.plan = plan
        return
    ladders: dict[str, Ladder] = {}
    policy._ladder = lambda cls, requests: ladders.setdefault(cls, Ladder.single(cap, model))


def write_medians(names: list[str], ratios: dict[str, list[float]],
                  taus: dict[str, list[float]], out: dict, path: str) -> None:
    """Print each engine's median ratio to NONE, its tau and its repeats; `out` as JSON."""
    width = max(map(len, names))
    for n in names:
        print(f"{n:{width}s} median {statistics.median(ratios[n]):.3f}x NONE, "
              f"tau {statistics.median(taus[n]):.2f}  "
              f"(per repeat {' / '.join(f'{x:.3f}' for x in ratios[n])})")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


def pinned_arm(name: str) -> tuple[int, bool] | None:
    """ALG/plain -> (0, False), ALG/c -> (c, False), ALG/cm -> (c, True); None for an engine
    that runs as the benchmark runs it."""
    if name.endswith(PLAIN):
        return 0, False
    tail = name.partition("/")[2]
    if name.startswith("NONE") or not tail.removesuffix("m").isdigit():
        return None
    return int(tail.removesuffix("m")), tail.endswith("m")


def arm_name(text: str) -> str:
    """A --caps entry ("0", "4" or "4m": cap 4 with the model) as its engines' suffix."""
    cap = text.removesuffix("m")
    if not cap.isdigit() or (text.endswith("m") and int(cap) == 0):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a cap is a number of drafts, 0 (plain) or more, and 'm' after one "
            f"of 1 or more pins the cost model within it (e.g. 4m)")
    return PLAIN if int(cap) == 0 else f"/{int(cap)}{'m' if text.endswith('m') else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--algorithms", nargs="+", default=["NGRAM", "DFLASH"],
                    choices=("NGRAM", "DFLASH", "DSPARK"))
    ap.add_argument("--caps", nargs="+", type=arm_name, default=[PLAIN],
                    help="pinned arms per algorithm (0: ALG/plain; c >= 1: ALG/c, every "
                         "request verifies c; cm: ALG/cm, the cost model within c)")
    ap.add_argument("--out", default="docs/bench/bench_plain_cost.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from dspark_launch.args import resolve_config
    from dspark_launch.parallel import destroy_parallel_runtime, init_parallel_runtime

    init_parallel_runtime(resolve_config(["--device", "cpu"], world_size=1))

    names = ["NONE", TWIN] + [n for a in args.algorithms for n in
                              (a, *(a + c for c in dict.fromkeys(args.caps)))]
    ratios: dict[str, list[float]] = {n: [] for n in names}
    drafting: dict[str, list[float]] = {n: [] for n in names}
    taus: dict[str, list[float]] = {n: [] for n in names}
    pinned: dict[str, object] = {}  # name -> its engine (its policy's metrics outlive it)
    adaptive: dict[str, object] = {}  # the engines that run as the benchmark runs them
    try:
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature)

        def adjust(name: str, engine) -> None:  # NONE/2 is a NONE engine, ALG/c an ALG one
            if (arm := pinned_arm(name)) is not None:
                pin(engine, *arm)
                pinned[name] = engine
            elif engine.policy is not None:
                adaptive[name] = engine

        for rep, done in side_by_side(names, args.batch, args.num_prompts, params, args.warmup,
                                      args.repeats, adjust):
            base = done["NONE"]["decode_tok_s"]
            line = []
            for name, r in done.items():
                if rep >= 0:
                    ratios[name].append(r["decode_tok_s"] / base)
                    drafting[name].append(r["drafting_share"] or 0.0)
                    taus[name].append(r["tau"] or 1.0)
                line.append(f"{name} {r['decode_tok_s'] / base:.3f}")
            label = "warm-up" if rep < 0 else f"repeat {rep}"
            print(f"{label}: NONE {base:.1f} tok/s; over it: " + ", ".join(line[1:]),
                  flush=True)
    finally:
        destroy_parallel_runtime()
    # Each pinned engine's drafts verified per request-round, warm-up included: the check
    # that the pin held (a round may verify fewer near max_tokens, never more).
    lengths = {n: dict(sorted(e.policy.metrics.lengths.items())) for n, e in pinned.items()}
    for n, seen in lengths.items():
        if max(seen, default=0) > pinned_arm(n)[0]:
            raise SystemExit(f"{n}: a round verified {max(seen)} drafts, above its cap "
                             f"{pinned_arm(n)[0]} (lengths {seen}): the pin did not hold; "
                             f"nothing written")
    out = {"meta": {"cpu": cpu_model(), "torch": torch.__version__, **vars(args)},
           "results": {n: {"speedup_vs_none": statistics.median(ratios[n]),
                           "runs": ratios[n], "drafting_share": drafting[n],
                           "tau": statistics.median(taus[n]),
                           **({"verified_lengths": lengths[n]} if n in lengths else {})}
                       for n in names},
           # where each adaptive engine's ladders ended, and the path of moves there
           "ladders": {n: e.policy.report()["ladders"] for n, e in adaptive.items()}}
    write_medians(names, ratios, taus, out, args.out)


if __name__ == "__main__":
    main()
