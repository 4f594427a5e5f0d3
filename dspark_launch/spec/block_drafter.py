"""DFlash and DSpark proposers: one draft forward turns the anchor + mask block into drafts.

The block [anchor, mask x (B-1)] sits at positions kv_len .. kv_len+B-1 and is embedded with
the target's embedding. Its rows in the draft pool are the rows the verify will use for the
same positions (the scheduler reserved them), so no temporary slots are needed: after the
verify, materialize() overwrites the accepted positions with context K/V and the engine
truncates the rest.
"""

from __future__ import annotations

import torch

from dspark_launch.attention import build_metadata
from dspark_launch.spec.proposer import Proposal, Proposer
from dspark_launch.spec.sampling import GREEDY_EPS, probs_from_logits


class DFlashProposer(Proposer):
    name = "DFLASH"

    def __init__(self, draft, target, space, pool, backend, block_size: int) -> None:
        self.draft, self.target = draft, target
        self.space, self.pool, self.backend = space, pool, backend
        self.block_size = block_size
        self.capture_layer_ids = tuple(draft.config.target_layer_ids)
        self.mask_id = draft.config.mask_token_id

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1  # slot 0 holds the anchor; slots 1..B-1 are drafts

    @property
    def block_rows(self) -> int:
        return self.block_size

    def _block_hidden(self, reqs: list) -> torch.Tensor:  # -> [R, B, d] final-normed
        b = self.block_size
        meta = build_metadata(self.space.req_to_token, [r.slot for r in reqs],
                              [r.kv_len for r in reqs], [b] * len(reqs), "none",
                              device=self.target.device)
        ids = torch.tensor([[r.anchor] + [self.mask_id] * (b - 1) for r in reqs],
                           dtype=torch.int64, device=self.target.device).reshape(-1)
        h = self.draft.forward_block(self.target.embed(ids), meta, self.backend, self.pool)
        return h.reshape(len(reqs), b, -1)

    def propose(self, reqs: list, limits: list[int], temperature: list[float]) -> Proposal:
        h = self._block_hidden(reqs)[:, 1:]  # [R, B-1, d]: slot j predicts position start+j
        r, k, d = h.shape
        if all(t < GREEDY_EPS for t in temperature):
            toks = self.target.greedy(h.reshape(r * k, d)).reshape(r, k)
            return Proposal(toks.tolist(), [None] * r)
        logits = self.target.logits(h.reshape(r * k, d)).float().reshape(r, k, -1).cpu()
        tokens, qs = [], []
        for i, (req, t) in enumerate(zip(reqs, temperature)):
            q = probs_from_logits(logits[i], t)  # [k, V]
            if t < GREEDY_EPS:
                tokens.append(q.argmax(-1).tolist())
            else:
                tokens.append(torch.multinomial(q, 1, generator=req.generator)[:, 0].tolist())
            qs.append(q)
        return Proposal(tokens, qs)

    def materialize(self, features, positions, rows) -> None:
        self.draft.materialize(features, positions, rows, self.pool)


class DSparkProposer(DFlashProposer):
    """All B slots predict (slot k -> position start+k+1), sampled left to right through the
    Markov head; the confidence head may shorten what is verified."""

    name = "DSPARK"

    def __init__(self, *args, confidence_threshold: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threshold = confidence_threshold

    @property
    def max_drafts(self) -> int:
        return self.block_size

    def propose(self, reqs: list, limits: list[int], temperature: list[float]) -> Proposal:
        h = self._block_hidden(reqs)  # [R, B, d]
        r, b, d = h.shape
        base = self.target.logits(h.reshape(r * b, d)).float().reshape(r, b, -1)
        anchors = torch.tensor([q.anchor for q in reqs], dtype=torch.int64, device=h.device)
        tokens, q, conf = self.draft.sample_block(
            base, h, anchors, torch.tensor(temperature), [q.generator for q in reqs])
        lengths = [confident_length(c, self.threshold) for c in conf]
        out_tokens = [t[:n].tolist() for t, n in zip(tokens, lengths)]
        greedy = all(t < GREEDY_EPS for t in temperature)
        out_q = [None if greedy else qq[:n].cpu() for qq, n in zip(q, lengths)]
        self.last_lengths = lengths
        return Proposal(out_tokens, out_q)


def confident_length(conf: torch.Tensor, threshold: float) -> int:
    """Drafts kept: up to the first slot whose confidence is below the threshold (0 keeps all)."""
    if threshold <= 0:
        return int(conf.shape[0])
    low = torch.nonzero(conf < threshold)
    return int(low[0, 0]) if low.numel() else int(conf.shape[0])
