"""One step at the largest batch the scheduler may form, run once at start-up on CUDA so that
memory/transients.py's price can be checked against torch.cuda.max_memory_allocated.

It allocates what a real step does beyond the pools: the target forward over every forward
row (R - 1 verify rounds and one prefill chunk) with the draft's features captured, the
draft's distributions over the vocabulary kept alive, then the verify logits, the greedy
argmax and the sampler's full-vocabulary distributions. Every rank runs it at the same point
(the forward and the logits are collectives); its KV rows are returned before it ends.
"""

from __future__ import annotations

import torch

from dspark_launch.attention import build_metadata
from dspark_launch.memory.transients import StepShape


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
