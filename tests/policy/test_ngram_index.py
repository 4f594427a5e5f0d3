"""The incremental NGRAM index proposes exactly what the whole-history scan (`lookup`) proposes,
at every length of a growing sequence, for every suffix length and block size."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_launch.engine.request import Request, RequestSpec
from dspark_launch.spec.ngram import NgramIndex, NgramProposer, lookup
from dspark_launch.spec.sampling import SamplingRows


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 4),
       st.integers(0, 9), st.lists(st.integers(1, 5), min_size=1, max_size=20))
def test_index_equals_scan_as_tokens_commit(seq, max_n, k, chunks):
    index = NgramIndex(max_n)
    pos = 0
    for c in chunks * 4:  # commit in rounds of varying size, checking after each
        if pos >= len(seq):
            break
        index.extend(seq[pos:pos + c])
        pos = min(len(seq), pos + c)
        assert index.propose(k) == lookup(seq[:pos], max_n, k), (seq[:pos], max_n, k)


def test_loop_proposes_whole_block():
    index = NgramIndex(3)
    index.extend([1, 2, 7, 7, 7])
    assert index.propose(5) == [7] * 5 == lookup([1, 2, 7, 7, 7], 3, 5)


def test_proposer_follows_requests_as_they_grow():
    prompt = (3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5)
    reqs = [Request(RequestSpec(i, f"r{i}", prompt[i:]), 0.0, i) for i in range(3)]
    prop = NgramProposer(block_size=6, max_n=3)
    tails = [[1, 4, 1], [5, 9], [3, 5, 3, 5]]
    limits = [5, 3, 0]
    for step in range(4):
        for r, tail in zip(reqs, tails):
            r.output_ids.extend(tail[step % len(tail):][:2])
        rows = SamplingRows.build([r.params for r in reqs], [r.key for r in reqs],
                                  [len(r.output_ids) for r in reqs], "cpu")
        got = prop.propose(reqs, limits, rows)
        want = [lookup(r.all_ids, 3, k) for r, k in zip(reqs, limits)]
        assert got.widths == [len(w) for w in want]
        assert [t[:n] for t, n in zip(got.tokens.tolist(), got.widths)] == want
