"""A verify's rejected rows stay the request's as spare rows (KVSpace.roll_back), reused by its
next round and reclaimed only when pages run short. The oracle is the same engine truncating
them every round (the old behaviour): since spare rows give way to any reservation that would
have fitted without them, every step must schedule, preempt, draft, accept and commit alike;
only which pool rows hold what may differ. With pages to spare, a running request's rows must
never move between steps, its spare rows included (what truncation broke every round)."""

from __future__ import annotations

import dataclasses

import pytest
from jobs import engine_args, prompt_ids, spec
from multirank import run_world

MAX_NEW = 16


def _run(rank: int, args, prompts: list[list[int]]) -> dict:
    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.parallel import init_parallel_runtime

    init_parallel_runtime(RunConfig(device="cpu"))
    out = {}
    for keep in (True, False):
        engine = build_engine(args)
        space, alloc = engine.space, engine.space.allocator
        counts = {"handed": 0, "shrinks": 0}
        handout, truncate = alloc.alloc, space.truncate

        def counted_alloc(n, counts=counts, handout=handout):
            pages = handout(n)
            counts["handed"] += len(pages or [])
            return pages

        def counted_truncate(slot, length, counts=counts, truncate=truncate, space=space):
            # a running request giving rows back (free_slot truncates to 0)
            counts["shrinks"] += 0 < length < space.reserved_len(slot)
            truncate(slot, length)

        alloc.alloc, space.truncate = counted_alloc, counted_truncate
        if not keep:
            space.roll_back = counted_truncate
        for i, p in enumerate(prompts):
            engine.add_request(spec(i, p, max_tokens=MAX_NEW, temperature=0.0))
        finals, trace, spare = {}, [], 0
        while engine.has_work or not finals:
            for o in engine.step():
                if o.finished:
                    finals[o.index] = (list(o.output_ids), list(o.accept_lens))
            # What each step did, in the engine's own terms (oracle: the truncating engine).
            trace.append(sorted((r.index, r.kv_len, len(r.output_ids), r.preemptions)
                                for r in engine.sched.running))
            spare = max(spare, space.spare_pages())
        engine.flush_prefix_cache()
        out[keep] = {"finals": finals, "trace": trace, "spare": spare, **counts,
                     "preempted": max((p for step in trace for *_, p in step), default=0),
                     "full": space.is_full()}
        engine.shutdown()
    return out


@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK"])
@pytest.mark.parametrize("pool", ["ample", "tight"])
def test_spare_rows_change_nothing_but_where_rows_live(tiny, algorithm, pool):
    draft = {"DFLASH": tiny.dflash, "DSPARK": tiny.dspark}[algorithm](4)
    args = engine_args(tiny, algorithm, draft, profile_cost_curve="off", max_running_requests=8)
    if pool == "tight":  # 160 rows for 8 requests of up to 50: they wait and are preempted
        args = dataclasses.replace(args, max_total_tokens=160)
    (out,) = run_world(1, _run, args, prompt_ids(tiny.prompts12))
    kept, truncated = out[True], out[False]
    assert kept["finals"] == truncated["finals"]  # same drafts accepted, same tokens
    assert any(a > 1 for _, accepts in kept["finals"].values() for a in accepts)
    assert kept["trace"] == truncated["trace"]  # same schedule, preemptions and commits
    assert kept["spare"] > 0 and truncated["spare"] == 0  # rejected rows really were kept
    assert kept["handed"] < truncated["handed"]  # ... and not handed out again
    assert truncated["shrinks"] > 0
    if pool == "ample":
        assert kept["shrinks"] == 0  # no running request gave a row back
    else:
        assert kept["preempted"] > 0  # the pool really was tight ...
        assert kept["shrinks"] > 0  # ... and spare rows went back to whoever needed them
    assert kept["full"] and truncated["full"]  # every row back once the work is done
