"""Embed dspark-launch in your own torchrun program: every rank builds `LLM` and calls
`generate` with the same arguments; every rank gets the same outputs.

    torchrun --nproc-per-node 4 examples/embed_llm.py --attn-dp-size 2 [--out results.json]

The program initialises its own process group first (as a training or RL job would); `LLM`
joins it, and `shutdown()` leaves it usable afterwards.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from dspark_launch import LLM, SamplingParams

PROMPTS = Path(__file__).resolve().parents[1] / "dspark_launch/assets/prompts/heldout.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attn-dp-size", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default=None, help="rank 0 writes the outputs here (JSON)")
    args = ap.parse_args()

    dist.init_process_group("gloo")  # the user's own group (env:// from torchrun)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]

    # No model: the embedded tiny Qwen3 and its DSpark draft, as the CLI.
    with LLM(attn_dp_size=args.attn_dp_size, kv_cache_memory="64MiB", device="cpu") as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens,
                                                       temperature=0))
        # A batch where each request brings its own sampling settings.
        mixed = llm.generate(prompts[:3], [
            SamplingParams(max_tokens=16, temperature=0),
            SamplingParams(max_tokens=16, temperature=0.8, seed=7),
            SamplingParams(max_tokens=16, temperature=0, stop=["\n"]),
        ])

    rows = [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
             "accept_lens": o.accept_lens} for o in outputs + mixed]
    # Every rank got the same outputs; the user's group still works after shutdown().
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    assert all(r == rows for r in everyone), "ranks disagree"
    if dist.get_rank() == 0:
        taus = [t for o in outputs for t in o.accept_lens]
        print(f"{len(outputs)} prompts, {sum(len(o.token_ids) for o in outputs)} tokens, "
              f"mean tau {sum(taus) / max(1, len(taus)):.2f}")
        print(repr(outputs[0].text))
        if args.out:
            Path(args.out).write_text(json.dumps(rows))
    total = torch.tensor([1])
    dist.all_reduce(total)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
