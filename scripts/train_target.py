#!/usr/bin/env python
"""Train the tiny Qwen3-architecture target on the stdlib train split (CPU, 1 thread).

Uses transformers' own Qwen3ForCausalLM and saves an HF checkpoint (bf16
safetensors + tokenizer + generation_config) that AutoModelForCausalLM loads.
Training length is a wall-clock budget (--minutes); the LR schedule is cosine
over that budget, so results depend (mildly) on machine speed.

    python scripts/train_tokenizer.py
    python scripts/train_target.py --minutes 30
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_common as tc  # noqa: E402


def make_config(args, tok):
    from transformers import Qwen3Config

    eos = tok.token_to_id(tc.EOS_TOKEN)
    return Qwen3Config(
        vocab_size=tc.VOCAB_SIZE,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        tie_word_embeddings=True,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
        attention_dropout=0.0,
        use_sliding_window=False,
    )


@__import__("torch").no_grad()
def evaluate(model, data, seq_len, max_tokens=None):
    import torch

    model.eval()
    n = (len(data) - 1) // seq_len
    if max_tokens:
        n = min(n, max(1, max_tokens // seq_len))
    tot, cnt = 0.0, 0
    for i in range(0, n, 16):
        rows = [data[j * seq_len : (j + 1) * seq_len + 1] for j in range(i, min(n, i + 16))]
        x = torch.stack(rows).long()
        logits = model(input_ids=x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        tot += loss.item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / max(1, cnt)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=str(tc.ASSETS / "target"))
    ap.add_argument(
        "--tokenizer", default=None, help="tokenizer.json (default: OUT/tokenizer.json)"
    )
    ap.add_argument("--split", default=str(tc.ASSETS / "split.json"))
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument(
        "--max-steps", type=int, default=0, help="stop after this many steps (0: time budget only)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument(
        "--bf16", type=int, default=1, help="bf16 autocast for matmuls (fp32 master weights)"
    )
    ap.add_argument(
        "--eval-every", type=float, default=5.0, help="minutes between quick held-out evals"
    )
    args = ap.parse_args()

    tc.set_threads(args.threads)
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    t_start = time.time()
    torch.manual_seed(args.seed)
    out = Path(args.out)
    tok = tc.load_tokenizer(Path(args.tokenizer) if args.tokenizer else out / "tokenizer.json")
    root, train_files, held_files = tc.load_split(Path(args.split))
    train = tc.encode_files(tok, root, train_files)
    held = tc.encode_files(tok, root, held_files)
    print(
        f"train {len(train)} tokens ({len(train_files)} files), "
        f"held-out {len(held)} tokens ({len(held_files)} files)",
        flush=True,
    )

    cfg = make_config(args, tok)
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.3f}M (unique, tied embedding)", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    g = torch.Generator().manual_seed(args.seed)
    budget = args.minutes * 60
    t0 = time.time()
    step, tokens, ema, next_eval = 0, 0, None, args.eval_every * 60
    log = []
    model.train()
    while True:
        el = time.time() - t0
        if el >= budget or (args.max_steps and step >= args.max_steps):
            break
        frac = el / budget if not args.max_steps else step / args.max_steps
        for grp in opt.param_groups:
            grp["lr"] = tc.cosine_lr(frac, args.lr, warm=0.05)
        idx = torch.randint(0, len(train) - args.seq_len - 1, (args.batch,), generator=g)
        x = torch.stack([train[i : i + args.seq_len + 1] for i in idx.tolist()]).long()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args.bf16)):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x[:, 1:].numel()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0 or step <= 5:
            el = time.time() - t0
            print(
                f"step {step} {el / 60:.1f}min loss {ema:.3f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {tokens / el:.0f} tok/s",
                flush=True,
            )
        if time.time() - t0 >= next_eval:
            next_eval += args.eval_every * 60
            hl = evaluate(model, held, args.seq_len, max_tokens=16384)
            log.append(
                {
                    "step": step,
                    "minutes": round((time.time() - t0) / 60, 2),
                    "train_loss": round(ema, 4),
                    "heldout_loss_16k": round(hl, 4),
                }
            )
            print(f"  eval step {step}: held-out (16k tokens) {hl:.3f}", flush=True)
    train_s = time.time() - t0
    hl = evaluate(model, held, args.seq_len)
    print(
        f"done: {step} steps, {tokens} tokens, {train_s / 60:.1f} min; "
        f"final held-out loss {hl:.4f} nats/token",
        flush=True,
    )

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out, safe_serialization=True)
    gc = GenerationConfig(
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        do_sample=False,
        max_new_tokens=128,
    )
    gc.save_pretrained(out)
    c = json.loads((out / "config.json").read_text())
    c["rope_theta"] = 10000.0  # also at top level for transformers-4.x-style readers
    (out / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    # bf16-rounded held-out loss (what ships)
    hl16 = evaluate(model.float(), held, args.seq_len)
    stats = {
        "params": n_params,
        "steps": step,
        "tokens_seen": tokens,
        "train_minutes": round(train_s / 60, 2),
        "wall_minutes_total": round((time.time() - t_start) / 60, 2),
        "seq_len": args.seq_len,
        "batch": args.batch,
        "lr": args.lr,
        "seed": args.seed,
        "threads": args.threads,
        "bf16_autocast": bool(args.bf16),
        "train_tokens": len(train),
        "heldout_tokens": len(held),
        "heldout_loss_fp32": round(hl, 4),
        "heldout_loss_bf16_weights": round(hl16, 4),
        "curve": log,
    }
    (out / "train_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(f"held-out loss with bf16 weights {hl16:.4f}; saved -> {out}", flush=True)
    # sample
    hf_tok = None
    prompt = "def read_config(path):\n"
    ids = torch.tensor([tok.encode(prompt).ids])
    gen = model.generate(ids, max_new_tokens=64, do_sample=False, generation_config=gc)
    print("sample:\n" + tok.decode(gen[0].tolist()), flush=True)
    del hf_tok


if __name__ == "__main__":
    main()
