"""DSpark drafter (DeepSpec format): the DFlash backbone plus a Markov head and a confidence head.

Differences from DFlash (models.md §3):
- every block slot is a proposal: slot k predicts position start+k+1, so the anchor's own
  output is used and a round verifies up to B+1 tokens;
- the block is sampled LEFT TO RIGHT: l_k = U_k + bias(x_{k-1}) with x_{-1} = the anchor, so
  each draft token depends on the token actually drafted before it;
- c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b) estimates whether slot k will be accepted.

The checkpoint's own `embed_tokens` / `lm_head` are frozen copies of the target's: the loader
checks that they equal the loaded target's (draft_loader.check_target_copies) and drops them,
and the engine embeds and computes U_k with the TARGET's (vocab-parallel) modules, as
llama.cpp and tokenspeed do. That saves 2*V*d per rank.

The Markov head is walked one slot at a time through `markov_state` / `markov_step` (the
rnn head carries a state across the slots of one block); the engine's walk, vectorised across
requests, is spec/dspark_sampler.walk_block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .dflash import DFlashDraft
from .draft_config import DraftConfig
from .layers import ColumnParallelLinear, new_param


class _HeadLinear(ColumnParallelLinear):
    """A small replicated projection of the heads (one shard: a plain Linear whose loader still
    checks the checkpoint's full shape). The heads read its weight, never through forward(),
    so it keeps no packed copy (gemm.py)."""

    def pack_source(self) -> None:
        return None


class _MarkovColumns(_HeadLinear):
    """W2 [V, r], which the walk multiplies by every slot's e [N, r] from the right. With the
    run's transposed GEMM (gemm.py) it keeps W2^T [r, V] too and the walk reads that at every
    row count (MarkovHead.columns): through the stored layout, read transposed, one thread's
    [1, 32] x [32, 2048] product took 20.5 us, from the copy 8.1 (2 rows 20.1 / 10.2, 16 rows
    40.2 / 32.5, 64 rows 127 / 117; Xeon, fp32, median of 300), and a batch-1 greedy round
    runs one per slot. oneDNN's blocked copy cannot be sliced by vocabulary: none is kept."""

    kernels = ("transposed",)

    def pack_source(self) -> torch.Tensor:
        return self.weight


def _replicated_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                       device: torch.device | str, kind: type = _HeadLinear
                       ) -> ColumnParallelLinear:
    return kind(in_features, out_features, bias=bias, shards=1, rank=0, dtype=dtype,
                device=device)


class _Table(nn.Module):
    """A bare [rows, cols] weight looked up by id (markov_w1 is an embedding)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device | str
                 ) -> None:
        super().__init__()
        self.weight = new_param((rows, cols), dtype, device)


class MarkovHead(nn.Module):
    """Per-slot logit correction bias_k(x_{k-1}, h_k[, s_{k-1}]) (replicated: V*r is small).

    models.md §3, e = W1[x_{k-1}]:
    - vanilla: bias = W2 e;
    - gated:   bias = W2 (sigmoid(G [h; e] + g_b) * e);
    - rnn:     a = J [s; e; h] + c split into g, u, o (r each); bias = W2 tanh(o) from the
               OLD state; s' = sigmoid(g) * s + (1 - sigmoid(g)) * tanh(u); s_{-1} = 0.
    The small projections run in fp32; the V x r product runs in W2's dtype (what DeepSpec's
    module does) so no fp32 copy of W2 is made per slot.
    """

    def __init__(self, cfg: DraftConfig, dtype: torch.dtype, device: torch.device | str
                 ) -> None:
        super().__init__()
        v, r, d = cfg.vocab_size, cfg.markov_rank, cfg.hidden_size
        self.head_type, self.rank = cfg.markov_head_type, r
        self.markov_w1 = _Table(v, r, dtype, device)  # [V, r]
        self.markov_w2 = _replicated_linear(r, v, False, dtype, device,
                                            _MarkovColumns)  # weight [V, r]
        # DeepSpec builds gate_proj / joint_proj as default nn.Linear layers, so real
        # checkpoints carry their biases; the loader drops the bias of a checkpoint without
        # one (bias 0).
        self.gate_proj = (_replicated_linear(d + r, r, True, dtype, device)
                          if self.head_type == "gated" else None)  # [r, d+r], [r]
        self.joint_proj = (_replicated_linear(2 * r + d, 3 * r, True, dtype, device)
                           if self.head_type == "rnn" else None)  # [3r, 2r+d], [3r]

    def embed(self, prev: torch.Tensor) -> torch.Tensor:  # [N] -> [N, r]
        return F.embedding(prev, self.markov_w1.weight)

    def initial_state(self, n: int, device: torch.device | str) -> torch.Tensor | None:
        """s_{-1}: zeros [n, r] fp32 for the rnn head, None for the stateless heads."""
        if self.joint_proj is None:
            return None
        return torch.zeros((n, self.rank), dtype=torch.float32, device=device)

    def forward(self, prev: torch.Tensor, hidden: torch.Tensor | None,
                state: torch.Tensor | None, vocab: slice | None = None,
                base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prev [N] int64, hidden [N, d], state [N, r] | None -> (bias [N, V'] fp32, state').

        vocab: only these columns (a contiguous id range) of the bias, e.g. one rank's shard.
        base [N, V'] fp32: logits to add the bias to; then base + bias is returned, in one
        multiply-add when W2 is fp32 (the walk's slot costs a few small ops, so one fewer
        counts at batch 1).
        """
        return self.step(prev, hidden, state, self.columns(vocab), base)

    def columns(self, vocab: slice | None = None) -> torch.Tensor:  # -> W2[vocab]^T [r, V']
        """The bias's columns for `vocab` (all ids: None), a view: a walk takes them once per
        block, not once per slot. From W2's transposed copy where it keeps one
        (_MarkovColumns), else W2 read transposed."""
        packed = self.markov_w2.packed
        if packed is not None:  # [r, V], rows contiguous
            return packed.weight if vocab is None else packed.weight[:, vocab]
        w2 = self.markov_w2.weight if vocab is None else self.markov_w2.weight[vocab]
        return w2.t()

    def step(self, prev: torch.Tensor, hidden: torch.Tensor | None, state: torch.Tensor | None,
             cols: torch.Tensor, base: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward() on columns(vocab) -> (base +) bias [N, V'] fp32, state'."""
        e = self.embed(prev).float()  # [N, r]
        if self.gate_proj is not None:
            assert hidden is not None, "the gated Markov head reads the slot's hidden state"
            gate_in = torch.cat([hidden.float(), e], dim=-1)  # [N, d+r]
            e = torch.sigmoid(_linear_f32(self.gate_proj, gate_in)) * e
        elif self.joint_proj is not None:
            assert hidden is not None and state is not None, \
                "the rnn Markov head reads the slot's hidden state and the block's state"
            z = torch.cat([state.float(), e, hidden.float()], dim=-1)  # [N, 2r+d], this order
            g, u, o = _linear_f32(self.joint_proj, z).split(self.rank, dim=-1)  # [N, r] each
            keep = torch.sigmoid(g)
            state = keep * state.float() + (1.0 - keep) * torch.tanh(u)  # the NEXT slot's s
            e = torch.tanh(o)  # from the old state: z held s_{k-1}
        if base is not None and cols.dtype == torch.float32:
            return torch.addmm(base, e, cols), state  # [N, V']
        bias = torch.mm(e.to(cols.dtype), cols).float()  # [N, V']
        return (bias if base is None else base + bias), state


def _linear_f32(layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """x [N, in] fp32 through a small replicated linear layer, in fp32 (with its bias)."""
    bias = layer.bias.float() if layer.bias is not None else None
    return F.linear(x, layer.weight.float(), bias)


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

    def markov_state(self, n: int, device: torch.device | str) -> torch.Tensor | None:
        """The Markov state before slot 0 of a block, for n requests: zeros [n, r] for the
        rnn head (reset every block), None for vanilla / gated / no head."""
        return None if self.markov_head is None else self.markov_head.initial_state(n, device)

    def markov_step(self, prev: torch.Tensor, hidden: torch.Tensor,
                    state: torch.Tensor | None, vocab: slice | None = None,
                    base: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot of the left-to-right walk: l_k = U_k + bias_k.

        prev [N] int64 (x_{k-1}; the anchor at k = 0), hidden [N, d] (h_k, final-normed),
        state from markov_state / the previous step -> (bias [N, V'] fp32, next state).
        vocab: a contiguous slice of ids (e.g. one rank's vocab shard): only those columns
        are computed. It is not padded past V: pass the ids a rank owns
        (slice(start, start + owned)), not its padded shard. Without a Markov head the bias
        is 0. base [N, V'] fp32: the slot's logits U_k; then l_k = base + bias is returned.
        """
        if self.markov_head is None:
            if base is not None:
                return base, state
            cols = self.config.vocab_size if vocab is None else \
                len(range(self.config.vocab_size)[vocab])
            return torch.zeros((prev.shape[0], cols), dtype=torch.float32,
                               device=prev.device), state
        return self.markov_head(prev, hidden, state, vocab, base)

    def markov_walk(self, vocab: slice | None = None) -> Callable:
        """markov_step for one block's slots, its constants (the columns of `vocab`) worked
        out once: (prev, hidden, state, base) -> (l_k [N, V'] fp32, state'). A slot is a few
        small ops, and at batch 1 what each step() call repeated (the column view, the module
        call) was ~12 us of a slot's ~60 (a greedy block of 8: 0.47 -> 0.37-0.40 ms, scratch)."""
        head = self.markov_head
        if head is None:
            return lambda prev, hidden, state, base: self.markov_step(prev, hidden, state,
                                                                      vocab, base)
        step, cols = head.step, head.columns(vocab)
        return lambda prev, hidden, state, base: step(prev, hidden, state, cols, base)

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """hidden [N, d], prev [N] -> c [N] fp32 in (0, 1); all ones without a head."""
        if self.confidence_head is None:
            return torch.ones(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        x = hidden.float()
        if self.config.confidence_with_markov:
            assert self.markov_head is not None
            x = torch.cat([x, self.markov_head.embed(prev).float()], dim=-1)  # [N, d+r]
        return self.confidence_head(x)
