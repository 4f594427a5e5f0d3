"""The adaptive verify-length policy inside the real engine (issue 16, must-show):

- a drafter that is always wrong: the policy converges to verifying ~0 drafts (verified rows
  counted at the acceptance op, no timing in the assertion);
- an oracle drafter: it verifies full blocks;
- greedy outputs identical to plain greedy decoding (NONE) under the adaptive policy at tp1,
  tp2/attn-dp2 and tp8/attn-dp8 (real gloo worlds, start-up profile included), while the
  policy really varies the lengths;
- sampling at T=1 stays exact for DFLASH and DSPARK under the policy (chi-square).

Oracle for outputs: NONE at tp1, each prompt alone (tests/jobs.py); for the distribution: HF
transformers' logits (tests/spec/test_spec_sampling.py's construction).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
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
    write_prompts,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "spec"))
from test_spec_sampling import N_REQ, PROMPT, exact_marginals  # noqa: E402
from test_verify_ngram import P_MIN, chi2_pvalue  # noqa: E402

MAX_NEW = 40
BLOCK = 6  # DFLASH: 5 drafts per round


def full_sequences(tiny, prompts, max_new):
    ref = reference(tiny, prompts, max_new)
    return {i: p + o for i, (p, o) in enumerate(zip(prompt_ids(prompts), ref))}, ref


def make_oracle(base, full):
    """Proposes the true greedy continuation (after running the real draft forward, so the
    draft's cost is what the policy measures)."""
    from dspark_launch.spec.proposer import Proposal

    class Oracle(base):
        def propose(self, reqs, limits, rows):
            base.propose(self, reqs, limits, rows)
            toks = [full[r.index][len(r.all_ids):len(r.all_ids) + k]
                    for r, k in zip(reqs, limits)]
            return Proposal.from_lists(toks, rows.keys.device)

    return Oracle


def policy_argv(tiny, algorithm, prompts, max_new=MAX_NEW, profile="off", policy="adaptive"):
    draft = {"DFLASH": tiny.dflash, "DSPARK": tiny.dspark}.get(algorithm)
    return [*model_args(tiny, algorithm, draft=None if draft is None else draft(BLOCK)),
            "--prompts", str(prompts), "--max-new-tokens", str(max_new),
            "--speculative-policy", policy, "--profile-cost-curve", profile, *AMPLE]


class SteadyClock(ProposerProbe):
    """Also hands the policy step times from a fixed machine (STEP seconds a step, ROW a
    forward token, DRAFT_ROW a draft row) instead of this one's: under a loaded test run the
    real times scatter so much that how fast the ladder climbs would depend on the load.
    The engine, its policy and its ladder run unchanged; only their clock is steady."""

    STEP, ROW, DRAFT_ROW = 0.05, 0.0002, 0.0001

    def install(self) -> None:
        from dspark_launch.spec.policy import VerifyPolicy

        super().install()
        original = VerifyPolicy.record_step
        self._saved.append((VerifyPolicy, "record_step", original))

        def record_step(policy, decode_tokens, forward_tokens, forward_s, draft_rows,
                        draft_s, base_tokens=None, context_s=0.0):
            # (deferred context writes: free on this machine)
            return original(policy, decode_tokens, forward_tokens,
                            self.STEP + self.ROW * forward_tokens, draft_rows,
                            self.DRAFT_ROW * draft_rows, base_tokens)

        VerifyPolicy.record_step = record_step


class DearDrafts(SteadyClock):
    """A machine where a draft row costs as much as ten forward tokens: each try of a
    drafter that is never right loses most of a step, so the exploration budget spaces the
    tries out past the wake-up horizon and the policy can go dormant between them."""

    DRAFT_ROW = 0.002


def test_always_wrong_drafter_converges_to_plain_decoding(tiny, tmp_path):
    max_new = 6 * MAX_NEW  # the ladder tries each neighbour a few times before backing off
    full, ref = full_sequences(tiny, tiny.prompts12, max_new)
    probe = SteadyClock("dspark_launch.spec.block_drafter", "DFlashProposer", make_drafter,
                          full, "garbage")
    job = run_job(tmp_path, "wrong", policy_argv(tiny, "DFLASH", tiny.prompts12, max_new),
                  probe=probe)
    assert job.rcs == [0]
    assert job.outputs == ref
    verified = [n for _, n, _ in job.probes[0]["verifies"]]
    late = verified[2 * len(verified) // 3:]
    # Fixed would verify 5 drafts in nearly every round; the policy tried, then stopped (but
    # for a try now and then, fewer and fewer).
    assert max(verified[:len(verified) // 4]) > 0
    assert sum(late) / len(late) < 0.25, late
    report = job.metrics["speculative_policy"]
    assert report["skipped_draft_steps"] > job.metrics["steps"] // 3
    # Nothing it verified was ever accepted (and the report's calibration sample, fixed-cap
    # steps only, one in CALIBRATION_EVERY, says so where its few tries left one).
    assert not any(a for _, n, a in job.probes[0]["verifies"] if n)
    assert report["realised_tau"] == (1.0 if report["rounds"] else None), report


@pytest.mark.parametrize("policy", ["adaptive", "model"])
def test_dormant_once_drafting_never_pays(tiny, tmp_path, policy):
    """Two long requests and a drafter that is always wrong: once plain decoding has settled
    and no try is near (adaptive: the ladder's; model: the cost model's backed-off probe),
    steps leave their rows out of the draft's context (dormant), and the outputs are still
    plain greedy's (the context only shapes the drafts)."""
    prompts = write_prompts(tmp_path / "p2.jsonl",
                            [{"input_ids": ids} for ids in prompt_ids(tiny.prompts12)[:2]])
    max_new = 12 * MAX_NEW
    full, ref = full_sequences(tiny, prompts, max_new)
    probe = DearDrafts("dspark_launch.spec.block_drafter", "DFlashProposer", make_drafter,
                       full, "garbage")
    job = run_job(tmp_path, "dormant", policy_argv(tiny, "DFLASH", prompts, max_new,
                                                   policy=policy), probe=probe)
    assert job.rcs == [0]
    assert job.outputs == ref
    report = job.metrics["speculative_policy"]
    assert report["dormant_steps"] > 0, report["dormant_steps"]


def test_oracle_drafter_verifies_full_blocks(tiny, tmp_path):
    # 24 requests of 280 tokens: the ladder starts plain and climbs one cap per comparison,
    # each needing a few tries of the next cap
    prompts = write_prompts(tmp_path / "p24.jsonl",
                            [{"input_ids": ids} for ids in prompt_ids(tiny.prompts12) * 2])
    max_new = 7 * MAX_NEW  # (and the climb is slower on a loaded machine)
    full, ref = full_sequences(tiny, prompts, max_new)
    probe = SteadyClock("dspark_launch.spec.block_drafter", "DFlashProposer", make_oracle,
                          full)
    job = run_job(tmp_path, "oracle", [*policy_argv(tiny, "DFLASH", prompts, max_new),
                                       "--max-total-tokens", "16384"], probe=probe)
    assert job.rcs == [0]
    assert job.outputs == ref
    rounds = [(n, a) for _, n, a in job.probes[0]["verifies"]]
    assert all(a == n for n, a in rounds)  # the oracle is always right
    # Once up (the first full block, 5 drafts): full blocks but where a request has fewer
    # tokens left or a neighbour is tried.
    widths = [n for n, _ in rounds]
    up = widths[widths.index(BLOCK - 1):]
    assert up.count(BLOCK - 1) >= 0.6 * len(up) and len(up) >= len(prompt_ids(prompts)), up
    assert job.metrics["speculative_policy"]["dormant_steps"] == 0


@pytest.mark.parametrize("algorithm,world,dp", [
    ("DFLASH", 1, 1), ("DSPARK", 1, 1), ("NGRAM", 1, 1),
    ("DFLASH", 2, 2), ("DSPARK", 2, 2),
    ("DFLASH", 8, 8), ("DSPARK", 8, 8),
], ids=lambda v: str(v))
def test_adaptive_greedy_equals_plain_greedy(tiny, tmp_path, algorithm, world, dp):
    prompts = tiny.prompts12
    ref = reference(tiny, prompts, 24)
    # The start-up profile runs too: every rank joins its forwards (a mismatch would hang).
    argv = [*policy_argv(tiny, algorithm, prompts, 24, profile="auto"), *topology(world, dp)]
    job = run_job(tmp_path, "adaptive", argv, world=world, probe=Probe())
    assert job.rcs == [0] * world
    assert job.outputs == ref
    for p in job.probes:
        assert p["after"]["is_full"] and p["after"]["unfinished"] == []
    report = job.metrics["speculative_policy"]
    assert report["policy"] == "adaptive"
    assert len(report["cost_curves"]) == dp  # one curve per attn_dp group
    widths = [n for p in job.probes for _, n, _ in p["verifies"]]
    assert len(set(widths)) > 1  # the policy chose, it did not verify fixed blocks


class SteepCost(Probe):
    """Pins the policy's cost model (a test of exactness must not depend on this machine's
    timings): a step costs 1 + SLOPE per extra token, drafting a fixed DRAFT, and
    the online refinement is off. The policy itself runs unchanged."""

    SLOPE = 0.01
    DRAFT = 0.05

    def install(self) -> None:
        import dspark_launch.engine.verify_policy as vp
        from dspark_launch.spec.cost_curve import CostCurve

        super().install()
        slope = self.SLOPE
        self._saved += [(vp, "profiled_curve", vp.profiled_curve),
                        (vp, "draft_curve_guess", vp.draft_curve_guess),
                        (CostCurve, "observe", CostCurve.observe)]
        vp.profiled_curve = lambda *a, **k: (CostCurve([1, 64], [1.0, 1.0 + 63 * slope]),
                                             "test")
        vp.draft_curve_guess = lambda *a, **k: CostCurve([1], [self.DRAFT])
        CostCurve.observe = lambda self, n, seconds: None


@pytest.mark.parametrize("algorithm,block,policy", [
    ("DFLASH", 4, "adaptive"), ("DSPARK", 3, "adaptive"), ("DFLASH", 4, "model"),
    ("DSPARK", 3, "model")])
def test_adaptive_sampling_matches_target_distribution(tiny, tmp_path, algorithm, block,
                                                       policy):
    """Every request samples 6 tokens at T=1 (rounds of up to `block` drafts, lengths chosen
    by the policy); the first three follow the target's exact marginals. "adaptive": the
    ladder's caps (from past steps) and, in its model arms, the cost model's; "model": the
    cost model alone, whose DSpark cut reads the confidences of the drafts just drawn."""
    prompts = write_prompts(tmp_path / "same.jsonl", [{"input_ids": PROMPT}] * N_REQ)
    draft = tiny.small_draft(algorithm, block)
    job = run_job(tmp_path, "sample", [
        "--model", str(tiny.small_vocab), "--speculative-algorithm", algorithm, "--draft",
        str(draft), "--prompts", str(prompts), "--max-new-tokens", "6", "--temperature", "1.0",
        "--seed", "11", "--speculative-policy", policy, *AMPLE], probe=SteepCost())
    assert job.rcs == [0]
    outs = torch.tensor(job.outputs)[:, :3]  # [N, 3] (no EOS in this vocabulary)
    assert outs.shape == (N_REQ, 3)
    lengths = job.metrics["speculative_policy"]["chosen_lengths"]
    # The policy really chose: plain decoding for some request-rounds, short and longer blocks
    # for others; and drafts were accepted.
    assert lengths.get("0", 0) > 0 and sum(v for k, v in lengths.items() if k != "0") > 0
    assert len(lengths) >= (3 if policy == "model" else 2), lengths
    assert any(n >= 2 for r in job.records for n in r["accept_lens"])
    exact = exact_marginals(tiny.small_vocab)
    for pos in range(3):
        counts = torch.bincount(outs[:, pos], minlength=16)
        assert chi2_pvalue(counts, exact[pos]) > P_MIN, (pos, counts, exact[pos])


class PeekingPolicy(SteepCost):
    """A policy that breaks the rule on purpose: it verifies draft 1 only when that draft is
    an even token id (its decision reads the draft it admits). The same chi-square must
    reject it, or the test above could not fail."""

    def install(self) -> None:
        import dspark_launch.engine.build as build_mod

        super().install()
        base = build_mod.Engine

        class Peeking(base):
            def _widths(self, plan, proposal):
                widths = super()._widths(plan, proposal)
                if proposal is None:
                    return widths
                first = proposal.tokens[:, 0].tolist()
                return [min(w, 1) if t % 2 == 0 else 0 for w, t in zip(widths, first)]

        build_mod.Engine = Peeking


def test_chi_square_catches_a_peeking_policy(tiny, tmp_path):
    prompts = write_prompts(tmp_path / "same.jsonl", [{"input_ids": PROMPT}] * N_REQ)
    draft = tiny.small_draft("DFLASH", 4)
    job = run_job(tmp_path, "peek", [
        "--model", str(tiny.small_vocab), "--speculative-algorithm", "DFLASH", "--draft",
        str(draft), "--prompts", str(prompts), "--max-new-tokens", "3", "--temperature", "1.0",
        "--seed", "11", "--speculative-policy", "model", *AMPLE], probe=PeekingPolicy())
    assert job.rcs == [0]
    outs = torch.tensor(job.outputs)
    exact = exact_marginals(tiny.small_vocab)
    counts = torch.bincount(outs[:, 1], minlength=16)  # token 2: the first verified draft
    assert chi2_pvalue(counts, exact[1]) < 1e-6
