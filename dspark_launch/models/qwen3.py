"""Qwen3 / Llama causal LM (one decoder: Llama is Qwen3 without the q/k norms).

Parameter names mirror the HF checkpoint (`model.layers.N.self_attn.qkv_proj` receives
q_proj/k_proj/v_proj via `packed_modules`), so the generic loader needs no model knowledge.

`forward` builds the forward's ForwardContext (which prepares the backend, once, before the
first layer); callers pass fresh metadata per forward and never prepare it themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dspark_launch.attention import AttentionBackend, ForwardContext, ForwardMetadata
from dspark_launch.parallel import get_parallel

from .config import ModelConfig
from .decoder import DecoderLayer
from .layers import DPTokens, ParallelLMHead, RMSNorm, RotaryEmbedding, VocabParallelEmbedding


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str
                 ) -> None:
        super().__init__()
        p = get_parallel()
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, shards=p.attn_tp_size, rank=p.attn_tp_rank,
            group=p.attn_tp_group, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device)


class CausalLM(nn.Module):
    # checkpoint sub-name -> (parameter sub-name, shard id) for fused parameters
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        p = get_parallel()
        config.check_topology(p.tp_size, p.attn_tp_size)
        dtype = dtype or config.dtype
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.model = Qwen3Model(config, dtype, device)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, shards=p.attn_tp_size,
            rank=p.attn_tp_rank, group=p.attn_tp_group, dtype=dtype, device=device,
            tied_to=self.model.embed_tokens if config.tie_word_embeddings else None)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, this attn_dp group's new tokens (T may be 0)
        meta: ForwardMetadata,
        backend: AttentionBackend,
        kv,  # KVPool: .k[layer] / .v[layer] [rows, Hkv_local, hd]
        capture_layer_ids: Sequence[int] = (),
        dp_counts: list[int] | None = None,  # every rank's token count, if already exchanged
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (final-normed hidden [T, d], captured [T, m*d] or None).

        captured concatenates, in the given order, the outputs of the given decoder layers
        BEFORE the final norm (HF hidden_states[id + 1]); id -1 is the embedding output.
        A collective over TP: every rank calls it every step, idle ones with T == 0.
        """
        ids = list(capture_layer_ids)
        n_layers = self.config.num_hidden_layers
        bad = [i for i in ids if not -1 <= i < n_layers]
        assert not bad, f"capture_layer_ids {bad} outside [-1, {n_layers})"
        dp = DPTokens.build(int(input_ids.shape[0]), dp_counts)
        x = self.model.embed_tokens(input_ids)  # [T, d]
        cos, sin = self.model.rotary.cos_sin(meta.positions, x.dtype)  # [T, hd]
        ctx = ForwardContext.prepare(meta, backend, kv, cos, sin, dp)
        saved: dict[int, torch.Tensor] = {-1: x} if -1 in ids else {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, ctx)
            if i in ids:
                saved[i] = x
        captured = torch.cat([saved[i] for i in ids], dim=-1) if ids else None
        return self.model.norm(x), captured

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, d]
        """Vocab-parallel lookup (all-reduce inside attn_tp); the drafts reuse it."""
        return self.model.embed_tokens(input_ids)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, d] -> [N, V]
        """Full-vocabulary logits, gathered inside attn_tp (padding columns removed)."""
        return self.lm_head.logits(hidden)

    @torch.no_grad()
    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, d] -> [N] int64
        """Argmax over the sharded vocabulary without gathering it; ties -> lowest id."""
        return self.lm_head.greedy(hidden)
