"""Real gloo worlds of 8: pools on every rank, MIN agreement, the self-check catching raw tp."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multirank import run_world

from dspark_launch.args import resolve_config
from dspark_launch.memory.budget import PoolPricingError, configure_memory, plan_memory
from dspark_launch.memory.build import build_kv_memory
from dspark_launch.memory.geometry import KVGeometry
from dspark_launch.parallel import get_parallel, init_parallel_runtime

TARGET = KVGeometry("target", 3, 8, 16, 16, torch.float32)
DRAFT = KVGeometry("draft", 1, 8, 16, 8, torch.bfloat16)
PAGE = 4


class RawTpGeometry(KVGeometry):
    """The seed bug, reproduced on purpose: prices KV heads at the raw tp_size."""

    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // get_parallel().tp_size)


def _budget(rank: int) -> int:
    # Deliberately different per rank; rank 5 is the poorest, so its count must win.
    return 100_000 if rank == 5 else 300_000 + 40_000 * rank


def _rank(rank: int, attn_dp: int) -> dict:
    cfg = resolve_config(
        ["--tp-size", "8", "--attn-dp-size", str(attn_dp), "--device", "cpu",
         "--page-size", str(PAGE), "--kv-cache-memory", str(_budget(rank))],
        world_size=8,
    )
    state = init_parallel_runtime(cfg)
    plan = configure_memory(cfg, TARGET, DRAFT, "cpu")  # budget -> plan -> MIN all-reduce
    local = plan_memory(_budget(rank), TARGET, DRAFT, PAGE)
    mem = build_kv_memory(plan, TARGET, DRAFT, max_requests=2, max_context_len=8, device="cpu")
    wrong_error = None
    try:
        wrong = plan_memory(_budget(rank), TARGET, RawTpGeometry(**_fields(DRAFT)), PAGE)
        build_kv_memory(wrong, TARGET, RawTpGeometry(**_fields(DRAFT)), 2, 8, "cpu")
    except PoolPricingError as err:
        wrong_error = str(err)
    return {
        "attn_tp": state.attn_tp_size,
        "tokens": plan.max_total_tokens,
        "local_tokens": local.max_total_tokens,
        "heads": (mem.target.heads_local, mem.draft.heads_local),
        "cells": (plan.target_cell, plan.draft_cell),
        "measured": (mem.target.bytes_per_token(), mem.draft.bytes_per_token()),
        "rows": mem.target.rows,
        "wrong_error": wrong_error,
    }


def _fields(g: KVGeometry) -> dict:
    return {k: getattr(g, k) for k in ("name", "num_layers", "num_kv_heads", "head_dim",
                                       "v_head_dim", "dtype")}


@pytest.mark.parametrize("attn_dp", [1, 2, 8])
def test_pools_on_every_rank_agree_and_self_check(attn_dp: int) -> None:
    results = run_world(8, _rank, attn_dp)
    attn_tp = 8 // attn_dp
    heads = max(1, 8 // attn_tp)
    cells = (heads * 32 * 3 * 4, heads * 24 * 1 * 2)
    expect = min(r["local_tokens"] for r in results)
    assert expect == results[5]["local_tokens"]
    assert expect < max(r["local_tokens"] for r in results), "budgets did not differ"
    for r in results:
        assert r["attn_tp"] == attn_tp
        assert r["heads"] == (heads, heads)
        assert r["cells"] == cells and r["measured"] == cells
        assert r["tokens"] == expect, "ranks disagree on max_total_tokens"
        assert r["rows"] == expect + PAGE
        if attn_dp == 1:  # raw tp == attn_tp: the wrong pricing happens to be right
            assert r["wrong_error"] is None
        else:
            msg = r["wrong_error"]
            assert msg is not None, "raw-tp pricing was not caught"
            assert "draft KV pool" in msg and f"attn_tp_size={attn_tp}" in msg
            assert f"priced {1 * 24 * 2} bytes/token" in msg
            assert f"holds {cells[1]} bytes/token" in msg


TINY = Path(__file__).resolve().parents[2] / "dspark_launch" / "assets" / "tiny"


def _default_rank(rank: int) -> dict:
    """No --kv-cache-memory: the CPU default sizes to the run; then one warm-up step at the
    largest batch on the real models (its forward and logits are collectives)."""
    from dspark_launch.attention import make_backend
    from dspark_launch.engine.warmup import largest_batch_step
    from dspark_launch.memory.transients import price_step, step_shape
    from dspark_launch.models.loader import load_model
    from dspark_launch.spec.factory import make_proposer

    cfg = resolve_config(["--tp-size", "4", "--attn-dp-size", "2", "--device", "cpu",
                          "--page-size", str(PAGE), "--max-running-requests", "2",
                          "--chunked-prefill-size", "16"], world_size=4)
    init_parallel_runtime(cfg)
    target = load_model(TINY / "target", "float32", "cpu")
    parts = make_proposer(cfg, "DSPARK", str(TINY / "dspark"), target, "cpu", "float32")
    step = step_shape(cfg, target.config, torch.float32, parts.max_drafts, parts.block_rows,
                      parts.draft)
    geometry = KVGeometry("target", 8, 2, 32, 32, torch.float32)
    plan = configure_memory(cfg, geometry, parts.geometry, "cpu", None, step, 30)
    memory = build_kv_memory(plan, geometry, parts.geometry, 2, 30, "cpu", target, parts.draft)
    proposer = parts.build(memory, make_backend("torch", "cpu"))
    ran = largest_batch_step(target, proposer, memory, make_backend("torch", "cpu"), step)
    return {"tokens": plan.max_total_tokens, "rule": plan.budget_rule,
            "budget": plan.budget_bytes, "transients": plan.transient_bytes,
            "priced": price_step(step).total, "cell": plan.cell, "ran": ran,
            "full": memory.space.is_full()}


def test_cpu_default_and_warmup_on_a_dp_attention_world() -> None:
    results = run_world(4, _default_rank)
    first = results[0]
    # 2 requests x ceil(30 rows / page 4) pages, plus the dummy page, plus the transients.
    assert first["tokens"] == 2 * 8 * PAGE
    assert first["budget"] == (2 * 8 + 1) * PAGE * first["cell"] + first["transients"]
    assert first["transients"] == first["priced"] > 0
    for r in results:
        # Equal but for the rule's note of each rank's RAM share (MemAvailable moves).
        assert {**r, "rule": ""} == {**first, "rule": ""}, "ranks disagree"
        assert r["rule"].startswith("fit: max running requests x context")
        assert r["ran"] and r["full"]
