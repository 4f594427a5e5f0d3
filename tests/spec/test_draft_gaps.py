"""Draft context gaps: the positions whose draft context dormant steps never wrote.

A dormant step (a ladder settled at plain decoding, spec/policy.py) forwards each decode
request's anchor through the target but writes no draft context for it. Those rows of the draft
pool keep whatever a page's last owner left there, so the drafts after a wake must not read
them: the request records the gap (Request.draft_gaps) and its draft block skips it
(attention.build_metadata's `skipped`). tests/drafts/test_draft_forward.py checks the block
against the reference; here the engine's bookkeeping and the drafts themselves.
"""

from __future__ import annotations

import pytest
from jobs import engine_args, prompt_ids

AWAKE, DORMANT = 3, 6  # plan() calls drafting, then dormant, then drafting to the end
MAX_NEW = 40


def _awake_dormant_awake(rank: int, args, prompts: list[list[int]], noise_seed: int | None
                         ) -> dict:
    """Decode `prompts` greedily: AWAKE drafting steps, DORMANT dormant ones, then drafting
    again, after filling the gap rows of the draft pool with noise (seeded; None: no noise)."""
    import torch
    from jobs import spec

    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.parallel import init_parallel_runtime

    init_parallel_runtime(RunConfig(device="cpu"))
    engine = build_engine(args)
    policy, cap = engine.policy, engine.proposer.max_drafts
    calls, starts, gaps = [], {}, {}

    def plan(keys, classes, limits, base_tokens):
        calls.append(len(keys))
        policy.dormant = AWAKE < len(calls) <= AWAKE + DORMANT
        if len(calls) == AWAKE + 1:  # the first dormant step: each anchor's position
            starts.update({r.index: r.kv_len for r in engine.sched.running})
        if len(calls) == AWAKE + DORMANT + 1:  # awake again: what the pool's gap rows hold
            gen = torch.Generator().manual_seed(noise_seed or 0)
            for req in engine.sched.running:
                gaps[req.index] = list(req.draft_gaps)
                for a, b in req.draft_gaps if noise_seed is not None else ():
                    rows = engine.space.req_to_token[req.slot, a:b].long()
                    for cache in (*engine.proposer.pool.k, *engine.proposer.pool.v):
                        cache[rows] = 3 * torch.randn(cache[rows].shape, generator=gen,
                                                      dtype=torch.float32).to(cache.dtype)
        return [0] * len(limits) if policy.dormant else list(limits)

    # Every draft verified: lengths the cost model cut (DSpark's choose()) follow step times.
    policy.plan, policy.pick = plan, (lambda classes: cap)
    policy.choose = lambda keys, classes, limits, *rest: list(limits)
    for i, p in enumerate(prompts):
        engine.add_request(spec(i, p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    finals = {}
    while len(finals) < len(prompts):
        finals.update({o.index: o for o in engine.step() if o.finished})
    engine.shutdown()
    return {"starts": starts, "gaps": gaps,
            "out": [(list(finals[i].output_ids), list(finals[i].accept_lens))
                    for i in range(len(prompts))]}


@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK"])
def test_drafts_after_a_wake_skip_the_gap(tiny, algorithm):
    """Each dormant step extends its requests' gap by the anchor's position, and the drafts
    after the wake do not depend on what the gap rows hold: the same accept lengths whatever
    noise fills them. (Read, the noise moved DFlash's and DSpark's accept lengths.)"""
    from multirank import run_world

    prompts = [p[:24] for p in prompt_ids(tiny.prompts12) if len(p) >= 24][:3]
    draft = {"DFLASH": tiny.dflash, "DSPARK": tiny.dspark}[algorithm](4)
    args = engine_args(tiny, algorithm, draft, speculative_policy="adaptive",
                       profile_cost_curve="off")
    runs = [run_world(1, _awake_dormant_awake, args, prompts, seed)[0] for seed in (None, 1, 2)]
    clean = runs[0]
    assert clean["starts"] and set(clean["gaps"]) == set(clean["starts"])
    assert clean["gaps"] == {i: [(a, a + DORMANT)] for i, a in clean["starts"].items()}
    for noisy in runs[1:]:
        assert noisy["out"] == clean["out"]
