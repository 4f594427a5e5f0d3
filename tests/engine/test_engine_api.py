"""The engine core API (issue 15): requests added and aborted while the engine runs, the same
outputs on every rank, per-request sampling parameters, keyed randomness (same seed, same
tokens at any topology and batch), one device->host copy per step, min_tokens and
stop_token_ids against HF's own logits processors, an idle engine that returns.

Oracles: plain greedy decoding (NONE, tp1, alone: tests/jobs.reference) and HF transformers.
"""

from __future__ import annotations

import pytest
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

PROMPTS = random_prompts(12, [5, 1, 17, 3, 9, 24, 2, 11, 6, 14, 4, 8], seed=21)


def _greedy_reference(tiny, tmp_path, prompts, max_new):
    path = write_prompts(tmp_path / f"ref{len(prompts)}_{max_new}.jsonl",
                         [{"input_ids": p} for p in prompts])
    return reference(tiny, path, max_new)


@pytest.mark.parametrize("world,dp,algorithm", [(1, 1, "DSPARK"), (2, 2, "DSPARK"),
                                                (2, 1, "NGRAM")],
                         ids=["tp1-dspark", "tp2-dp2-dspark", "tp2-ngram"])
def test_requests_over_time_and_abort(tiny, tmp_path, world, dp, algorithm):
    """Requests arrive at different steps (greedy and sampled mixed), one is aborted while it
    runs and one before it starts: every rank returns identical outputs, greedy requests equal
    plain greedy decoding, the streamed pieces add up, the pool drains, and a step never makes
    more than one device->host copy (exactly one whenever it commits a token)."""
    ref = _greedy_reference(tiny, tmp_path, PROMPTS, 12)
    draft = tiny.dspark(4) if algorithm == "DSPARK" else None
    arrivals = [Arrival(i // 3, spec(i, p, max_tokens=12,
                                     temperature=0.0 if i % 2 == 0 else 0.9,
                                     top_k=8 if i % 4 == 1 else 0, seed=i if i % 3 else None))
                for i, p in enumerate(PROMPTS)]
    arrivals += [Arrival(2, abort="r1"), Arrival(0, abort="r11")]  # r11 arrives at step 3
    arrivals += [Arrival(3, spec(99, PROMPTS[0], rid="late-abort", max_tokens=40))]
    arrivals += [Arrival(6, abort="late-abort")]
    results = drive(engine_args(tiny, algorithm, draft), arrivals, world=world, dp=dp)
    steps = results[0]["steps"]
    assert all(_untimed(r["steps"]) == _untimed(steps) for r in results), \
        "ranks returned different outputs"
    assert all(r["pool_full"] and r["table_clear"] for r in results)
    final = final_outputs(results[0])
    assert final["r1"].finish_reason == "abort"
    assert final["late-abort"].finish_reason == "abort"
    assert 0 < len(final["late-abort"].output_ids) < 40
    # r11's abort came before r11 itself: it runs to completion
    assert final["r11"].finish_reason in ("length", "stop")
    for i in range(12):
        out = final[f"r{i}"]
        pieces = [t for outs in steps for o in outs if o.rid == out.rid for t in o.new_token_ids]
        assert tuple(pieces) == out.output_ids
        assert sum(1 for outs in steps for o in outs if o.rid == out.rid and o.finished) == 1
        if i % 2 == 0:
            assert list(out.output_ids) == ref[i], i
        if out.finish_reason != "abort":
            assert 1 + sum(out.accept_lens) == len(out.output_ids)
    # A rank copies once when its own group committed something (other groups' tokens come
    # with the outputs exchange), never more.
    assert all(max(r["copies"]) == 1 for r in results)
    for k, outs in enumerate(steps):
        if any(o.new_token_ids for o in outs):
            assert any(r["copies"][k] == 1 for r in results), k


def _untimed(steps):
    """Outputs without the clock readings (each rank of a group stamps its own)."""
    return [[(o.rid, o.index, o.new_token_ids, o.output_ids, o.finished, o.finish_reason,
              o.prompt_tokens, o.accept_lens, o.arrival, o.preemptions) for o in outs]
            for outs in steps]


def _mixed_specs(n: int, offset: int = 0):
    """Requests with different sampling parameters, seeds set and unset."""
    kinds = [dict(temperature=0.0), dict(temperature=1.0, seed=7),
             dict(temperature=0.7, top_k=5), dict(temperature=1.2, top_p=0.8, seed=3),
             dict(temperature=1.0), dict(temperature=0.5, top_k=3, top_p=0.9, seed=11)]
    return [spec(offset + i, PROMPTS[i % len(PROMPTS)], max_tokens=10,
                 **kinds[i % len(kinds)]) for i in range(n)]


@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK"])
def test_per_request_params_in_one_batch_match_alone(tiny, algorithm):
    """Six parameter sets in one batch give each request exactly what it gets alone."""
    draft = tiny.dflash(4) if algorithm == "DFLASH" else tiny.dspark(4)
    args = engine_args(tiny, algorithm, draft)
    specs = _mixed_specs(6)
    batch = final_outputs(drive(args, [Arrival(0, s) for s in specs])[0])
    alone = final_outputs(drive(args, [Arrival(0, s) for s in specs], alone=True)[0])
    assert {k: v.output_ids for k, v in batch.items()} == \
        {k: v.output_ids for k, v in alone.items()}
    assert len({v.output_ids for v in batch.values()}) == 6  # really different requests


def test_same_seed_same_tokens_alone_batch_and_topologies(tiny):
    """params.seed keys the request: alone, in a batch of 16 (at another index), at tp1, tp2
    and tp2/attn-dp2, the tokens are the same; another seed gives others."""
    args = engine_args(tiny, "DSPARK", tiny.dspark(4))
    seeded = dict(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    solo = [Arrival(0, spec(0, PROMPTS[2], rid="x", **seeded))]
    crowd = [Arrival(0, s) for s in _mixed_specs(15, offset=100)]
    crowd.insert(7, Arrival(0, spec(7, PROMPTS[2], rid="x", **seeded)))
    want = final_outputs(drive(args, solo)[0])["x"].output_ids
    for world, dp in [(1, 1), (2, 1), (2, 2)]:
        results = drive(args, crowd, world=world, dp=dp)
        assert all(final_outputs(r)["x"].output_ids == want for r in results), (world, dp)
    other = dict(seeded, seed=1235)
    assert final_outputs(drive(args, [Arrival(0, spec(0, PROMPTS[2], rid="x", **other))])[0]
                         )["x"].output_ids != want


@pytest.mark.parametrize("algorithm", ["NONE", "DSPARK"])
def test_min_tokens_and_stop_token_ids_match_hf(tiny, algorithm):
    """stop_token_ids end a request at the first such token; before min_tokens, EOS and stop
    ids are masked out of the target's distribution (HF: MinNewTokensLengthLogitsProcessor).
    Greedy, so the speculative path must give exactly HF's tokens."""
    import torch
    from checkpoints import load_hf

    hf = load_hf(tiny.target)
    prompts = PROMPTS[:4]
    cases = []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        free = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=1,
                           pad_token_id=0)[0, len(p):].tolist()
        stop = free[3]  # a token the request really produces
        for j, min_tokens in enumerate((0, 6)):
            out = hf.generate(ids, max_new_tokens=12, min_new_tokens=min_tokens,
                              do_sample=False, eos_token_id=[1, stop],
                              pad_token_id=0)[0, len(p):].tolist()
            cases.append((spec(2 * i + j, p, max_tokens=12, stop_token_ids=(stop,),
                               min_tokens=min_tokens, temperature=0.0), out, stop))
    draft = tiny.dspark(4) if algorithm == "DSPARK" else None
    final = final_outputs(drive(engine_args(tiny, algorithm, draft),
                                [Arrival(0, s) for s, _, _ in cases])[0])
    for s, want, stop in cases:
        got = final[s.rid]
        assert list(got.output_ids) == want, (s.params.min_tokens, stop)
        if s.params.min_tokens:
            assert stop not in got.output_ids[:s.params.min_tokens]
        if got.output_ids[-1] in (1, stop) and len(got.output_ids) > s.params.min_tokens:
            assert got.finish_reason == "stop"


def test_idle_engine_returns_and_refuses_bad_prompts(tiny):
    """No work: step() returns [] (rank 0 waited on its inbox); a prompt that does not fit
    finishes as "refused" on every rank without running."""
    args = engine_args(tiny, "NONE", context_length=16)
    results = drive(args, [Arrival(0, spec(0, list(range(2, 30)), rid="long")),
                           Arrival(0, spec(1, [5, 6], rid="ok", max_tokens=3)),
                           Arrival(0, spec(2, [], rid="empty"))], world=2, dp=2)
    for r in results:
        final = final_outputs(r)
        assert final["long"].finish_reason == "refused" and "context" in final["long"].error
        assert final["empty"].finish_reason == "refused"
        assert final["ok"].finish_reason == "length" and len(final["ok"].output_ids) == 3
        assert r["pool_full"]
    idle = drive(args, [])
    assert idle[0]["steps"] == [[]]


@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK"])
def test_greedy_fast_path_never_gathers_the_vocabulary(tiny, tmp_path, monkeypatch, algorithm):
    """All-greedy steps take the argmax over vocab shards (tp2: two shards): the
    full-vocabulary logits gather and the distribution builder are never called, and the
    output is still plain greedy decoding."""
    from dspark_launch.models.layers.embedding import ParallelLMHead

    def forbidden(*_a, **_k):
        raise AssertionError("the greedy fast path formed a full-vocabulary distribution")

    monkeypatch.setattr(ParallelLMHead, "logits", forbidden)
    monkeypatch.setattr("dspark_launch.spec.sampling.target_probs", forbidden)
    monkeypatch.setattr("dspark_launch.spec.dspark_sampler.target_probs", forbidden)
    monkeypatch.setattr("dspark_launch.spec.block_drafter.target_probs", forbidden)
    monkeypatch.setattr("dspark_launch.engine.accept.target_probs", forbidden)
    ref = _greedy_reference(tiny, tmp_path, PROMPTS[:6], 10)
    draft = tiny.dflash(4) if algorithm == "DFLASH" else tiny.dspark(4)
    results = drive(engine_args(tiny, algorithm, draft),
                    [Arrival(0, spec(i, p, max_tokens=10, temperature=0.0))
                     for i, p in enumerate(PROMPTS[:6])], world=2)
    final = final_outputs(results[0])
    assert [list(final[f"r{i}"].output_ids) for i in range(6)] == ref


@pytest.mark.parametrize("world", [1, 2])
def test_idle_engine_honours_signals(tiny, world):
    """An idle engine parks rank 0 on its inbox (no busy loop: a few steps in 0.3 s, not
    thousands) and still stops every rank after the step in which any rank got SIGTERM."""
    import gc

    from jobs import _idle_signal_rank
    from multirank import run_world

    gc.collect()
    results = run_world(world, _idle_signal_rank, engine_args(tiny, "NONE"), timeout=60)
    for r in results:
        assert r["exit_code"] == 143
        assert r["idle_steps"] < 10


def test_confidence_cut_costs_one_more_read(tiny, tmp_path):
    """DSpark with a confidence threshold reads its cut lengths to shorten the verify: a
    decode step that drafts makes exactly two device->host copies (one without a threshold,
    or when no request drafts), and the output is still plain greedy decoding."""
    ref = _greedy_reference(tiny, tmp_path, PROMPTS[:4], 10)
    specs = [Arrival(0, spec(i, p, max_tokens=10, temperature=0.0))
             for i, p in enumerate(PROMPTS[:4])]
    for threshold, per_draft_step in [(0.5, 2), (0.0, 1)]:
        r = drive(engine_args(tiny, "DSPARK", tiny.dspark(4),
                              dspark_confidence_threshold=threshold), specs)[0]
        final = final_outputs(r)
        assert [list(final[f"r{i}"].output_ids) for i in range(4)] == ref
        decode_steps = [(n, d) for outs, n, d in zip(r["steps"], r["copies"], r["drafted"])
                        if outs and all(len(o.accept_lens) > 0 for o in outs)]
        assert any(d for _, d in decode_steps), threshold
        assert all(n == (per_draft_step if d else 1) for n, d in decode_steps), threshold
