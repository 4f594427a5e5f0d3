"""DP attention: gather every attn_dp group's tokens for the TP-sharded MLP, scatter back.

Each attn_dp group attends over its own requests, but the MLP is sharded over the full TP
group, so all TP ranks must multiply the same rows. Per forward, the per-group token counts
are all-gathered once (an idle group reports 0); each group then owns a slot at the prefix
sum of the counts in a zero-filled [sum_len, d] buffer. Only attn_tp rank 0 of a group
writes its slot (the rows are identical across its attn_tp ranks), and one all-reduce over
TP assembles the whole buffer on every rank ("SUM_LEN" mode). After the MLP's own TP
all-reduce, each rank keeps its group's slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_launch.comm import all_gather_ints, all_reduce
from dspark_launch.parallel import get_parallel


@dataclass(frozen=True)
class DPTokens:
    counts: tuple[int, ...]  # tokens per attn_dp group, in attn_dp_rank order
    offset: int  # where this group's rows start in the gathered batch
    local: int  # this group's token count
    active: bool  # False when attn_dp_size == 1: gather/scatter are identities

    @property
    def total(self) -> int:
        return sum(self.counts)

    @classmethod
    def build(cls, num_tokens: int, per_rank: list[int] | None = None) -> DPTokens:
        """per_rank: every rank's token count when the caller already exchanged them (the
        engine's step does); else a collective over the TP group when attn_dp_size > 1."""
        p = get_parallel()
        if p.attn_dp_size == 1:
            return cls((num_tokens,), 0, num_tokens, False)
        if per_rank is None:
            per_rank = [row[0] for row in all_gather_ints([num_tokens], p.cpu_group)]
        per_rank = [[c] for c in per_rank]
        counts = tuple(per_rank[g * p.attn_tp_size][0] for g in range(p.attn_dp_size))
        assert counts[p.attn_dp_rank] == num_tokens
        mine = per_rank[p.attn_dp_rank * p.attn_tp_size: (p.attn_dp_rank + 1) * p.attn_tp_size]
        assert all(c == [num_tokens] for c in mine), (
            f"attn_tp ranks of one attn_dp group disagree on the token count: {mine}")
        return cls(counts, sum(counts[:p.attn_dp_rank]), num_tokens, True)

    def gather(self, x: torch.Tensor) -> torch.Tensor:  # [T, d] -> [sum_len, d]
        if not self.active:
            return x
        p = get_parallel()
        buf = x.new_zeros((self.total, x.shape[-1]))
        if p.attn_tp_rank == 0:
            buf[self.offset:self.offset + self.local] = x
        return all_reduce(buf, p.tp_group)

    def scatter(self, y: torch.Tensor) -> torch.Tensor:  # [sum_len, d] -> [T, d]
        if not self.active:
            return y
        return y[self.offset:self.offset + self.local]
