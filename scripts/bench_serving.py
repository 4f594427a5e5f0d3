"""Decode-throughput benchmark: algorithms side by side in one run, through the engine API.

    python scripts/bench_serving.py [--model DIR --dflash DIR --dspark DIR] [--prompts FILE]
        [--num-prompts 128] [--min-waves 8] [--batches 16] [--temperatures 0 1] [--repeats 3]
        [--warmup 1] [--algorithms NONE NGRAM DFLASH DSPARK] [--noise-band BATCH ...]
        [--twins 1] [--max-new-tokens 64]
        [--out docs/bench/bench_serving.json] [--plot PNG (default: --out's name, .png)]

A world of one (tp1, CPU by default, --threads 1); several --batches run one process each, their
JSON merged (run_apart). For each algorithm and batch size one engine is built; for each
temperature and repeat the prompts run at a concurrency of `batch` (a new
request is added as soon as one finishes, as vLLM's --max-concurrency does; fixed waves that
drained to their slowest request penalised speculation, whose requests finish at different
steps), every algorithm's engine taking turns of TURN_S (1 s) with the others, so the noise of a
shared machine lands on all of them alike; each step is timed alone. --warmup passes (default
one) run first, unmeasured in the table and reported in the JSON: each engine's verify-length
policy learns online from plain decoding up, once per engine (a server pays it once at
start-up), and a 128-prompt repeat at batch 64 is only ~128 steps. The engine runs with
disable_mixed_chunk, so a step prefills or decodes, never both:
decode tok/s counts only the tokens and wall time of steps that prefilled nothing
(engine.last_step). Each number is the median of the repeats.
Decode throughput is also reported at full concurrency (full_tok_s, full_speedup_vs_none):
over the decode steps in which all `batch` slots decoded, i.e. without the last wave's drain.
Every request asks for the same number of tokens, so plain decoding's requests finish
together and it never drains, while a speculative engine's finish a few steps apart and its
last ~max_new_tokens / tau steps run part-empty (batch 64 greedy, 512 prompts, DSpark
verifying 1 draft: 6% of its decode time, a 2% lower ratio; scratch measurement). Both are
kept: decode tok/s is what a finite batch job of equal-length requests sees, the full figure
what a server holding `batch` requests sees. drafting_share is the part of decode time spent
in steps where some request drafted, drafting_vs_plain those steps' tokens/s over the plain
steps': at a cell where nothing pays, what a speculative engine's tries cost it. Greedy
outputs of every algorithm are checked against NONE's (lossless). Fewer than --num-prompts
prompts in the file are stretched by cutting each at earlier line ends (distinct, shorter
prompts).
A cell at batch b runs max(--num-prompts, --min-waves x b) prompts (the prompt list again
when the file has fewer), so a large batch is measured in its steady state, over enough turns.
--noise-band adds a second NONE engine (NONE/2) at the batches named: its ratio to NONE is
what the measurement itself scatters by, the band within which a ratio means nothing.
--twins K makes that K copies (NONE/2 .. NONE/K+1): with `--algorithms NONE` the run measures
the harness's own resolution, how far identical engines' medians fall from NONE's.
Defaults: the embedded tiny model, its drafts, the built-in held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dspark_launch.args import parse_bytes
from dspark_launch.engine.build import ASSETS, EngineArgs, build_engine
from dspark_launch.engine.gemm_choice import MODES as GEMM_MODES
from dspark_launch.engine.heap import freeze_heap
from dspark_launch.engine.inputs import BUILTIN_PROMPTS
from dspark_launch.engine.params import SamplingParams
from dspark_launch.engine.request import RequestSpec
from dspark_launch.models.layers.gemm import FIRST_SHAPES, NEVER
from dspark_launch.spec.policy import POLICIES


def twins(k: int) -> list[str]:
    """The names of k plain-decoding copies beside NONE: NONE/2, NONE/3, ..."""
    return [f"NONE/{i}" for i in range(2, k + 2)]


TWIN = twins(1)[0]  # a second plain-decoding engine: the noise band (--noise-band)


def embedded_engine(algorithm: str, batch: int):
    """The embedded model (and the algorithm's embedded draft) as the side scripts run it:
    the default adaptive policy, a 256 MiB KV budget, at most `batch` requests, and prefills
    in steps of their own (the benchmarks time decode steps only)."""
    return build_engine(EngineArgs(speculative_algorithm=algorithm,
                                   kv_cache_memory=parse_bytes("256MiB"),
                                   max_running_requests=batch, disable_mixed_chunk=True))


def cpu_model() -> str:
    """The CPU's model name (ratios move with it: a verify row's price is the GEMM kernel's)."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load_prompts(path: str, n: int) -> list[str]:
    base = [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line]
    out = list(base)
    cut = 1
    while len(out) < n and cut < 64:
        for text in base:
            lines = text.splitlines(keepends=True)
            if len(lines) > cut:
                out.append("".join(lines[:-cut]))
        cut += 1
    distinct = len(out)
    while len(out) < n:  # still short: the list again (sampled requests draw their own keys)
        out += out[:min(distinct, n - len(out))]
    return out[:n]


def drive(engine, prompts: list[list[int]], batch: int, params: SamplingParams,
          first_index: int):
    """All prompts through one engine at a concurrency of `batch` (a new request is added as
    soon as one finishes; the next step prefills it, in a step of its own:
    disable_mixed_chunk).
    A generator: it yields after every step, so several engines can take turns step by step
    (run_interleaved); each step's time is its own engine.step() alone. Returns the result."""
    decode_s = prefill_s = 0.0
    decode_tokens = total_tokens = 0
    # Decode steps at the cell's concurrency (every one of `batch` slots decoding): the
    # steady state, apart from the last wave's drain (see the module docstring).
    full_s, full_tokens = 0.0, 0
    # Decode steps in which some request drafted (the policy's arm or a try): where a
    # speculative engine's time at plain decoding goes, apart from its plain steps.
    drafting_s, drafting_tokens = 0.0, 0
    outputs: dict[int, tuple[int, ...]] = {}
    rounds: list[int] = []
    queue = list(enumerate(prompts))
    queue.reverse()

    def add(n: int) -> None:
        for _ in range(min(n, len(queue))):
            i, ids = queue.pop()
            engine.add_request(RequestSpec(first_index + i, str(first_index + i), tuple(ids),
                                           params))

    add(batch)
    pending = True  # added requests count in has_work once a step has carried them in
    while engine.has_work or pending:
        pending = False
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        new = sum(len(o.new_token_ids) for o in outs)
        total_tokens += new
        if engine.last_step.prefill_tokens:
            prefill_s += dt
        else:
            decode_s += dt
            decode_tokens += new
            if engine.last_step.drafted:
                drafting_s += dt
                drafting_tokens += new
            if engine.last_step.decode_requests == batch:
                full_s += dt
                full_tokens += new
        finished = [o for o in outs if o.finished]
        for o in finished:
            outputs[o.index - first_index] = o.output_ids
            rounds += o.accept_lens
        if finished and queue:
            add(len(finished))  # the next step carries them in and prefills them
            pending = True
        yield
    wall = decode_s + prefill_s
    plain_s, plain_tokens = decode_s - drafting_s, decode_tokens - drafting_tokens
    return {"decode_tok_s": decode_tokens / decode_s if decode_s else None,
            # share of decode time in drafting steps, and their speed over the plain steps'
            "drafting_share": drafting_s / decode_s if decode_s else None,
            "drafting_vs_plain": (drafting_tokens / drafting_s) / (plain_tokens / plain_s)
            if drafting_s and plain_s and plain_tokens else None,
            "full_tok_s": full_tokens / full_s if full_s else None, "full_s": full_s,
            "decode_s": decode_s, "prefill_s": prefill_s, "decode_tokens": decode_tokens,
            "output_tokens": total_tokens, "tok_s": total_tokens / wall, "wall_s": wall,
            "tau": sum(rounds) / len(rounds) if rounds else None,
            "outputs": [outputs[i] for i in range(len(prompts))]}


def run_concurrent(engine, prompts: list[list[int]], batch: int, params: SamplingParams,
                   first_index: int) -> dict:
    """drive() one engine to the end."""
    return run_interleaved({"one": engine}, prompts, batch, params, first_index)["one"]


# An engine runs this many seconds (one step at least) before the next takes its turn: turns
# of equal time, not of a fixed step count (32 steps were 0.25 s at batch 1, 1 s at batch 64).
# A turn's first steps find the CPU caches cold, and a drafting engine, with its draft model
# and draft pool, has more to reload: at batch 16 greedy, DFlash verifying 2 drafts ran 0.98x
# plain decoding in turns of 0.1 s and 1.06x in turns of 1 s (plain DFlash 0.98x and 0.99x),
# and a lone engine is always warm. Longer turns average a drifting machine over fewer turns.
TURN_S = 1.0


def run_interleaved(engines: dict, prompts: list[list[int]], batch: int,
                    params: SamplingParams, first_index: int, turn_s: float = TURN_S
                    ) -> dict[str, dict]:
    """Every engine runs the same prompts, taking turns of `turn_s` seconds: a slow spell of
    a shared machine lands on all of them alike (runs of a few seconds one after another
    differed by +-15% here), while each turn keeps its engine's weights in the CPU caches as
    a lone engine would (turns of one step made every step read them from memory). The
    order of turns rotates by one engine every round, so none always follows the same one.
    Each engine's requests get their own indices."""
    gens = {name: drive(engine, prompts, batch, params, first_index + k * len(prompts))
            for k, (name, engine) in enumerate(engines.items())}
    results: dict[str, dict] = {}
    order = list(gens)
    while order:
        for name in list(order):
            end = time.perf_counter() + turn_s
            try:
                next(gens[name])
                while time.perf_counter() < end:
                    next(gens[name])
            except StopIteration as stop:
                results[name] = stop.value
                order.remove(name)
        order = order[1:] + order[:1]
    return {name: results[name] for name in engines}


def side_by_side(names: list[str], batch: int, num_prompts: int, params: SamplingParams,
                 warmup: int, repeats: int, adjust: Callable[[str, object], None] | None = None):
    """The side scripts' harness: a spare NONE engine built first (the first engine built runs
    slower) and one embedded engine per name (its algorithm: the name up to any "/", then
    `adjust(name, engine)`), then `warmup` + `repeats` passes of run_interleaved over the
    built-in prompts, each with fresh request indices. Yields (pass, results), pass < 0 for a
    warm-up; every engine is shut down at the end."""
    spare = embedded_engine("NONE", batch)
    engines = {}
    for name in names:
        engines[name] = embedded_engine(name.split("/")[0], batch)
        if adjust is not None:
            adjust(name, engines[name])
    freeze_heap()
    texts = load_prompts(str(BUILTIN_PROMPTS), num_prompts)
    prompts = [spare.tokenizer.encode(t).ids for t in texts]
    try:
        for rep in range(-warmup, repeats):
            yield rep, run_interleaved(engines, prompts, batch, params,
                                       (rep + warmup) * len(names) * len(prompts))
    finally:
        for engine in [*engines.values(), spare]:
            engine.shutdown()


def median_of(runs: list[dict]) -> dict:
    keys = ("decode_tok_s", "full_tok_s", "decode_s", "full_s", "prefill_s", "tok_s", "wall_s",
            "tau", "drafting_share", "drafting_vs_plain")
    out = {k: statistics.median(x) if (x := [r[k] for r in runs if r[k] is not None]) else None
           for k in keys}
    out["runs"] = [{k: r[k] for k in keys} for r in runs]
    out["outputs"] = runs[0]["outputs"]
    return out


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(results)  # "batch 16, T=0"
    order = ["NONE", "NGRAM", "DFLASH", "DSPARK"]  # NONE's copies right after it
    names = sorted({a for g in results.values() for a in g},
                   key=lambda n: (order.index(n.split("/")[0]), n))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(groups))]
        ys = [results[g].get(name, {}).get("decode_tok_s") or 0 for g in groups]
        bars = ax.bar(xs, ys, width, label=name)
        for bar, g in zip(bars, groups):
            ratio = results[g].get(name, {}).get("speedup_vs_none")
            if ratio:
                ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                              bar.get_height()), ha="center", va="bottom",
                            fontsize=7)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(groups))])
    ax.set_xticklabels(groups)
    ax.set_ylabel("decode tokens / s (median)")
    ax.set_title("decode throughput (prefill excluded); labels: speedup over NONE")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _without(argv: list[str], names: set[str]) -> list[str]:
    """argv less the options `names` and their values (values: the tokens up to the next
    option)."""
    out, dropping = [], False
    for token in argv:
        if token.startswith("--"):
            dropping = token.split("=", 1)[0] in names
        if not dropping:
            out.append(token)
    return out


def run_apart(args, argv: list[str]) -> None:
    """Each batch size in a process of its own (this script with --batches <b>), the parts
    merged into one JSON and plot. Run in one process after batch 16, DFLASH and DSPARK read
    0.875-0.935x NONE at batch 64, at plain decoding, in every repeat, and 0.995-1.022x run
    alone (round 33, docs/bench/HISTORY.md; the cause is not known). A server builds its
    engine once, in a fresh process."""
    own = _without(argv, {"--batches", "--noise-band", "--out", "--plot"})
    merged: dict[str, dict] = {"results": {}, "warmup": {}, "ladders": {}}
    meta: dict | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batches:
            out = Path(tmp) / f"batch_{batch}.json"
            child = [sys.executable, __file__, *own, "--batches", str(batch), "--out", str(out),
                     "--plot", str(out.with_suffix(".png"))]
            if batch in args.noise_band:
                child += ["--noise-band", str(batch)]
            print(f"batch {batch}: {' '.join(child[1:])}", flush=True)
            if (rc := subprocess.run(child).returncode) != 0:
                sys.exit(f"bench_serving: the run of batch {batch} exited with {rc}")
            part = json.loads(out.read_text())
            for key, value in merged.items():
                value.update(part[key])
            if meta is None:
                meta = part["meta"]
            else:  # the per-batch fields
                for key in ("num_prompts", "gemm_from_rows", "onednn_compiles"):
                    meta[key].update(part["meta"][key])
                meta["distinct_prompts"] = max(meta["distinct_prompts"],
                                               part["meta"]["distinct_prompts"])
    meta["processes"] = "one per batch size"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, **merged}, indent=2))
    print(f"wrote {args.out}")
    plot(merged["results"], Path(args.plot) if args.plot else Path(args.out).with_suffix(".png"))


def main() -> None:
    # No abbreviations: run_apart() rewrites a run's own options for each batch size.
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--model", default=str(ASSETS / "target"))
    ap.add_argument("--dflash", default=str(ASSETS / "dflash"))
    ap.add_argument("--dspark", default=str(ASSETS / "dspark"))
    ap.add_argument("--prompts", default=str(BUILTIN_PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--min-waves", type=int, default=8,
                    help="a cell at batch b runs max(--num-prompts, min_waves * b) prompts: "
                    "128 prompts at batch 64 are two waves, ~130 steps of ramp and tail, and "
                    "~4 s per engine, i.e. four turns, too few for the machine's drift to "
                    "average out (per-repeat ratios of identical engines spread +-9%%)")
    ap.add_argument("--noise-band", type=int, nargs="*", default=[],
                    help="batches at which a second NONE engine (NONE/2) runs beside the "
                    "others: its ratio to NONE is the cell's own measurement noise")
    ap.add_argument("--twins", type=int, default=1,
                    help="NONE copies at the --noise-band batches (NONE/2 .. NONE/K+1): "
                    "identical engines, whose medians' spread is the harness's resolution")
    ap.add_argument("--batches", type=int, nargs="+", default=[16])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1,
                    help="unmeasured passes over the prompts before the repeats (each "
                    "engine's policy learns online once, as a server's does at start-up)")
    ap.add_argument("--algorithms", nargs="+", default=["NONE", "NGRAM", "DFLASH", "DSPARK"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--speculative-policy", choices=POLICIES, default="adaptive",
                    help="verify-length policy of every speculative algorithm")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--cpu-gemm", default="auto", choices=GEMM_MODES,
                    help="every engine's CPU GEMM (engine/gemm_choice.py)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (default 1: on a small or shared CPU more threads "
                    "mostly spin against each other)")
    ap.add_argument("--out", default="docs/bench/bench_serving.json")
    ap.add_argument("--plot", default=None,
                    help="the plot's path (default: --out's, with .png: a run's JSON and plot "
                    "stay together)")
    args = ap.parse_args()
    if args.noise_band and "NONE" not in args.algorithms:
        ap.error("--noise-band compares a second NONE engine with NONE: add NONE to "
                 f"--algorithms (got {' '.join(args.algorithms)})")
    if missing := sorted(set(args.noise_band) - set(args.batches)):
        ap.error(f"--noise-band {missing}: not among --batches {args.batches}")
    if args.twins < 1:
        ap.error(f"--twins {args.twins}: the noise band needs at least one NONE copy (>= 1)")
    if len(args.batches) > 1:
        run_apart(args, sys.argv[1:])
        return
    torch.set_num_threads(args.threads)

    from dspark_launch.args import resolve_config
    from dspark_launch.parallel import destroy_parallel_runtime, init_parallel_runtime

    init_parallel_runtime(resolve_config(["--device", args.device], world_size=1))

    def cell_prompts(batch: int) -> int:
        return max(args.num_prompts, args.min_waves * batch)

    texts = load_prompts(args.prompts, max(cell_prompts(b) for b in args.batches))
    results: dict[str, dict] = {}
    index = 0
    runs: dict[tuple[str, str], list[dict]] = {}  # (group, algorithm) -> one per repeat
    ladders: dict[str, dict] = {}  # batch -> algorithm -> the verify ladders at the end
    counts: dict[str, int] = {}  # batch -> prompts per repeat
    warmups: dict[str, dict] = {}  # group -> algorithm -> each warm-up pass
    gemms: dict[str, dict] = {}  # batch -> algorithm -> oneDNN from rows (None: never)
    # batch -> the oneDNN shapes this process made, and their compiles' seconds (left out of
    # every step's time the policies learn from, in the decode times here: gemm.FirstShapes)
    compiles: dict[str, dict] = {}
    try:
        for batch in args.batches:
            def build(algorithm: str, batch: int = batch):
                return build_engine(EngineArgs(
                    model=args.model, draft={"DFLASH": args.dflash, "DSPARK": args.dspark}.get(
                        algorithm), speculative_algorithm=algorithm,
                    block_size=args.block_size, attention_backend=args.attention_backend,
                    kv_cache_memory=parse_bytes(args.kv_cache_memory),
                    max_running_requests=batch, speculative_policy=args.speculative_policy,
                    disable_mixed_chunk=True, cpu_gemm=args.cpu_gemm))

            # The first engine built was 1.1-2.4% slower than identical copies built after
            # it, however the turns ran (three NONE engines, batch 1 and 64); with one more
            # engine built before them and kept, the three agreed within 0.5%. So a spare
            # engine takes that place, and NONE is measured like every other engine.
            spare = build("NONE")
            names = list(args.algorithms)
            if batch in args.noise_band and "NONE" in names:
                at = names.index("NONE") + 1
                names[at:at] = twins(args.twins)
            engines = {name: build(name.split("/")[0]) for name in names}
            freeze_heap()  # as the CLI job and the server do; undone by shutdown()
            n_prompts = cell_prompts(batch)
            prompts = [engines[args.algorithms[0]].tokenizer.encode(t).ids
                       for t in texts[:n_prompts]]
            counts[f"batch {batch}"] = n_prompts
            # Warm-up passes first (rep < 0), unmeasured in the table (reported in the JSON):
            # the policy learns online, from plain decoding up, once per engine, as a server
            # does once at start-up; the repeats then measure the engine as it runs. Repeats
            # outermost and the algorithms next to each other inside one, so a slow spell of
            # a shared machine lands on all of them, not on one algorithm's runs.
            for rep in range(-args.warmup, args.repeats):
                for temp in args.temperatures:
                    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=temp)
                    group = f"batch {batch}, T={temp:g}"
                    done = run_interleaved(engines, prompts, batch, params, index)
                    index += len(engines) * len(prompts)
                    first = done[args.algorithms[0]]["decode_tok_s"]
                    for algorithm, r in done.items():
                        if rep < 0:
                            warmups.setdefault(group, {}).setdefault(algorithm, []).append(
                                {k: r[k] for k in ("decode_tok_s", "tau")}
                                | {"vs_first": r["decode_tok_s"] / first if first else None})
                        else:
                            runs.setdefault((group, algorithm), []).append(r)
                        label = f"warm-up {args.warmup + rep}" if rep < 0 else f"repeat {rep}"
                        print(f"{label} {group} {algorithm:7s} decode "
                              f"{r['decode_tok_s'] or 0:8.1f} tok/s  all {r['tok_s']:8.1f} "
                              f"tok/s  tau {r['tau'] or 0:.2f}  drafting "
                              f"{100 * (r['drafting_share'] or 0):5.2f}% of decode",
                              flush=True)
            # Where each ladder ended (per request class): what the policy settled on.
            ladders[f"batch {batch}"] = {name: engine.policy.report()["ladders"]
                                         for name, engine in engines.items()
                                         if getattr(engine, "policy", None) is not None}
            gemms[f"batch {batch}"] = {
                name: None if engine.gemm_from_rows == NEVER else
                {"kernel": engine.gemm_kernel, "from_rows": engine.gemm_from_rows}
                for name, engine in engines.items()}
            compiles[f"batch {batch}"] = {"shapes": len(FIRST_SHAPES.seen),
                                          "seconds": round(FIRST_SHAPES.seconds, 3)}
            for engine in [*engines.values(), spare]:
                engine.shutdown()
    finally:
        destroy_parallel_runtime()
    for (group, algorithm), rs in runs.items():
        results.setdefault(group, {})[algorithm] = median_of(rs)
    for group, by_alg in results.items():
        base = runs.get((group, "NONE"))
        for algorithm, r in by_alg.items():
            mine = runs[(group, algorithm)]
            for field, key in (("decode_tok_s", "speedup_vs_none"),
                               ("full_tok_s", "full_speedup_vs_none")):
                if base and all(x[field] for x in mine + base):
                    # Paired: each repeat against NONE's run of the same repeat, the median.
                    r[key] = statistics.median(x[field] / b[field] for x, b in zip(mine, base))
            if base and group.endswith("T=0"):
                r["lossless_vs_none"] = all(x["outputs"] == b["outputs"]
                                            for x, b in zip(mine, base))
        for r in by_alg.values():
            r.pop("outputs", None)
    # NONE at T=1 against NONE at T=0, per batch (issue 14: the sampler's overhead).
    for batch in args.batches:
        t0 = results.get(f"batch {batch}, T=0", {}).get("NONE")
        t1 = results.get(f"batch {batch}, T=1", {}).get("NONE")
        if t0 and t1 and t0["decode_tok_s"] and t1["decode_tok_s"]:
            t1["t1_over_t0"] = t1["decode_tok_s"] / t0["decode_tok_s"]
            print(f"batch {batch}: NONE decode at T=1 / T=0 = {t1['t1_over_t0']:.2f}")
    print("\ngroup            algorithm  decode tok/s   tau   vs NONE  at full  lossless")
    for group, by_alg in results.items():
        for name, r in by_alg.items():
            tau = f"{r['tau']:.2f}" if r.get("tau") else "  - "
            print(f"{group:16s} {name:9s} {r['decode_tok_s'] or 0:10.1f}  {tau:>5}  "
                  f"{r.get('speedup_vs_none', 0):6.2f}x  {r.get('full_speedup_vs_none', 0):6.2f}x"
                  f"  {r.get('lossless_vs_none', '-')}")
    meta = {"cpu": f"{cpu_model()} x{os.cpu_count()}", "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
            "num_prompts": counts, "distinct_prompts": len(set(texts)),
            "repeats": args.repeats, "warmup": args.warmup,
            "model": args.model,
            "speculative_policy": args.speculative_policy, "cpu_gemm": args.cpu_gemm,
            "gemm_from_rows": gemms, "onednn_compiles": compiles,
            "statistic": "median of repeats; decode = steps that prefilled nothing; full = "
                         "decode steps with every one of the batch's slots decoding"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results,
                                          "warmup": warmups, "ladders": ladders}, indent=2))
    print(f"wrote {args.out}")
    plot(results, Path(args.plot) if args.plot else Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
