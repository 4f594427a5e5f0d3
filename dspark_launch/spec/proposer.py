"""What a drafter gives the verify/commit path: up to k draft tokens per request per round."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    tokens: list[list[int]]  # per request, the drafts after its anchor (may be empty)
    # per request [k, V]: the distribution each draft was drawn from (None: a fixed proposal)
    q: list[torch.Tensor | None]


class Proposer:
    """The plain-decoding proposer (NONE): no drafts, every round verifies the anchor alone."""

    name = "NONE"
    capture_layer_ids: tuple[int, ...] = ()

    @property
    def max_drafts(self) -> int:
        return 0

    @property
    def block_rows(self) -> int:
        """KV positions past kv_len the draft block itself writes (the verify may write more)."""
        return 0

    def propose(self, reqs: list, limits: list[int], temperature: list[float]) -> Proposal:
        return Proposal([[] for _ in reqs], [None for _ in reqs])

    def materialize(
        self,
        features: torch.Tensor | None,  # [N, m*d] captured target hidden states
        positions: torch.Tensor,  # [N] absolute positions
        rows: torch.Tensor,  # [N] pool rows (same rows as the target's)
    ) -> None:
        """Bring the draft's context up to the committed target rows (model drafters only)."""
