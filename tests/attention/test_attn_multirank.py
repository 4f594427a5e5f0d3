"""One attention layer with its heads split over attn_tp reproduces the single-rank output.

Real gloo worlds: each rank loads only its shard of q/k/v/o (KV heads replicated when there
are fewer KV heads than ranks), writes its local heads into its own paged pool, attends with
the torch backend, and the o_proj partial sums are all-reduced inside attn_tp.
"""

from __future__ import annotations

import pytest
import torch
from multirank import run_world

from dspark_launch.args import resolve_config
from dspark_launch.attention import ForwardContext, build_metadata, make_backend
from dspark_launch.memory.allocator import KVSpace
from dspark_launch.memory.geometry import KVGeometry
from dspark_launch.memory.kv_pool import KVPool
from dspark_launch.models.config import ModelConfig
from dspark_launch.models.decoder import Attention
from dspark_launch.models.layers import RotaryEmbedding
from dspark_launch.parallel import init_parallel_runtime

D, HQ, HD = 32, 8, 8


def _config(kv_heads: int) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=D, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=HQ, num_key_value_heads=kv_heads, head_dim=HD,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
        tie_word_embeddings=False, attention_bias=False, dtype=torch.float32)


def _weights(kv_heads: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(kv_heads)
    return {
        "q": torch.randn(HQ * HD, D, generator=g) * 0.3,
        "k": torch.randn(kv_heads * HD, D, generator=g) * 0.3,
        "v": torch.randn(kv_heads * HD, D, generator=g) * 0.3,
        "o": torch.randn(D, HQ * HD, generator=g) * 0.3,
        "q_norm": 1 + 0.2 * torch.randn(HD, generator=g),
        "k_norm": 1 + 0.2 * torch.randn(HD, generator=g),
    }


def _layer_outputs(rank: int, world: int, kv_heads: int, page_size: int) -> list[list]:
    """Prefill two requests (chunked for one of them), then one decode step; every output."""
    init_parallel_runtime(resolve_config([], world_size=world))
    cfg, w = _config(kv_heads), _weights(kv_heads)
    attn = Attention(cfg, torch.float32, "cpu", layer_id=0)
    for sid in "qkv":
        attn.qkv_proj.weight.weight_loader(attn.qkv_proj.weight, w[sid], sid)
    attn.o_proj.weight.weight_loader(attn.o_proj.weight, w["o"])
    attn.q_norm.weight.data.copy_(w["q_norm"])
    attn.k_norm.weight.data.copy_(w["k_norm"])
    space = KVSpace(128, page_size, 4, 64, "cpu")
    pool = KVPool(KVGeometry("target", 1, kv_heads, HD, HD, torch.float32), space.num_rows, "cpu")
    backend = make_backend("torch", "cpu")
    rope = RotaryEmbedding(HD, cfg.rope_theta, "cpu")
    slots = [space.new_slot(), space.new_slot()]
    g = torch.Generator().manual_seed(7)
    outs = []
    # (prefix lengths, new tokens) per step: prefill 5 and 9 (as 6 + 3), then a decode step.
    for prefix, q_lens in [([0, 0], [5, 6]), ([5, 6], [1, 3]), ([6, 9], [1, 1])]:
        for s, p, q in zip(slots, prefix, q_lens):
            assert space.reserve(s, p + q)
        meta = build_metadata(space.req_to_token, slots, prefix, q_lens)
        x = torch.randn(sum(q_lens), D, generator=g)
        cos, sin = rope.cos_sin(meta.positions, x.dtype)
        ctx = ForwardContext.prepare(meta, backend, pool, cos, sin)
        with torch.no_grad():
            outs.append(attn(x, ctx).tolist())
    return outs


CASES = [(1, 2, 1), (2, 2, 1), (4, 4, 16), (4, 2, 1), (8, 2, 16), (8, 4, 1)]


@pytest.mark.parametrize("world,kv_heads,page_size", CASES,
                         ids=[f"attn_tp{w}-kv{k}-page{p}" for w, k, p in CASES])
def test_sharded_heads_match_one_rank(world: int, kv_heads: int, page_size: int) -> None:
    (single,) = run_world(1, _layer_outputs, 1, kv_heads, page_size)
    for rank_out in run_world(world, _layer_outputs, world, kv_heads, page_size):
        for got, want in zip(rank_out, single):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want),
                                       atol=1e-5, rtol=1e-5)
