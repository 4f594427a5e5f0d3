"""Real gloo worlds of 8: pools on every rank, MIN agreement, the self-check catching raw tp."""

from __future__ import annotations

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
