"""The engine's side of the verify-length policy (spec/policy.py): build it for this attn_dp
group, profile the target forward at start-up, and gather the report.

Every rank of an attention-TP group must choose the same lengths: the profile is rank 0's (one
broadcast), and the step times that refine it online are the maximum over all ranks, carried by
the per-step exchange. Under DP attention each group keeps its own curve (its own token counts
against the shared step time), so each group decides for its own requests.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from dspark_launch.comm import all_gather_object, broadcast_object
from dspark_launch.engine.warmup import conditions, profile_forward
from dspark_launch.log import logger
from dspark_launch.parallel import get_parallel
from dspark_launch.spec.acceptance import load_calibration
from dspark_launch.spec.cost_curve import profile_points, profiled_curve
from dspark_launch.spec.policy import VerifyPolicy, draft_curve_guess, merge_metrics
from dspark_launch.spec.proposer import Proposal
from dspark_launch.spec.sampling import GREEDY_EPS

PROFILE_POINTS = 8


def request_class(req) -> str:
    """Acceptance is pooled per class: sampled drafts are accepted less often than greedy."""
    return "greedy" if req.params.temperature < GREEDY_EPS else "sampled"


def build_verify_policy(engine, mode: str, profile: str, draft_dir: str | None,
                        algorithm: str) -> VerifyPolicy | None:
    """On every rank, after the pools exist (the profile runs collectives)."""
    proposer = engine.proposer
    if not proposer.max_drafts:
        return None
    state = get_parallel()
    block = 1 + proposer.max_drafts
    # The profile's forwards lay one block per request slot, and each slot takes whole pages
    # (at page size 16 a 9-token block takes a page of 16: priced in tokens, a small pool
    # failed at start-up)
    blocks = engine.space.allocator.num_free_pages // -(-block // engine.space.page_size)
    room = block * min(engine.limits.max_running, blocks)
    points = profile_points(max(1, room), PROFILE_POINTS)
    c = engine.target.config
    # The profiled forwards walk pages and capture the draft's layers, as the step's do.
    machine = {**conditions(engine), "gemm_kernel": engine.gemm_kernel,
               "gemm_from_rows": engine.gemm_from_rows, "block": block,
               "page_size": engine.space.page_size,
               "captured": list(proposer.capture_layer_ids)}
    curve, source = profiled_curve(profile, machine, lambda n: profile_forward(engine, n),
                                   points, agree=broadcast_object, writer=state.rank == 0)
    draft = getattr(proposer, "draft", None)
    # A drafter's forward costs about its layer share of the target's over the block rows;
    # NGRAM's host lookups next to nothing. Both are refined from measured draft times.
    scale = draft.config.num_hidden_layers / c.num_hidden_layers if draft is not None else 0.0
    if mode != "fixed":
        proposer.fit_block = True  # a block drafter runs the shortest block the verify needs
    draft_curve = draft_curve_guess(
        curve, int(proposer.draft_rows(engine.limits.max_running, proposer.max_drafts)), scale)
    temps = load_calibration(draft_dir) if algorithm == "DSPARK" else None
    if state.rank == 0:
        logger.info("speculative policy %s; cost curve (%s): %s tokens -> %s steps/s%s", mode,
                    source, curve.tokens, [round(1 / s, 1) for s in curve.seconds],
                    f"; STS temperatures from {draft_dir}" if temps else "")
    return VerifyPolicy(mode, curve, draft_curve, proposer.max_drafts, temps,
                        confidence=algorithm == "DSPARK", draft_rows=proposer.draft_rows)


def gather_policy_report(engine) -> dict | None:
    """Every group's report merged (collective: every rank calls it); None without a policy."""
    policy = getattr(engine, "policy", None)
    if policy is None:
        return None
    state = get_parallel()
    mine = policy.report() if state.attn_tp_rank == 0 else None
    parts = [p for p in all_gather_object(mine) if p is not None]
    merged = merge_metrics(parts)
    merged["policy"] = policy.mode
    merged["cost_curves"] = [p["cost_curve"] for p in parts]  # one per attn_dp group
    merged["draft_cost_curves"] = [p["draft_cost_curve"] for p in parts]
    merged["ladders"] = [p["ladders"] for p in parts]  # per group: per request class and batch size
    merged["drafting_costs"] = [p["drafting_cost"] for p in parts]
    return merged


def micros(seconds: float) -> int:
    """Step times travel as integer microseconds in the per-step exchange."""
    return int(min(max(seconds, 0.0), 1e6) * 1e6) if math.isfinite(seconds) else 0


def spread(proposal: Proposal, index: list[int], total: int) -> Proposal:
    """A proposal for the requests at `index` (the ones the policy let draft) -> one for all
    `total` decode requests: the others get no drafts (width 0, zero rows)."""
    at = torch.tensor(index, dtype=torch.int64).to(proposal.tokens.device)

    def scatter(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.zeros((total, *t.shape[1:]), dtype=t.dtype, device=t.device) \
            .index_copy(0, at, t)

    widths = [0] * total
    for i, w in zip(index, proposal.widths):
        widths[i] = w
    return dataclasses.replace(proposal, tokens=scatter(proposal.tokens), widths=widths,
                               q=scatter(proposal.q),
                               conf=None if proposal.conf is None else
                               functools.cache(lambda: scatter(proposal.conf())))
