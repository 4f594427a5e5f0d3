"""Prompt lookup (NGRAM): propose what followed the latest earlier match of the last n tokens.

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
    seq = list(ids)
    for i in range(k):
        seq.append(seq[src + i])
    return seq[len(ids):]


class NgramProposer(Proposer):
    name = "NGRAM"

    def __init__(self, block_size: int, max_n: int = 3) -> None:
        self.block_size = block_size
        self.max_n = max_n

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    def propose(self, reqs: list, limits: list[int], rows: SamplingRows) -> Proposal:
        tokens = [lookup(r.all_ids, self.max_n, k) for r, k in zip(reqs, limits)]
        return Proposal.from_lists(tokens, rows.keys.device)  # a point mass at each draft
