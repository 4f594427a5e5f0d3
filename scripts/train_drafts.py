#!/usr/bin/env python
"""Train the tiny DFlash (z-lab format) and DSpark (DeepSpec format) drafts
against the frozen tiny target, and measure greedy tau in a real decode loop.

Stages (run in order by default; each can be run alone):
  rollouts  the target's own greedy continuations of real-text prompts (chunks
            of training files), plus the captured target features; cached in
            --work (default out_tiny/, git-ignored).
  dflash    train the 1-layer DFlash draft (slots 1..B-1 predict positions start+j)
  dspark    train the 1-layer DSpark draft (all B slots predict start+k+1,
            vanilla Markov head, confidence head)
  eval      batch-1 greedy draft -> verify -> commit loop with the target's KV
            cache on held-out prompts; mean accepted length (incl. bonus) for
            DFLASH, DSPARK and a prompt-lookup n-gram (n<=3) drafter; checks the
            output equals plain greedy decoding.

    python scripts/train_drafts.py --stages rollouts,dflash,dspark,eval --minutes 20

Then, for sampled decoding (the shipped drafts went through this after the above):
  mixed     greedy and T=1-sampled continuations (--mixed-rollouts G S) with the
            target's final hidden states (its distributions); cached in --work
  finetune  warm-start each draft from DRAFT_ROOT and train on greedy batches (hard
            labels, as above) plus sampled batches whose labels are the target's own
            T=1 distribution (soft cross-entropy); prints per-slot greedy top-1 and
            expected T=1 acceptance sum_x min(p, q) on held-out rollouts, before/after

    python scripts/train_drafts.py --stages mixed,finetune,eval --finetune-minutes 12
"""

import argparse
import json
import os
import random
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_common as tc  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TARGET_LAYER_IDS = [1, 4, 6]
BLOCK = 8


# ----------------------------------------------------------------------------- model
class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope_cos_sin(pos, hd, theta):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    f = pos.float()[..., None] * inv
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    # x [..., S, hd]; cos/sin broadcastable [..., S, hd]
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


class Attn(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, H, KV, hd = (
            c["hidden_size"],
            c["num_attention_heads"],
            c["num_key_value_heads"],
            c["head_dim"],
        )
        self.H, self.KV, self.hd = H, KV, hd
        self.q_proj = nn.Linear(d, H * hd, bias=False)
        self.k_proj = nn.Linear(d, KV * hd, bias=False)
        self.v_proj = nn.Linear(d, KV * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, c["rms_norm_eps"])

    def forward(self, n, ctx, cs_q, cs_k, mask):
        """n: [b, Q, d] normed block rows; ctx: [b, T, d] projected context (no input norm);
        cs_q: cos/sin for block rows [b,1,Q,hd]; cs_k: for [ctx; block] rows [b,1,T+Q,hd];
        mask: bool [b,1,Q,T+Q] or None (= all visible)."""
        b, Q, _ = n.shape
        T = ctx.shape[1]
        q = self.q_norm(self.q_proj(n).view(b, Q, self.H, self.hd)).transpose(1, 2)
        kv_in = torch.cat([ctx, n], 1)
        k = self.k_norm(self.k_proj(kv_in).view(b, T + Q, self.KV, self.hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, T + Q, self.KV, self.hd).transpose(1, 2)
        q = apply_rope(q, *cs_q)
        k = apply_rope(k, *cs_k)
        rep = self.H // self.KV
        k = k.repeat_interleave(rep, 1)
        v = v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, Q, self.H * self.hd))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attn(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x, ctx, cs_q, cs_k, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cs_q, cs_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    def __init__(self, V, r):
        super().__init__()
        self.markov_w1 = nn.Embedding(V, r)
        self.markov_w2 = nn.Linear(r, V, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, d, r):
        super().__init__()
        self.proj = nn.Linear(d + r, 1)


class Draft(nn.Module):
    """DFlash / DSpark backbone.  embed / lm_head are the frozen target's (passed in)."""

    def __init__(self, c, n_feats, markov_rank=0, confidence=False):
        super().__init__()
        d = c["hidden_size"]
        self.c = c
        self.fc = nn.Linear(n_feats * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, c["rms_norm_eps"])
        self.layers = nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(d, c["rms_norm_eps"])
        self.theta = float(
            c.get("rope_theta", c.get("rope_parameters", {}).get("rope_theta", 10000.0))
        )
        if markov_rank:
            self.markov_head = MarkovHead(c["vocab_size"], markov_rank)
            nn.init.normal_(self.markov_head.markov_w1.weight, std=0.02)
            nn.init.zeros_(self.markov_head.markov_w2.weight)
        if confidence:
            self.confidence_head = ConfidenceHead(d, markov_rank)
            nn.init.zeros_(self.confidence_head.proj.weight)
            nn.init.zeros_(self.confidence_head.proj.bias)

    def backbone(self, feats, ctx_pos, x, blk_pos, mask):
        """feats [b,T,m*d], ctx_pos [b,T], x [b,Q,d] block embeddings, blk_pos [b,Q]
        -> normed h [b,Q,d]"""
        hd = self.c["head_dim"]
        ctx = self.hidden_norm(self.fc(feats))
        cq = rope_cos_sin(blk_pos, hd, self.theta)
        ck = rope_cos_sin(torch.cat([ctx_pos, blk_pos], 1), hd, self.theta)
        cs_q = (cq[0][:, None].to(x.dtype), cq[1][:, None].to(x.dtype))
        cs_k = (ck[0][:, None].to(x.dtype), ck[1][:, None].to(x.dtype))
        for layer in self.layers:
            x = layer(x, ctx, cs_q, cs_k, mask)
        return self.norm(x)


def draft_config(tcfg, kind, num_anchors):
    c = dict(tcfg)
    for k in ("transformers_version", "_name_or_path"):
        c.pop(k, None)
    c["num_hidden_layers"] = 1
    c["layer_types"] = ["full_attention"]
    c["block_size"] = BLOCK
    c["num_target_layers"] = tcfg["num_hidden_layers"]
    c["dtype"] = "bfloat16"
    if kind == "dflash":
        c["architectures"] = ["DFlashDraftModel"]
        c["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
        c["dflash_config"] = {
            "mask_token_id": tcfg["vocab_size"] - 1,
            "target_layer_ids": list(TARGET_LAYER_IDS),
        }
    else:
        c["architectures"] = ["Qwen3DSparkModel"]
        c["target_layer_ids"] = list(TARGET_LAYER_IDS)
        c["mask_token_id"] = tcfg["vocab_size"] - 1
        c["num_anchors"] = num_anchors
        c["markov_rank"] = 32
        c["markov_head_type"] = "vanilla"
        c["enable_confidence_head"] = True
        c["confidence_head_with_markov"] = True
        c["tie_word_embeddings"] = False
    return c


# ----------------------------------------------------------------------------- target
def load_target(tdir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32, attn_implementation="sdpa")
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def target_features(hidden_states):
    return torch.cat([hidden_states[i + 1] for i in TARGET_LAYER_IDS], -1)


# ----------------------------------------------------------------------------- rollouts
@torch.no_grad()
def greedy_batch(target, prompt, G):
    """Plain batched greedy continuation (no stopping at EOS) with a KV cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = target(input_ids=prompt, past_key_values=cache, use_cache=True)
    toks = [out.logits[:, -1].argmax(-1)]
    for _ in range(G - 1):
        out = target(input_ids=toks[-1][:, None], past_key_values=cache, use_cache=True)
        toks.append(out.logits[:, -1].argmax(-1))
    return torch.cat([prompt, torch.stack(toks, 1)], 1)


@torch.no_grad()
def sampled_batch(target, prompt, G, g):
    """Batched continuation sampled at T=1 (no top-k/top-p, no stopping at EOS)."""
    from transformers import DynamicCache

    def draw(logits):
        return torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=g)[:, 0]

    cache = DynamicCache()
    out = target(input_ids=prompt, past_key_values=cache, use_cache=True)
    toks = [draw(out.logits[:, -1])]
    for _ in range(G - 1):
        out = target(input_ids=toks[-1][:, None], past_key_values=cache, use_cache=True)
        toks.append(draw(out.logits[:, -1]))
    return torch.cat([prompt, torch.stack(toks, 1)], 1)


@torch.no_grad()
def mixed_rollouts(target, tok, files, root, n, seed, sampled, bs=32, G=128):
    """n continuations (greedy, or sampled at T=1) of random 32..128-token windows, with the
    captured features and the final-normed hidden states (the target's distributions)."""
    data = tc.encode_files(tok, root, files)
    g = torch.Generator().manual_seed(seed)
    seqs, feats, finals, plens = [], [], [], []
    i = 0
    while len(seqs) * bs < n:
        P = [32, 64, 96, 128][i % 4]
        i += 1
        idx = torch.randint(0, len(data) - P - 1, (bs,), generator=g)
        prompt = torch.stack([data[j : j + P] for j in idx.tolist()]).long()
        out = sampled_batch(target, prompt, G, g) if sampled else greedy_batch(target, prompt, G)
        hs = target(input_ids=out, output_hidden_states=True).hidden_states
        seqs.append(out.to(torch.int16))
        feats.append(target_features(hs).to(torch.bfloat16))
        finals.append(hs[-1].to(torch.bfloat16))
        plens.append(P)
    return {"seqs": seqs, "feats": feats, "finals": finals, "plens": plens}


@torch.no_grad()
def make_rollouts(args, target, tok, files, root, minutes, seed, n_max):
    """Greedy continuations of random prompts (token windows of the given files)."""
    data = tc.encode_files(tok, root, files)
    g = torch.Generator().manual_seed(seed)
    seqs, feats, plens = [], [], []
    t0 = time.time()
    bs, G = args.rollout_batch, args.gen_len
    i = 0
    while time.time() - t0 < minutes * 60 and len(seqs) * bs < n_max:
        P = [32, 64, 96, 128][i % 4]
        i += 1
        idx = torch.randint(0, len(data) - P - 1, (bs,), generator=g)
        prompt = torch.stack([data[j : j + P] for j in idx.tolist()]).long()
        out = greedy_batch(target, prompt, G)
        hs = target(input_ids=out, output_hidden_states=True).hidden_states
        seqs.append(out.to(torch.int16))
        feats.append(target_features(hs).to(torch.bfloat16))
        plens.append(P)
        if i % 5 == 0:
            print(
                f"  rollouts: {len(seqs) * bs} seqs, {(time.time() - t0) / 60:.1f} min", flush=True
            )
    return {"seqs": seqs, "feats": feats, "plens": plens}


# ----------------------------------------------------------------------------- training
def sample_anchors(plen, T, n, kind, g):
    lo = plen  # first generated token (the first anchor at inference)
    hi = T - BLOCK - (1 if kind == "dspark" else 0)  # inclusive
    return torch.randint(lo, hi + 1, (n,), generator=g)


def draft_logits(model, kind, E, seqs, feats, anchors, mask_id):
    """Teacher-forced block logits at every anchor: seqs [b,T] long, feats [b,T,m*d],
    anchors [b,N] -> (logits [b,N,S,V], label positions [b,N,S], h, Markov w1 (DSpark) or
    None). S = B-1 slots for DFlash (slot j predicts start+j), B for DSpark (slot k predicts
    start+k+1, its Markov input the true token before)."""
    b, T = seqs.shape
    N = anchors.shape[1]
    ar = torch.arange(BLOCK)
    pos = anchors[:, :, None] + ar  # [b,N,B]
    ids = torch.full((b, N, BLOCK), mask_id, dtype=torch.long)
    ids[:, :, 0] = torch.gather(seqs, 1, anchors)
    x = F.embedding(ids.view(b, N * BLOCK), E)
    ctx_pos = torch.arange(T).expand(b, T)
    # mask: block row (anchor a) sees ctx t < a and rows of its own block
    anc_row = anchors[:, :, None].expand(b, N, BLOCK).reshape(b, N * BLOCK)
    m_ctx = ctx_pos[:, None, :] < anc_row[:, :, None]
    blk_id = torch.arange(N).repeat_interleave(BLOCK)
    m_blk = (blk_id[:, None] == blk_id[None, :]).expand(b, -1, -1)
    mask = torch.cat([m_ctx, m_blk], 2)[:, None]
    h = model.backbone(feats.float(), ctx_pos, x, pos.view(b, N * BLOCK), mask).view(
        b, N, BLOCK, -1
    )
    if kind == "dflash":
        return h[:, :, 1:] @ E.t(), pos[:, :, 1:], h, None
    prev = torch.gather(seqs, 1, pos.reshape(b, -1)).view(b, N, BLOCK)
    w1 = model.markov_head.markov_w1(prev)
    return h @ model.lm_head_w.t() + model.markov_head.markov_w2(w1), pos + 1, h, w1


def labels_at(seqs, lpos):
    return torch.gather(seqs, 1, lpos.reshape(seqs.shape[0], -1)).view(lpos.shape)


def target_probs_at(finals, lpos, E):
    """The target's T=1 distribution of the token at each label position: softmax of the
    logits one position earlier (finals [b,T,d] final-normed hidden) -> [b,N,S,V]."""
    b, _, d = finals.shape
    idx = (lpos - 1).reshape(b, -1, 1).expand(-1, -1, d)
    return torch.softmax(torch.gather(finals.float(), 1, idx) @ E.t(), -1).view(*lpos.shape, -1)


def position_weights(slots, gamma):
    return torch.exp(-torch.arange(slots, dtype=torch.float32) / gamma)


def draft_loss(model, kind, E, seqs, feats, plen, anchors, mask_id, gamma):
    """seqs [b,T] long, feats [b,T,m*d], anchors [b,N].  Returns loss, stats."""
    logits, lpos, h, w1 = draft_logits(model, kind, E, seqs, feats, anchors, mask_id)
    labels = labels_at(seqs, lpos)
    w = position_weights(labels.shape[-1], gamma)
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
    ).view(labels.shape)
    loss = (ce * w).sum(-1).mean() / w.sum()
    hit = logits.argmax(-1) == labels
    stats = {"ce": ce.mean(0).mean(0).detach(), "acc": hit.float().mean(0).mean(0)}
    if kind == "dspark":
        z = model.confidence_head.proj(torch.cat([h.detach(), w1.detach()], -1).float()).squeeze(-1)
        bce = F.binary_cross_entropy_with_logits(z, hit.float())
        loss = loss + 0.2 * bce
        stats["bce"] = bce.detach()
    return loss, stats


def soft_loss(model, kind, E, seqs, feats, finals, anchors, mask_id, gamma):
    """On sampled rollouts: cross-entropy against the target's own T=1 distribution (not its
    sampled token), so that the draft's q matches p where speculative sampling accepts
    sum_x min(p, q). -> loss, per-slot mean overlap sum_x min(p, q) [S]."""
    logits, lpos, _, _ = draft_logits(model, kind, E, seqs, feats, anchors, mask_id)
    p = target_probs_at(finals, lpos, E)
    logq = torch.log_softmax(logits, -1)
    w = position_weights(lpos.shape[-1], gamma)
    loss = (-(p * logq).sum(-1) * w).sum(-1).mean() / w.sum()
    overlap = torch.minimum(p, logq.exp()).sum(-1).mean((0, 1)).detach()
    return loss, overlap


def accept_len_estimate(acc_prefix_hits):
    """Expected accepted length (incl. bonus) from per-slot hit tensor [n, S] (prefix product)."""
    return 1 + torch.cumprod(acc_prefix_hits.float(), -1).sum(-1).mean().item()


@torch.no_grad()
def eval_draft_loss(model, kind, E, ro, mask_id, gamma, n_anchor=16, seed=1):
    model.eval()
    g = torch.Generator().manual_seed(seed)
    tot, cnt, taus = 0.0, 0, []
    for seqs, feats, P in zip(ro["seqs"], ro["feats"], ro["plens"]):
        seqs = seqs.long()
        for j in range(0, seqs.shape[0], 8):
            s, f = seqs[j : j + 8], feats[j : j + 8]
            anc = torch.stack(
                [sample_anchors(P, s.shape[1], n_anchor, kind, g) for _ in range(s.shape[0])]
            )
            loss, st = draft_loss(model, kind, E, s, f, P, anc, mask_id, gamma)
            tot += loss.item()
            cnt += 1
            taus.append(st["acc"])
    model.train()
    acc = torch.stack(taus).mean(0)
    return tot / cnt, acc


def train_draft(args, kind, target, tcfg, ro_train, ro_held, out_dir):
    torch.manual_seed(args.seed + (1 if kind == "dflash" else 2))
    g = torch.Generator().manual_seed(args.seed + 10)
    mask_id = tcfg["vocab_size"] - 1
    c = draft_config(tcfg, kind, args.anchors)
    model = Draft(
        c,
        len(TARGET_LAYER_IDS),
        markov_rank=c.get("markov_rank", 0) if kind == "dspark" else 0,
        confidence=kind == "dspark",
    )
    # warm start the draft layer from the target's last layer (then trained fully)
    tsd = target.state_dict()
    last = tcfg["num_hidden_layers"] - 1
    with torch.no_grad():
        for name, p in model.layers[0].named_parameters():
            p.copy_(tsd[f"model.layers.{last}.{name}"])
        model.norm.weight.copy_(tsd["model.norm.weight"])
        nn.init.normal_(model.fc.weight, std=0.02)
    E = tsd["model.embed_tokens.weight"].detach().clone()
    model.lm_head_w = E  # frozen (tied target)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    print(f"[{kind}] trainable params {n_params / 1e6:.3f}M", flush=True)
    opt = torch.optim.AdamW(params, lr=args.draft_lr, betas=(0.9, 0.95), weight_decay=0.01)
    budget = args.minutes * 60
    t0 = time.time()
    step, n_seq, ema = 0, 0, None
    nb = len(ro_train["seqs"])
    bs = ro_train["seqs"][0].shape[0]
    curve = []
    while time.time() - t0 < budget:
        frac = (time.time() - t0) / budget
        for grp in opt.param_groups:
            grp["lr"] = tc.cosine_lr(frac, args.draft_lr, warm=0.03)
        bi = int(torch.randint(0, nb, (1,), generator=g))
        rows = torch.randint(0, bs, (args.draft_batch,), generator=g)
        seqs = ro_train["seqs"][bi][rows].long()
        feats = ro_train["feats"][bi][rows]
        P = ro_train["plens"][bi]
        anc = torch.stack(
            [sample_anchors(P, seqs.shape[1], args.anchors, kind, g) for _ in range(seqs.shape[0])]
        )
        loss, st = draft_loss(model, kind, E, seqs, feats, P, anc, mask_id, args.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        n_seq += seqs.shape[0]
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0:
            acc = " ".join(f"{a:.2f}" for a in st["acc"].tolist())
            print(
                f"[{kind}] step {step} {(time.time() - t0) / 60:.1f}min loss {ema:.3f} "
                f"acc/slot {acc}",
                flush=True,
            )
            curve.append(
                {"step": step, "minutes": round((time.time() - t0) / 60, 2), "loss": round(ema, 4)}
            )
    train_s = time.time() - t0
    hl, hacc = eval_draft_loss(model, kind, E, ro_held, mask_id, args.gamma)
    tau_est = 1 + torch.cumprod(hacc, 0).sum().item()
    print(
        f"[{kind}] done {step} steps, {n_seq} seqs x {args.anchors} anchors, "
        f"{train_s / 60:.1f} min; "
        f"held-out weighted CE {hl:.4f}; per-slot acc {[round(a, 3) for a in hacc.tolist()]}",
        flush=True,
    )
    save_draft(model, kind, c, E, out_dir)
    stats = {
        "kind": kind,
        "trainable_params": n_params,
        "steps": step,
        "sequences_seen": n_seq,
        "anchors_per_seq": args.anchors,
        "blocks_seen": n_seq * args.anchors,
        "train_minutes": round(train_s / 60, 2),
        "lr": args.draft_lr,
        "gamma": args.gamma,
        "seed": args.seed,
        "heldout_weighted_ce": round(hl, 4),
        "heldout_slot_acc": [round(a, 4) for a in hacc.tolist()],
        "tau_estimate_from_slot_acc_product": round(tau_est, 3),
        "curve": curve,
    }
    (Path(out_dir) / "train_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    return model


def save_draft(model, kind, c, E, out_dir):
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if kind == "dspark":
        sd["embed_tokens.weight"] = E.to(torch.bfloat16).contiguous()
        sd["lm_head.weight"] = E.to(torch.bfloat16).clone().contiguous()
        sd["confidence_head.proj.weight"] = (
            sd["confidence_head.proj.weight"].float().to(torch.bfloat16)
        )
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    print(
        f"saved {kind} -> {out} ({sum(v.numel() for v in sd.values()) / 1e6:.3f}M tensors elems)",
        flush=True,
    )


def load_draft(ddir, kind):
    from safetensors.torch import load_file

    c = json.loads((Path(ddir) / "config.json").read_text())
    sd = {k: v.float() for k, v in load_file(str(Path(ddir) / "model.safetensors")).items()}
    ids = c["dflash_config"]["target_layer_ids"] if kind == "dflash" else c["target_layer_ids"]
    assert ids == TARGET_LAYER_IDS, ids
    m = Draft(
        c,
        len(ids),
        markov_rank=c.get("markov_rank", 0) if kind == "dspark" else 0,
        confidence=kind == "dspark",
    )
    E = sd.pop("embed_tokens.weight", None)
    L = sd.pop("lm_head.weight", None)
    m.load_state_dict(sd, strict=True)
    m.eval()
    return m, c, E, L


# ----------------------------------------------------------------------------- fine-tune
@torch.no_grad()
def eval_mixed(model, kind, E, ro_greedy, ro_sampled, mask_id, n_anchor=16, seed=1):
    """Per slot, teacher-forced: top-1 agreement with the target's greedy token on greedy
    rollouts, and the expected T=1 acceptance sum_x min(p, q) on sampled ones."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    out = []
    for ro, sampled in ((ro_greedy, False), (ro_sampled, True)):
        rows = []
        for seqs, feats, finals, P in zip(ro["seqs"], ro["feats"], ro["finals"], ro["plens"]):
            seqs = seqs.long()
            anc = torch.stack([sample_anchors(P, seqs.shape[1], n_anchor, kind, g)
                               for _ in range(seqs.shape[0])])
            logits, lpos, _, _ = draft_logits(model, kind, E, seqs, feats, anc, mask_id)
            if sampled:
                p = target_probs_at(finals, lpos, E)
                rows.append(torch.minimum(p, torch.softmax(logits, -1)).sum(-1).mean((0, 1)))
            else:
                rows.append((logits.argmax(-1) == labels_at(seqs, lpos)).float().mean((0, 1)))
        out.append([round(a, 4) for a in torch.stack(rows).mean(0).tolist()])
    model.train()
    return out


def finetune_draft(args, kind, target, ro, out_dir):
    """Warm-start from the draft in out_dir; each step one greedy batch (hard labels, as in
    train_draft) plus --soft-weight x one sampled batch (soft_loss). Greedy acceptance needs
    argmax(q) = argmax(p); sampled acceptance needs q close to p, which hard labels of greedy
    continuations never teach (the shipped drafts accepted ~0.3 per slot at T=1)."""
    torch.manual_seed(0)
    model, c, _, L = load_draft(out_dir, kind)
    E = target.get_input_embeddings().weight.detach().clone()
    model.lm_head_w = E if L is None else L
    mask_id = mask_id_of(c)
    before = eval_mixed(model, kind, E, ro["held_greedy"], ro["held_sampled"], mask_id)
    print(f"[{kind}] before: greedy top-1 {before[0]}, T=1 acceptance {before[1]}", flush=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.finetune_lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(3)
    budget, t0, step = args.finetune_minutes * 60, time.time(), 0
    while time.time() - t0 < budget:
        for grp in opt.param_groups:
            grp["lr"] = tc.cosine_lr((time.time() - t0) / budget, args.finetune_lr, warm=0.05)
        loss = 0.0
        for name in ("greedy", "sampled"):
            d = ro[name]
            bi = int(torch.randint(0, len(d["seqs"]), (1,), generator=g))
            rows = torch.randint(0, d["seqs"][bi].shape[0], (args.draft_batch,), generator=g)
            seqs, feats = d["seqs"][bi][rows].long(), d["feats"][bi][rows]
            P = d["plens"][bi]
            anc = torch.stack([sample_anchors(P, seqs.shape[1], args.anchors, kind, g)
                               for _ in range(seqs.shape[0])])
            if name == "greedy":
                loss = loss + draft_loss(model, kind, E, seqs, feats, P, anc, mask_id,
                                         args.gamma)[0]
            else:
                loss = loss + args.soft_weight * soft_loss(
                    model, kind, E, seqs, feats, d["finals"][bi][rows], anc, mask_id,
                    args.gamma)[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 200 == 0:
            print(f"[{kind}] fine-tune step {step} {(time.time() - t0) / 60:.1f}min "
                  f"loss {loss.item():.3f}", flush=True)
    after = eval_mixed(model, kind, E, ro["held_greedy"], ro["held_sampled"], mask_id)
    print(f"[{kind}] after {step} steps: greedy top-1 {after[0]}, T=1 acceptance {after[1]}",
          flush=True)
    save_draft(model, kind, c, E, out_dir)
    stats_path = Path(out_dir) / "train_stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    stats["finetune_sampled"] = {
        "steps": step, "minutes": round((time.time() - t0) / 60, 2), "lr": args.finetune_lr,
        "soft_weight": args.soft_weight, "sequences_per_batch": args.draft_batch,
        "greedy_rollouts": sum(x.shape[0] for x in ro["greedy"]["seqs"]),
        "sampled_rollouts": sum(x.shape[0] for x in ro["sampled"]["seqs"]),
        "heldout_greedy_top1_before": before[0], "heldout_greedy_top1_after": after[0],
        "heldout_t1_acceptance_before": before[1], "heldout_t1_acceptance_after": after[1],
    }
    stats_path.write_text(json.dumps(stats, indent=1) + "\n")


def mask_id_of(c):
    return c["dflash_config"]["mask_token_id"] if "dflash_config" in c else c["mask_token_id"]


# ----------------------------------------------------------------------------- eval loop
class Proposer:
    def __init__(self, kind, model=None, E=None, L=None, mask_id=None):
        self.kind, self.model, self.E, self.L, self.mask_id = kind, model, E, L, mask_id

    @torch.no_grad()
    def propose(self, committed, feats, start):
        """committed: list of token ids incl. the anchor at index `start`; feats [start, m*d]."""
        if self.kind == "ngram":
            return ngram_propose(committed, BLOCK - 1)
        ids = torch.full((1, BLOCK), self.mask_id, dtype=torch.long)
        ids[0, 0] = committed[start]
        x = F.embedding(ids, self.E)
        pos = torch.arange(start, start + BLOCK)[None]
        h = self.model.backbone(feats[None], torch.arange(start)[None], x, pos, None)[0]
        if self.kind == "dflash":
            return (h[1:] @ self.E.t()).argmax(-1).tolist()
        U = h @ self.L.t()
        mh = self.model.markov_head
        prev = committed[start]
        out = []
        for k in range(BLOCK):
            lk = U[k] + mh.markov_w2(mh.markov_w1.weight[prev])
            prev = int(lk.argmax())
            out.append(prev)
        return out


def ngram_propose(seq, k, nmax=3):
    n_seq = len(seq)
    for n in range(min(nmax, n_seq - 1), 0, -1):
        suf = seq[n_seq - n :]
        for i in range(n_seq - n - 1, -1, -1):
            if seq[i : i + n] == suf:
                return seq[i + n : i + n + k]
    return []


@torch.no_grad()
def spec_decode(target, proposer, prompt_ids, max_new, eos):
    """Batch-1 greedy speculative decoding with the target's KV cache.

    Returns (generated ids, accept lens)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    P = len(prompt_ids)
    out = target(
        input_ids=torch.tensor([prompt_ids]),
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
    )
    feats = target_features(out.hidden_states)[0]
    seq = list(prompt_ids) + [int(out.logits[0, -1].argmax())]
    start = P
    accs = []
    while len(seq) - P < max_new and eos not in seq[P:]:
        d = proposer.propose(seq, feats, start)[: max(0, max_new - (len(seq) - P))]
        inp = torch.tensor([[seq[start]] + d])
        o = target(
            input_ids=inp,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
            position_ids=torch.arange(start, start + len(d) + 1)[None],
        )
        post = o.logits[0].argmax(-1).tolist()
        a = 0
        while a < len(d) and d[a] == post[a]:
            a += 1
        acc = d[:a]
        if eos in acc:  # stop inside the accepted drafts: no bonus
            acc = acc[: acc.index(eos) + 1]
            seq += acc
            accs.append(len(acc))
            break
        seq += acc + [post[a]]
        accs.append(a + 1)
        feats = torch.cat([feats, target_features(o.hidden_states)[0, : a + 1]], 0)
        start += a + 1
        cache.crop(start - cache.get_seq_length())
    gen = seq[P:]
    if eos in gen:
        gen = gen[: gen.index(eos) + 1]
    return gen[:max_new], accs


def eval_prompts(tok, root, held, n, seed, max_chars=500):
    rng = random.Random(seed)
    prompts = []
    files = [f for f in held if len(tc.read_text(root, f)) > 2 * max_chars]
    while len(prompts) < n:
        f = files[len(prompts) % len(files)]
        text = tc.read_text(root, f)
        lines = text.splitlines(keepends=True)
        i = rng.randrange(0, max(1, len(lines) - 40))
        p = ""
        while i < len(lines) and len(p) + len(lines[i]) <= max_chars:
            p += lines[i]
            i += 1
        if len(p) > 100:
            prompts.append({"file": f, "text": p})
    return prompts


def run_eval(args, target, tok, root, held):
    eos = tok.token_to_id(tc.EOS_TOKEN)
    pf = Path(args.prompts)
    if pf.exists():  # the package's built-in held-out prompt set
        prompts = [
            {"file": json.loads(line).get("id"), "text": json.loads(line)["prompt"]}
            for line in pf.read_text().splitlines()
            if line.strip()
        ][: args.eval_prompts]
        print(f"[eval] {len(prompts)} prompts from {pf}", flush=True)
    else:
        prompts = eval_prompts(tok, root, held, args.eval_prompts, args.seed)
        (Path(args.draft_root) / "eval_prompts.json").write_text(
            json.dumps(prompts, indent=1) + "\n"
        )
    mask_id = tok.token_to_id(tc.MASK_TOKEN)
    props = {"ngram": Proposer("ngram")}
    for kind in ("dflash", "dspark"):
        d = Path(args.draft_root) / kind
        if (d / "model.safetensors").exists():
            m, c, E, L = load_draft(d, kind)
            tE = target.get_input_embeddings().weight.detach()
            props[kind] = Proposer(
                kind, m, tE if E is None else E, L if L is not None else tE, mask_id
            )
    # plain greedy references
    refs = []
    t0 = time.time()
    for p in prompts:
        ids = tok.encode(p["text"]).ids
        g = target.generate(
            torch.tensor([ids]),
            max_new_tokens=args.max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        r = g[0, len(ids) :].tolist()
        if eos in r:
            r = r[: r.index(eos) + 1]
        refs.append(r)
    t_plain = time.time() - t0
    res = {
        "prompts": len(prompts),
        "prompt_source": (os.path.relpath(pf, tc.ROOT) if pf.exists() else "eval_prompts.json"),
        "max_new_tokens": args.max_new,
        "block_size": BLOCK,
        "plain_greedy_seconds": round(t_plain, 2),
        "drafters": {},
    }
    for name, pr in props.items():
        accs, match, ntok = [], 0, 0
        t0 = time.time()
        for p, r in zip(prompts, refs):
            gen, a = spec_decode(target, pr, tok.encode(p["text"]).ids, args.max_new, eos)
            accs += a
            match += int(gen == r)
            ntok += len(gen)
        dt = time.time() - t0
        tau = sum(accs) / max(1, len(accs))
        res["drafters"][name] = {
            "tau": round(tau, 3),
            "rounds": len(accs),
            "tokens": ntok,
            "lossless_match": f"{match}/{len(prompts)}",
            "seconds": round(dt, 2),
        }
        print(
            f"[eval] {name}: tau {tau:.3f} over {len(accs)} rounds, {ntok} tokens, "
            f"output == plain greedy for {match}/{len(prompts)} prompts, {dt:.1f}s "
            f"(plain greedy HF generate {t_plain:.1f}s)",
            flush=True,
        )
    (Path(args.draft_root) / "eval_tau.json").write_text(json.dumps(res, indent=1) + "\n")
    print(
        "sample plain-greedy continuation of prompt 0:\n"
        + prompts[0]["text"]
        + "<<<\n"
        + tok.decode(refs[0]),
        flush=True,
    )
    return res


# ----------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stages", default="rollouts,dflash,dspark,eval")
    ap.add_argument("--target", default=str(tc.ASSETS / "target"))
    ap.add_argument(
        "--draft-root",
        default=str(tc.ASSETS),
        help="drafts go to DRAFT_ROOT/dflash and DRAFT_ROOT/dspark",
    )
    ap.add_argument("--split", default=str(tc.ASSETS / "split.json"))
    ap.add_argument("--work", default="out_tiny", help="rollout cache (git-ignored)")
    ap.add_argument("--minutes", type=float, default=20.0, help="training minutes per draft")
    ap.add_argument("--rollout-minutes", type=float, default=6.0)
    ap.add_argument("--max-rollouts", type=int, default=4096)
    ap.add_argument("--rollout-batch", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--draft-batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=32, help="random anchors per sequence")
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--gamma", type=float, default=4.0, help="position weight exp(-k/gamma)")
    ap.add_argument("--mixed-rollouts", type=int, nargs=2, default=[1024, 3072],
                    metavar=("GREEDY", "SAMPLED"), help="training rollouts of stage mixed")
    ap.add_argument("--finetune-minutes", type=float, default=12.0, help="per draft")
    ap.add_argument("--finetune-lr", type=float, default=1e-3)
    ap.add_argument("--kinds", default="dflash,dspark", help="drafts the finetune stage trains "
                    "(one per process runs them concurrently)")
    ap.add_argument("--soft-weight", type=float, default=1.5,
                    help="weight of a sampled batch's soft loss next to a greedy batch's")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument(
        "--prompts",
        default=str(tc.ROOT / "dspark_launch" / "assets" / "prompts" / "heldout.jsonl"),
        help="jsonl with a 'prompt' field; if missing, windows of held-out files are used",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    tc.set_threads(args.threads)
    stages = args.stages.split(",")
    tdir = Path(args.target)
    tok = tc.load_tokenizer(tdir / "tokenizer.json")
    root, train_files, held_files = tc.load_split(Path(args.split))
    target = load_target(tdir)
    tcfg = json.loads((tdir / "config.json").read_text())
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ro_path = work / "rollouts.pt"
    if "rollouts" in stages:
        t0 = time.time()
        ro_train = make_rollouts(
            args, target, tok, train_files, root, args.rollout_minutes, args.seed, args.max_rollouts
        )
        ro_held = make_rollouts(
            args, target, tok, held_files, root, 1.0, args.seed + 1, 2 * args.rollout_batch
        )
        torch.save({"train": ro_train, "held": ro_held}, ro_path)
        n = sum(s.shape[0] for s in ro_train["seqs"])
        print(
            f"rollouts: {n} train seqs ({n * args.gen_len} generated tokens), "
            f"{sum(s.shape[0] for s in ro_held['seqs'])} held-out seqs; "
            f"{(time.time() - t0) / 60:.1f} min",
            flush=True,
        )
        (work / "rollout_stats.json").write_text(
            json.dumps(
                {
                    "train_seqs": n,
                    "gen_len": args.gen_len,
                    "minutes": round((time.time() - t0) / 60, 2),
                }
            )
            + "\n"
        )
    if "dflash" in stages or "dspark" in stages:
        ro = torch.load(ro_path)
        for kind in ("dflash", "dspark"):
            if kind in stages:
                train_draft(
                    args, kind, target, tcfg, ro["train"], ro["held"], Path(args.draft_root) / kind
                )
    mixed_path = work / "mixed_rollouts.pt"
    if "mixed" in stages:
        t0 = time.time()
        n_greedy, n_sampled = args.mixed_rollouts
        ro = {"greedy": mixed_rollouts(target, tok, train_files, root, n_greedy, 5, False),
              "sampled": mixed_rollouts(target, tok, train_files, root, n_sampled, 6, True),
              "held_greedy": mixed_rollouts(target, tok, held_files, root, 64, 7, False),
              "held_sampled": mixed_rollouts(target, tok, held_files, root, 64, 8, True)}
        torch.save(ro, mixed_path)
        print(f"mixed rollouts: {n_greedy} greedy + {n_sampled} sampled; "
              f"{(time.time() - t0) / 60:.1f} min", flush=True)
    if "finetune" in stages:
        ro = torch.load(mixed_path)
        for kind in args.kinds.split(","):
            finetune_draft(args, kind, target, ro, Path(args.draft_root) / kind)
    if "eval" in stages:
        run_eval(args, target, tok, root, held_files)


if __name__ == "__main__":
    main()
