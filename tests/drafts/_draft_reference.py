"""An independent fp32 reference for the DFlash/DSpark drafts, written from models.md §2/§3.

Single rank, no paging: one request at a time, context K/V and block K/V concatenated along
the sequence, full softmax with no mask. It reads the checkpoint-named tensors directly and
shares no code with dspark_launch, so a wiring mistake in the engine cannot cancel out.
Also: the harness that runs OUR draft through a real KVSpace/KVPool/torch backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from dspark_launch.attention import build_metadata, make_backend
from dspark_launch.memory.allocator import KVSpace
from dspark_launch.memory.geometry import KVGeometry
from dspark_launch.memory.kv_pool import KVPool

Tensors = Mapping[str, torch.Tensor]


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [S, H, hd] rotate-half RoPE at absolute positions pos [S]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.cat([pos.float()[:, None] * inv] * 2, dim=-1)[:, None, :]  # [S, 1, hd]
    half = hd // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * ang.cos() + rotated * ang.sin()


def ref_block(sd: Tensors, raw: Mapping[str, Any], features: torch.Tensor,
              ctx_pos: torch.Tensor, x: torch.Tensor, block_pos: torch.Tensor) -> torch.Tensor:
    """One request: features [N, m*d] at ctx_pos, embedded block x [B, d] -> norm(x_L) [B, d]."""
    eps, theta = raw["rms_norm_eps"], raw["rope_theta"]
    h, kv, hd = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    c = rms(features @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)  # [N, d]
    n_ctx, b = c.shape[0], x.shape[0]
    for layer in range(raw["num_hidden_layers"]):
        w = {k.split(f"layers.{layer}.", 1)[1]: t for k, t in sd.items()
             if k.startswith(f"layers.{layer}.")}
        n = rms(x, w["input_layernorm.weight"], eps)
        q = rms((n @ w["self_attn.q_proj.weight"].T).view(b, h, hd), w["self_attn.q_norm.weight"],
                eps)
        q = rope(q, block_pos, theta)

        def keys(src: torch.Tensor, pos: torch.Tensor, w=w) -> torch.Tensor:
            k = (src @ w["self_attn.k_proj.weight"].T).view(src.shape[0], kv, hd)
            return rope(rms(k, w["self_attn.k_norm.weight"], eps), pos, theta)

        # Context rows: no input_layernorm; same k/v weights as the block rows.
        k_all = torch.cat([keys(c, ctx_pos), keys(n, block_pos)])  # [N+B, kv, hd]
        v_all = torch.cat([c @ w["self_attn.v_proj.weight"].T,
                           n @ w["self_attn.v_proj.weight"].T]).view(n_ctx + b, kv, hd)
        k_all, v_all = (t.repeat_interleave(h // kv, dim=1) for t in (k_all, v_all))
        scores = torch.einsum("qhd,khd->hqk", q, k_all) * hd ** -0.5  # no mask
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v_all).reshape(b, h * hd)
        x = x + o @ w["self_attn.o_proj.weight"].T
        n2 = rms(x, w["post_attention_layernorm.weight"], eps)
        mlp = F.silu(n2 @ w["mlp.gate_proj.weight"].T) * (n2 @ w["mlp.up_proj.weight"].T)
        x = x + mlp @ w["mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"], eps)


def ref_sample_greedy(sd: Tensors, raw: Mapping[str, Any], base_logits: torch.Tensor,
                      hidden: torch.Tensor, anchor: int) -> tuple[list[int], list[float]]:
    """One request, T=0, vanilla head: l_k = U_k + W1[x_{k-1}] W2^T, x_{-1} = anchor."""
    r = raw["markov_rank"]
    prev, tokens, confs = anchor, [], []
    for k in range(base_logits.shape[0]):
        logits = base_logits[k].clone()
        e = sd["markov_head.markov_w1.weight"][prev] if r else torch.zeros(0)
        if r:
            logits = logits + sd["markov_head.markov_w2.weight"] @ e
        if raw.get("enable_confidence_head"):
            z = torch.cat([hidden[k], e]) @ sd["confidence_head.proj.weight"][0]
            confs.append(float(torch.sigmoid(z + sd["confidence_head.proj.bias"][0])))
        prev = int(logits.argmax())
        tokens.append(prev)
    return tokens, confs


def run_draft(draft, features: Sequence[torch.Tensor], blocks: Sequence[torch.Tensor],
              *, page_size: int = 4, split: int = 2,
              gaps: Sequence[Sequence[tuple[int, int]]] | None = None, noise_seed: int = 0,
              skip: bool = True) -> torch.Tensor:
    """Our path: materialize each request's context (in `split` chunks, mixed across requests
    as the engine commits them) into a real paged pool, then one batched forward_block.
    `gaps`: per request, position ranges whose rows are then overwritten with noise (as a
    dormant step leaves them: a page's last owner's K/V), and skipped by the block if `skip`.

    features[i] [N_i, m*d], blocks[i] [B, d] -> concatenated hidden [sum B, d].
    """
    cfg = draft.config
    block = blocks[0].shape[0]
    geo = KVGeometry("draft", cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.head_dim, torch.float32)
    space = KVSpace(1024, page_size, len(features) + 1, 256, "cpu")
    pool = KVPool(geo, space.num_rows, "cpu")
    space.new_slot()  # a dummy first slot, so request slots and rows are not trivially 0..
    slots = [space.new_slot() for _ in features]
    for slot, f in zip(slots, features):
        assert space.reserve(slot, f.shape[0] + block)
    for part in range(split):
        feats, pos, rows = [], [], []
        for slot, f in zip(slots, features):
            lo, hi = part * f.shape[0] // split, (part + 1) * f.shape[0] // split
            feats.append(f[lo:hi])
            pos.append(torch.arange(lo, hi))
            rows.append(space.req_to_token[slot, lo:hi])
        draft.materialize(torch.cat(feats), torch.cat(pos), torch.cat(rows), pool)
    gen = torch.Generator().manual_seed(noise_seed)
    for slot, ranges in zip(slots, gaps or [[] for _ in features]):
        for a, b in ranges:
            rows = space.req_to_token[slot, a:b]
            for cache in (*pool.k, *pool.v):
                cache[rows] = 3 * torch.randn(cache[rows].shape, generator=gen)
    meta = build_metadata(space.req_to_token, slots, [f.shape[0] for f in features],
                          [block] * len(features), mask_mode="none",
                          skipped=gaps if skip else None)
    return draft.forward_block(torch.cat(list(blocks)), meta, make_backend("torch", "cpu"),
                               pool)


GREEDY_BELOW = 1e-5  # temperatures below this are greedy (argmax, one-hot q)


@torch.no_grad()
def sample_block(draft, base_logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor,
                 temperature: float | torch.Tensor,
                 generators: Sequence[torch.Generator | None] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain left-to-right walk through a DSparkDraft's public step API (markov_state /
    markov_step / confidence), one per-request CPU generator each: an independent check of the
    engine's vectorised walk (spec/dspark_sampler.walk_block).

    base_logits [R, B, V] fp32 (target lm_head on the final-normed block outputs), hidden
    [R, B, d], anchors [R] int64, temperature scalar or [R] -> tokens [R, B] int64, q [R, B, V]
    fp32 (the corrected distribution each token was drawn from; one-hot when greedy), conf."""
    r_count, block, vocab = base_logits.shape
    temps = torch.as_tensor(temperature, dtype=torch.float32).expand(r_count)  # [R]
    tokens = torch.empty((r_count, block), dtype=torch.int64)
    q_probs = torch.empty((r_count, block, vocab), dtype=torch.float32)
    conf = torch.empty((r_count, block), dtype=torch.float32)
    prev = anchors.to(torch.int64)  # x_{-1} = the anchor
    state = draft.markov_state(r_count, "cpu")  # reset every block
    for k in range(block):
        h_k = hidden[:, k]  # [R, d]
        bias, state = draft.markov_step(prev, h_k, state)  # [R, V]
        logits = base_logits[:, k].float() + bias
        conf[:, k] = draft.confidence(h_k, prev)
        greedy = temps < GREEDY_BELOW
        scale = torch.where(greedy, torch.ones_like(temps), temps)
        probs = torch.softmax(logits / scale[:, None], dim=-1)  # [R, V]
        token = logits.argmax(dim=-1)  # ties -> lowest id, like the target's greedy
        for row in torch.nonzero(~greedy).flatten().tolist():
            gen = generators[row] if generators is not None else None
            token[row] = torch.multinomial(probs[row], 1, generator=gen)[0]
        one_hot = F.one_hot(token, vocab).to(probs.dtype)
        tokens[:, k], q_probs[:, k] = token, torch.where(greedy[:, None], one_hot, probs)
        prev = tokens[:, k]  # the token actually drafted seeds the next slot
    return tokens, q_probs, conf
