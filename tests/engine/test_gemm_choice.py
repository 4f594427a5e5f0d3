"""The engine's CPU GEMM choice (engine/gemm_choice.py) on real engines and gloo worlds: every
rank takes rank 0's measurement, a second build reads it from the cache, each mode packs what
it says, speculative greedy outputs on packed weights equal plain greedy decoding, and a mode
that cannot apply is refused by name.

Oracles: plain greedy decoding (tests/jobs.reference: NONE, tp1); a clock whose reading per
kernel is known, for the agreement across ranks.
"""

from __future__ import annotations

import pytest
import torch
from jobs import (
    Arrival,
    drive,
    engine_args,
    final_outputs,
    random_prompts,
    reference,
    spec,
    write_prompts,
)
from multirank import run_world

from dspark_launch.models.layers.gemm import NEVER

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="torch without oneDNN")


def _packed_layers(engine) -> set[int | None]:
    """The plans' row counts over every packable layer of the target (None: not packed)."""
    return {m.packed.plan.from_rows if m.packed is not None else None
            for m in engine.target.modules() if hasattr(m, "packed")}


def _kernels(engine) -> set[str | None]:
    """The kernel of the copy of every layer, target and draft, that takes the engine's
    kernel's copy (None: no copy)."""
    from dspark_launch.models.layers import Packs

    models = [engine.target] + ([engine.proposer.draft]
                                if getattr(engine.proposer, "draft", None) is not None else [])
    return {m.packed.kernel if m.packed is not None else None for model in models
            for m in model.modules() if isinstance(m, Packs) and m.pack_source() is not None
            and engine.gemm_kernel in m.kernels}


def _choose_rank(rank: int, args, cache: str) -> dict:
    """Build with torch's GEMM, then choose 'auto' with a clock under which both copies' kernels
    are faster on rank 0 (the transposed one the most) and slower on every other rank; then
    again (from the cache), and the other modes."""
    import os

    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.engine.gemm_choice import choose_gemm
    from dspark_launch.parallel import get_parallel, init_parallel_runtime

    os.environ["DSPARK_CACHE_DIR"] = cache
    init_parallel_runtime(RunConfig(tp_size=int(os.environ["WORLD_SIZE"]), device="cpu"))
    engine = build_engine(args)
    out = {"built": (engine.gemm_from_rows, _packed_layers(engine))}
    head = engine.target.lm_head
    now = [0.0]

    def clock() -> float:  # each reading advances by what the current kernel costs here
        packed = head.packed is not None and head.packed.plan.from_rows < NEVER
        fast = {"onednn": 1.5, "transposed": 1.0}[head.packed.kernel] if packed else 2.0
        now[0] += fast if get_parallel().rank == 0 or not packed else 3.0
        return now[0]

    out["auto"] = choose_gemm(engine, "auto", clock)
    out["auto_layers"] = _packed_layers(engine)
    out["auto_kernels"] = (engine.gemm_kernel, _kernels(engine))
    out["again"] = choose_gemm(engine, "auto", clock)
    out["again_kernels"] = (engine.gemm_kernel, _kernels(engine))
    out["onednn"] = choose_gemm(engine, "onednn")
    out["onednn_layers"] = _packed_layers(engine)
    out["onednn_kernels"] = (engine.gemm_kernel, _kernels(engine))
    out["draft_packed"] = _draft_packed(engine)
    out["onednn_w2"] = _w2_copy(engine)
    out["transposed"] = choose_gemm(engine, "transposed")
    out["transposed_kernels"] = (engine.gemm_kernel, _kernels(engine))
    out["transposed_w2"] = (_w2_copy(engine), _draft_packed(engine, "transposed"))
    out["torch"] = choose_gemm(engine, "torch")
    out["torch_layers"] = _packed_layers(engine) | _draft_packed(engine)
    out["field"] = engine.gemm_from_rows
    engine.shutdown()
    return out


def _w2_copy(engine) -> str | None:
    """The kernel of the DSpark Markov head's W2 copy (None: no copy)."""
    packed = engine.proposer.draft.markov_head.markov_w2.packed
    return None if packed is None else packed.kernel


def _draft_packed(engine, kernel: str = "onednn") -> set[bool]:
    """Whether each of the draft's projections that takes `kernel`'s copy (its layer's context
    k/v included) holds a packed copy."""
    from dspark_launch.models.layers import Packs

    return {m.packed is not None for m in engine.proposer.draft.modules()
            if isinstance(m, Packs) and m.pack_source() is not None and kernel in m.kernels}


@pytest.mark.parametrize("world", [1, 2])
def test_every_rank_takes_rank_0s_measurement_and_the_cache_keeps_it(tiny, tmp_path, world):
    args = engine_args(tiny, "DSPARK", tiny.dspark(4), cpu_gemm="torch")
    results = run_world(world, _choose_rank, args, str(tmp_path / "cache"), timeout=120)
    for r in results:
        assert r["built"] == (NEVER, {None})  # torch: nothing packed
        assert r["auto"] == (1, "measured")  # rank 0's clock: copies faster everywhere
        assert r["auto_layers"] == {1}
        assert r["auto_kernels"] == ("transposed", {"transposed"})  # rank 0's fastest
        assert r["again"] == (1, "cache") and r["again_kernels"] == r["auto_kernels"]
        assert r["onednn"] == (1, "onednn") and r["onednn_layers"] == {1}
        assert r["onednn_kernels"] == ("onednn", {"onednn"})
        assert r["draft_packed"] == {True}
        assert r["transposed"] == (1, "transposed")
        assert r["transposed_kernels"] == ("transposed", {"transposed"})
        # The Markov head's W2 takes the transposed copy only (the walk slices it by vocab)
        assert r["onednn_w2"] is None and r["transposed_w2"] == ("transposed", {True})
        assert r["torch"] == (NEVER, "torch")
        assert r["torch_layers"] == {None, False}  # the earlier copies are dropped
        assert r["field"] == NEVER
    assert len(list((tmp_path / "cache" / "gemm").glob("*.json"))) == 1


def _slower_rank(rank: int, args, cache: str) -> dict:
    """'auto' under a clock by which the packed kernel is slower on rank 0 (faster elsewhere):
    no copy is kept, in the target or the draft."""
    import os

    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.engine.gemm_choice import choose_gemm
    from dspark_launch.parallel import get_parallel, init_parallel_runtime

    os.environ["DSPARK_CACHE_DIR"] = cache
    init_parallel_runtime(RunConfig(tp_size=int(os.environ["WORLD_SIZE"]), device="cpu"))
    engine = build_engine(args)
    head, now = engine.target.lm_head, [0.0]

    def clock() -> float:
        packed = head.packed is not None and head.packed.plan.from_rows < NEVER
        now[0] += (3.0 if get_parallel().rank == 0 else 1.0) if packed else 2.0
        return now[0]

    out = {"auto": choose_gemm(engine, "auto", clock),
           "layers": _packed_layers(engine) | _draft_packed(engine),
           "field": (engine.gemm_kernel, engine.gemm_from_rows)}
    engine.shutdown()
    return out


def test_auto_keeps_no_copy_where_the_packed_kernel_loses(tiny, tmp_path):
    args = engine_args(tiny, "DFLASH", tiny.dflash(4), cpu_gemm="onednn")  # built packed
    for r in run_world(2, _slower_rank, args, str(tmp_path / "cache"), timeout=120):
        assert r["auto"] == (NEVER, "measured")
        assert r["layers"] == {None, False} and r["field"] == ("torch", NEVER)


def _failing_rank(rank: int, args, cache: str) -> dict:
    """Copying fails on rank 1 only (oneDNN's reorder out of memory, injected, for either
    kernel): 'auto' keeps torch's GEMM on every rank, 'onednn' is refused on every rank,
    naming rank 1."""
    import os

    import dspark_launch.engine.gemm_choice as gemm_choice
    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.errors import ConfigError
    from dspark_launch.parallel import init_parallel_runtime

    os.environ["DSPARK_CACHE_DIR"] = cache
    init_parallel_runtime(RunConfig(tp_size=int(os.environ["WORLD_SIZE"]), device="cpu"))
    engine = build_engine(args)
    if rank == 1:
        def out_of_memory(model, plan, kernel):
            raise RuntimeError("could not allocate 1048576 bytes")
        gemm_choice.pack_model = out_of_memory
    out = {"auto": gemm_choice.choose_gemm(engine, "auto"),
           "layers": _packed_layers(engine) | _draft_packed(engine)}
    try:
        gemm_choice.choose_gemm(engine, "onednn")
    except ConfigError as err:
        out["onednn"] = str(err)
    out["after"] = _packed_layers(engine) | _draft_packed(engine)
    engine.shutdown()
    return out


def test_a_rank_that_cannot_pack_leaves_none_waiting(tiny, tmp_path):
    args = engine_args(tiny, "DSPARK", tiny.dspark(4), cpu_gemm="torch")
    for r in run_world(2, _failing_rank, args, str(tmp_path / "cache"), timeout=120):
        assert r["auto"] == (NEVER, "failed")
        assert r["layers"] == {None, False}  # rank 0's copies dropped too
        assert r["onednn"] == ("--cpu-gemm onednn: packing the weights for onednn failed on "
                               "rank 1: RuntimeError: could not allocate 1048576 bytes; use "
                               "--cpu-gemm torch")
        assert r["after"] == {None, False}


def test_a_mode_that_cannot_apply_is_refused():
    from dspark_launch.engine.gemm_choice import choose_gemm
    from dspark_launch.errors import ConfigError
    from dspark_launch.models.layers import ColumnParallelLinear

    class Half:  # an engine whose projections oneDNN does not pack (fp16)
        target = torch.nn.Sequential(ColumnParallelLinear(
            8, 8, bias=False, shards=1, rank=0, dtype=torch.float16, device="cpu"))
        target.dtype = torch.float16
        proposer, device = None, torch.device("cpu")

    with pytest.raises(ConfigError, match="--cpu-gemm onednn packs CPU weights in float32.*"
                                          "float16 on cpu.*--cpu-gemm auto or torch"):
        choose_gemm(Half(), "onednn")
    with pytest.raises(ConfigError, match="--cpu-gemm transposed packs CPU weights in "
                                          "float32.*float16 on cpu"):
        choose_gemm(Half(), "transposed")
    with pytest.raises(ConfigError, match="--cpu-gemm='fast': expected one of auto, torch, "
                                          "onednn, transposed"):
        choose_gemm(Half(), "fast")
    half = Half()
    assert choose_gemm(half, "auto") == (NEVER, "torch") and half.gemm_from_rows == NEVER


@pytest.mark.parametrize("world,algorithm,kernel", [(1, "DSPARK", "onednn"),
                                                    (2, "DFLASH", "onednn"),
                                                    (2, "DSPARK", "transposed")])
def test_speculation_on_packed_weights_equals_plain_greedy(tiny, tmp_path, world, algorithm,
                                                           kernel):
    """Every projection on a copy from one row (target and draft, verify and draft blocks):
    greedy outputs as plain greedy decoding's on torch's default GEMM path."""
    prompts = random_prompts(8, [3, 17, 1, 9, 24, 5, 12, 2], seed=5)
    path = write_prompts(tmp_path / "p.jsonl", [{"input_ids": p} for p in prompts])
    ref = reference(tiny, path, 16)
    draft = tiny.dspark(4) if algorithm == "DSPARK" else tiny.dflash(4)
    args = engine_args(tiny, algorithm, draft, cpu_gemm=kernel, speculative_policy="fixed")
    results = drive(args, [Arrival(0, spec(i, p, max_tokens=16, temperature=0.0)) for i, p in
                           enumerate(prompts)], world=world)
    final = final_outputs(results[0])
    assert [list(final[f"r{i}"].output_ids) for i in range(len(prompts))] == ref
    assert sum(sum(o.accept_lens) for o in final.values()) > len(prompts)  # drafts accepted


SLOW_COMPILE_S = 0.3  # what each new shape's compile is made to take below


def _slow_compile_rank(rank: int, args, prompts: list[list[int]]) -> dict:
    """An adaptive engine on oneDNN's copy whose every first call of a shape (the primitive's
    compile, FirstShapes) takes SLOW_COMPILE_S more: the step times its policy is told, and
    the wall time of each step."""
    import time

    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.models.layers.gemm import FIRST_SHAPES
    from dspark_launch.parallel import init_parallel_runtime

    init_parallel_runtime(RunConfig(device="cpu"))
    engine = build_engine(args)
    first = FIRST_SHAPES.first

    def slow_first(key, call):
        def slow_call():
            time.sleep(SLOW_COMPILE_S)  # a compile this slow: inside the booked call
            return call()
        first(key, slow_call)

    FIRST_SHAPES.first = slow_first
    told = []
    record = engine.policy.record_step

    def record_step(decode_tokens, forward_tokens, forward_s, draft_rows, draft_s,
                    base_tokens=None, context_s=0.0):
        told.append(forward_s + draft_s + context_s)
        return record(decode_tokens, forward_tokens, forward_s, draft_rows, draft_s,
                      base_tokens, context_s)

    engine.policy.record_step = record_step
    for i, p in enumerate(prompts):
        engine.add_request(spec(i, p, max_tokens=24, temperature=0.0))
    walls, compiled = [], []
    while engine.has_work or not walls:  # (requests added count once a step carried them in)
        n, t0 = len(FIRST_SHAPES.seen), time.perf_counter()
        outs = engine.step()
        walls.append(time.perf_counter() - t0)
        compiled.append(len(FIRST_SHAPES.seen) - n)
        for o in outs:
            assert o.finish_reason in (None, "length")
    engine.shutdown()
    return {"told": told, "walls": walls, "compiled": compiled}


def test_a_new_shapes_compile_is_in_no_step_time_the_policy_is_told(tiny):
    """Every step's time as the policy learns it (curves, ladder) leaves out oneDNN's compiles
    of shapes met for the first time (FirstShapes, steady_clock), while they stay in the
    step's wall time: the ladder's tries meet new verify row counts, and scored with them they
    looked 20-35% dearer than those arms run. Oracle: each compile made to take
    SLOW_COMPILE_S, and no step of the tiny model near that long without it."""
    prompts = random_prompts(6, [5, 11, 3, 17, 8, 2], seed=9)
    args = engine_args(tiny, "DFLASH", tiny.dflash(4), cpu_gemm="onednn",
                       speculative_policy="adaptive")
    r = run_world(1, _slow_compile_rank, args, prompts, timeout=300)[0]
    slow = [w for w, c in zip(r["walls"], r["compiled"]) if c]
    assert len(slow) >= 3 and min(slow) >= SLOW_COMPILE_S, r  # compiles met while decoding
    assert len(r["told"]) >= len(r["walls"]) // 2, r
    assert max(r["told"]) < SLOW_COMPILE_S, r
