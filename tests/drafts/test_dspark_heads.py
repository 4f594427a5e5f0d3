"""DSpark Markov head, confidence head and left-to-right block sampling (models.md §3, §5.8)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _draft_reference import sample_block
from draft_checkpoints import tiny_target_config, write_draft

from dspark_launch.models.draft_loader import load_draft
from dspark_launch.parallel import override_parallel

V, D, R_RANK = 256, 64, 8


@pytest.fixture(autouse=True)
def single_rank():
    with override_parallel(1):
        yield


def _dspark(tmp_path, **options):
    target = tiny_target_config()
    return load_draft(write_draft(tmp_path / "d", target, "DSPARK", **options), target)


def _inputs(rows: int, block: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, block, V, generator=gen),  # base logits
            torch.randn(rows, block, D, generator=gen),  # hidden
            torch.randint(0, V, (rows,), generator=gen))  # anchors


def test_bias_is_w1_prev_times_w2(tmp_path):
    draft = _dspark(tmp_path, markov_rank=R_RANK)
    head = draft.markov_head
    prev = torch.tensor([0, 7, 255, 7])
    expected = head.markov_w1.weight[prev] @ head.markov_w2.weight.T  # [N, V]
    torch.testing.assert_close(draft.markov_step(prev, None, None)[0], expected)


def test_anchor_seeds_step0_and_sampled_token_seeds_next(tmp_path):
    """Greedy: tokens follow l_k = U_k + bias(x_{k-1}) with x_{-1} = anchor, exactly."""
    draft = _dspark(tmp_path, markov_rank=R_RANK, scale=8.0)  # a bias big enough to matter
    base, hidden, anchors = _inputs(3, 5)
    tokens, _, _ = sample_block(draft, base, hidden, anchors, 0.0)
    prev = anchors
    for k in range(5):
        expected = (base[:, k] + draft.markov_step(prev, None, None)[0]).argmax(-1)
        assert torch.equal(tokens[:, k], expected)
        prev = tokens[:, k]
    # The head really changes the answer here (otherwise the check above is vacuous).
    assert not torch.equal(tokens, base.argmax(-1))
    # Changing only the anchor changes step 0's logits.
    other, _, _ = sample_block(draft, base, hidden, (anchors + 1) % V, 0.0)
    assert not torch.equal(other, tokens)


def test_rank_zero_is_plain_argmax(tmp_path):
    draft = _dspark(tmp_path, markov_rank=0, confidence=False)
    assert draft.markov_head is None and draft.confidence_head is None
    base, hidden, anchors = _inputs(4, 6)
    tokens, q, conf = sample_block(draft, base, hidden, anchors, 0.0)
    assert torch.equal(tokens, base.argmax(-1))
    assert torch.equal(q, F.one_hot(tokens, V).float())
    assert torch.equal(conf, torch.ones(4, 6))  # no head: never truncates


def test_confidence_formula(tmp_path):
    draft = _dspark(tmp_path, markov_rank=R_RANK)
    _, hidden, anchors = _inputs(5, 1)
    h = hidden[:, 0]
    proj = draft.confidence_head.proj
    e = draft.markov_head.markov_w1.weight[anchors]
    expected = torch.sigmoid(torch.cat([h, e], -1) @ proj.weight[0] + proj.bias[0])
    got = draft.confidence(h, anchors)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected)


def test_confidence_without_markov_input(tmp_path):
    draft = _dspark(tmp_path, markov_rank=R_RANK, confidence_with_markov=False)
    _, hidden, anchors = _inputs(3, 1)
    proj = draft.confidence_head.proj
    assert tuple(proj.weight.shape) == (1, D)
    expected = torch.sigmoid(hidden[:, 0] @ proj.weight[0] + proj.bias[0])
    torch.testing.assert_close(draft.confidence(hidden[:, 0], anchors), expected)


def test_sampling_returns_the_corrected_distribution(tmp_path):
    """At T > 0, q_k = softmax((U_k + bias(x_{k-1})) / T) with x_{k-1} the SAMPLED token,
    and a seeded generator per request makes the block reproducible."""
    draft = _dspark(tmp_path, markov_rank=R_RANK, scale=4.0)
    base, hidden, anchors = _inputs(3, 6)

    def run(seed):
        gens = [torch.Generator().manual_seed(seed + r) for r in range(3)]
        return sample_block(draft, base, hidden, anchors, 0.7, gens)

    tokens, q, _ = run(11)
    prev = anchors
    for k in range(6):
        expected = torch.softmax((base[:, k] + draft.markov_step(prev, None, None)[0]) / 0.7, -1)
        torch.testing.assert_close(q[:, k], expected)
        prev = tokens[:, k]
    again, _, _ = run(11)
    assert torch.equal(tokens, again)


def test_per_request_temperature_mixes_greedy_and_sampled(tmp_path):
    draft = _dspark(tmp_path, markov_rank=R_RANK)
    base, hidden, anchors = _inputs(2, 4)
    temps = torch.tensor([0.0, 1.0])
    tokens, q, _ = sample_block(draft, base, hidden, anchors, temps,
                                      [None, torch.Generator().manual_seed(0)])
    greedy, _, _ = sample_block(draft, base[:1], hidden[:1], anchors[:1], 0.0)
    assert torch.equal(tokens[0], greedy[0])
    assert torch.equal(q[0], F.one_hot(greedy[0], V).float())
    assert (q[1] > 0).all()  # a full softmax, not one-hot


def test_gated_head(tmp_path):
    draft = _dspark(tmp_path, markov_rank=R_RANK, head_type="gated")
    head = draft.markov_head
    _, hidden, prev = _inputs(3, 1)
    h = hidden[:, 0]
    e = head.markov_w1.weight[prev]
    gate = torch.sigmoid(torch.cat([h, e], -1) @ head.gate_proj.weight.T
                         + head.gate_proj.bias)
    want = (gate * e) @ head.markov_w2.weight.T
    torch.testing.assert_close(draft.markov_step(prev, h, None)[0], want)

