"""Build the shared location space and both pools from a plan, then self-check them."""

from __future__ import annotations

from dataclasses import dataclass

from dspark_launch.memory.allocator import KVSpace
from dspark_launch.memory.budget import MemoryPlan, self_check
from dspark_launch.memory.geometry import KVGeometry
from dspark_launch.memory.kv_pool import KVPool


@dataclass(frozen=True)
class KVMemory:
    plan: MemoryPlan
    space: KVSpace
    target: KVPool
    draft: KVPool | None


def build_kv_memory(
    plan: MemoryPlan,
    target: KVGeometry,
    draft: KVGeometry | None,
    max_requests: int,
    max_context_len: int,
    device,
    target_model=None,
    draft_model=None,
) -> KVMemory:
    """Space + pools for a plan. The models, when given, are what the self-check compares
    each pool with (their attention layers' own KV-head counts)."""
    space = KVSpace(plan.max_total_tokens, plan.page_size, max_requests, max_context_len, device)
    target_pool = KVPool(target, space.num_rows, device)
    draft_pool = KVPool(draft, space.num_rows, device) if draft is not None else None
    # Fail at startup, naming the term, rather than OOM mid-run.
    self_check(plan, target_pool, draft_pool, target_model, draft_model)
    return KVMemory(plan, space, target_pool, draft_pool)
