"""Unit tests: greedy_accept (prefix cumprod), batched rejection_accept (T->0 is greedy; lossless
on a toy p/q by chi-square, thousands of requests in one batch), keyed uniforms, the batched
per-row sampler (temperature / top-k / top-p against closed forms), confident_length, and NGRAM
prompt lookup."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_launch.spec.block_drafter import confident_length
from dspark_launch.spec.keyed import (
    ACCEPT,
    DRAFT,
    SAMPLE,
    draft_purposes,
    request_key,
    salt,
    uniforms,
)
from dspark_launch.spec.ngram import lookup
from dspark_launch.spec.sampling import draw, probs_from_logits
from dspark_launch.spec.verify import greedy_accept, rejection_accept

P_MIN = 1e-3  # chi-square tests pass when p > 1e-3 (fixed seeds: deterministic)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; bins with expected < 5 are pooled."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def test_greedy_accept_prefix_only():
    drafts = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 6, 7, 8], [5, 6, 7, 8],
                           [5, 6, 0, 0]])
    lens = torch.tensor([4, 4, 4, 2, 2])
    target = torch.tensor([[5, 6, 7, 8, 42]] * 4 + [[5, 6, 0, 0, 9]])
    acc, committed = greedy_accept(drafts, lens, target)
    # all match; mismatch at 1 (later matches do not count); mismatch at 0; capped by length;
    # matching padding past the length does not count.
    assert acc.tolist() == [4, 1, 0, 2, 2]
    # the accepted drafts, then the target's token after them, then -1
    assert committed.tolist() == [[5, 6, 7, 8, 42], [5, 6, -1, -1, -1], [5, -1, -1, -1, -1],
                                  [5, 6, 7, -1, -1], [5, 6, 0, -1, -1]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=0, max_size=6),
                          st.lists(st.integers(0, 3), min_size=7, max_size=7)),
                min_size=1, max_size=5))
def test_greedy_accept_matches_loop(rows):
    k = 6
    drafts = torch.tensor([d + [0] * (k - len(d)) for d, _ in rows])
    lens = torch.tensor([len(d) for d, _ in rows])
    target = torch.tensor([t for _, t in rows])
    acc, committed = greedy_accept(drafts, lens, target)
    for i, (d, t) in enumerate(rows):
        n = 0
        while n < len(d) and d[n] == t[n]:
            n += 1
        assert acc[i] == n
        assert committed[i].tolist() == d[:n] + [t[n]] + [-1] * (k - n)


def _uniforms(n: int, k: int, purpose: int, seed: int = 0) -> torch.Tensor:  # [n, k]
    keys = torch.tensor([request_key(seed, i, None) for i in range(n)]).repeat_interleave(k)
    pos = torch.arange(k).repeat(n)
    return uniforms(keys, pos, purpose).reshape(n, k)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 1e-6]))
def test_rejection_at_zero_temperature_is_greedy(k, seed, temp):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, 11, generator=gen) * 3
    p = probs_from_logits(logits, temp)
    target = logits.argmax(-1)
    # drafts: a greedy prefix then (maybe) a wrong token
    drafts = target[:k].clone()
    cut = int(torch.randint(0, k + 1, (), generator=gen))
    if cut < k:
        drafts[cut] = (drafts[cut] + 1) % 11
    q = probs_from_logits(torch.nn.functional.one_hot(drafts, 11).float(), temp)
    u_acc, u_s = _uniforms(1, k, ACCEPT, seed), _uniforms(1, k + 1, SAMPLE, seed)
    g_acc, g_committed = greedy_accept(drafts[None], torch.tensor([k]), target[None])
    g_bonus = g_committed[0, g_acc[0]]
    for q_arg in (q[None], None):
        acc, nxt = rejection_accept(drafts[None], torch.tensor([k]), q_arg, p[None], u_acc, u_s)
        assert (int(acc[0]), int(nxt[0])) == (int(g_acc[0]), int(g_bonus))


def _toy(seed: int, v: int = 6):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, v, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(2, v, generator=gen) * 1.5, -1)
    return p, q


def test_keyed_uniforms_are_uniform_and_keyed():
    u = _uniforms(4000, 5, DRAFT)
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.histc(u.flatten(), bins=20, min=0, max=1)
    assert chi2_pvalue(counts, torch.full((20,), 1 / 20)) > P_MIN
    # Same key, position and purpose: the same number, whatever else is in the batch.
    keys = torch.tensor([request_key(0, i, None) for i in range(8)])
    alone = uniforms(keys[3:4], torch.tensor([7]), SAMPLE)
    batch = uniforms(keys, torch.full((8,), 7), SAMPLE)
    assert alone[0] == batch[3]
    assert uniforms(keys[3:4], torch.tensor([7]), ACCEPT)[0] != alone[0]
    # A request's own seed keys it regardless of its index or the engine seed.
    assert request_key(0, 3, 42) == request_key(9, 11, 42) != request_key(0, 3, 43)
    assert request_key(0, 3, None) != request_key(0, 4, None)


def test_a_position_drafted_again_draws_afresh():
    """A draft's draw is keyed by its slot in the block (the round's anchor) too: a position
    drafted at slot 2 of one round, then at slot 0 of the next after a rejection before it,
    draws an unrelated uniform (its first draw may have steered the policy's records, from
    which the next round's admission of it is decided). No draft salt is an accept or sample
    salt, and each slot's draws are uniform."""
    n, k, anchor = 4000, 4, 50
    keys = torch.tensor([request_key(0, i, None) for i in range(n)]).repeat_interleave(k)
    salts = draft_purposes(n, k)
    first = uniforms(keys, torch.arange(anchor, anchor + k).repeat(n), salts).reshape(n, k)
    again = uniforms(keys, torch.arange(anchor + 2, anchor + 2 + k).repeat(n),
                     salts).reshape(n, k)
    assert bool((first[:, 2] != again[:, 0]).all())
    assert abs(float(torch.corrcoef(torch.stack([first[:, 2], again[:, 0]]))[0, 1])) < 0.06
    for j in range(k):
        counts = torch.histc(first[:, j], bins=20, min=0, max=1)
        assert chi2_pvalue(counts, torch.full((20,), 1 / 20)) > P_MIN
    assert not set(draft_purposes(1, 64).tolist()) & {salt(ACCEPT), salt(SAMPLE)}


def _murmur_uniform(key: int, position: int, purpose: int) -> float:
    """The keyed uniform in Python integers (no overflow anywhere): the oracle."""
    def fmix(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    h = fmix((key + position * 0x9E3779B1) & 0xFFFFFFFF)
    h = fmix(h ^ ((purpose * 0x632BE5AB) & 0xFFFFFFFF))
    return ((h >> 9) * 2 + 1) / 2**24


def test_keyed_uniforms_equal_python_integers():
    """The tensor hash lets 32-bit products wrap in int64 (past 2^63 for large operands): its
    draws must equal exact integer arithmetic, extremes included, for a purpose given once or
    per element (salt)."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randint(0, 2**32, (2000,), generator=gen, dtype=torch.int64)
    positions = torch.randint(0, 2**32, (2000,), generator=gen, dtype=torch.int64)
    positions[:500] = torch.arange(500)  # real output positions are small
    keys[-4:] = torch.tensor([0, 1, 2**32 - 1, 2**31])
    positions[-4:] = torch.tensor([2**32 - 1, 2**32 - 2, 2**32 - 1, 0])
    kinds = (DRAFT + 3, ACCEPT, SAMPLE)  # (a draft block's slot 3)
    picked = torch.randint(0, 3, (2000,), generator=gen)
    want = [[_murmur_uniform(k, p, purpose) for k, p in zip(keys.tolist(), positions.tolist())]
            for purpose in kinds]
    for purpose, expected in zip(kinds, want):
        assert uniforms(keys, positions, purpose).tolist() == expected
    salts = torch.tensor([salt(kinds[int(x)]) for x in picked])
    mixed = [want[int(x)][i] for i, x in enumerate(picked)]
    assert draft_purposes(1, 4)[3] == salt(DRAFT + 3)
    assert uniforms(keys, positions, salts).tolist() == mixed
    # Small positions in int32 (a product of two 32-bit values must not wrap at 32 bits).
    assert uniforms(keys[:500], positions[:500].to(torch.int32), SAMPLE).tolist() == want[2][:500]


def test_rejection_sampling_is_lossless_on_toy_p_q():
    """Drafts from q, verify against p (rows independent of the prefix), n requests in one
    batch: the first committed token ~ p[0], the second (when the first draft survived)
    ~ p[1]."""
    p, q = _toy(0)
    n = 6000
    u_draft = _uniforms(n, 2, DRAFT)
    drafts = torch.stack([draw(q[i].expand(n, -1), u_draft[:, i]) for i in range(2)], 1)
    acc, nxt = rejection_accept(drafts, torch.full((n,), 2), q.expand(n, -1, -1),
                                p.expand(n, -1, -1), _uniforms(n, 2, ACCEPT),
                                _uniforms(n, 3, SAMPLE))
    first = torch.where(acc > 0, drafts[:, 0], nxt)
    second = torch.where(acc > 1, drafts[:, 1], nxt)[acc >= 1]
    assert chi2_pvalue(torch.bincount(first, minlength=6), p[0]) > P_MIN
    assert chi2_pvalue(torch.bincount(second, minlength=6), p[1]) > P_MIN
    # Power: the draft's own distribution is far from p (a lossy rule would be caught).
    assert chi2_pvalue(torch.bincount(drafts[:, 0], minlength=6), p[0]) < 1e-6


def test_rejection_with_fixed_proposal_is_lossless():
    """q=None (a point mass, e.g. NGRAM) still commits tokens distributed as p."""
    p, _ = _toy(2)
    n = 5000
    acc, nxt = rejection_accept(torch.full((n, 1), 4), torch.ones(n, dtype=torch.int64), None,
                                p[:2].expand(n, -1, -1), _uniforms(n, 1, ACCEPT),
                                _uniforms(n, 2, SAMPLE))
    first = torch.where(acc > 0, torch.full_like(nxt, 4), nxt)
    assert chi2_pvalue(torch.bincount(first, minlength=6), p[0]) > P_MIN


def test_rejection_accepts_everything_when_q_equals_p():
    p, _ = _toy(4)
    n = 200
    u = _uniforms(n, 2, DRAFT)
    drafts = torch.stack([draw(p[i].expand(n, -1), u[:, i]) for i in range(2)], 1)
    acc, _ = rejection_accept(drafts, torch.full((n,), 2), p[:2].expand(n, -1, -1),
                              p.expand(n, -1, -1), _uniforms(n, 2, ACCEPT),
                              _uniforms(n, 3, SAMPLE))
    assert (acc == 2).all()


def test_draw_follows_top_k_top_p_closed_form():
    """Batched per-row parameters: each row's draws follow its own closed-form distribution."""
    from dspark_launch.engine.params import SamplingParams
    from dspark_launch.spec.sampling import SamplingRows, target_probs

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    settings_ = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=3),
                 SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=0.0)]
    n = 3000
    params = [s for s in settings_ for _ in range(n)]
    keys = [request_key(0, i, None) for i in range(len(params))]
    rows = SamplingRows.build(params, keys, [0] * len(params), "cpu")
    probs = target_probs(logits.expand(len(params), -1), rows)
    toks = draw(probs, uniforms(rows.keys, rows.positions, SAMPLE)).reshape(4, n)
    base = torch.softmax(logits[0].double(), -1)
    top3 = torch.softmax(logits[0].double() / 0.5, -1) * torch.tensor([1, 1, 1, 0, 0, 0])
    nucleus = base * torch.tensor([1, 1, 0, 0, 0, 0])  # 0.56 < 0.7 <= 0.56 + 0.21
    for row, want in zip(toks[:3], (base, top3 / top3.sum(), nucleus / nucleus.sum())):
        assert chi2_pvalue(torch.bincount(row, minlength=6), want) > P_MIN
    assert (toks[3] == 0).all()  # greedy row in the same batch: the argmax


def test_extreme_top_k_and_top_p_are_what_they_mean():
    """A top_k past any vocabulary (2**63 overflowed the int64 upload and killed the server's
    step) keeps every token; a top_p that float32 reads as 0 keeps the most likely one (its
    rows were all 0 and every draw fell to the last id)."""
    from dspark_launch.engine.params import SamplingParams
    from dspark_launch.spec.sampling import SamplingRows, target_probs

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = [SamplingParams(temperature=1.0, top_k=2**63), SamplingParams(top_k=2**70),
              SamplingParams(temperature=1.0, top_p=1e-50), SamplingParams(top_p=1e-46)]
    rows = SamplingRows.build(params, [1, 2, 3, 4], [0] * 4, "cpu")
    probs = target_probs(logits.expand(4, -1), rows)
    softmax = torch.softmax(logits[0], -1)
    assert torch.allclose(probs[0], softmax) and torch.allclose(probs[1], softmax)
    one_hot = torch.nn.functional.one_hot(torch.tensor(0), 6).float()
    assert torch.equal(probs[2], one_hot) and torch.equal(probs[3], one_hot)


def test_confident_length():
    c = torch.tensor([[0.9, 0.7, 0.4, 0.8], [0.5, 0.5, 0.1, 0.1]])
    assert confident_length(c, 0.0) is None  # threshold 0: the full block
    assert confident_length(c, 0.5).tolist() == [2, 2]  # first c below it; 0.5 is kept
    assert confident_length(c, 0.75).tolist() == [1, 0]
    assert confident_length(c, 0.95).tolist() == [0, 0]  # nothing may be accepted
    assert confident_length(c, 0.05).tolist() == [4, 4]


def test_ngram_lookup():
    assert lookup([1, 2, 3, 9, 1, 2, 3], 3, 3) == [9, 1, 2]
    assert lookup([1, 2, 3, 9, 1, 2, 3], 3, 6) == [9, 1, 2, 3, 9, 1]  # copies past the end
    assert lookup([1, 2, 3, 9, 1, 2, 3], 3, 1) == [9]
    # the most recent earlier occurrence wins
    assert lookup([7, 1, 5, 7, 1, 6, 7, 1], 2, 2) == [6, 7]
    # the longest suffix wins over a more recent shorter one
    assert lookup([4, 5, 6, 8, 9, 6, 7, 4, 5, 6], 3, 2) == [8, 9]
    # fall back to shorter suffixes; nothing when no earlier occurrence
    assert lookup([1, 2, 3, 4, 3], 3, 2) == [4, 3]
    assert lookup([1, 2, 3, 4, 3], 3, 5) == [4, 3, 4, 3, 4]
    assert lookup([1, 2, 3, 4], 3, 2) == []
    assert lookup([5], 3, 2) == []
    assert lookup([1, 2, 1, 2], 3, 0) == []
    # a repeating tail proposes its own continuation (self-overlapping match)
    assert lookup([3, 3, 3, 3], 3, 4) == [3, 3, 3, 3]
    assert lookup([1, 2, 1, 2, 1, 2], 2, 5) == [1, 2, 1, 2, 1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=14), st.integers(1, 3),
       st.integers(0, 5))
def test_ngram_lookup_property(ids, max_n, k):
    out = lookup(ids, max_n, k)
    if not out:
        return
    assert len(out) == k
    # ids + out repeats itself: out continues an earlier occurrence of a suffix of ids
    ext = ids + out
    ok = False
    for n in range(1, min(max_n, len(ids) - 1) + 1):
        for s in range(len(ids) - n):
            if ids[s:s + n] == ids[-n:] and ext[s + n:s + n + k] == out:
                ok = True
    assert ok


def _sorted_filters(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Oracle: each row on its own, sorting its whole vocabulary (transformers' top-k keeps
    ties with the k-th; top-p the smallest sorted prefix reaching the mass)."""
    out = []
    for row, p in zip(logits.double(), params):
        if p.temperature < 1e-5:
            out.append(torch.nn.functional.one_hot(row.argmax(), row.numel()).double())
            continue
        x = row / p.temperature
        if p.top_k:
            kth = torch.sort(x, descending=True).values[min(p.top_k, x.numel()) - 1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, -1)
        if p.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = (sorted_p.cumsum(0) - sorted_p) < p.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
            probs = probs / probs.sum()
        out.append(probs)
    return torch.stack(out).float()


def test_filters_match_a_per_row_sort_of_the_vocabulary():
    """The filters look at each row's most likely tokens through a top-k of the largest k
    asked (and top-p only at the rows that have one, over their top-k where each has one)
    instead of sorting every row of the vocabulary; the result is the sorted oracle's, for
    mixed rows, draft-block rows (repeat) and greedy rows among them."""
    from dspark_launch.engine.params import SamplingParams
    from dspark_launch.spec.sampling import SamplingRows, target_probs

    gen = torch.Generator().manual_seed(0)
    vocab = 3000
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20),
              SamplingParams(temperature=1.3, top_p=0.9),
              SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
              SamplingParams(temperature=1.0, top_k=5, top_p=0.5),
              SamplingParams(temperature=0.0, top_k=3, top_p=0.2),
              SamplingParams(temperature=1.0, top_k=vocab + 7)]
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    rows = SamplingRows.build(params, list(range(len(params))), [0] * len(params), "cpu")
    torch.testing.assert_close(target_probs(logits, rows), _sorted_filters(logits, params),
                               atol=1e-6, rtol=1e-5)
    # Only rows with top-k among the nucleus rows: the narrow path (a top-k of width 20)
    narrow = [params[1], params[3], params[4]]
    rows = SamplingRows.build(narrow, [1, 2, 3], [0] * 3, "cpu").repeat(2)
    block = logits[[1, 1, 3, 3, 4, 4]]
    assert rows.top_p_width == 20
    torch.testing.assert_close(target_probs(block, rows),
                               _sorted_filters(block, [p for p in narrow for _ in (0, 1)]),
                               atol=1e-6, rtol=1e-5)
