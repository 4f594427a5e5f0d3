"""DFlash and DSpark proposers: one draft forward turns the anchor + mask block into drafts.

The block [anchor, mask x (B-1)] sits at positions kv_len .. kv_len+B-1 and is embedded with
the target's embedding. Its rows in the draft pool are the rows the verify will use for the
same positions (the scheduler reserved them), so no temporary slots are needed: after the
verify, materialize() overwrites those positions with context K/V and the engine truncates
the rejected ones.

A step in which no request drafted needs no draft context yet: its rows (all committed: anchors
of plain-decoding requests) wait, and are written in one batch before the next draft forward,
before their rows change hands (KVSpace.before_release), or once DEFERRED_CONTEXT_ROWS have
gathered.
When the policy keeps every request from drafting, this is what makes speculation cost nothing.
The seconds those writes take are kept apart (flushed_s): the steps that let them wait are
timed without them (engine.step), as a settled plain ladder would run them (dormant). A
dormant step writes none for its anchors: the block skips those positions (Request.draft_gaps),
whose rows hold whatever a page's last owner left there.

Drafts stay on the device. Every request drafts its full block (capped by its limit), so the
verify width is known on the host before any draft exists. DSpark's confidence cut (threshold
> 0) is the exception: its lengths are read back (spec.transfer.to_host) to shorten the verify.
"""

from __future__ import annotations

import numpy as np
import torch

from dspark_launch.attention import build_metadata, upload
from dspark_launch.memory.transients import DEFERRED_CONTEXT_ROWS
from dspark_launch.models.layers.gemm import steady_clock
from dspark_launch.spec.dspark_sampler import walk_block
from dspark_launch.spec.keyed import draft_purposes, uniforms
from dspark_launch.spec.proposer import Proposal, Proposer
from dspark_launch.spec.sampling import SamplingRows, draw, target_probs
from dspark_launch.spec.transfer import to_host


class DFlashProposer(Proposer):
    name = "DFLASH"
    anchor_slots = 1  # slot 0 holds the anchor and proposes nothing

    def __init__(self, draft, target, space, pool, backend, block_size: int) -> None:
        self.draft, self.target = draft, target
        self.space, self.pool, self.backend = space, pool, backend
        self.block_size = block_size
        self.capture_layer_ids = tuple(draft.config.target_layer_ids)
        self.mask_id = draft.config.mask_token_id
        self._pending: list[tuple[torch.Tensor, ...]] = []  # (features, positions, rows)
        self._pending_rows = 0
        if space is not None:  # None: a stub that only answers max_drafts/block_rows
            space.before_release.append(self.flush)

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1  # slot 0 holds the anchor; slots 1..B-1 are drafts

    @property
    def block_rows(self) -> int:
        return self.block_size

    def block_for(self, longest):
        """Block rows a draft whose longest verify is `longest` drafts runs: the trained block,
        or with fit_block the shortest that holds `longest` (a draft forward costs its rows;
        a shorter block's first slots predict almost as well)."""
        if not self.fit_block:
            return self.block_size
        return np.minimum(self.block_size, np.maximum(1, longest + self.anchor_slots))

    def draft_rows(self, requests, longest):
        return requests * self.block_for(longest)

    def _block_hidden(self, reqs: list, b: int) -> torch.Tensor:  # -> [R, b, d] final-normed
        device = self.target.device
        meta = build_metadata(self.space.req_to_token, [r.slot for r in reqs],
                              [r.kv_len for r in reqs], [b] * len(reqs), "none",
                              device=device, skipped=[r.draft_gaps for r in reqs])
        ids = upload([[r.anchor] + [self.mask_id] * (b - 1) for r in reqs], torch.int64,
                     device).reshape(-1)
        h = self.draft.forward_block(self.target.embed(ids), meta, self.backend, self.pool)
        return h.reshape(len(reqs), b, -1)

    def propose(self, reqs: list, limits: list[int], rows: SamplingRows) -> Proposal:
        self.flush()  # the block attends to the whole context
        b = int(self.block_for(max(limits)))
        h = self._block_hidden(reqs, b)[:, 1:]  # [R, b-1, d]: slot j predicts position start+j
        r, k, d = h.shape
        flat = h.reshape(r * k, d)
        if rows.all_greedy:  # argmax over the vocab shards; no distribution is formed
            return Proposal(self.target.greedy(flat).reshape(r, k), list(limits))
        slots = rows.repeat(k)  # row r*k + j: request r, its output position + j
        q = target_probs(self.target.logits(flat), slots)  # [R*K, V]
        tokens = draw(q, uniforms(slots.keys, slots.positions, draft_purposes(r, k, q.device)))
        return Proposal(tokens.reshape(r, k), list(limits), q.reshape(r, k, -1))

    def materialize(self, features, positions, rows, defer_from=None) -> None:
        n = features.shape[0]
        if defer_from is not None and defer_from < n:
            part = (features[defer_from:], positions[defer_from:], rows[defer_from:])
            if defer_from:  # a view would keep the whole step's features alive
                part = tuple(t.clone() for t in part)
            self._pending.append(part)
            self._pending_rows += n - defer_from
            features, positions, rows = features[:defer_from], positions[:defer_from], \
                rows[:defer_from]
        self.draft.materialize(features, positions, rows, self.pool)
        if self._pending_rows >= DEFERRED_CONTEXT_ROWS:
            self.flush()

    def flush(self) -> None:
        """Write the waiting context rows into the draft pool (one batched call)."""
        if not self._pending:
            return
        t0 = steady_clock()
        features, positions, rows = (torch.cat(parts) for parts in zip(*self._pending))
        self._pending, self._pending_rows = [], 0
        self.draft.materialize(features, positions, rows, self.pool)
        self.flushed_s += steady_clock() - t0


class DSparkProposer(DFlashProposer):
    """All B slots predict (slot k -> position start+k+1), drawn left to right through the
    Markov head; the confidence head may cut what can be accepted."""

    name = "DSPARK"
    anchor_slots = 0

    def __init__(self, *args, confidence_threshold: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threshold = confidence_threshold

    @property
    def max_drafts(self) -> int:
        return self.block_size

    def propose(self, reqs: list, limits: list[int], rows: SamplingRows) -> Proposal:
        self.flush()  # the block attends to the whole context
        h = self._block_hidden(reqs, int(self.block_for(max(limits))))  # [R, b, d]
        anchors = upload([q.anchor for q in reqs], torch.int64, h.device)
        tokens, q, conf = walk_block(self.draft, self.target.lm_head, h, anchors, rows)
        if self.threshold <= 0:
            return Proposal(tokens, list(limits), q, conf=conf)
        # The cut shortens the verify itself, so the host must know it: one extra read.
        (cut,) = to_host(confident_length(conf(), self.threshold))
        return Proposal(tokens, [min(n, c) for n, c in zip(limits, cut)], q, conf=conf)


def confident_length(conf: torch.Tensor, threshold: float) -> torch.Tensor | None:
    """conf [R, B] -> [R] drafts kept: up to the first slot whose confidence is below the
    threshold (None at threshold 0: all kept). Computed on the device."""
    if threshold <= 0:
        return None
    return (conf >= threshold).to(torch.int64).cumprod(dim=1).sum(dim=1)
