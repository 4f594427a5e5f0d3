"""DSpark drafter (DeepSpec format): the DFlash backbone plus a Markov head and a confidence head.

Differences from DFlash (models.md §3):
- every block slot is a proposal: slot k predicts position start+k+1, so the anchor's own
  output is used and a round verifies up to B+1 tokens;
- the block is sampled LEFT TO RIGHT: l_k = U_k + bias(x_{k-1}) with x_{-1} = the anchor, so
  each draft token depends on the token actually drafted before it;
- c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b) estimates whether slot k will be accepted.

The checkpoint's own `embed_tokens` / `lm_head` are frozen copies of the target's: the loader
checks their shapes and drops them, and the engine embeds and computes U_k with the TARGET's
(vocab-parallel) modules, as llama.cpp and tokenspeed do. That saves 2*V*d per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark_launch.errors import ConfigError

from .dflash import DFlashDraft
from .draft_config import DraftConfig
from .layers import ColumnParallelLinear, new_param

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (argmax, one-hot q)


def _replicated_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                       device: torch.device | str) -> ColumnParallelLinear:
    # One shard = a plain Linear whose loader still checks the checkpoint's full shape.
    return ColumnParallelLinear(in_features, out_features, bias=bias, shards=1, rank=0,
                                dtype=dtype, device=device)


class _Table(nn.Module):
    """A bare [rows, cols] weight looked up by id (markov_w1 is an embedding)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device | str
                 ) -> None:
        super().__init__()
        self.weight = new_param((rows, cols), dtype, device)


class MarkovHead(nn.Module):
    """Low-rank bigram correction B(prev, .) = W1[prev] W2^T (replicated: V*r is small)."""

    def __init__(self, cfg: DraftConfig, dtype: torch.dtype, device: torch.device | str
                 ) -> None:
        super().__init__()
        v, r, d = cfg.vocab_size, cfg.markov_rank, cfg.hidden_size
        if cfg.markov_head_type == "rnn":
            # models.md only says "GRU-like over [s; W1[x]; h]": running a guessed recurrence
            # would draft silently worse tokens, so refuse until the exact update is pinned.
            raise ConfigError("DSpark markov_head_type='rnn' is not supported (its recurrence "
                              "is not pinned by the reference); use 'vanilla' or 'gated'")
        self.head_type = cfg.markov_head_type
        self.markov_w1 = _Table(v, r, dtype, device)  # [V, r]
        self.markov_w2 = _replicated_linear(r, v, False, dtype, device)  # weight [V, r]
        self.gate_proj = (_replicated_linear(d + r, r, False, dtype, device)
                          if self.head_type == "gated" else None)  # weight [r, d+r]

    def embed(self, prev: torch.Tensor) -> torch.Tensor:  # [N] -> [N, r]
        return F.embedding(prev, self.markov_w1.weight)

    def forward(self, prev: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """prev [N] int64 (, hidden [N, d]) -> bias [N, V] fp32."""
        e = self.embed(prev).float()  # [N, r]
        if self.gate_proj is not None:
            assert hidden is not None, "the gated Markov head reads the slot's hidden state"
            gate_in = torch.cat([hidden.float(), e], dim=-1)  # [N, d+r]
            e = torch.sigmoid(F.linear(gate_in, self.gate_proj.weight.float())) * e
        return F.linear(e, self.markov_w2.weight.float())  # [N, V]


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int, dtype: torch.dtype, device: torch.device | str
                 ) -> None:
        super().__init__()
        self.proj = _replicated_linear(in_features, 1, True, dtype, device)  # [1, in], [1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N] fp32
        w, b = self.proj.weight.float(), self.proj.bias.float()
        return torch.sigmoid(F.linear(x.float(), w, b)).squeeze(-1)


class DSparkDraft(DFlashDraft):
    # Every slot is a proposal and slot k predicts start+k+1: B proposals, B+1 verified.
    first_proposal_slot = 0
    predicts_next = True

    def __init__(self, cfg: DraftConfig, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(cfg, dtype, device)
        dtype = self.dtype
        self.markov_head = MarkovHead(cfg, dtype, device) if cfg.markov_rank > 0 else None
        conf_in = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0)
        self.confidence_head = (ConfidenceHead(conf_in, dtype, device)
                                if cfg.has_confidence_head else None)

    def markov_bias(self, prev: torch.Tensor, hidden: torch.Tensor | None = None
                    ) -> torch.Tensor:
        """prev [N] int64 (, hidden [N, d] for the gated head) -> [N, V] fp32; 0 at rank 0."""
        if self.markov_head is None:
            return torch.zeros((prev.shape[0], self.config.vocab_size), dtype=torch.float32,
                               device=prev.device)
        return self.markov_head(prev, hidden)

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """hidden [N, d], prev [N] -> c [N] fp32 in (0, 1); all ones without a head."""
        if self.confidence_head is None:
            return torch.ones(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        x = hidden.float()
        if self.config.confidence_with_markov:
            assert self.markov_head is not None
            x = torch.cat([x, self.markov_head.embed(prev).float()], dim=-1)  # [N, d+r]
        return self.confidence_head(x)

    @torch.no_grad()
    def sample_block(self, base_logits: torch.Tensor, hidden: torch.Tensor,
                     anchors: torch.Tensor, temperature: float | torch.Tensor,
                     generators: Sequence[torch.Generator | None] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-to-right block sampling through the Markov head.

        base_logits [R, B, V] fp32 (target lm_head on the final-normed block outputs),
        hidden [R, B, d], anchors [R] int64, temperature scalar or [R], generators one per
        request (or None) -> tokens [R, B] int64, q_probs [R, B, V] fp32 (the corrected
        distribution each token was drawn from; one-hot when greedy), confidences [R, B].
        """
        r_count, block, vocab = base_logits.shape
        device = base_logits.device
        temps = torch.as_tensor(temperature, dtype=torch.float32, device=device)
        temps = temps.expand(r_count)  # [R]
        tokens = torch.empty((r_count, block), dtype=torch.int64, device=device)
        q_probs = torch.empty((r_count, block, vocab), dtype=torch.float32, device=device)
        conf = torch.empty((r_count, block), dtype=torch.float32, device=device)
        prev = anchors.to(device=device, dtype=torch.int64)  # x_{-1} = the anchor
        for k in range(block):
            h_k = hidden[:, k]  # [R, d]
            logits = base_logits[:, k].float() + self.markov_bias(prev, h_k)  # [R, V]
            conf[:, k] = self.confidence(h_k, prev)
            tokens[:, k], q_probs[:, k] = _draw(logits, temps, generators)
            prev = tokens[:, k]  # the token actually drafted seeds the next slot
        return tokens, q_probs, conf


def _draw(logits: torch.Tensor, temps: torch.Tensor,
          generators: Sequence[torch.Generator | None] | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] fp32, temps [R] -> token [R], q [R, V]: argmax/one-hot when greedy."""
    greedy = temps < GREEDY_BELOW  # [R]
    scale = torch.where(greedy, torch.ones_like(temps), temps)
    probs = torch.softmax(logits / scale[:, None], dim=-1)  # [R, V]
    token = logits.argmax(dim=-1)  # ties -> lowest id, like the target's greedy
    for row in torch.nonzero(~greedy).flatten().tolist():
        gen = generators[row] if generators is not None else None
        # Per-request generators live on the CPU (same draws at any topology/device).
        token[row] = torch.multinomial(probs[row].cpu(), 1, generator=gen)[0].to(token.device)
    one_hot = F.one_hot(token, logits.shape[-1]).to(probs.dtype)
    return token, torch.where(greedy[:, None], one_hot, probs)
