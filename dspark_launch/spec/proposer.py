"""What a drafter gives the verify/commit path: up to k draft tokens per request per round."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark_launch.attention import upload
from dspark_launch.spec.sampling import SamplingRows


@dataclass
class Proposal:
    tokens: torch.Tensor  # [R, K] int64 on the device, padded past each request's drafts
    widths: list[int]  # drafts to verify per request (host-known: sizes the verify forward)
    # [R, K, V] fp32: the distribution each draft was drawn from; None: a point mass at the
    # draft (NGRAM, and model drafts when every request is greedy).
    q: torch.Tensor | None = None
    # DSpark: -> [R, K] fp32 on the device, the raw confidence c_k of each draft (read with
    # the draft before it), for the verify-length policy, computed at the first call (a
    # fixed-cap ladder reads them at one step in four: CALIBRATION_EVERY); None for drafters
    # without a head.
    conf: Callable[[], torch.Tensor] | None = None

    @classmethod
    def from_lists(cls, tokens: list[list[int]], device: torch.device | str) -> Proposal:
        """Host-made drafts (NGRAM, test drafters): one host->device copy."""
        k = max((len(t) for t in tokens), default=0)
        padded = [t + [0] * (k - len(t)) for t in tokens]
        return cls(upload(padded, torch.int64, device).reshape(len(tokens), k),
                   [len(t) for t in tokens])


class Proposer:
    """The plain-decoding proposer (NONE): no drafts, every round verifies the anchor alone."""

    name = "NONE"
    capture_layer_ids: tuple[int, ...] = ()
    # A block drafter may run a block shorter than its trained one, just long enough for the
    # step's longest verify (the adaptive policy turns this on; others have no block).
    fit_block = False
    # Seconds flush() spent writing deferred context rows since the engine last zeroed it:
    # rows plain steps owe only if a later step drafts (no step's price: engine.step).
    flushed_s = 0.0

    @property
    def max_drafts(self) -> int:
        return 0

    @property
    def block_rows(self) -> int:
        """KV positions past kv_len the draft block itself writes (the verify may write more)."""
        return 0

    def propose(self, reqs: list, limits: list[int], rows: SamplingRows) -> Proposal:
        """reqs: decoding requests; limits: most drafts each may verify; rows: per request its
        sampling parameters, key and the output position of its first draft."""
        return Proposal.from_lists([[] for _ in reqs], rows.keys.device)

    def draft_rows(self, requests, longest):
        """What drafting for `requests` requests costs, in draft rows, when the longest verify
        among them is `longest` drafts (numbers or numpy arrays alike): the unit of the
        policy's draft-cost curve. Here (a host lookup per request): one per request."""
        return requests

    def flush(self) -> None:
        """Write any draft context that materialize() let wait (model drafters only)."""

    def materialize(
        self,
        features: torch.Tensor | None,  # [N, m*d] captured target hidden states
        positions: torch.Tensor,  # [N] absolute positions
        rows: torch.Tensor,  # [N] pool rows (same rows as the target's)
        defer_from: int | None = None,  # rows [defer_from, N) are committed: they may wait
    ) -> None:
        """Bring the draft's context up to the committed target rows (model drafters only)."""
