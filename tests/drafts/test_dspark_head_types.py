"""DeepSpec's gated (with gate_proj.bias) and rnn Markov heads against plain torch written here
from models.md §3, through the whole drafter (backbone -> lm_head -> left-to-right walk), plus
the vocab-slice contract of `markov_step` the vectorised sampler relies on.

The reference reads the checkpoint-named tensors straight from the safetensors file and
shares no code with dspark_launch.
"""

from __future__ import annotations

import json

import pytest
import torch
from _draft_reference import ref_block, run_draft, sample_block
from draft_checkpoints import tiny_target_config, write_draft
from safetensors.torch import load_file

from dspark_launch.models.draft_loader import load_draft
from dspark_launch.models.layers import PackPlan, pack_model, unpack_model
from dspark_launch.parallel import override_parallel

TARGET = tiny_target_config()
V, D, R = TARGET.vocab_size, TARGET.hidden_size, 8
CTX_LENS = (3, 9, 1, 14)
BLOCK = 7
# fp32 through two layers and the lm_head in another order of summation: 1e-5 failed on one
# CPU by 1.4e-5 at one logit in 1792 (a wrong Markov bias moves logits by ~0.1 or more)
TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(autouse=True)
def single_rank():
    with override_parallel(1):
        yield


def ref_markov_logits(sd, raw, base: torch.Tensor, hidden: torch.Tensor, prevs: list[int]
                      ) -> torch.Tensor:
    """One request's corrected logits l_k = U_k + bias_k for k = 0..B-1 (models.md §3).

    base [B, V] = U, hidden [B, d] = h (final-normed), prevs[k] = x_{k-1} (prevs[0] = anchor).
    """
    head = raw["markov_head_type"]
    w1, w2 = sd["markov_head.markov_w1.weight"], sd["markov_head.markov_w2.weight"]  # [V, r]
    r = w1.shape[1]
    state = torch.zeros(r)  # s_{-1} = 0, reset every block
    out = []
    for k, prev in enumerate(prevs):
        e = w1[prev]  # [r]
        if head == "vanilla":
            bias = w2 @ e
        elif head == "gated":
            g = torch.sigmoid(sd["markov_head.gate_proj.weight"] @ torch.cat([hidden[k], e])
                              + sd.get("markov_head.gate_proj.bias", torch.zeros(r)))
            bias = w2 @ (g * e)
        else:  # rnn
            z = torch.cat([state, e, hidden[k]])  # [2r + d]: old state, W1[x], h, in order
            a = sd["markov_head.joint_proj.weight"] @ z + sd["markov_head.joint_proj.bias"]
            g, u, o = a[:r], a[r:2 * r], a[2 * r:]
            bias = w2 @ torch.tanh(o)  # from z, i.e. the OLD state
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(u)
        out.append(base[k] + bias)
    return torch.stack(out)  # [B, V]


def ref_greedy(sd, raw, base, hidden, anchor: int) -> tuple[list[int], torch.Tensor]:
    """Greedy walk: x_k = argmax l_k, fed back as the next slot's previous token."""
    prevs = [anchor]
    for k in range(base.shape[0]):
        logits = ref_markov_logits(sd, raw, base[:k + 1], hidden[:k + 1], prevs)
        prevs.append(int(logits[k].argmax()))
    return prevs[1:], logits


def _case(tmp_path, head_type: str, seed: int = 0, scale: float = 3.0, **options):
    """A loaded DeepSpec-format draft, its raw tensors, and our / the reference's block
    hidden states and base logits (U = h @ lm_head copy) for four requests."""
    path = write_draft(tmp_path / head_type, TARGET, "DSPARK", seed=seed, scale=scale,
                       head_type=head_type, markov_rank=R, block_size=BLOCK, num_layers=2,
                       **options)
    draft = load_draft(path, TARGET)
    raw = json.loads((path / "config.json").read_text())
    sd = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1)
    m = draft.config.num_features
    feats = [torch.randn(n, m * D, generator=gen) for n in CTX_LENS]
    blocks = [torch.randn(BLOCK, D, generator=gen) for _ in CTX_LENS]
    ours = run_draft(draft, feats, blocks).view(len(CTX_LENS), BLOCK, D)
    ref = torch.stack([ref_block(sd, raw, f, torch.arange(f.shape[0]), x,
                                 torch.arange(f.shape[0], f.shape[0] + BLOCK))
                       for f, x in zip(feats, blocks)])  # [R, B, d]
    lm_head = sd["lm_head.weight"]
    return draft, raw, sd, (ours, ours @ lm_head.T), (ref, ref @ lm_head.T)


def _our_logits(draft, base, hidden, anchors, tokens) -> torch.Tensor:
    """Our corrected logits along a given token path, through the public step API."""
    state = draft.markov_state(anchors.shape[0], "cpu")
    prev, out = anchors, []
    for k in range(base.shape[1]):
        bias, state = draft.markov_step(prev, hidden[:, k], state)
        out.append(base[:, k] + bias)
        prev = tokens[:, k]
    return torch.stack(out, dim=1)  # [R, B, V]


def _greedy_as_reference(draft, raw, sd, ours, ref, anchors: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy walk on our (hidden, base logits) -> (tokens, q), checked request by request
    against the reference's walk on its own: the same tokens, logits to within TOL."""
    (h, base), (ref_h, ref_base) = ours, ref
    tokens, q, _ = sample_block(draft, base, h, anchors, 0.0)
    logits = _our_logits(draft, base, h, anchors, tokens)
    for r in range(len(CTX_LENS)):
        ref_tokens, ref_logits = ref_greedy(sd, raw, ref_base[r], ref_h[r], int(anchors[r]))
        assert tokens[r].tolist() == ref_tokens
        torch.testing.assert_close(logits[r], ref_logits, **TOL)
    return tokens, q


@pytest.mark.parametrize("head_type", ["gated", "rnn"])
def test_greedy_block_logits_match_reference(tmp_path, head_type):
    draft, raw, sd, (h, base), (ref_h, ref_base) = _case(tmp_path, head_type)
    assert raw["markov_head_type"] == head_type
    if head_type == "gated":
        assert sd["markov_head.gate_proj.bias"].abs().min() > 0  # a real, non-zero bias
    tokens, q = _greedy_as_reference(draft, raw, sd, (h, base), (ref_h, ref_base),
                                     torch.tensor([5, 17, 250, 0]))
    assert torch.equal(q, torch.nn.functional.one_hot(tokens, V).float())
    # The head decides tokens here (otherwise the token check above would be vacuous).
    assert not torch.equal(tokens, base.argmax(-1))


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_w2s_transposed_copy_walks_as_the_reference(tmp_path, head_type):
    """Under the run's transposed GEMM, W2 keeps W2^T [r, V] and the walk reads it (every
    vocab slice a view of it): tokens and logits still the reference's. oneDNN's blocked copy
    cannot be sliced by vocabulary: W2 keeps none; unpacked, W2 is read transposed again."""
    draft, raw, sd, (h, base), (ref_h, ref_base) = _case(tmp_path, head_type, seed=2)
    head = draft.markov_head
    pack_model(draft, PackPlan(), "onednn")
    assert head.markov_w2.packed is None
    pack_model(draft, PackPlan(), "transposed")
    copy = head.markov_w2.packed.weight
    assert copy.shape == (R, V) and copy.is_contiguous()
    assert head.columns().data_ptr() == copy.data_ptr()
    assert head.columns(slice(64, 128)).data_ptr() == copy[:, 64:].data_ptr()
    tokens, _ = _greedy_as_reference(draft, raw, sd, (h, base), (ref_h, ref_base),
                                     torch.tensor([3, 250, 17, 0]))
    assert not torch.equal(tokens, base.argmax(-1))  # the head decides tokens here
    unpack_model(draft)
    assert head.columns().data_ptr() == head.markov_w2.weight.data_ptr()


@pytest.mark.parametrize("head_type", ["gated", "rnn"])
def test_sampled_block_distribution_matches_reference(tmp_path, head_type):
    """At T > 0 each q_k = softmax(l_k / T) with x_{k-1} the SAMPLED token and the rnn state
    carried along that sampled path."""
    draft, raw, sd, (h, base), (ref_h, ref_base) = _case(tmp_path, head_type, seed=4)
    anchors = torch.tensor([1, 2, 3, 4])
    gens = [torch.Generator().manual_seed(40 + r) for r in range(4)]
    tokens, q, _ = sample_block(draft, base, h, anchors, 0.8, gens)
    for r in range(len(CTX_LENS)):
        prevs = [int(anchors[r]), *tokens[r, :-1].tolist()]
        ref_logits = ref_markov_logits(sd, raw, ref_base[r], ref_h[r], prevs)
        torch.testing.assert_close(q[r], torch.softmax(ref_logits / 0.8, -1), **TOL)


def test_gated_bias_is_applied(tmp_path):
    """The same checkpoint without gate_proj.bias (bias 0) gives different logits: the bias
    tensor is not silently dropped."""
    with_bias, _, _, (h, base), _ = _case(tmp_path / "a", "gated")
    without = load_draft(write_draft(tmp_path / "b", TARGET, "DSPARK", scale=3.0,
                                     head_type="gated", markov_rank=R, block_size=BLOCK,
                                     num_layers=2, drop=["markov_head.gate_proj.bias"]), TARGET)
    prev = torch.arange(4)
    a, _ = with_bias.markov_step(prev, h[:, 0], None)
    b, _ = without.markov_step(prev, h[:, 0], None)
    assert (a - b).abs().max() > 1e-2


def test_rnn_state_carries_within_a_block_and_resets_between_blocks(tmp_path):
    draft, _, _, (h, base), _ = _case(tmp_path, "rnn")
    zero = draft.markov_state(4, "cpu")
    assert torch.equal(zero, torch.zeros(4, R))
    prev = torch.tensor([9, 9, 9, 9])
    _, s1 = draft.markov_step(prev, h[:, 0], zero)
    assert s1.abs().max() > 1e-2
    # Same token and hidden, different state -> different bias (the state is read).
    b_zero, _ = draft.markov_step(prev, h[:, 1], zero)
    b_s1, _ = draft.markov_step(prev, h[:, 1], s1)
    assert (b_zero - b_s1).abs().max() > 1e-3
    # sample_block starts every block from s = 0: the same inputs give the same block.
    anchors = torch.tensor([5, 6, 7, 8])
    first = sample_block(draft, base, h, anchors, 0.0)[0]
    assert torch.equal(sample_block(draft, base, h, anchors, 0.0)[0], first)


@pytest.mark.parametrize("head_type,rank", [("vanilla", R), ("gated", R), ("rnn", R),
                                            ("vanilla", 0)])
def test_vocab_slice_is_the_columns_of_the_full_bias(tmp_path, head_type, rank):
    """markov_step(vocab=slice) computes just those columns (one rank's vocab shard), and
    with base adds them to those logits; markov_walk(vocab) gives the same, slot after slot."""
    path = write_draft(tmp_path / "d", TARGET, "DSPARK", head_type=head_type, markov_rank=rank,
                       scale=3.0)
    draft = load_draft(path, TARGET)
    gen = torch.Generator().manual_seed(3)
    prev, hidden = torch.randint(0, V, (5,), generator=gen), torch.randn(5, D, generator=gen)
    state = draft.markov_state(5, "cpu")
    if state is not None:
        state = torch.randn(5, R, generator=gen)
    full, s_full = draft.markov_step(prev, hidden, state)
    assert full.shape == (5, V) and full.dtype == torch.float32
    for cols in (slice(0, 64), slice(64, 128), slice(200, 256), slice(250, 256)):
        part, s_part = draft.markov_step(prev, hidden, state, cols)
        assert part.shape == (5, cols.stop - cols.start)
        torch.testing.assert_close(part, full[:, cols], atol=1e-6, rtol=1e-6)
        if state is None:
            assert s_part is None and s_full is None
        else:
            assert torch.equal(s_part, s_full)
    # base: the slot's logits U_k, returned with the bias added (one multiply-add in fp32).
    base = torch.randn(5, 64, generator=gen)
    summed, s_sum = draft.markov_step(prev, hidden, state, slice(64, 128), base)
    torch.testing.assert_close(summed, base + full[:, 64:128], atol=1e-6, rtol=1e-6)
    assert (s_sum is None) if state is None else torch.equal(s_sum, s_full)
    if rank == 0:
        assert torch.equal(full, torch.zeros(5, V))
    # markov_walk: the same step, its columns taken once for every slot of a block.
    walk = draft.markov_walk(slice(64, 128))
    for _ in range(2):
        walked, s_walk = walk(prev, hidden, state, base)
        assert torch.equal(walked, summed)
        assert (s_walk is None) if state is None else torch.equal(s_walk, s_full)
    whole, _ = draft.markov_walk()(prev, hidden, state, torch.zeros(5, V))
    torch.testing.assert_close(whole, full, atol=1e-6, rtol=1e-6)
