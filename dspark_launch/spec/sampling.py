"""Batched token distributions and draws with per-row parameters, on the logits' device.

A logit row belongs to one request and predicts one output position. `SamplingRows` carries,
per row, that request's temperature / top-k / top-p, its random key and the output position,
built from host-side values with one host->device copy. Draws are inverse-CDF with one keyed
uniform per draw (spec/keyed.py), so nothing here reads a device value back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_launch.attention import upload
from dspark_launch.memory.transients import SAMPLING_CHUNK_ROWS  # the filters' priced chunk

GREEDY_EPS = 1e-5  # temperatures below this are greedy (engine.params.GREEDY_BELOW)
# A top_k past the vocabulary keeps every token (target_probs clamps it to the row's width);
# one past this is uploaded as this, so that any Python int fits the int64 tensor.
TOP_K_ALL = 2**31 - 1


@dataclass
class SamplingRows:
    n: int
    all_greedy: bool
    any_greedy: bool
    top_k_max: int  # the largest top_k of a sampled row (0: no row has one)
    # Host-known, so that neither filter reads the device: the sampled rows with a top_p
    # below 1, and how many of each row's most likely tokens the filter must look at (0: the
    # whole vocabulary; else, when every such row has a top_k, the largest of theirs: the
    # rest of the row is 0 already)
    top_p_rows: list[int]
    top_p_width: int
    temperature: torch.Tensor | None  # [N] fp32, 1 on greedy rows
    top_p: torch.Tensor | None  # [N] fp32
    top_k: torch.Tensor | None  # [N] int64, 0 = off
    greedy: torch.Tensor | None  # [N] bool
    keys: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64 output position each row predicts

    @classmethod
    def build(cls, params: list, keys: list[int], positions: list[int],
              device: torch.device | str) -> SamplingRows:
        """params: per row an object with temperature, top_k, top_p (a SamplingParams)."""
        n = len(params)
        greedy = [p.temperature < GREEDY_EPS for p in params]
        top_k = [min(p.top_k, TOP_K_ALL) for p in params]
        ints = upload([keys, positions, top_k], torch.int64, device).reshape(3, n)
        if all(greedy):
            return cls(n, True, True, 0, [], 0, None, None, None, None, ints[0], ints[1])
        floats = upload([[1.0 if g else p.temperature for p, g in zip(params, greedy)],
                         [p.top_p for p in params], [float(g) for g in greedy]],
                        torch.float32, device).reshape(3, n)
        sampled = [i for i, g in enumerate(greedy) if not g]
        nucleus = [i for i in sampled if params[i].top_p < 1.0]
        width = max((top_k[i] for i in nucleus), default=0) \
            if all(top_k[i] > 0 for i in nucleus) else 0
        return cls(n, False, any(greedy), max((top_k[i] for i in sampled), default=0),
                   nucleus, width, floats[0], floats[1], ints[2], floats[2] > 0.5, ints[0],
                   ints[1])

    def repeat(self, k: int) -> SamplingRows:
        """Each row becomes k rows for consecutive positions (a draft block's slots)."""
        def rep(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.repeat_interleave(k)

        offsets = torch.arange(k, device=self.keys.device).repeat(self.n)
        return SamplingRows(self.n * k, self.all_greedy, self.any_greedy, self.top_k_max,
                            [i * k + j for i in self.top_p_rows for j in range(k)],
                            self.top_p_width,
                            rep(self.temperature), rep(self.top_p), rep(self.top_k),
                            rep(self.greedy), rep(self.keys), rep(self.positions) + offsets)


def target_probs(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] fp32 (temperature, top-k, top-p per row; greedy
    rows one-hot at the argmax, ties to the lowest id); with filters or greedy rows,
    SAMPLING_CHUNK_ROWS rows at a time (a temperature alone makes two fp32 rows per row, which
    the budget prices for every row: chunked, 576 rows of 2048 took 29% longer)."""
    n, vocab = logits.shape
    if rows.all_greedy:
        return _one_hot(logits.argmax(-1), vocab)
    if n <= SAMPLING_CHUNK_ROWS or not (rows.top_k_max or rows.top_p_rows or rows.any_greedy):
        return _chunk_probs(logits, rows, 0, n)
    probs = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    for a in range(0, n, SAMPLING_CHUNK_ROWS):
        b = min(n, a + SAMPLING_CHUNK_ROWS)
        probs[a:b] = _chunk_probs(logits[a:b], rows, a, b)
    return probs


def _chunk_probs(logits: torch.Tensor, rows: SamplingRows, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of target_probs: logits [b - a, V] -> [b - a, V] fp32."""
    assert rows.temperature is not None and rows.greedy is not None
    x = logits.float() / rows.temperature[a:b, None]
    vocab = x.shape[-1]
    if rows.top_k_max:
        # The k-th largest logit from a top-k over the largest k asked, not a sort of the
        # vocabulary (every row was sorted once any row had a top_k: 825 ms for 64 rows of
        # 152k tokens, against 7 ms). Ties with the k-th stay, as in transformers and vLLM.
        k = rows.top_k[a:b].clamp(0, vocab)
        largest = torch.topk(x, min(rows.top_k_max, vocab), dim=-1).values  # [C, kmax]
        kth = largest.gather(1, (k - 1).clamp(0, largest.shape[1] - 1)[:, None])  # [C, 1]
        x.masked_fill_((k[:, None] > 0) & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    del x
    if nucleus := [i - a for i in rows.top_p_rows if a <= i < b]:
        at = upload(nucleus, torch.int64, probs.device)
        probs[at] = _nucleus(probs[at], rows.top_p[a:b][at], rows.top_p_width)
    if rows.any_greedy:
        greedy = rows.greedy[a:b, None]
        probs = torch.where(greedy, _one_hot(logits.argmax(-1), vocab), probs)
    return probs


def _one_hot(index: torch.Tensor, vocab: int) -> torch.Tensor:  # [N] -> [N, V] fp32
    """fp32 from the start (one_hot's own result is int64: twice the bytes, then a copy)."""
    return torch.zeros(index.shape[0], vocab, device=index.device).scatter_(
        1, index[:, None], 1.0)


def _nucleus(
    probs: torch.Tensor,  # [M, V] the rows with a top_p
    top_p: torch.Tensor,  # [M]
    width: int,  # look at each row's `width` most likely tokens (0: all)
) -> torch.Tensor:  # [M, V] renormalised
    """Keep the smallest prefix of the most likely tokens whose mass reaches top_p. The first
    token always stays, also where top_p is below float32's smallest number and reads 0.
    With a width (every row has a top_k: the rest of its row is 0), a top-k of that width
    stands for a sort of the vocabulary; a token tied with a row's k-th past the width is
    dropped (a sort orders ties arbitrarily anyway)."""
    if width and width < probs.shape[-1]:
        sorted_p, order = torch.topk(probs, width, dim=-1)
    else:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p[:, None]
    drop[:, 0] = False
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: weights [N, V] >= 0 (need not sum to 1), u [N] in (0, 1) -> [N] int64.

    A token of weight 0 is never drawn; a one-hot row always gives its hot token."""
    cdf = weights.float().cumsum(-1)  # [N, V]
    x = (u * cdf[:, -1]).unsqueeze(-1)  # [N, 1]
    return torch.searchsorted(cdf, x).squeeze(-1).clamp_max(weights.shape[-1] - 1)


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> torch.Tensor:
    """One parameter set for every row: logits [N, V] -> [N, V] (tests and tools)."""
    n = logits.shape[0]
    params = [_Params(temperature, top_k, top_p)] * n
    return target_probs(logits, SamplingRows.build(params, [0] * n, [0] * n, logits.device))


@dataclass(frozen=True)
class _Params:
    temperature: float
    top_k: int
    top_p: float
