"""Sampling is lossless (issue 8): on a vocabulary of 16, the committed tokens of DFLASH and
DSPARK at temperature 1 follow the target's exact distribution (chi-square, p > 1e-3, fixed
seeds so deterministic); the same seed gives the same sampled output at tp1 and tp2; DSpark's
confidence threshold truncates verify blocks and tau counts the truncated rounds."""

from __future__ import annotations

import pytest
import torch
from jobs import (
    AMPLE,
    Arrival,
    ProposerProbe,
    drive,
    engine_args,
    final_outputs,
    make_drafter,
    model_args,
    reference,
    run_job,
    spec,
    topology,
    write_prompts,
)
from test_verify_ngram import P_MIN, chi2_pvalue

PROMPT = [3, 7, 5, 11]
N_REQ = 600


def _filtered(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Closed-form top-k / top-p (vLLM's rules) on fp64 probabilities, row by row."""
    probs = torch.softmax(logits.double(), -1)
    out = torch.zeros_like(probs)
    for i, row in enumerate(probs.reshape(-1, probs.shape[-1])):
        order = sorted(range(len(row)), key=lambda t: -float(row[t]))
        keep = order[:top_k] if top_k else order
        kept = row[keep] / row[keep].sum()
        mass, chosen = 0.0, []
        for t, pt in zip(keep, kept.tolist()):
            if chosen and mass >= top_p:
                break
            chosen.append(t)
            mass += pt
        out.reshape(-1, probs.shape[-1])[i, chosen] = row[chosen] / row[chosen].sum()
    return out


def exact_marginals(model_dir, top_k: int = 0, top_p: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """P(t1), P(t2), P(t3) under plain sampling at T=1 (with top-k / top-p), from HF logits
    (independent code)."""
    from checkpoints import load_hf

    hf = load_hf(model_dir)
    v = hf.config.vocab_size
    with torch.no_grad():
        p1 = _filtered(hf(torch.tensor([PROMPT])).logits[0, -1], top_k, top_p)
        seq2 = torch.tensor([PROMPT + [a] for a in range(v)])
        p2 = _filtered(hf(seq2).logits[:, -1], top_k, top_p)  # [v, v]
        seq3 = torch.tensor([PROMPT + [a, b] for a in range(v) for b in range(v)])
        p3 = _filtered(hf(seq3).logits[:, -1], top_k, top_p).reshape(v, v, v)
    joint12 = p1[:, None] * p2
    return p1, joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


@pytest.mark.parametrize("algorithm,block", [("DFLASH", 4), ("DSPARK", 3)])
def test_spec_sampling_matches_target_distribution(tiny, tmp_path, algorithm, block):
    prompts = write_prompts(tmp_path / "same.jsonl", [{"input_ids": PROMPT}] * N_REQ)
    probe = ProposerProbe("dspark_launch.spec.block_drafter",
                          "DFlashProposer" if algorithm == "DFLASH" else "DSparkProposer",
                          make_drafter, {}, "record")
    draft = tiny.small_draft(algorithm, block)
    job = run_job(tmp_path, "sample", ["--model", str(tiny.small_vocab),
                                       "--speculative-algorithm", algorithm, "--draft",
                                       str(draft), "--prompts", str(prompts),
                                       "--max-new-tokens", "3", "--temperature", "1.0",
                                       "--seed", "11", "--speculative-policy", "fixed",
                                       *AMPLE], probe=probe)
    assert job.rcs == [0]
    outs = torch.tensor(job.outputs)  # [N, 3] (no EOS in this vocabulary)
    assert outs.shape == (N_REQ, 3)
    # Tokens 2 and 3 came through draft/verify rounds (some accepted drafts, some resampled).
    assert any(n >= 2 for r in job.records for n in r["accept_lens"])
    exact = exact_marginals(tiny.small_vocab)
    for pos in range(3):
        counts = torch.bincount(outs[:, pos], minlength=16)
        assert chi2_pvalue(counts, exact[pos]) > P_MIN, (pos, counts, exact[pos])
    # Power: the draft's own first proposals (what a rule that accepted every draft would
    # commit as token 2) are far from the target's distribution.
    firsts = {}
    for index, pos, d in job.probes[0]["log"]["drafts"]:
        if pos == len(PROMPT) + 1 and d and index not in firsts:
            firsts[index] = d[0]
    counts = torch.bincount(torch.tensor(list(firsts.values())), minlength=16)
    assert chi2_pvalue(counts, exact[1]) < 1e-6


def test_same_seed_same_sample_across_topologies(tiny, tmp_path):
    argv = [*model_args(tiny, "DSPARK", draft=tiny.dspark(4)), "--prompts",
            str(tiny.prompts12), "--max-new-tokens", "12", "--temperature", "0.8",
            "--top-k", "40", "--seed", "5", *AMPLE]
    one = run_job(tmp_path, "tp1", argv)
    two = run_job(tmp_path, "tp2", [*argv, *topology(2, 1)], world=2)
    dp = run_job(tmp_path, "tp2dp2", [*argv, *topology(2, 2)], world=2)
    other = run_job(tmp_path, "seed6", [*argv, "--seed", "6"])
    assert one.rcs == [0] and two.rcs == dp.rcs == [0, 0]
    assert one.outputs == two.outputs == dp.outputs
    assert one.outputs != other.outputs
    assert one.outputs != reference(tiny, tiny.prompts12, 12)  # really sampled


@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.97])
def test_confidence_threshold_truncates_verify(tiny, tmp_path, threshold):
    block = 6
    ref = reference(tiny, tiny.prompts12, 16)
    probe = ProposerProbe("dspark_launch.spec.block_drafter", "DSparkProposer", make_drafter,
                          {}, "record")
    job = run_job(tmp_path, "conf", [*model_args(tiny, "DSPARK", draft=tiny.dspark(block)),
                                     "--prompts", str(tiny.prompts12), "--max-new-tokens",
                                     "16", "--dspark-confidence-threshold", str(threshold),
                                     *AMPLE], probe=probe)
    assert job.rcs == [0]
    assert job.outputs == ref  # truncation never changes greedy output
    log = job.probes[0]["log"]
    kept: dict[int, list[int]] = {}
    for index, n in log["kept"]:
        kept.setdefault(index, []).append(n)
    drafts: dict[int, list[int]] = {}
    for index, _, d in log["drafts"]:
        drafts.setdefault(index, []).append(len(d))
    for rec in job.records:
        i = rec["index"]
        # one confidence cut per round that drafted, rounds counted in tau; a round with one
        # token left drafts nothing (a draft could not be committed): at most the last one
        assert len(rec["accept_lens"]) == rec["rounds"]
        assert len(kept[i]) in (rec["rounds"], rec["rounds"] - 1)
        if len(kept[i]) < rec["rounds"]:
            assert rec["accept_lens"][-1] == 1
        for n_kept, n_verified, acc in zip(kept[i], drafts[i], rec["accept_lens"]):
            assert n_verified <= n_kept
            assert 1 <= acc <= n_kept + 1
            if n_kept == 0:
                assert acc == 1  # an anchor-only verify commits exactly the bonus
    all_kept = [n for v in kept.values() for n in v]
    if threshold == 0:
        assert max(all_kept) == block
    elif threshold == 0.5:
        assert 0 in all_kept and any(0 < n < block for n in all_kept)
    else:
        assert set(all_kept) == {0}
        assert job.metrics["mean_tau"] == 1.0
    # The verify widths the engine used are the cut lengths (capped by room left).
    # (rounds that drafted nothing verify their anchor alone: width 0)
    rounds = [n for r in job.records for n in r["accept_lens"]]
    widths = sorted(n for _, n, _ in job.probes[0]["verifies"])
    undrafted = [0] * (len(rounds) - len(all_kept))
    assert widths == sorted([n for v in drafts.values() for n in v] + undrafted)
    assert job.metrics["rounds"] == len(rounds)
    assert job.metrics["mean_tau"] == pytest.approx(sum(rounds) / len(rounds))


@pytest.mark.parametrize("algorithm,block,threshold,top_k,top_p", [
    ("DFLASH", 4, 0.0, 0, 1.0),
    ("DSPARK", 3, 0.5, 6, 1.0),
    ("DSPARK", 3, 0.0, 0, 0.8),
], ids=["dflash", "dspark-conf0.5-topk6", "dspark-topp0.8"])
def test_batched_sampler_mixed_batch_matches_target(tiny, algorithm, block, threshold, top_k,
                                                    top_p):
    """Through the engine API: 600 sampled requests (T=1, top-k / top-p, DSpark with a
    confidence cut) and 60 greedy ones in the same batches. Sampled tokens follow the
    target's exact filtered marginals; greedy ones are plain greedy decoding."""
    greedy_ref = reference(tiny, write_prompts(tiny.root / "same1.jsonl",
                                               [{"input_ids": PROMPT}]), 3,
                           model=tiny.small_vocab)[0]
    specs = []
    for i in range(N_REQ + N_REQ // 10):
        params = (dict(temperature=0.0) if i % 11 == 10 else
                  dict(temperature=1.0, top_k=top_k, top_p=top_p))
        specs.append(spec(i, PROMPT, max_tokens=3, **params))
    args = engine_args(tiny, algorithm, tiny.small_draft(algorithm, block),
                       model=tiny.small_vocab, dspark_confidence_threshold=threshold,
                       max_running_requests=128, seed=11)
    final = final_outputs(drive(args, [Arrival(0, s) for s in specs])[0])
    sampled = torch.tensor([final[s.rid].output_ids for s in specs if s.params.temperature])
    greedy = [list(final[s.rid].output_ids) for s in specs if not s.params.temperature]
    assert sampled.shape == (N_REQ, 3)
    assert all(g == greedy_ref for g in greedy)
    assert any(n >= 2 for o in final.values() for n in o.accept_lens)  # drafts were accepted
    exact = exact_marginals(tiny.small_vocab, top_k, top_p)
    for pos in range(3):
        counts = torch.bincount(sampled[:, pos], minlength=16)
        assert chi2_pvalue(counts, exact[pos]) > P_MIN, (pos, counts, exact[pos])
    if top_k or top_p < 1:  # power: the unfiltered distribution is rejected
        plain = exact_marginals(tiny.small_vocab)
        assert min(chi2_pvalue(torch.bincount(sampled[:, pos], minlength=16), plain[pos])
                   for pos in range(3)) < 1e-6


def _slot_salts_drawn(rank: int, algorithm: str) -> list[list[int]]:
    """The purposes a drafter passed to its keyed uniforms over a short sampled batch."""
    from dspark_launch import LLM, SamplingParams
    from dspark_launch.spec import block_drafter, dspark_sampler, keyed

    seen: list[list[int]] = []

    def spy(keys, positions, purpose):  # records, then draws as the drafter would
        seen.append([purpose] if isinstance(purpose, int) else purpose.tolist())
        return keyed.uniforms(keys, positions, purpose)

    module = block_drafter if algorithm == "DFLASH" else dspark_sampler
    module.uniforms = spy
    with LLM(speculative_algorithm=algorithm, kv_cache_memory="64MiB", device="cpu",
             speculative_policy="fixed") as llm:
        llm.generate(["def f(x):", "class A:"], SamplingParams(max_tokens=8, temperature=1.0))
    return seen


@pytest.mark.parametrize("algorithm", ["DFLASH", "DSPARK"])
def test_drafters_draw_by_slot(algorithm):
    """Both drafters key their draws by each draft's slot in the block (draft_purposes: a
    position drafted again after a rejection draws afresh, test_verify_ngram's
    test_a_position_drafted_again_draws_afresh), not by one constant purpose."""
    from multirank import run_world

    from dspark_launch.spec.keyed import DRAFT, salt

    seen = run_world(1, _slot_salts_drawn, algorithm, timeout=120)[0]
    assert seen
    for salts in seen:
        k = salts.count(salt(DRAFT))  # requests drafting: one first slot each
        assert k and salts == [salt(DRAFT + j) for _ in range(k)
                               for j in range(len(salts) // k)]
        assert len(salts) // k > 1  # a block of several slots, each its own purpose
