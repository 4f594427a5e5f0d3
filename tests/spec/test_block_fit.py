"""Under the adaptive policy a block drafter runs the shortest block that holds the step's
longest verify (spec/block_drafter.py, block_for): a draft forward costs its rows, and the
policy prices drafting in those rows (Proposer.draft_rows). Oracle: plain greedy decoding
(the outputs), closed-form arithmetic (the rows), and the trained block under "fixed"."""

from __future__ import annotations

import pytest
from jobs import engine_args, prompt_ids, reference, spec
from multirank import run_world

MAX_NEW = 12
LONGEST = 2  # the forced plan: every request verifies at most 2 drafts


def _run(rank: int, args, prompts: list[list[int]]) -> dict:
    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.parallel import init_parallel_runtime

    init_parallel_runtime(RunConfig(device="cpu"))
    engine = build_engine(args)
    proposer = engine.proposer
    blocks: list[int] = []  # draft tokens per request in each proposal
    propose = proposer.propose

    def recording(reqs, limits, rows):
        proposal = propose(reqs, limits, rows)
        blocks.append(proposal.tokens.shape[1])
        return proposal

    proposer.propose = recording
    if engine.policy.adaptive:
        # Every step drafts (pick: the arm's cap, before plan sees each request's limit).
        engine.policy.pick = lambda classes: proposer.max_drafts
        engine.policy.plan = lambda keys, classes, limits, base: [min(n, LONGEST)
                                                                  for n in limits]
    for i, p in enumerate(prompts):
        engine.add_request(spec(i, p, max_tokens=MAX_NEW, temperature=0.0))
    finals = {}
    while engine.has_work or not finals:
        for o in engine.step():
            if o.finished:
                finals[o.index] = list(o.output_ids)
    rows = {n: int(proposer.draft_rows(3, n)) for n in (1, 2, 7)}
    engine.shutdown()
    return {"blocks": sorted(set(blocks)), "finals": [finals[i] for i in sorted(finals)],
            "fit": proposer.fit_block, "rows": rows}


@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK"])
def test_adaptive_runs_the_shortest_block_and_stays_lossless(tiny, algorithm):
    prompts = prompt_ids(tiny.prompts12)[:4]
    draft = tiny.dflash(6) if algorithm == "DFLASH" else tiny.dspark(6)
    ref = reference(tiny, tiny.prompts12, MAX_NEW)[:4]
    anchor = 1 if algorithm == "DFLASH" else 0  # DFlash's slot 0 holds the anchor
    (fit,) = run_world(1, _run, engine_args(tiny, algorithm, draft, max_running_requests=4,
                                            speculative_policy="adaptive",
                                            profile_cost_curve="off"), prompts)
    assert fit["fit"] and fit["finals"] == ref
    # drafts per request: the block held only what the verify needed (1 once no request
    # has more than 2 tokens left)
    assert fit["blocks"][-1] == LONGEST and set(fit["blocks"]) <= {1, LONGEST}
    # 3 requests: requests x min(trained block, longest + anchor slot) draft rows
    assert fit["rows"] == {n: 3 * min(6, n + anchor) for n in (1, 2, 7)}
    (fixed,) = run_world(1, _run, engine_args(tiny, algorithm, draft, max_running_requests=4,
                                              profile_cost_curve="off"), prompts)
    assert not fixed["fit"] and fixed["finals"] == ref
    assert fixed["blocks"] == [6 - anchor]  # the trained block, as the reference code runs it
    assert fixed["rows"] == {n: 3 * 6 for n in (1, 2, 7)}
