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
