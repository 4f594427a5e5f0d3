"""Unit tests: greedy_accept (prefix cumprod), rejection_accept (T->0 is greedy; lossless on a
toy p/q by chi-square), confident_length, and NGRAM prompt lookup."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_launch.spec.block_drafter import confident_length
from dspark_launch.spec.ngram import lookup
from dspark_launch.spec.sampling import probs_from_logits
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
    acc, bonus = greedy_accept(drafts, lens, target)
    # all match; mismatch at 1 (later matches do not count); mismatch at 0; capped by length;
    # matching padding past the length does not count.
    assert acc.tolist() == [4, 1, 0, 2, 2]
    assert bonus.tolist() == [42, 6, 5, 7, 0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=0, max_size=6),
                          st.lists(st.integers(0, 3), min_size=7, max_size=7)),
                min_size=1, max_size=5))
def test_greedy_accept_matches_loop(rows):
    k = 6
    drafts = torch.tensor([d + [0] * (k - len(d)) for d, _ in rows])
    lens = torch.tensor([len(d) for d, _ in rows])
    target = torch.tensor([t for _, t in rows])
    acc, bonus = greedy_accept(drafts, lens, target)
    for i, (d, t) in enumerate(rows):
        n = 0
        while n < len(d) and d[n] == t[n]:
            n += 1
        assert acc[i] == n and bonus[i] == t[n]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 1e-6]))
def test_rejection_at_zero_temperature_is_greedy(k, seed, temp):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, 11, generator=gen) * 3
    p = probs_from_logits(logits, temp)
    target = logits.argmax(-1)
    # drafts: a greedy prefix then (maybe) a wrong token
    drafts = target[:k].tolist()
    cut = int(torch.randint(0, k + 1, (), generator=gen))
    if cut < k:
        drafts[cut] = (drafts[cut] + 1) % 11
    q = probs_from_logits(torch.nn.functional.one_hot(torch.tensor(drafts), 11).float(), temp)
    for q_arg in (q, None):
        acc, nxt = rejection_accept(drafts, q_arg, p, torch.Generator().manual_seed(seed))
        g_acc, g_bonus = greedy_accept(torch.tensor([drafts]), torch.tensor([k]),
                                       target[None])
        assert (acc, nxt) == (int(g_acc[0]), int(g_bonus[0]))


def _toy(seed: int, v: int = 6):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, v, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(2, v, generator=gen) * 1.5, -1)
    return p, q


def test_rejection_sampling_is_lossless_on_toy_p_q():
    """Drafts from q, verify against p (rows independent of the prefix): the first committed
    token ~ p[0], the second (when the first draft survived) ~ p[1], the bonus after two ~ p[2]."""
    p, q = _toy(0)
    gen = torch.Generator().manual_seed(1)
    first, second = torch.zeros(6), torch.zeros(6)
    n = 6000
    for _ in range(n):
        d = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        acc, nxt = rejection_accept(d, q, p, gen)
        committed = d[:acc] + [nxt]
        first[committed[0]] += 1
        if len(committed) > 1:
            second[committed[1]] += 1
    assert chi2_pvalue(first, p[0]) > P_MIN
    assert chi2_pvalue(second, p[1]) > P_MIN
    # Power: the draft's own distribution is far from p (a lossy rule would be caught).
    assert chi2_pvalue(q[0] * n, p[0]) < 1e-6


def test_rejection_with_fixed_proposal_is_lossless():
    """q=None (a deterministic draft, e.g. NGRAM) still commits tokens distributed as p."""
    p, _ = _toy(2)
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(6)
    for _ in range(5000):
        acc, nxt = rejection_accept([4], None, p[:2], gen)
        counts[4 if acc else nxt] += 1
    assert chi2_pvalue(counts, p[0]) > P_MIN


def test_rejection_accepts_everything_when_q_equals_p():
    p, _ = _toy(4)
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        d = [int(torch.multinomial(p[i], 1, generator=gen)) for i in range(2)]
        acc, _ = rejection_accept(d, p[:2], p, gen)
        assert acc == 2


def test_confident_length():
    c = torch.tensor([0.9, 0.7, 0.4, 0.8])
    assert confident_length(c, 0.0) == 4  # threshold 0: the full block
    assert confident_length(c, 0.5) == 2  # between 0.4 and 0.7: first c below it
    assert confident_length(c, 0.75) == 1
    assert confident_length(c, 0.95) == 0  # truncated to 0: verify the anchor only
    assert confident_length(c, 0.3) == 4
    assert confident_length(torch.tensor([0.5, 0.5]), 0.5) == 2  # not below: kept


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
