"""The forwards the engine runs at start-up, before any request.

profile_forward: one real target forward of n tokens shaped like a decode step, timed by the
CPU GEMM choice (engine/gemm_choice.py) and the cost-curve profile (engine/verify_policy.py);
conditions: what both timings depend on, their cache key's common part (disk_cache.py).

largest_batch_step: one step at the largest batch the scheduler may form, run once at start-up
on CUDA so that memory/transients.py's price can be checked against
torch.cuda.max_memory_allocated.

It allocates what a real step does beyond the pools: the target forward over every forward
row (R - 1 verify rounds and one prefill chunk) with the draft's features captured, the
draft's distributions over the vocabulary kept alive, then the verify logits, the greedy
argmax and the sampler's full-vocabulary distributions. Every rank runs it at the same point
(the forward and the logits are collectives); its KV rows are returned before it ends.
"""

from __future__ import annotations

import torch

from dspark_launch.attention import build_metadata
from dspark_launch.disk_cache import device_name
from dspark_launch.memory.transients import StepShape
from dspark_launch.parallel import get_parallel


@torch.inference_mode()  # allocates as the step does (Engine.step)
def largest_batch_step(target, proposer, memory, backend, shape: StepShape) -> bool:
    """Run the step's allocations once at `shape`; False (nothing run) when the pools or the
    request table cannot hold that batch."""
    space = memory.space
    q_lens = [shape.verify_rows] * (shape.max_running - 1)
    q_lens.append(shape.forward_rows - sum(q_lens))  # the prefill chunk (or one more round)
    slots: list[int] = []
    try:
        for n in q_lens:
            slot = space.new_slot()
            if slot is None:
                return False
            slots.append(slot)
            if not space.reserve(slot, n):
                return False
        _run(target, proposer, memory, backend, shape, slots, q_lens)
        return True
    finally:
        for slot in slots:
            space.free_slot(slot)


def _run(target, proposer, memory, backend, shape: StepShape, slots: list[int],
         q_lens: list[int]) -> None:
    device = target.device
    meta = build_metadata(memory.space.req_to_token, slots, [0] * len(slots), q_lens,
                          "causal", device=device)
    ids = torch.zeros(sum(q_lens), dtype=torch.int64, device=device)  # [forward_rows]
    hidden, captured = target.forward(ids, meta, backend, memory.target,
                                      proposer.capture_layer_ids)  # [T, d], [T, m*d]
    q_rows = shape.max_running * shape.draft_slots
    # The draft's q [R * slots, V] lives from propose until accept: alive during the verify.
    q = torch.softmax(target.logits(hidden[:q_rows]).float(), dim=-1) if q_rows else None
    rows = hidden[:shape.logit_rows]  # [logit_rows, d]
    target.greedy(rows)
    probs = torch.softmax(target.logits(rows).float(), dim=-1)  # [logit_rows, V]
    del hidden, captured, q, probs


@torch.inference_mode()  # timed as the step runs (Engine.step)
def profile_forward(engine, n: int, block: int | None = None) -> torch.Tensor:
    """One real target forward of n tokens on every rank (each group forwards n), shaped like
    a decode step: requests of one verify block each (or of `block` tokens), in fresh request
    slots. -> the final hidden states [n, d] (the start-up GEMM choice runs the LM head on
    them)."""
    block = block or 1 + engine.proposer.max_drafts
    sizes = [block] * (n // block) + ([n % block] if n % block else [])
    space = engine.space
    slots = []
    try:
        for size in sizes:
            slot = space.new_slot()
            if slot is None or not space.reserve(slot, size):
                raise RuntimeError(f"start-up profile: no room for {n} tokens")
            slots.append(slot)
        meta = build_metadata(space.req_to_token, slots, [0] * len(slots), sizes, "causal",
                              device=engine.device)
        ids = torch.zeros(n, dtype=torch.int64, device=engine.device)
        hidden, _ = engine.target.forward(ids, meta, engine.backend, engine.memory.target,
                                          engine.proposer.capture_layer_ids,
                                          [n] * get_parallel().world_size)
        return hidden
    finally:
        for slot in slots:
            space.free_slot(slot)


def conditions(engine) -> dict:
    """What a start-up timing of the target forward depends on: the processor, torch and its
    threads, the topology, the dtype, the attention backend, the target's architecture
    (Qwen3's q/k norms) and shape, and the autograd mode the step runs in (timings cached
    before the step ran in inference mode were up to 12% slower than its forwards now are).
    Nothing a benchmark varies between the engines it compares (drafter, page size): they
    share one GEMM choice (engine/gemm_choice.py)."""
    state, c = get_parallel(), engine.target.config
    return {"device": device_name(engine.device), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "world": state.world_size, "tp": state.tp_size,
            "attn_dp": state.attn_dp_size, "dtype": str(engine.target.dtype),
            "backend": engine.backend.name, "grad_mode": "inference",
            "architecture": c.architecture,
            "model": [c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size,
                      c.num_attention_heads, c.num_key_value_heads, c.head_dim]}
