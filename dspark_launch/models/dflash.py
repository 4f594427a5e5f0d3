"""DFlash block drafter (z-lab format): target features -> draft-pool K/V, then one block pass.

Two entry points, matching the two halves of the reference forward (models.md §2):
- `materialize` turns newly committed target features into the draft's CONTEXT K/V and
  stores them in the draft pool at the rows the target uses (no Q, no input_layernorm);
- `forward_block` runs the [anchor, mask x (B-1)] block over that context, unmasked.

Sharding: the draft runs entirely inside its attn_tp group. Attention heads are split over
attn_tp like the target's (KV heads replicated when fewer than attn_tp), and so is the MLP,
so only attn_tp collectives appear here: under DP attention each attn_dp group drafts its
own requests without waiting on the others. `fc` and the norms are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_launch.attention import AttentionBackend, ForwardContext, ForwardMetadata
from dspark_launch.memory.kv_pool import KVPool
from dspark_launch.parallel import get_parallel

from .decoder import MLP, Attention
from .draft_config import DraftConfig
from .layers import (
    ColumnParallelLinear,
    Packs,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    dense,
)


class DraftLayer(Packs, nn.Module):
    def __init__(self, cfg: DraftConfig, dtype: torch.dtype, device: torch.device | str,
                 layer_id: int) -> None:
        super().__init__()
        # The target's attention block: same qkv/o sharding over attn_tp, same q/k norms.
        self.self_attn = Attention(cfg.layer_config(), dtype, device, layer_id)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device, over_attn_tp=True)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                device)

    def context_kv(self, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected context c [N, d] -> k [N, Hkv_l, hd] (k_norm + RoPE), v [N, Hkv_l, hd].

        Only the K/V rows of the fused qkv weight are multiplied: context rows never need Q.
        """
        attn = self.self_attn
        qkv = attn.qkv_proj
        n, hd = c.shape[0], attn.head_dim
        kv_b = None if qkv.bias is None else qkv.bias[qkv.q_size:]
        k, v = dense(c, self._kv_weight, kv_b, self.packed).split(
            [qkv.kv_size, qkv.kv_size], dim=-1)
        k, v = k.reshape(n, -1, hd), v.reshape(n, -1, hd)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        return apply_rotary(k, cos, sin), v

    @property
    def _kv_weight(self) -> torch.Tensor:  # [2 * kv_size, d]: the k rows then the v rows
        qkv = self.self_attn.qkv_proj
        return qkv.weight[qkv.q_size:]

    def pack_source(self) -> torch.Tensor:
        """The context's k/v projection gets a packed copy of its own (gemm.py): its rows
        are packed twice, here and in qkv_proj's copy (the block's projection)."""
        return self._kv_weight

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [T, d]
        h = x + self.self_attn(self.input_layernorm(x), ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    # Slot rule (models.md §2): the anchor slot is not a proposal; slot j >= 1 predicts the
    # token AT start+j (mask-predict), so a round proposes B-1 tokens. Logits are computed by
    # the engine with the TARGET's LM head on slots [first_proposal_slot, B).
    first_proposal_slot = 1
    predicts_next = False  # slot j predicts position start+j (not start+j+1)

    def __init__(self, cfg: DraftConfig, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        dtype = dtype or cfg.dtype
        cfg.check_topology(get_parallel().attn_tp_size)
        self.config, self.dtype = cfg, dtype
        d = cfg.hidden_size
        # fc and hidden_norm are replicated: every rank needs the whole projected context.
        self.fc = ColumnParallelLinear(cfg.num_features * d, d, bias=False, shards=1, rank=0,
                                       dtype=dtype, device=device)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.layers = nn.ModuleList(DraftLayer(cfg, dtype, device, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, device)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @torch.no_grad()
    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """C = hidden_norm(fc(features)): [N, m*d] -> [N, d], shared by all draft layers."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    @torch.no_grad()
    def materialize(self, features: torch.Tensor, positions: torch.Tensor,
                    rows: torch.Tensor, kv: KVPool) -> None:
        """Store context K/V of newly committed tokens into the draft pool.

        features [N, m*d] (target layer outputs in target_layer_ids order), positions [N]
        absolute positions, rows [N] draft-pool rows (the same rows the target uses).
        """
        if features.shape[0] == 0:
            return
        c = self.project_context(features)  # [N, d]
        cos, sin = self.rotary.cos_sin(positions, c.dtype)  # [N, hd] each
        for layer_id, layer in enumerate(self.layers):
            k, v = layer.context_kv(c, cos, sin)  # [N, Hkv_l, hd] each
            kv.k[layer_id][rows] = k.to(kv.k[layer_id].dtype)
            kv.v[layer_id][rows] = v.to(kv.v[layer_id].dtype)

    @torch.no_grad()
    def forward_block(self, x: torch.Tensor, meta: ForwardMetadata,
                      backend: AttentionBackend, kv: KVPool) -> torch.Tensor:
        """Embedded block tokens x [T, d] -> final-normed hidden states [T, d].

        meta: mask_mode "none"; each request's kv rows are its context rows then its block
        rows, the block rows being meta.out_rows (the backend stores the block's K/V there).
        """
        assert meta.mask_mode == "none", (
            f"the draft block attends bidirectionally; got mask_mode={meta.mask_mode!r}")
        x = x.to(self.dtype)
        cos, sin = self.rotary.cos_sin(meta.positions.to(x.device), x.dtype)  # [T, hd]
        ctx = ForwardContext.prepare(meta, backend, kv, cos, sin)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)
