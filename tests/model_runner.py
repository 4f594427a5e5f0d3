"""A tiny serving loop for model tests: paged KV via KVSpace, torch attention backend.

`Runner.step(batch)` runs one forward for [(slot, new_tokens)] (an empty batch is an idle
step that still joins every collective) and returns the last-row logits, greedy tokens and
all-row logits. `generate` drives prefill + one-token decode steps for a list of prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_launch.attention import build_metadata, make_backend
from dspark_launch.memory.allocator import KVSpace
from dspark_launch.memory.geometry import KVGeometry
from dspark_launch.memory.kv_pool import KVPool
from dspark_launch.models.qwen3 import CausalLM


@dataclass
class StepOut:
    hidden: torch.Tensor  # [T, d] final-normed
    logits: torch.Tensor  # [T, V] every row of the forward
    last_logits: torch.Tensor  # [B, V] the last row of each request
    greedy: list[int]  # [B] distributed argmax of the last rows
    captured: torch.Tensor | None  # [T, m*d]
    last_captured: torch.Tensor | None  # [B, m*d]


class Runner:
    def __init__(self, model: CausalLM, max_requests: int = 8, max_context: int = 96,
                 page_size: int = 4) -> None:
        cfg = model.config
        self.model = model
        self.space = KVSpace(max_requests * max_context, page_size, max_requests, max_context,
                             "cpu")
        geom = KVGeometry("target", cfg.num_hidden_layers, cfg.num_key_value_heads,
                          cfg.head_dim, cfg.head_dim, model.dtype)
        self.pool = KVPool(geom, self.space.num_rows, "cpu")
        self.backend = make_backend("torch", "cpu")
        self.lens: dict[int, int] = {}

    def new_request(self) -> int:
        slot = self.space.new_slot()
        assert slot is not None
        self.lens[slot] = 0
        return slot

    def step(self, batch: list[tuple[int, list[int]]], capture: tuple[int, ...] = ()
             ) -> StepOut:
        slots = [s for s, _ in batch]
        prefix = [self.lens[s] for s in slots]
        q_lens = [len(toks) for _, toks in batch]
        for s, p, q in zip(slots, prefix, q_lens):
            assert self.space.reserve(s, p + q)
            self.lens[s] = p + q
        meta = build_metadata(self.space.req_to_token, slots, prefix, q_lens)
        ids = torch.tensor([t for _, toks in batch for t in toks], dtype=torch.int64)
        hidden, captured = self.model(ids, meta, self.backend, self.pool, capture)
        last = torch.cumsum(torch.tensor(q_lens, dtype=torch.int64), 0) - 1
        logits = self.model.logits(hidden)
        greedy = self.model.greedy(hidden[last]).tolist()
        return StepOut(hidden, logits, logits[last], greedy, captured,
                       None if captured is None else captured[last])


def generate(model: CausalLM, prompts: list[list[int]], n_new: int
             ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Batched greedy decoding -> (new tokens per prompt, prefill logits [len, V] per prompt)."""
    runner = Runner(model, max_requests=len(prompts))
    slots = [runner.new_request() for _ in prompts]
    out = runner.step(list(zip(slots, prompts)))
    bounds = torch.cumsum(torch.tensor([0] + [len(p) for p in prompts]), 0).tolist()
    prefill = [out.logits[a:b] for a, b in zip(bounds, bounds[1:])]
    tokens = [[t] for t in out.greedy]
    for _ in range(n_new - 1):
        out = runner.step([(s, [toks[-1]]) for s, toks in zip(slots, tokens)])
        for toks, t in zip(tokens, out.greedy):
            toks.append(t)
    return tokens, prefill
