"""The prefix cache changes no output (issue 17): greedy outputs equal plain greedy decoding
and every request's per-round accept lengths equal those of the same job run with
--disable-prefix-cache, for NONE, DFLASH and DSPARK at tp1 and tp2/attn-dp2 and for NONE and
DSPARK at tp8/attn-dp8, page sizes 1 and 16, in a pool small enough that cached pages are
evicted and running requests are preempted. After the run the cache is flushed and the
allocator is full again.

Prompts share system prefixes (some longer than two pages of 16), one repeats a prompt exactly
(a full hit still computes its last token), one is a prefix of another, and the last ones are
second turns: an earlier prompt + its greedy answer + a follow-up, which hit K/V (and draft
context) written for generated tokens.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
from jobs import (
    Probe,
    model_args,
    prompt_ids,
    read_jsonl,
    reference,
    run_job,
    topology,
    write_prompts,
)

MAX_NEW = 12
BLOCK = 4
# 80 rows per rank: one or two requests at a time, so requests wait, preempt, and finished
# prefixes are evicted to make room.
TIGHT = ["--kv-cache-memory", "64MiB", "--max-total-tokens", "80", "--max-running-requests", "4"]
AMPLE_ONE = ["--kv-cache-memory", "64MiB", "--max-total-tokens", "4096",
             "--max-running-requests", "1"]


class CacheProbe(Probe):
    """Also records the cache's page counters just before the job flushes it."""

    def install(self) -> None:
        super().install()
        import dspark_launch.engine.build as build_mod

        probe, base = self, build_mod.Engine
        self.cache_stats: dict = {}

        class CacheEngine(base):
            def flush_prefix_cache(self):
                c = self.space.cache
                if c is not None:
                    probe.cache_stats = {"evicted_pages": c.evicted_pages,
                                         "cached_pages": c.num_pages,
                                         "locked_pages": c.locked_pages}
                super().flush_prefix_cache()

        build_mod.Engine = CacheEngine

    def result(self) -> dict:
        return {**super().result(), "cache": self.cache_stats}


@cache
def shared_prompts(root: str, families: int = 1) -> Path:
    """Per family: 11 first turns over 3 shared system prefixes, then 3 second turns built on
    their greedy answers (14 prompts; families use different tokens)."""
    from jobs import assets

    a = assets(root)
    rng = random.Random(17)

    def toks(n: int) -> list[int]:
        return [rng.randrange(2, 127) for _ in range(n)]

    first: list[list[int]] = []
    for _ in range(families):
        systems = [toks(40), toks(33), toks(18)]
        mine = [systems[i % 3] + toks(3 + i % 5) for i in range(9)]
        mine.append(list(mine[0]))  # the same prompt again
        mine.append(mine[4][:36])  # a prefix of another prompt
        first += mine
    turns1 = write_prompts(a.root / f"prefix_turns1_{families}.jsonl",
                           [{"input_ids": p} for p in first])
    answers = reference(a, turns1, MAX_NEW)
    second = [first[f * 11 + i] + answers[f * 11 + i] + toks(4)
              for f in range(families) for i in (0, 1, 5)]
    return write_prompts(a.root / f"prefix_turns2_{families}.jsonl",
                         [{"input_ids": p} for p in first + second])


def argv_for(tiny, algorithm: str, world: int, dp: int, page: int, prompts: Path,
             pool: list[str] = TIGHT) -> list[str]:
    draft = None
    if algorithm != "NONE":
        draft = {"DFLASH": tiny.dflash, "DSPARK": tiny.dspark}[algorithm](BLOCK)
    return [*model_args(tiny, algorithm, draft=draft), *topology(world, dp), "--prompts",
            str(prompts), "--max-new-tokens", str(MAX_NEW), "--page-size", str(page), *pool]


# Both page sizes at tp1 and at tp2-dp2 (two groups, each with its own cache); attn-dp8 at
# page 16 only: the page size is the allocator's and the radix cache's business, which
# tp2-dp2 already checks per group, and 8 ranks at page 1 cost the suite 140 s of CPU. At
# attn-dp8 NONE and DSPARK (40-47 s each): DFlash's context and block rows take the paths
# DSpark's do, and DFlash runs with the cache at tp1 and tp2-dp2.
TOPOLOGIES = {"tp1-page1": (1, 1, 1), "tp1-page16": (1, 1, 16), "tp2-dp2-page1": (2, 2, 1),
              "tp2-dp2-page16": (2, 2, 16), "tp8-dp8-page16": (8, 8, 16)}


@pytest.mark.parametrize("algorithm,world,dp,page", [
    pytest.param(algorithm, *shape, id=f"{algorithm}-{name}")
    for algorithm in ("NONE", "DFLASH", "DSPARK") for name, shape in TOPOLOGIES.items()
    if not (algorithm == "DFLASH" and shape[1] == 8)])
def test_cache_changes_no_output_and_no_accept_length(tiny, tmp_path, algorithm, world, dp,
                                                      page):
    # Two families under attn-dp8 (28 prompts), so that each group runs several requests.
    prompts = shared_prompts(str(tiny.root), 2 if dp == 8 else 1)
    ref = reference(tiny, prompts, MAX_NEW)
    argv = argv_for(tiny, algorithm, world, dp, page, prompts)
    off = run_job(tmp_path, "off", [*argv, "--disable-prefix-cache"], world=world,
                  probe=CacheProbe(), timeout=240)
    on = run_job(tmp_path, "on", argv, world=world, probe=CacheProbe(), timeout=240)
    assert off.rcs == on.rcs == [0] * world
    assert off.outputs == ref and on.outputs == ref
    assert [r["accept_lens"] for r in on.records] == [r["accept_lens"] for r in off.records]
    # The cache was used, evicted from, and requests were preempted with it on.
    assert on.metrics["cached_tokens"] > 0 and off.metrics["cached_tokens"] == 0
    assert off.metrics["prefix_hit_rate"] is None  # no cache: no "hit rate 0.0%" line
    assert on.metrics["prefill_tokens"] < off.metrics["prefill_tokens"]
    assert sum(r["preemptions"] for r in on.records) > 0
    assert sum(p["cache"]["evicted_pages"] for p in on.probes) > 0
    # A full hit still computes the last prompt token: every request computed at least one.
    assert all(r["prefill_tokens"] >= 1 for r in on.records)
    for rank, p in enumerate(on.probes):
        assert p["cache"]["locked_pages"] == 0, rank  # no request holds a page at the end
        assert p["after"]["is_full"] and p["after"]["table_rows_held"] == 0, (rank, p["after"])


@pytest.mark.parametrize("world,dp", [(1, 1), (2, 2)], ids=["tp1", "tp2-dp2"])
@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK"])
def test_second_turn_hits_generated_tokens(tiny, tmp_path, algorithm, world, dp):
    """One request at a time, ample pool: a second turn finds its first turn's prompt and
    answer cached (K/V written by verify rounds, draft context materialised from them) and
    still decodes exactly as without the cache."""
    prompts = shared_prompts(str(tiny.root))
    rows = read_jsonl(prompts)
    first, second = rows[0]["input_ids"], rows[11]["input_ids"]  # turn 2 of prompt 0
    pair = write_prompts(tmp_path / "pair.jsonl", [{"input_ids": first}, {"input_ids": second}])
    ref = reference(tiny, pair, MAX_NEW)
    argv = argv_for(tiny, algorithm, world, dp, 1, pair, pool=AMPLE_ONE)
    off = run_job(tmp_path, "off", [*argv, "--disable-prefix-cache"], world=world)
    on = run_job(tmp_path, "on", argv, world=world)
    assert off.outputs == ref and on.outputs == ref
    assert [r["accept_lens"] for r in on.records] == [r["accept_lens"] for r in off.records]
    # Turn 2 = turn 1's prompt + answer + 4 new tokens: it computes only what is new (under
    # attn-dp2 the placement keeps it on turn 1's group).
    assert on.records[1]["cached_tokens"] >= len(first) + MAX_NEW - 2
    assert on.records[1]["prefill_tokens"] <= len(second) - len(first) - MAX_NEW + 2


def test_a_prefix_shared_by_requests_arriving_together_is_computed_once(tiny, tmp_path):
    """Six prompts = one 40-token prefix + their own 5 tokens, all arriving at once: the first
    computes the prefix, the others wait one step for it and compute only their own tokens."""
    rng = random.Random(5)
    prefix = [rng.randrange(2, 127) for _ in range(40)]
    rows = [{"input_ids": prefix + [rng.randrange(2, 127) for _ in range(5)]} for _ in range(6)]
    prompts = write_prompts(tmp_path / "six.jsonl", rows)
    ref = reference(tiny, prompts, MAX_NEW)
    argv = argv_for(tiny, "NONE", 1, 1, 1, prompts, pool=[
        "--kv-cache-memory", "64MiB", "--max-total-tokens", "4096"])
    job = run_job(tmp_path, "six", argv)
    assert job.outputs == ref
    assert [r["prefill_tokens"] for r in job.records] == [45] + [5] * 5
    assert [r["cached_tokens"] for r in job.records] == [0] + [40] * 5
    m = job.metrics
    assert (m["cached_tokens"], m["prefill_tokens"]) == (200, 70)
    assert m["prefix_hit_rate"] == 200 / 270


@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK"])
def test_sampled_outputs_are_the_same_with_and_without_the_cache(tiny, tmp_path, algorithm):
    """Sampling draws from keyed streams (request, position): with the same K/V in the pools,
    a hit changes no draw, so sampled outputs and accept lengths match token for token."""
    prompts = shared_prompts(str(tiny.root))
    argv = [*argv_for(tiny, algorithm, 1, 1, 16, prompts), "--temperature", "0.8"]
    off = run_job(tmp_path, "off", [*argv, "--disable-prefix-cache"])
    on = run_job(tmp_path, "on", argv)
    assert off.rcs == on.rcs == [0]
    assert on.outputs == off.outputs
    assert [r["accept_lens"] for r in on.records] == [r["accept_lens"] for r in off.records]
    assert on.metrics["cached_tokens"] > 0


def _dormant_first_turns(rank: int, args, firsts: list[list[int]], extra: list[int]) -> dict:
    """First turns decoded dormant (nobody drafts, the anchors' draft context is left out, as
    a ladder settled at plain decoding does), then second turns (prompt + answer + extra)
    with every draft verified: once hitting the cache, once after a flush."""
    from jobs import spec

    from dspark_launch.args import RunConfig
    from dspark_launch.engine.build import build_engine
    from dspark_launch.parallel import init_parallel_runtime

    init_parallel_runtime(RunConfig(device="cpu"))
    engine = build_engine(args)
    policy, cap = engine.policy, engine.proposer.max_drafts

    slept = []

    def dormant(keys, classes, limits, base_tokens):
        policy.dormant = True
        slept.append(len(keys))
        return [0] * len(limits)

    def every_draft(keys, classes, limits, base_tokens):
        policy.dormant = False
        return list(limits)

    def run(prompts: list[list[int]], base: int) -> list:
        for i, p in enumerate(prompts):
            engine.add_request(spec(base + i, p, max_tokens=MAX_NEW, temperature=0.0))
        finals = {}
        while len(finals) < len(prompts):
            finals.update({o.index: o for o in engine.step() if o.finished})
        return [finals[base + i] for i in range(len(prompts))]

    policy.plan, policy.pick = dormant, (lambda classes: 0)
    answers = [list(o.output_ids) for o in run(firsts, 0)]
    dormant_steps = len(slept)
    policy.plan, policy.pick = every_draft, (lambda classes: cap)
    # Every draft verified: lengths the cost model cut (DSpark's choose()) follow step times.
    policy.choose = lambda keys, classes, limits, *rest: list(limits)
    seconds = [f + a + extra for f, a in zip(firsts, answers)]
    hit = run(seconds, 100)
    engine.flush_prefix_cache()
    fresh = run(seconds, 200)
    engine.shutdown()
    return {"dormant_steps": dormant_steps,
            "hit": [(list(o.output_ids), list(o.accept_lens), o.cached_tokens) for o in hit],
            "fresh": [(list(o.output_ids), list(o.accept_lens), o.cached_tokens)
                      for o in fresh]}


@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK"])
def test_rows_decoded_dormant_stay_out_of_the_cache(tiny, algorithm):
    """A dormant step writes no draft context for its anchors; their pages went into the
    cache all the same, so a second turn drafted from another request's stale context rows
    (accept lengths moved with the cache on; sampled tokens could too). Now a request's
    pages from its first dormant position on stay out: the second turn hits its first turn's
    prompt only and drafts exactly as without the cache."""
    from jobs import engine_args
    from multirank import run_world

    firsts = [p[:20] for p in prompt_ids(tiny.prompts12) if len(p) >= 20][:3]
    draft = {"DFLASH": tiny.dflash, "DSPARK": tiny.dspark}[algorithm](BLOCK)
    args = engine_args(tiny, algorithm, draft, speculative_policy="adaptive",
                       profile_cost_curve="off", page_size=1)
    (out,) = run_world(1, _dormant_first_turns, args, firsts, [5, 6, 7])
    assert out["dormant_steps"] > 0
    assert [o[:2] for o in out["hit"]] == [o[:2] for o in out["fresh"]]
    assert [o[2] for o in out["hit"]] == [len(f) for f in firsts]
    assert [o[2] for o in out["fresh"]] == [0, 0, 0]

