"""Greedy speculative decoding is lossless (issues 7 and 8): DFLASH and DSPARK outputs equal
plain greedy decoding token for token at tp1, tp2, tp4/attn-dp2 and tp8/attn-dp8 with block
sizes 2, 4 and 16; acceptance is exercised for real (NGRAM on repetitive output, an oracle
drafter with spoiled positions, a drafter that is always wrong); the pools drain.

Oracle: NONE at tp1, each prompt alone (see tests/engine/_jobs.py).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from jobs import (
    AMPLE,
    Probe,
    ProposerProbe,
    make_drafter,
    model_args,
    prompt_ids,
    reference,
    run_job,
    topology,
)

MAX_NEW = 16
SMALLISH = ["--kv-cache-memory", "64MiB", "--max-total-tokens", "400",
            "--max-running-requests", "8"]


def spec_argv(tiny, algorithm, block, world, dp, max_new=MAX_NEW, pool=AMPLE):
    draft = {"DFLASH": tiny.dflash, "DSPARK": tiny.dspark}[algorithm](block)
    return [*model_args(tiny, algorithm, draft=draft), *topology(world, dp),
            "--prompts", str(tiny.prompts12), "--max-new-tokens", str(max_new), *pool]


def check_drained(job):
    for rank, probe in enumerate(job.probes):
        after = probe["after"]
        assert after["is_full"] and after["table_rows_held"] == 0, (rank, after)
        assert after["unfinished"] == []


def check_accounting(job, algorithm, block):
    for rec in job.records:
        assert 1 + sum(rec["accept_lens"]) == rec["completion_tokens"]
        cap = block if algorithm == "DFLASH" else block + 1
        assert all(1 <= n <= cap for n in rec["accept_lens"])
        assert rec["draft_s"] > 0 and rec["verify_s"] > 0


@pytest.mark.parametrize("algorithm,world,dp,block", [
    ("DFLASH", 1, 1, 2),
    ("DFLASH", 2, 1, 4),
    ("DFLASH", 4, 2, 16),
    ("DFLASH", 8, 8, 2),
    ("DSPARK", 1, 1, 16),
    ("DSPARK", 2, 1, 2),
    ("DSPARK", 4, 2, 4),
    ("DSPARK", 8, 8, 16),
], ids=lambda v: str(v))
def test_greedy_spec_equals_plain_greedy(tiny, tmp_path, algorithm, world, dp, block):
    ref = reference(tiny, tiny.prompts12, MAX_NEW)
    # A pool that makes requests wait and preempt at tp1/tp2 (everything fits at dp>1).
    job = run_job(tmp_path, "spec", spec_argv(tiny, algorithm, block, world, dp, pool=SMALLISH),
                  world=world, probe=Probe())
    assert job.rcs == [0] * world
    assert job.outputs == ref
    assert job.metrics["topology"]["attn_tp_size"] == world // dp
    check_accounting(job, algorithm, block)
    check_drained(job)
    assert all(p["after"]["has_draft_pool"] for p in job.probes)
    # Verifies carried the drafts: block-1 (DFLASH) or block (DSPARK) when room allows.
    widths = {n for p in job.probes for _, n, _ in p["verifies"]}
    assert max(widths) == min(block - 1 if algorithm == "DFLASH" else block, MAX_NEW - 2)


def _full(tiny, prompts, max_new):
    ref = reference(tiny, prompts, max_new)
    return {i: p + o for i, (p, o) in enumerate(zip(prompt_ids(prompts), ref))}, ref


def _same_step_commit_and_rollback(verifies) -> bool:
    steps = defaultdict(list)
    for step, n, acc in verifies:
        steps[step].append((n, acc))
    return any(any(acc >= 2 for n, acc in v) and any(acc < n for n, acc in v)
               for v in steps.values())


@pytest.mark.parametrize("world,dp", [(1, 1), (2, 2)], ids=["tp1", "tp2-dp2"])
def test_oracle_drafter_long_blocks(tiny, tmp_path, world, dp):
    """A model-free drafter proposing the true continuation with ~1/4 positions spoiled:
    long blocks accepted, rollbacks in the same step, output unchanged, pools drained."""
    full, ref = _full(tiny, tiny.prompts12, MAX_NEW)
    probe = ProposerProbe("dspark_launch.spec.factory", "Proposer", make_drafter, full,
                          "oracle", 5)
    job = run_job(tmp_path, "oracle", [*model_args(tiny, "NONE"), *topology(world, dp),
                                       "--prompts", str(tiny.prompts12), "--max-new-tokens",
                                       str(MAX_NEW), *SMALLISH], world=world, probe=probe)
    assert job.rcs == [0] * world
    assert job.outputs == ref
    assert job.metrics["mean_tau"] > 2
    assert max(n for r in job.records for n in r["accept_lens"]) == 6  # 5 drafts + bonus
    assert min(n for r in job.records for n in r["accept_lens"]) == 1
    verifies = [v for p in job.probes for v in p["verifies"]]
    assert _same_step_commit_and_rollback(verifies)
    check_drained(job)


@pytest.mark.parametrize("world,dp", [(1, 1), (2, 1)], ids=["tp1", "tp2"])
def test_oracle_tokens_through_the_dflash_draft(tiny, tmp_path, world, dp):
    """The real DFlash draft runs every round (its draft K/V and context materialisation on
    the real path) but the verified tokens come from the oracle: multi-token commits and
    rollbacks. The draft's own proposal for a given (request, position) must not depend on
    how the previous rounds were accepted: compare with a plain DFLASH run (tau ~ 1)."""
    full, ref = _full(tiny, tiny.prompts12, MAX_NEW)
    argv = spec_argv(tiny, "DFLASH", 8, world, dp, pool=SMALLISH)
    oracle = run_job(tmp_path, "oracle", argv, world=world, probe=ProposerProbe(
        "dspark_launch.spec.block_drafter", "DFlashProposer", make_drafter, full, "oracle"))
    plain = run_job(tmp_path, "plain", argv, world=world, probe=ProposerProbe(
        "dspark_launch.spec.block_drafter", "DFlashProposer", make_drafter, full, "record"))
    assert oracle.rcs == plain.rcs == [0] * world
    assert oracle.outputs == ref and plain.outputs == ref
    assert oracle.metrics["mean_tau"] > 2
    assert _same_step_commit_and_rollback(oracle.probes[0]["verifies"])
    check_drained(oracle)
    raw_o = {(i, kv): d for i, kv, d in oracle.probes[0]["log"]["raw"]}
    raw_p = {(i, kv): d for i, kv, d in plain.probes[0]["log"]["raw"]}
    common = raw_o.keys() & raw_p.keys()
    assert len(common) >= 30
    assert {k: raw_o[k] for k in common} == {k: raw_p[k] for k in common}


def test_wrong_drafter_tau_is_one(tiny, tmp_path):
    full, ref = _full(tiny, tiny.prompts12, MAX_NEW)
    probe = ProposerProbe("dspark_launch.spec.factory", "Proposer", make_drafter, full,
                          "garbage", 4)
    job = run_job(tmp_path, "garbage", [*model_args(tiny, "NONE"), "--prompts",
                                        str(tiny.prompts12), "--max-new-tokens", str(MAX_NEW),
                                        *SMALLISH], probe=probe)
    assert job.rcs == [0]
    assert job.outputs == ref
    assert job.metrics["mean_tau"] == 1.0
    assert all(n == 1 for r in job.records for n in r["accept_lens"])
    assert any(n == 4 for _, n, _ in job.probes[0]["verifies"])  # drafts were verified
    check_drained(job)


def test_ngram_accepts_repetitive_output(tiny, tmp_path):
    max_new = 48
    ref = reference(tiny, tiny.prompts12, max_new, model=tiny.loopy)
    job = run_job(tmp_path, "ngram", ["--model", str(tiny.loopy), "--speculative-algorithm",
                                      "NGRAM", "--prompts",
                                      str(tiny.prompts12), "--max-new-tokens", str(max_new),
                                      *SMALLISH, "--speculative-policy", "fixed"], probe=Probe())
    assert job.rcs == [0]
    assert job.outputs == ref
    assert job.metrics["mean_tau"] > 2
    assert _same_step_commit_and_rollback(job.probes[0]["verifies"])
    check_drained(job)
