#!/usr/bin/env python
"""Fit Sequential Temperature Scaling (STS) for the embedded DSpark draft's confidence head.

Data: the target's own greedy rollouts of held-out prompts (token windows of the held-out files
in split.json, drawn with a seed other than the training scripts'), exactly how the drafts'
training data was made (scripts/train_drafts.py), but from files the drafts never saw. For every
anchor position in the generated part, the draft drafts its block as the engine does at greedy
decoding (context = target features of positions < anchor, tokens chosen left to right through
the Markov head, c_k read with the drafted x_{k-1}); a draft is accepted while it equals the
rollout's (= the target's greedy) token, so `accepted` is exactly the engine's in-loop accept
length for that round.

The rollouts are split in two by sequence: STS is fitted on one half, and the expected
calibration error of the survival a_k = prod c_i against "drafts 1..k all accepted" is reported
on the other, before and after. Writes DRAFT/calibration.json, which the engine's DSpark
verify-length policy loads (spec/acceptance.py).

    python scripts/calibrate_dspark.py            # ~1-2 CPU minutes with 1 thread
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_common as tc  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import train_drafts as td  # noqa: E402

from dspark_launch.spec.acceptance import (  # noqa: E402
    CALIBRATION_FILE,
    apply_temperatures,
    expected_calibration_error,
    fit_sts,
    survival,
)


@torch.no_grad()
def heldout_rollouts(target, tok, root, files, n, gen_len, seed, batch=16):
    """n greedy continuations (gen_len tokens) of random 32..128-token held-out windows."""
    data = tc.encode_files(tok, root, files)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(0, n, batch):
        plen = [32, 64, 96, 128][(i // batch) % 4]
        idx = torch.randint(0, len(data) - plen - 1, (min(batch, n - i),), generator=g)
        prompt = torch.stack([data[j:j + plen] for j in idx.tolist()]).long()
        seqs = td.greedy_batch(target, prompt, gen_len)
        feats = td.target_features(target(input_ids=seqs, output_hidden_states=True)
                                   .hidden_states)
        out.append((seqs, feats, plen))
    return out


@torch.no_grad()
def draft_blocks(draft, emb, lm_head, seqs, feats, plen, mask_id):
    """Every anchor of the generated part -> (raw confidences [N, B], accepted drafts [N])."""
    block = td.BLOCK
    b, t = seqs.shape
    anchors = torch.arange(plen, t - block).expand(b, -1)  # labels exist for all B slots
    n = anchors.shape[1]
    pos = anchors[:, :, None] + torch.arange(block)  # [b, n, B]
    ids = torch.full((b, n, block), mask_id, dtype=torch.long)
    ids[:, :, 0] = torch.gather(seqs, 1, anchors)
    ctx_pos = torch.arange(t).expand(b, t)
    # A block row sees the context before its anchor and its own block (as in the engine).
    row_anchor = anchors[:, :, None].expand(b, n, block).reshape(b, n * block)
    see_ctx = ctx_pos[:, None, :] < row_anchor[:, :, None]
    blk = torch.arange(n).repeat_interleave(block)
    see_blk = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
    mask = torch.cat([see_ctx, see_blk], 2)[:, None]
    h = draft.backbone(feats.float(), ctx_pos, F.embedding(ids.view(b, -1), emb),
                       pos.view(b, -1), mask).view(b, n, block, -1)
    labels = torch.gather(seqs, 1, (pos + 1).reshape(b, -1)).view(b, n, block)
    mh, ch = draft.markov_head, draft.confidence_head
    prev = ids[:, :, 0]  # x_{-1} = the anchor
    conf = torch.empty(b, n, block)
    hit = torch.empty(b, n, block, dtype=torch.bool)
    for k in range(block):  # left to right: each slot reads the token drafted before it
        w1 = mh.markov_w1(prev)
        logits = h[:, :, k] @ lm_head.t() + mh.markov_w2(w1)
        conf[:, :, k] = torch.sigmoid(ch.proj(torch.cat([h[:, :, k], w1], -1))).squeeze(-1)
        prev = logits.argmax(-1)
        hit[:, :, k] = prev == labels[:, :, k]
    accepted = hit.to(torch.int64).cumprod(-1).sum(-1)
    return conf.reshape(-1, block), accepted.reshape(-1)


def report(conf, accepted, temps):
    """Per-position ECE of the survival, and predicted vs realised tokens per round."""
    block = conf.shape[1]
    a = survival(apply_temperatures(conf, temps))
    ece = [expected_calibration_error(a[:, k], (accepted > k).float()) for k in range(block)]
    return {"ece": [round(e, 4) for e in ece], "mean_ece": round(sum(ece) / block, 4),
            "predicted_tau": round(1 + float(a.sum(1).mean()), 4),
            "realised_tau": round(1 + float(accepted.float().mean()), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(tc.ASSETS / "target"))
    ap.add_argument("--draft", default=str(tc.ASSETS / "dspark"))
    ap.add_argument("--split", default=str(tc.ASSETS / "split.json"))
    ap.add_argument("--rollouts", type=int, default=192, help="held-out greedy rollouts")
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=7, help="window seed (training used 0 and 1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help=f"default: DRAFT/{CALIBRATION_FILE}")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    tc.set_threads(args.threads)
    t0 = time.time()
    tdir = Path(args.target)
    tok = tc.load_tokenizer(tdir / "tokenizer.json")
    root, _, held = tc.load_split(Path(args.split))
    target = td.load_target(tdir)
    draft, cfg, _, lm_head = td.load_draft(args.draft, "dspark")
    emb = target.get_input_embeddings().weight.detach()
    rollouts = heldout_rollouts(target, tok, root, held, args.rollouts, args.gen_len, args.seed)
    t_roll = time.time() - t0
    parts = [draft_blocks(draft, emb, lm_head, s, f, p, cfg["mask_token_id"])
             for s, f, p in rollouts]
    # Split by rollout batch (whole sequences): fit on even batches, evaluate on odd ones.
    fit = [x for i, x in enumerate(parts) if i % 2 == 0]
    held_out = [x for i, x in enumerate(parts) if i % 2 == 1] or fit
    conf_fit, acc_fit = (torch.cat([x[j] for x in fit]) for j in (0, 1))
    conf_ev, acc_ev = (torch.cat([x[j] for x in held_out]) for j in (0, 1))
    temps = fit_sts(conf_fit, acc_fit)
    before, after = report(conf_ev, acc_ev, None), report(conf_ev, acc_ev, temps)
    result = {
        "method": "sequential temperature scaling (c_k -> sigmoid(logit(c_k) / t_k))",
        "temperatures": temps,
        "heldout_eval": {"blocks": int(conf_ev.shape[0]), "raw": before, "calibrated": after},
        "fit_blocks": int(conf_fit.shape[0]),
        "data": (f"{args.rollouts} greedy target rollouts of {args.gen_len} tokens from "
                 f"held-out-file windows (seed {args.seed}); every generated anchor; decoded "
                 "greedily as the engine does; fit on half the rollouts, ECE on the other half"),
        "command": "python scripts/calibrate_dspark.py " + " ".join(sys.argv[1:]),
    }
    out = Path(args.out) if args.out else Path(args.draft) / CALIBRATION_FILE
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"rollouts {t_roll:.0f}s, total {time.time() - t0:.0f}s; "
          f"{conf_fit.shape[0]} blocks fitted, {conf_ev.shape[0]} evaluated")
    print(f"temperatures: {temps}")
    for name, r in (("raw", before), ("calibrated", after)):
        print(f"{name:>10}: mean ECE {r['mean_ece']:.4f}  per position {r['ece']}  "
              f"predicted tau {r['predicted_tau']:.3f} vs realised {r['realised_tau']:.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
