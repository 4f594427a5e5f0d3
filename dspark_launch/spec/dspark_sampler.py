"""DSpark's left-to-right block walk, vectorised across requests (only the B slots are
sequential): l_k = U_k + bias_k(x_{k-1}, h_k, s), x_{-1} = the anchor.

Greedy (every request greedy): U_k stays in this rank's vocab shard, the Markov bias is
computed for the shard's ids only, and the argmax meets across shards like the target's, so no
full-vocabulary row, softmax or one-hot is formed. Otherwise the full U is gathered once and
each slot's distribution q_k (per-request temperature / top-k / top-p; one-hot for greedy
rows) is kept for acceptance; one keyed uniform per request per slot draws x_k.
"""

from __future__ import annotations

import torch

from dspark_launch.spec.keyed import DRAFT, uniforms
from dspark_launch.spec.sampling import SamplingRows, draw, target_probs


@torch.no_grad()
def walk_block(
    draft,  # DSparkDraft: markov_state / markov_step / confidence
    lm_head,  # the target's ParallelLMHead
    hidden: torch.Tensor,  # [R, B, d] final-normed block outputs
    anchors: torch.Tensor,  # [R] int64
    rows: SamplingRows,  # per request; positions = output position of slot 0
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:  # tokens [R, B], q, conf [R, B]
    r, b, d = hidden.shape
    flat = hidden.reshape(r * b, d)
    if rows.all_greedy:
        base = lm_head.local_logits(flat)[:, :lm_head.owned].reshape(r, b, -1)  # [R, B, V_l]
        vocab = lm_head.owned_ids
    else:
        base = lm_head.logits(flat).reshape(r, b, -1)  # [R, B, V]
        vocab = None
    tokens = torch.empty((r, b), dtype=torch.int64, device=hidden.device)
    q = None if rows.all_greedy else torch.empty((r, b, base.shape[-1]), dtype=torch.float32,
                                                 device=hidden.device)
    prev = anchors
    state = draft.markov_state(r, hidden.device)  # reset every block
    for k in range(b):
        h_k = hidden[:, k]  # [R, d]
        bias, state = draft.markov_step(prev, h_k, state, vocab)  # [R, V or V_l] fp32
        logits = base[:, k].float() + bias
        if q is None:
            tokens[:, k] = lm_head.argmax(logits)
        else:
            q[:, k] = target_probs(logits, rows)
            tokens[:, k] = draw(q[:, k], uniforms(rows.keys, rows.positions + k, DRAFT))
        prev = tokens[:, k]  # the token actually drafted seeds the next slot
    # c_k reads h_k and x_{k-1} only: every slot at once, once the walk has drawn them.
    prevs = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)  # [R, B]
    conf = draft.confidence(flat, prevs.reshape(-1)).reshape(r, b)
    return tokens, q, conf
