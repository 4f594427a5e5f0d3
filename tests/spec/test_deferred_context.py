"""A block drafter's deferred draft context (spec/block_drafter.py): when no request drafts in a
step, the committed anchors' context K/V waits and is written in one batch later. The oracle is
the same engine writing every row at once (deferral switched off) under the same forced
schedule: the draft pool rows of every committed position, the drafts that follow (accept
lengths) and the outputs must be the same, whether the wait ends at the next draft forward,
at the row cap, or when a finishing request's rows change hands."""

from __future__ import annotations

import pytest
import torch
from jobs import engine_args, prompt_ids, spec
from multirank import run_world

SKIP = 5  # decode steps in which the policy lets nobody draft
MAX_NEW = 14


def _run(rank: int, args, prompts: list[list[int]], cap: int) -> dict:
    import dspark_launch.spec.block_drafter as block_drafter
    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.parallel import init_parallel_runtime

    init_parallel_runtime(RunConfig(device="cpu"))
    block_drafter.DEFERRED_CONTEXT_ROWS = cap
    out = {}
    for defer in (True, False):
        engine = build_engine(args)
        proposer, policy = engine.proposer, engine.policy
        if not defer:
            eager = proposer.materialize
            proposer.materialize = (lambda f, p, r, defer_from=None, eager=eager:
                                    eager(f, p, r, None))
        planned = [0]

        def forced(keys, classes, limits, base_tokens, planned=planned):
            # Nobody drafts in the first SKIP decode steps; afterwards every request does.
            planned[0] += 1
            return [0] * len(limits) if planned[0] <= SKIP else list(limits)

        policy.plan = forced
        # The arm drafts, so the engine works out the limits the forced plan hands back.
        policy.pick = lambda classes, cap=proposer.max_drafts: cap
        for i, p in enumerate(prompts):
            engine.add_request(spec(i, p, max_tokens=MAX_NEW, temperature=0.0))
        pending, pools, finals = [], None, {}
        while engine.has_work or not finals:
            for o in engine.step():
                if o.finished:
                    finals[o.index] = (list(o.output_ids), list(o.accept_lens))
            pending.append(proposer._pending_rows)
            if planned[0] == SKIP and pools is None:
                proposer.flush()  # what the next draft forward would do first
                pools = {}
                for req in engine.sched.running:
                    rows = engine.space.req_to_token[req.slot, :req.kv_len]
                    # numpy, not tensors: a tensor leaves the child as a shared-memory fd,
                    # which races with the child's exit
                    pools[req.index] = [engine.memory.draft.k[0][rows].numpy().copy(),
                                        engine.memory.draft.v[0][rows].numpy().copy()]
        engine.flush_prefix_cache()
        out[defer] = {"pending": max(pending), "pools": pools, "finals": finals,
                      "full": engine.space.is_full()}
        engine.shutdown()
    return out


@pytest.mark.parametrize("cap", [6, 10_000], ids=["cap6", "uncapped"])
def test_deferred_context_equals_eager(tiny, cap):
    prompts = prompt_ids(tiny.prompts12)[:4]
    args = engine_args(tiny, "DFLASH", tiny.dflash(4), speculative_policy="adaptive",
                       profile_cost_curve="off", max_running_requests=4)
    (out,) = run_world(1, _run, args, prompts, cap)
    lazy, eager = out[True], out[False]
    assert eager["pending"] == 0
    # Rows really waited (4 anchors a step; the cap flushes once 6 have gathered).
    assert lazy["pending"] == (4 if cap == 6 else 4 * SKIP)
    assert lazy["pools"] and lazy["pools"].keys() == eager["pools"].keys()
    for index, (k, v) in lazy["pools"].items():
        for mine, theirs in zip((k, v), eager["pools"][index]):
            torch.testing.assert_close(torch.from_numpy(mine), torch.from_numpy(theirs),
                                       atol=1e-5, rtol=1e-5)
    assert lazy["finals"] == eager["finals"]  # same drafts accepted, same tokens
    assert any(a > 1 for _, accepts in lazy["finals"].values() for a in accepts)
    assert lazy["full"] and eager["full"]


SLOW_WRITE = 0.2  # seconds a deferred context write is made to take


def _timed(rank: int, args, prompts: list[list[int]]) -> dict:
    import time

    import dspark_launch.spec.block_drafter as block_drafter
    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.parallel import init_parallel_runtime

    init_parallel_runtime(RunConfig(device="cpu"))
    block_drafter.DEFERRED_CONTEXT_ROWS = 6  # 4 anchors a step: a flush every other step
    engine = build_engine(args)
    proposer, policy = engine.proposer, engine.policy
    write = proposer.draft.materialize
    slow = [False]

    def materialize(*a, **k):
        if slow[0]:
            time.sleep(SLOW_WRITE)
        return write(*a, **k)

    proposer.draft.materialize = materialize
    flush = proposer.flush

    def slow_flush():  # only the deferred rows' write is slow
        slow[0] = True
        try:
            flush()
        finally:
            slow[0] = False

    proposer.flush = slow_flush
    policy.plan = lambda keys, classes, limits, base_tokens: [0] * len(limits)
    told, context = [], []
    record = policy.record_step

    def record_step(decode_tokens, forward_tokens, forward_s, draft_rows, draft_s,
                    base_tokens=None, context_s=0.0):
        if decode_tokens:
            told.append(forward_s + draft_s)
            context.append(context_s)
        return record(decode_tokens, forward_tokens, forward_s, draft_rows, draft_s,
                      base_tokens, context_s)

    policy.record_step = record_step
    for i, p in enumerate(prompts):
        engine.add_request(spec(i, p, max_tokens=MAX_NEW, temperature=0.0))
    walls, finished = [], 0
    while finished < len(prompts):
        t0 = time.perf_counter()
        finished += sum(o.finished for o in engine.step())
        walls.append(time.perf_counter() - t0)
    engine.shutdown()
    return {"told": told, "context": context, "walls": walls}


def test_plain_steps_are_timed_without_the_deferred_writes(tiny):
    """The policy is told a plain step's time without the deferred context writes it made:
    a plain step owes those rows only if a later step drafts, and a ladder settled at plain
    decoding goes dormant and never writes them (engine.step). It is told the writes' time
    apart (the ladder charges it to its exploring budget). Oracle: the wall clock around
    each step, with every deferred write made SLOW_WRITE seconds slow."""
    prompts = prompt_ids(tiny.prompts12)[:4]
    args = engine_args(tiny, "DFLASH", tiny.dflash(4), speculative_policy="adaptive",
                       profile_cost_curve="off", max_running_requests=4)
    (out,) = run_world(1, _timed, args, prompts)
    slow_steps = [w for w in out["walls"] if w >= SLOW_WRITE]
    assert len(slow_steps) >= MAX_NEW // 3, out["walls"]  # the writes were in timed steps
    assert out["told"] and max(out["told"]) < SLOW_WRITE / 2, out["told"]
    # ... and the writes' time apart, in the steps that made them (one step late: the last
    # step's times come with the next step's exchange, so the last one is never told)
    slow_told = [c for c in out["context"] if c >= SLOW_WRITE]
    assert len(slow_told) >= len(slow_steps) - 1, (out["context"], out["walls"])
