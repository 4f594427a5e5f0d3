"""Acceptance rules for a verified block: greedy prefix match and lossless rejection sampling.

A round verifies [anchor, d_1 .. d_k] in one target forward; target row i predicts the token
after block token i. Draft d_{i+1} is accepted while it matches (greedy) or survives the
min(1, p/q) test (sampling); the token at the first failure (or after the last draft) is the
bonus, so every round commits accept_len + 1 tokens before stop rules apply.
"""

from __future__ import annotations

import torch

from dspark_launch.spec.sampling import sample


def greedy_accept(
    drafts: torch.Tensor,  # [R, K] int64, padded past each row's length
    draft_lens: torch.Tensor,  # [R] int64
    target_tokens: torch.Tensor,  # [R, K+1] int64, argmax of each verify row
) -> tuple[torch.Tensor, torch.Tensor]:  # accept_len [R], bonus [R]
    k = drafts.shape[1]
    valid = torch.arange(k, device=drafts.device)[None, :] < draft_lens[:, None]
    match = (drafts == target_tokens[:, :k]) & valid
    accept_len = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    bonus = target_tokens.gather(1, accept_len[:, None]).squeeze(1)
    return accept_len, bonus


def rejection_accept(
    drafts: list[int],  # k draft tokens of one request
    q: torch.Tensor | None,  # [k, V] the distribution each draft was sampled from (None: one-hot)
    p: torch.Tensor,  # [k+1, V] target distribution at each verify row
    gen: torch.Generator,
) -> tuple[int, int]:  # accept_len, next token
    """Speculative sampling for one request: the committed tokens are distributed as p."""
    k = len(drafts)
    for i, tok in enumerate(drafts):
        q_tok = 1.0 if q is None else float(q[i, tok])
        ratio = float(p[i, tok]) / max(q_tok, 1e-8)
        u = float(torch.rand((), generator=gen))
        if u >= min(1.0, ratio):
            q_row = torch.nn.functional.one_hot(torch.tensor(tok), p.shape[-1]).float() \
                if q is None else q[i].float()
            residual = (p[i].float() - q_row).clamp_min(0.0)
            if float(residual.sum()) <= 1e-8:
                residual = p[i].float()
            return i, sample(residual / residual.sum(), gen)
    return k, sample(p[k], gen)
