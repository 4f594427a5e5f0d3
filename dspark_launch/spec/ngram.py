"""Prompt lookup (NGRAM): propose what followed the latest earlier match of the last n tokens.

`lookup` is the definition (a scan of the whole history); the proposer uses `NgramIndex`, which
keeps, per request, the latest end position of every n-gram (n <= max_n) and is updated as tokens
commit, so a step costs O(max_n * new tokens + k) instead of O(history * max_n).

Model-free, so it is the baseline every drafter's tau is reported against, and it exercises long
accepted blocks even with random weights (greedy output of a tiny random model repeats).
"""

from __future__ import annotations

from dspark_launch.spec.proposer import Proposal, Proposer
from dspark_launch.spec.sampling import SamplingRows


def lookup(ids: list[int], max_n: int, k: int) -> list[int]:
    """Tokens after the most recent earlier occurrence of the longest matching suffix (n<=max_n)."""
    if k <= 0:
        return []
    for n in range(min(max_n, len(ids) - 1), 0, -1):
        suffix = ids[-n:]
        # Search right to left, excluding the suffix itself.
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                return _copy_forward(ids, start + n, k)
    return []


def _copy_forward(ids: list[int], src: int, k: int) -> list[int]:
    """k tokens copied from ids[src:], LZ77-style: a match that ends near the end of the
    sequence keeps copying what it has just proposed, so a period-p loop proposes the whole
    block (e.g. [.., 7, 7, 7] -> [7] * k), not just the p tokens left before the end."""
    out: list[int] = []
    for p in range(src, src + k):  # without copying the history
        out.append(ids[p] if p < len(ids) else out[p - len(ids)])
    return out


class NgramIndex:
    """Latest occurrence of every n-gram (1 <= n <= max_n) of one request's committed tokens.

    `lookup` excludes the suffix itself (a match must end before the last token), so the index
    only holds n-grams ending at positions <= len - 2: it lags one token behind the sequence,
    and the latest entry of a suffix is exactly the scan's right-to-left first hit."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.ids: list[int] = []
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self._indexed = 0  # n-grams ending at positions < _indexed are in `ends`

    def extend(self, tokens: list[int]) -> None:
        """Append newly committed tokens."""
        self.ids.extend(tokens)
        last = len(self.ids) - 1  # the n-grams ending at the last token stay out (see above)
        for p in range(self._indexed, last):
            for n in range(1, min(self.max_n, p + 1) + 1):
                self.ends[n][tuple(self.ids[p - n + 1:p + 1])] = p + 1
        self._indexed = max(self._indexed, last)

    def propose(self, k: int) -> list[int]:
        """What `lookup(self.ids, max_n, k)` returns."""
        if k <= 0:
            return []
        ids = self.ids
        for n in range(min(self.max_n, len(ids) - 1), 0, -1):
            src = self.ends[n].get(tuple(ids[-n:]))
            if src is not None:
                return _copy_forward(ids, src, k)
        return []


class NgramProposer(Proposer):
    name = "NGRAM"

    def __init__(self, block_size: int, max_n: int = 3) -> None:
        self.block_size = block_size
        self.max_n = max_n
        self._index: dict[int, tuple[object, NgramIndex]] = {}  # id(request) -> (request, index)

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    def _index_of(self, req) -> NgramIndex:
        """The request's index, brought up to its committed tokens (rebuilt if it is new)."""
        entry = self._index.get(id(req))
        if entry is None or entry[0] is not req:
            entry = (req, NgramIndex(self.max_n))
            self._index[id(req)] = entry
        index = entry[1]
        prompt, out = req.spec.prompt_ids, req.output_ids
        have = len(index.ids)
        if have < len(prompt):
            index.extend(list(prompt[have:]))
            have = len(prompt)
        index.extend(out[have - len(prompt):])
        return index

    def propose(self, reqs: list, limits: list[int], rows: SamplingRows) -> Proposal:
        if len(self._index) > 4 * len(reqs) + 64:  # drop finished requests' indexes
            live = {id(r) for r in reqs}
            self._index = {k: v for k, v in self._index.items() if k in live}
        tokens = [self._index_of(r).propose(k) for r, k in zip(reqs, limits)]
        return Proposal.from_lists(tokens, rows.keys.device)  # a point mass at each draft
