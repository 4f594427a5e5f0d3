"""The Qwen3/Llama decoder layer (attention over attn_tp, MLP over tp).

Kept apart from the causal-LM wrapper so the DFlash/DSpark drafts can reuse the MLP, the
norms and the attention's projections with their own attention wiring.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_launch.attention import ForwardContext
from dspark_launch.parallel import get_parallel

from .config import ModelConfig
from .layers import (
    DPTokens,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    apply_rotary,
    rms_normalize,
    silu_and_mul,
)


class Attention(nn.Module):
    """Local heads only: qkv/o are sharded over attn_tp, o's partial sums reduced there."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 layer_id: int) -> None:
        super().__init__()
        p = get_parallel()
        self.layer_id = layer_id  # its K/V pool layer
        hd = cfg.head_dim
        self.head_dim, self.scale = hd, hd ** -0.5
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
            bias=cfg.attention_bias, shards=p.attn_tp_size, rank=p.attn_tp_rank,
            dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * hd, cfg.hidden_size, bias=cfg.attention_bias,
            shards=p.attn_tp_size, rank=p.attn_tp_rank, group=p.attn_tp_group,
            dtype=dtype, device=device)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, d] -> q [T, Hq_l, hd], k [T, Hkv_l, hd] (normed, rotated), v [T, Hkv_l, hd].

        q and k are adjacent heads of the fused qkv output, so they are normed and rotated
        together as one [T, Hq_l + Hkv_l, hd] tensor: half the eager ops of doing each apart.
        """
        t, hd, qkv = x.shape[0], self.head_dim, self.qkv_proj
        hq, hkv = qkv.q_heads, qkv.kv_heads
        # Explicit head counts (not -1): an idle batch has T == 0.
        heads = qkv(x).view(t, hq + 2 * hkv, hd)
        qk, v = heads[:, :hq + hkv], heads[:, hq + hkv:]
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm BEFORE RoPE
            # HF's order (fp32 math, cast back, then x weight); q and k differ only in weight.
            weight = torch.cat([self.q_norm.weight.expand(hq, hd),
                                self.k_norm.weight.expand(hkv, hd)])  # [Hq_l + Hkv_l, hd]
            qk = rms_normalize(qk, self.q_norm.eps) * weight
        qk = apply_rotary(qk, cos, sin)
        return qk[:, :hq], qk[:, hq:], v

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [T, d]
        q, k, v = self.project(x, ctx.cos, ctx.sin)
        o = ctx.attend(self.layer_id, q, k, v, self.scale)  # [T, Hq_l, hd]
        # [T, Hq_l * hd] -> [T, d], partial sums reduced over attn_tp
        return self.o_proj(o.reshape(x.shape[0], self.qkv_proj.q_size))


class MLP(nn.Module):
    """SiLU-gated MLP sharded over a group: the FULL tp group for the target (rows already
    DP-gathered), attn_tp for the drafts (which never leave their attention group)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device | str, over_attn_tp: bool = False) -> None:
        super().__init__()
        p = get_parallel()
        shards, rank, group = ((p.attn_tp_size, p.attn_tp_rank, p.attn_tp_group) if over_attn_tp
                               else (p.tp_size, p.tp_rank, p.tp_group))
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=False,
            shards=shards, rank=rank, dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, shards=shards, rank=rank,
            group=group, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, d] -> [N, d], reduced over the group
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, dtype, device, layer_id)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                device)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [T, d]
        h = x + self.self_attn(self.input_layernorm(x), ctx)
        # Every TP rank joins gather/MLP/reduce even with T == 0 (idle attn_dp group).
        dp: DPTokens = ctx.dp
        mlp_out = self.mlp(dp.gather(self.post_attention_layernorm(h)))  # [sum_len, d]
        return h + dp.scatter(mlp_out)
