"""The run's CPU GEMM (models/layers/gemm.py): torch's default, or from some row count up a
second copy of the weights for a faster kernel (oneDNN's packed layout, or the weights
transposed), chosen by timing the real forward at start-up.

`--cpu-gemm auto` (unless a copy would take more than RAM_SHARE of MemAvailable on some rank)
gives every projection of the target and the draft one kernel's copy at a time, and times the
target forward plus its greedy LM head (engine/warmup.py: profile_forward, shaped like a
decode step) at a few token counts on torch's GEMM and on the copy, in REPEATS alternating
pairs, the median of each. A kernel faster by MARGIN at the largest count takes over from the
count that saves the largest sum of time fractions over the counts from it up, among those
from which it is nowhere slower by MARGIN (from_rows); of the kernels that take over
anywhere, the one that saves the most there keeps its copy (pick_kernel), and where none does
no copy is kept. The inputs are rank 0's timings, so every rank (and every rank of an
attention-TP group, whose replicated parts must round alike) takes the same choice; it is
cached per machine like the cost curve.

Medians of 8 pairs, and ties inside a winning run: on this Intel Xeon (one thread) the fastest
of 3 timed forwards each, a tie at one count ending the run, put the transposed copy from 4,
16 and 64 rows in three start-ups within an hour (scratch), while 45 alternating forwards at
each count ran it 5% faster than torch's at 1 token, level at 2, 6-7% faster at 3 and 4
(contexts of 0 and 150 tokens, scratch): a lone tie, or one count's noise, handed every count
below it to the slower kernel.

Measured in the model, not on the projections alone: in one scratch run (AMD EPYC, one
thread, min of 15) oneDNN ran the embedded target's 33 one-row projections alone in 1.19 ms
against MKL's 2.11 ms, yet the whole one-token forward took 4.27 ms with it against 4.12 ms
without. Every count from 1 to 4 is timed, and 16 and 64 above them (each count costs
2 + 2 x REPEATS forwards per kernel on every rank at start-up). Timed only at 1, 4, 16 and 64,
a 3-token forward kept MKL, 19% slower there (5.77 against 4.85 ms, min of 15): a verify
block of 3 rows cost more than one of 5 (at batch 1, T=1, DFlash verifying 2 drafts took
10.2 ms a step, 4 drafts 8.8 ms), and the ladder, which climbs from plain decoding through
caps 1 and 2, never reached cap 4, where DFlash ran 1.15x plain decoding (it stayed at
plain, 0.985x).
"""

from __future__ import annotations

import statistics
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
from dspark_launch.models.layers.gemm import KERNELS, NEVER
from dspark_launch.parallel import get_parallel

MODES = ("auto", "torch", *KERNELS)
POINTS = (1, 2, 3, 4, 16, 64)  # token counts timed (those the pools can hold)
REPEATS = 8  # timed forwards per kernel and count (after one warm-up each), alternating
MARGIN = 0.03  # a copy's kernel must be this much faster (ties keep torch's: no copy)
VERSION = 3  # of the cached file (1: oneDNN's copy only; 2: fastest of 3, a winning run)
# auto copies nothing when the copies would take more than this share of MemAvailable on some
# rank: they are outside the KV budget (memory/budget.py leaves the RAM it does not share
# out to the weights), and a model that fits once must not fail at start-up for a faster GEMM.
RAM_SHARE = 0.2

Times = dict[int, tuple[float, float]]  # token count -> (torch's seconds, the copy's)


def from_rows(times: Times, margin: float = MARGIN) -> int:
    """(torch seconds, copy's seconds) per token count -> the count from which the copy's
    kernel takes the rows (NEVER: none). It must be faster by `margin` at the largest count
    measured (every count past it takes the copy too); of the counts from which it is nowhere
    slower by `margin`, the one whose counts from it up it saves the largest sum of time
    fractions at (a count where the two tie may stay in the run: the copy's memory is spent
    once it is kept, and a lone tie must not hand the counts below it to the slower kernel;
    equal sums keep the larger count)."""
    return _run(times, margin)[0]


def _run(times: Times, margin: float) -> tuple[int, float]:
    """from_rows, and the sum of time fractions the copy saves from there up (0: none)."""
    counts = sorted(times)
    if not counts or not times[counts[-1]][1] < times[counts[-1]][0] * (1 - margin):
        return NEVER, 0.0
    chosen, best, saved = NEVER, 0.0, 0.0
    for n in reversed(counts):
        plain, packed = times[n]
        if packed > plain * (1 + margin):
            break
        saved += 1.0 - packed / plain
        if saved > best:
            chosen, best = n, saved
    return chosen, best


def pick_kernel(times: dict[str, Times], margin: float = MARGIN) -> tuple[str, int]:
    """Each kernel's timings against torch's (from its own alternation: a shared machine's
    speed drifts between the kernels' turns) -> (the kernel, from_rows) whose counts from there
    up save the largest sum of time fractions ("torch", NEVER: none wins).
    Ties keep the earlier kernel of `times`."""
    best, rows, saved = "torch", NEVER, 0.0
    for kernel, pairs in times.items():
        start, saving = _run(pairs, margin)
        if start != NEVER and saving > saved:
            best, rows, saved = kernel, start, saving
    return best, rows


def measure(run: Callable[[int], None], plan: PackPlan, points: Sequence[int],
            repeats: int = REPEATS, clock: Callable[[], float] = time.perf_counter) -> Times:
    """Time run(n) on torch's kernel and on the copy's: one warm-up each, then `repeats`
    alternating pairs; the median of each (a stall or a lucky forward moves neither). The
    number of forwards is fixed, so every rank runs the same collectives."""
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
        times[n] = (statistics.median(runs[NEVER]), statistics.median(runs[1]))
    return times


def choose_gemm(engine, mode: str, clock: Callable[[], float] = time.perf_counter
                ) -> tuple[int, str]:
    """Give the engine's models their copies (dropping any earlier ones) and set their shared
    plan, engine.gemm_kernel and engine.gemm_from_rows, on every rank -> (from_rows, where it
    came from: 'torch', 'onednn', 'transposed', 'cache', 'measured', 'memory' or 'failed':
    copying failed on some rank)."""
    if mode not in MODES:
        raise ConfigError(f"--cpu-gemm={mode!r}: expected one of {', '.join(MODES)}")
    models = [engine.target] + ([engine.proposer.draft]
                                if getattr(engine.proposer, "draft", None) is not None else [])
    _drop(models)
    kernel, rows, source = _choose(engine, mode, models, clock)
    if rows == NEVER:
        _drop(models)
        kernel = "torch"
    engine.gemm_kernel, engine.gemm_from_rows = kernel, rows
    return rows, source


def _choose(engine, mode: str, models: list, clock: Callable[[], float]
            ) -> tuple[str, int, str]:
    if mode == "torch":
        return "torch", NEVER, "torch"
    kernels = [k for k in (KERNELS if mode == "auto" else (mode,))
               if sum(packable_bytes(model, k) for model in models)]
    if not kernels:
        if mode != "auto":
            raise ConfigError(
                f"--cpu-gemm {mode} packs CPU weights in float32 (or bfloat16 on a CPU with "
                f"bf16 instructions) with a torch built with oneDNN (available: "
                f"{torch.backends.mkldnn.is_available()}); this run's are "
                f"{engine.target.dtype} on {engine.device}; use --cpu-gemm auto or torch")
        return "torch", NEVER, "torch"
    copy = max(sum(packable_bytes(model, k) for model in models) for k in kernels)
    if mode == "auto" and any(all_gather_object(copy > RAM_SHARE * mem_available_bytes())):
        # The copy is outside every budget: a model this large keeps torch's kernel.
        return "torch", NEVER, "memory"
    plan = PackPlan()
    if mode != "auto":
        if (failed := _pack(models, plan, mode)) is not None:
            raise ConfigError(f"--cpu-gemm {mode}: packing the weights for {mode} failed on "
                              f"{failed}; use --cpu-gemm torch")
        plan.from_rows = 1
        return mode, 1, mode
    return _measured(engine, models, kernels, plan, clock)


def _pack(models: list, plan: PackPlan, kernel: str) -> str | None:
    """Give every model on every rank its copies for `kernel` -> None, or where and what failed
    (oneDNN's reorder out of memory, say), every copy dropped again. Every rank learns of any
    rank's failure before the timed forwards, whose collectives would otherwise leave the
    others waiting until --dist-timeout."""
    try:
        for model in models:
            pack_model(model, plan, kernel)
        mine = None
    except (RuntimeError, MemoryError) as err:
        mine = f"{type(err).__name__}: {err}"
    failed = {rank: message for rank, message in enumerate(all_gather_object(mine))
              if message is not None}
    if not failed:
        return None
    _drop(models)
    return "; ".join(f"rank {rank}: {message}" for rank, message in failed.items())


def _auto_pack(models: list, plan: PackPlan, kernel: str) -> bool:
    """_pack under auto: True, or a warning and no copies (torch's GEMM in their place)."""
    failed = _pack(models, plan, kernel)
    if failed is not None:
        logger.warning("cpu gemm: copying the weights for %s failed on %s; not using it",
                       kernel, failed)
    return failed is None


def _drop(models: list) -> None:
    for model in models:
        unpack_model(model)


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


def _measured(engine, models: list, kernels: list[str], plan: PackPlan,
              clock: Callable[[], float]) -> tuple[str, int, str]:
    """(kernel, from_rows, source) for this machine, its copies made: rank 0's cached choice
    ('cache'), or every rank's forwards timed per kernel and rank 0's timings taken
    ('measured'). A kernel whose copies fail on some rank is left out ('failed' when all
    are)."""
    state = get_parallel()
    points = _points(engine)
    # No drafter in the key: which kernel wins is the target's rows', so every engine of a
    # machine, topology and target takes one choice (a benchmark's engines compare alike).
    machine = {"version": VERSION, **conditions(engine), "points": points}
    directory, key = disk_cache.cache_dir("gemm"), disk_cache.cache_key(machine)
    cached = broadcast_object(_cached(directory, key, kernels) if state.rank == 0 else None)
    if cached is not None:
        kernel, rows = cached
        if rows == NEVER or _auto_pack(models, plan, kernel):
            plan.from_rows = rows
            return kernel, rows, "cache"
        return "torch", NEVER, "failed"

    @torch.inference_mode()  # as the step runs (Engine.step)
    def run(n: int) -> None:
        engine.target.greedy(profile_forward(engine, n, _block(engine, n)))

    times: dict[str, Times] = {}
    held = None  # the kernel whose copies the models hold (the last one timed)
    for kernel in kernels:
        _drop(models)
        held = kernel if _auto_pack(models, plan, kernel) else None
        if held is not None:
            times[kernel] = broadcast_object(measure(run, plan, points, clock=clock))
    if not times:
        return "torch", NEVER, "failed"
    kernel, rows = pick_kernel(times)
    if rows != NEVER and held != kernel:  # (NEVER: choose_gemm drops the copies)
        _drop(models)
        if not _auto_pack(models, plan, kernel):
            return "torch", NEVER, "failed"
    plan.from_rows = rows
    if state.rank == 0:
        disk_cache.write_json(directory, key, {
            "kernel": kernel, "from_rows": rows, "machine": machine,
            "ms": {k: {n: [round(1e3 * s, 4) for s in pair] for n, pair in pairs.items()}
                   for k, pairs in times.items()}})
        for k, pairs in times.items():
            logger.info("cpu gemm: %s", ", ".join(
                f"{n} tokens torch {1e3 * a:.2f} / {k} {1e3 * b:.2f} ms"
                for n, (a, b) in pairs.items()))
    return kernel, rows, "measured"


def _cached(directory, key: str, kernels: list[str]) -> tuple[str, int] | None:
    """A stored (kernel, from_rows), if it is one (NEVER, or a count >= 1 with a kernel this
    run can copy); else None: measure again."""
    data = disk_cache.read_json(directory, key)
    if data is None:
        return None
    kernel, rows = data.get("kernel"), data.get("from_rows")
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        return None
    if rows == NEVER:
        return "torch", NEVER
    return (kernel, rows) if kernel in kernels else None
