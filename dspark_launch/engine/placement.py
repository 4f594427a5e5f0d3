"""Cache-aware placement of arriving requests on attn_dp groups.

Each group's radix cache lives only on that group's ranks, but placement must be the same
decision on every rank. So, like SGLang's cache-aware router, every rank keeps an
approximate index of each group's cache built from the prompts placed there (replicated:
every rank sees the same arrivals in the same order): chained hashes of the prompt's blocks,
so a prompt's longest indexed prefix is found block by block. The index forgets least
recently used blocks beyond what the group's pool could hold, as the real cache would.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BLOCK = 16  # tokens per indexed block: the match resolution (placement is a heuristic)
REL_SLACK = 1.5  # a group is overloaded past 1.5x the least load plus one request (SGLang-like)


class CacheAwarePlacer:
    def __init__(self, groups: int, capacity_tokens: int) -> None:
        self._index: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(groups)]
        self._capacity = max(1, capacity_tokens // BLOCK)

    @staticmethod
    def _chain(prompt: Sequence[int]) -> list[int]:
        """Hash of each whole-block prefix: h_k covers prompt[:k * BLOCK]. Tuples of ints hash
        the same in every process (no per-process salt), so every rank agrees."""
        out, h = [], 0
        for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
            h = hash((h, tuple(prompt[start:start + BLOCK])))
            out.append(h)
        return out

    def matched_tokens(self, group: int, chain: list[int]) -> int:
        index = self._index[group]
        n = 0
        while n < len(chain) and chain[n] in index:
            n += 1
        return n * BLOCK

    def place(self, prompt: Sequence[int], load: list[int], request_load: int) -> int:
        """The group whose cache holds the longest prefix of prompt (least loaded on ties),
        unless it is overloaded; then the least-loaded group. Records the prompt there."""
        chain = self._chain(prompt)
        least = min(range(len(load)), key=lambda g: (load[g], g))
        best = max(range(len(load)),
                   key=lambda g: (self.matched_tokens(g, chain), -load[g], -g))
        overloaded = load[best] > REL_SLACK * load[least] + request_load
        group = least if overloaded or self.matched_tokens(best, chain) == 0 else best
        index = self._index[group]
        for h in reversed(chain):  # shorter prefixes most recent: evicted after longer ones
            index[h] = None
            index.move_to_end(h)
        while len(index) > self._capacity:
            index.popitem(last=False)
        return group
