"""Prompt lookup (NGRAM): propose what followed the latest earlier match of the last n tokens.

Model-free, so it is the baseline every drafter's tau is reported against, and it exercises long
accepted blocks even with random weights (greedy output of a tiny random model repeats).
"""

from __future__ import annotations

from dspark_launch.spec.proposer import Proposal, Proposer


def lookup(ids: list[int], max_n: int, k: int) -> list[int]:
    """Tokens after the most recent earlier occurrence of the longest matching suffix (n<=max_n)."""
    if k <= 0:
        return []
    for n in range(min(max_n, len(ids) - 1), 0, -1):
        suffix = ids[-n:]
        # Search right to left, excluding the suffix itself.
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                follow = ids[start + n:start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer(Proposer):
    name = "NGRAM"

    def __init__(self, block_size: int, max_n: int = 3) -> None:
        self.block_size = block_size
        self.max_n = max_n

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    def propose(self, reqs: list, limits: list[int], temperature: list[float]) -> Proposal:
        tokens = [lookup(r.all_ids, self.max_n, k) for r, k in zip(reqs, limits)]
        return Proposal(tokens, [None] * len(reqs))
