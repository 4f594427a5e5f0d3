"""Token distributions: temperature, top-k and top-p applied to fp32 logits."""

from __future__ import annotations

import torch

GREEDY_EPS = 1e-5  # temperatures below this are greedy (one-hot at the argmax)


def probs_from_logits(
    logits: torch.Tensor,  # [N, V]
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # [N, V] fp32, rows sum to 1
    logits = logits.float()
    if temperature < GREEDY_EPS:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def request_generator(seed: int, index: int) -> torch.Generator:
    """One stream per request, so a request's samples do not depend on the topology or batch."""
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + index) % (2**63))
    return gen


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One draw from a [V] distribution (on the CPU, so every rank draws the same)."""
    return int(torch.multinomial(probs.float().cpu(), 1, generator=gen).item())
