"""The run's CPU GEMM (models/layers/gemm.py): torch's default, or oneDNN's packed weights from
some row count up, chosen by timing the real forward at start-up.

`--cpu-gemm auto` packs every projection of the target and the draft (unless the copies
would take more than RAM_SHARE of MemAvailable on some rank), then times the target
forward plus its greedy LM head (engine/warmup.py: profile_forward, shaped like a decode step)
at a few token counts with each kernel, alternating, the fastest of REPEATS each. The packed
kernel takes over from the smallest count at which it was faster by MARGIN there and at every
larger count measured; where it never was, the packed copies are dropped. The inputs are rank
0's timings, so every rank (and every rank of an attention-TP group, whose replicated parts
must round alike) takes the same choice; it is cached per machine like the cost curve.

Measured in the model, not on the projections alone: in one scratch run (AMD EPYC, one
thread, min of 15) oneDNN ran the embedded target's 33 one-row projections alone in 1.19 ms
against MKL's 2.11 ms, yet the whole one-token forward took 4.27 ms with it against 4.12 ms
without. Every count from 1 to 4 is timed, and 16 and 64 above them (each count costs
2 + 2 x REPEATS forwards on every rank at start-up). Timed only at 1, 4, 16 and 64, a 3-token
forward kept MKL, 19% slower there (5.77 against 4.85 ms, min of 15): a verify block of 3
rows cost more than one of 5 (at batch 1, T=1, DFlash verifying 2 drafts took 10.2 ms a
step, 4 drafts 8.8 ms), and the ladder, which climbs from plain decoding through caps 1 and
2, never reached cap 4, where DFlash ran 1.15x plain decoding (it stayed at plain, 0.985x).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from dspark_launch import disk_cache
from dspark_launch.comm import all_gather_object, broadcast_object
from dspark_launch.engine.warmup import conditions, profile_forward
from dspark_launch.errors import ConfigError
from dspark_launch.log import logger
from dspark_launch.memory.budget import mem_available_bytes
from dspark_launch.models.layers import PackPlan, pack_model, packable_bytes, unpack_model
from dspark_launch.models.layers.gemm import NEVER
from dspark_launch.parallel import get_parallel

MODES = ("auto", "torch", "onednn")
POINTS = (1, 2, 3, 4, 16, 64)  # token counts timed (those the pools can hold)
REPEATS = 3  # timed forwards per kernel and count (after one warm-up each), alternating
MARGIN = 0.03  # the packed kernel must be this much faster (ties keep torch's: no copy)
VERSION = 1  # of the cached file
# auto packs nothing when the copies would take more than this share of MemAvailable on some
# rank: they are outside the KV budget (memory/budget.py leaves the RAM it does not share
# out to the weights), and a model that fits once must not fail at start-up for a faster GEMM.
RAM_SHARE = 0.2


def from_rows(times: dict[int, tuple[float, float]], margin: float = MARGIN) -> int:
    """(torch seconds, packed seconds) per token count -> the smallest count from which the
    packed kernel is faster by `margin` at every count measured (NEVER: at none)."""
    chosen = NEVER
    for n in sorted(times, reverse=True):
        plain, packed = times[n]
        if not packed < plain * (1 - margin):
            break
        chosen = n
    return chosen


def measure(run: Callable[[int], None], plan: PackPlan, points: Sequence[int],
            repeats: int = REPEATS, clock: Callable[[], float] = time.perf_counter
            ) -> dict[int, tuple[float, float]]:
    """Time run(n) on each kernel: one warm-up each, then `repeats` alternating pairs; the
    fastest of each (a shared machine's noise only ever adds time). The number of forwards
    is fixed, so every rank runs the same collectives."""
    times = {}
    for n in points:
        runs: dict[int, list[float]] = {NEVER: [], 1: []}
        for rows in runs:  # warm-up: first-touch allocations, oneDNN's primitive cache
            plan.from_rows = rows
            run(n)
        for _ in range(repeats):
            for rows, took in runs.items():
                plan.from_rows = rows
                t0 = clock()
                run(n)
                took.append(clock() - t0)
        times[n] = (min(runs[NEVER]), min(runs[1]))
    return times


def choose_gemm(engine, mode: str, clock: Callable[[], float] = time.perf_counter
                ) -> tuple[int, str]:
    """Pack the engine's models (dropping any earlier copies) and set their shared plan and
    engine.gemm_from_rows, on every rank -> (from_rows, where it came from: 'torch',
    'onednn', 'cache', 'measured', 'memory' or 'failed': packing failed on some rank)."""
    if mode not in MODES:
        raise ConfigError(f"--cpu-gemm={mode!r}: expected one of {', '.join(MODES)}")
    models = [engine.target] + ([engine.proposer.draft]
                                if getattr(engine.proposer, "draft", None) is not None else [])
    for model in models:
        unpack_model(model)
    rows, source = _choose(engine, mode, models, clock)
    if rows == NEVER:
        for model in models:
            unpack_model(model)
    engine.gemm_from_rows = rows
    return rows, source


def _choose(engine, mode: str, models: list, clock: Callable[[], float]) -> tuple[int, str]:
    if mode == "torch":
        return NEVER, "torch"
    copy = sum(packable_bytes(model) for model in models)
    if not copy:
        if mode == "onednn":
            raise ConfigError(
                f"--cpu-gemm onednn packs CPU weights in float32 (or bfloat16 on a CPU with "
                f"bf16 instructions) with a torch built with oneDNN (available: "
                f"{torch.backends.mkldnn.is_available()}); this run's are "
                f"{engine.target.dtype} on {engine.device}; use --cpu-gemm auto or torch")
        return NEVER, "torch"
    if mode == "auto" and any(all_gather_object(copy > RAM_SHARE * mem_available_bytes())):
        # The copy is outside every budget: a model this large keeps torch's kernel.
        return NEVER, "memory"
    plan = PackPlan()
    failed = {rank: message for rank, message in
              enumerate(all_gather_object(_pack(models, plan))) if message is not None}
    if failed:
        for model in models:
            unpack_model(model)
        where = "; ".join(f"rank {rank}: {message}" for rank, message in failed.items())
        if mode == "onednn":
            raise ConfigError(f"--cpu-gemm onednn: packing the weights for oneDNN failed on "
                              f"{where}; use --cpu-gemm torch")
        logger.warning("cpu gemm: packing the weights for oneDNN failed on %s; torch's GEMM "
                       "on every rank", where)
        return NEVER, "failed"
    if mode == "onednn":
        plan.from_rows = 1
        return 1, "onednn"
    plan.from_rows, source = _measured(engine, plan, clock)
    return plan.from_rows, source


def _pack(models: list, plan: PackPlan) -> str | None:
    """Pack every model on this rank -> None, or what failed (oneDNN's reorder out of memory,
    say). Every rank learns of any rank's failure before the timed forwards, whose
    collectives would otherwise leave the others waiting until --dist-timeout."""
    try:
        for model in models:
            pack_model(model, plan)
    except (RuntimeError, MemoryError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _points(engine) -> list[int]:
    """The counts a decode-shaped forward can lay out: in at most max_running requests of one
    block each, within a request's context and the free pages (every count, whatever the
    batch: prefill chunks forward many rows at batch 1 too)."""
    space, out = engine.space, []
    for n in POINTS:
        block = _block(engine, n)
        pages = -(-n // block) * -(-block // space.page_size)
        if block <= space.max_context_len and pages <= space.allocator.num_free_pages:
            out.append(n)
    return out or [1]


def _block(engine, n: int) -> int:
    """Tokens per request of an n-token measuring forward: verify blocks, in as many requests
    as the batch may hold."""
    return max(1 + engine.proposer.max_drafts, -(-n // engine.limits.max_running))


def _measured(engine, plan: PackPlan, clock: Callable[[], float]) -> tuple[int, str]:
    """from_rows for this machine: rank 0's cached choice ('cache'), or every rank's forwards
    timed and rank 0's timings taken ('measured')."""
    state = get_parallel()
    points = _points(engine)
    # No drafter in the key: which kernel wins is the target's rows', so every engine of a
    # machine, topology and target takes one choice (a benchmark's engines compare alike).
    machine = {"version": VERSION, **conditions(engine), "points": points}
    directory, key = disk_cache.cache_dir("gemm"), disk_cache.cache_key(machine)
    cached = broadcast_object(_cached_rows(directory, key) if state.rank == 0 else None)
    if cached is not None:
        return cached, "cache"

    @torch.inference_mode()  # as the step runs (Engine.step)
    def run(n: int) -> None:
        engine.target.greedy(profile_forward(engine, n, _block(engine, n)))

    times = broadcast_object(measure(run, plan, points, clock=clock))
    rows = from_rows(times)
    if state.rank == 0:
        disk_cache.write_json(directory, key, {
            "from_rows": rows, "machine": machine,
            "ms": {n: [round(1e3 * s, 4) for s in pair] for n, pair in times.items()}})
        logger.info("cpu gemm: %s", ", ".join(
            f"{n} tokens torch {1e3 * a:.2f} / onednn {1e3 * b:.2f} ms"
            for n, (a, b) in times.items()))
    return rows, "measured"


def _cached_rows(directory, key: str) -> int | None:
    """A stored from_rows, if it is one (a count >= 1, or NEVER); else None: measure again."""
    data = disk_cache.read_json(directory, key)
    rows = None if data is None else data.get("from_rows")
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1 else None
