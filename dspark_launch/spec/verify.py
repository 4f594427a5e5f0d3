"""Acceptance for a batch of verified blocks, as tensor operations over padded blocks.

A round verifies [anchor, d_1 .. d_k] in one target forward; target row i predicts the token
after block token i. Draft d_{i+1} is accepted while it matches (greedy) or survives the
min(1, p/q) test (sampling); the token at the first failure (or after the last draft) is drawn
from the residual max(0, p - q) (or from p: the bonus), so every round commits accept_len + 1
tokens before stop rules apply. Blocks are padded to the widest; `draft_lens` says how many
drafts of each row count. No per-request or per-token Python, no host reads.
"""

from __future__ import annotations

import torch

from dspark_launch.spec.sampling import draw


def greedy_accept(
    drafts: torch.Tensor,  # [R, K] int64, padded past each row's length
    draft_lens: torch.Tensor,  # [R] int64
    target_tokens: torch.Tensor,  # [R, K+1] int64, argmax of each verify row
) -> tuple[torch.Tensor, torch.Tensor]:  # accept_len [R], committed [R, K+1]
    """Accepted drafts, and what the round commits (-1 padded): the accepted drafts ARE the
    target's tokens at their rows and the bonus is the one after them, so the target's
    tokens up to row accept_len are committed (no committed_tokens() over the drafts)."""
    k = drafts.shape[1]
    col = torch.arange(k + 1, device=drafts.device)[None, :]  # [1, K+1]
    match = (drafts == target_tokens[:, :k]) & (col[:, :k] < draft_lens[:, None])
    accept_len = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return accept_len, torch.where(col <= accept_len[:, None], target_tokens, -1)


def rejection_accept(
    drafts: torch.Tensor,  # [R, K] int64, padded
    draft_lens: torch.Tensor,  # [R] int64
    q: torch.Tensor | None,  # [R, K, V] each draft's proposal distribution; None: point mass
    p: torch.Tensor,  # [R, K+1, V] target distribution at each verify row
    u_accept: torch.Tensor,  # [R, K] uniforms for the accept tests
    u_sample: torch.Tensor,  # [R, K+1] uniforms for the residual / bonus draw at each row
) -> tuple[torch.Tensor, torch.Tensor]:  # accept_len [R], next token [R]
    """Speculative sampling for every request at once: committed tokens are distributed as p."""
    r, k = drafts.shape
    vocab = p.shape[-1]
    valid = torch.arange(k, device=p.device)[None, :] < draft_lens[:, None]  # [R, K]
    tok = drafts[..., None]  # [R, K, 1]
    p_tok = p[:, :k].gather(2, tok).squeeze(-1)  # [R, K]
    # Accept while u < p/q, i.e. u * q < p (a point mass has q = 1).
    bar = u_accept if q is None else u_accept * q.gather(2, tok).squeeze(-1)
    accepted = (bar < p_tok) & valid
    accept_len = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [R]
    row = accept_len[:, None, None].expand(r, 1, vocab)
    p_row = p.gather(1, row).squeeze(1)  # [R, V]
    rejected = (accept_len < draft_lens)[:, None]  # [R, 1]
    if k == 0:
        residual = p_row
    else:
        at = accept_len.clamp_max(k - 1)
        if q is None:  # max(0, p - one_hot(d)) is p with the draft's entry zeroed
            residual = p_row.scatter(1, drafts.gather(1, at[:, None]), 0.0)
        else:
            q_row = q.gather(1, at[:, None, None].expand(r, 1, vocab)).squeeze(1)
            residual = (p_row - q_row).clamp_min(0.0)
        # A rejection has probability 0 where p <= q everywhere except rounding: fall back to p.
        empty = residual.sum(-1, keepdim=True) <= 1e-12
        residual = torch.where(rejected & ~empty, residual, p_row)
    nxt = draw(residual, u_sample.gather(1, accept_len[:, None]).squeeze(1))
    return accept_len, nxt


def committed_tokens(drafts: torch.Tensor, accept_len: torch.Tensor, nxt: torch.Tensor
                     ) -> torch.Tensor:
    """[R, K] drafts, [R] accept_len, [R] next -> [R, K+1]: the accepted drafts, then next,
    then -1 padding (what one round commits, before stop rules)."""
    r, k = drafts.shape
    col = torch.arange(k + 1, device=drafts.device)[None, :]
    padded = torch.cat([drafts, drafts.new_full((r, 1), -1)], dim=1)
    out = torch.where(col < accept_len[:, None], padded, padded.new_full((), -1))
    return torch.where(col == accept_len[:, None], nxt[:, None], out)
