"""Pricing at the live attn_tp width: the seed regression, the property, the formulas."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_launch.errors import ConfigError
from dspark_launch.memory.budget import (
    PoolPricingError,
    cuda_budget,
    plan_memory,
    self_check,
    smallest_budget,
)
from dspark_launch.memory.build import build_kv_memory
from dspark_launch.memory.geometry import KVGeometry, geometry_from_config
from dspark_launch.memory.kv_pool import KVPool
from dspark_launch.parallel import override_parallel

GIB = 1024**3


def test_draft_budget_prices_the_attention_sharded_width() -> None:
    h_t, h_d, hd, vhd, l_t, l_d, nbytes = 8, 8, 128, 128, 36, 5, 2
    target = KVGeometry("target", l_t, h_t, hd, vhd, torch.bfloat16)
    draft = KVGeometry("draft", l_d, h_d, hd, vhd, torch.bfloat16)
    budget = 8 * GIB
    with override_parallel(16, 16) as state:
        assert state.tp_size == 16 and state.attn_tp_size == 1
        plan = plan_memory(budget, target, draft, page_size=1)
    # attn_tp = 1: every rank holds all draft KV heads; the raw-tp price would be 16x less
    # per head (max(1, 8 // 16) = 1 head instead of 8).
    assert plan.draft_cell == h_d * (hd + vhd) * l_d * nbytes
    assert plan.draft_cell != max(1, h_d // 16) * (hd + vhd) * l_d * nbytes
    assert plan.target_cell == h_t * (hd + vhd) * l_t * nbytes
    assert plan.draft_kv_heads_per_rank == h_d
    assert plan.max_total_tokens * (plan.target_cell + plan.draft_cell) <= budget
    # Including the dummy page, the pools still fit.
    assert plan.pool_rows * (plan.target_cell + plan.draft_cell) <= budget


def _valid_topologies() -> list[tuple[int, int]]:
    return [(tp, dp) for tp in (1, 2, 4, 8, 16) for dp in (1, 2, 4, 8, 16) if tp % dp == 0]


@st.composite
def geometries(draw, name: str) -> KVGeometry:
    return KVGeometry(
        name,
        num_layers=draw(st.integers(1, 4)),
        num_kv_heads=draw(st.integers(1, 16)),
        head_dim=draw(st.sampled_from([1, 8, 16, 64, 128])),
        v_head_dim=draw(st.sampled_from([1, 8, 16, 64, 128])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
    )


@settings(max_examples=60, deadline=None)
@given(
    topo=st.sampled_from(_valid_topologies()),
    rank_seed=st.integers(0, 15),
    target=geometries("target"),
    draft=st.none() | geometries("draft"),
    page_size=st.sampled_from([1, 2, 16]),
    pages=st.integers(1, 3),
    slack=st.floats(0.0, 0.999),
    cap=st.none() | st.integers(16, 64),  # >= one page; below is refused (tested apart)
)
def test_priced_equals_allocated_and_plan_fits(
    topo, rank_seed, target, draft, page_size, pages, slack, cap
) -> None:
    tp, dp = topo
    with override_parallel(tp, dp, tp_rank=rank_seed % tp) as state:
        cell = target.cell_bytes() + (draft.cell_bytes() if draft else 0)
        # A budget worth `pages` usable pages + the dummy + part of one more page.
        budget = int((pages + 1 + slack) * page_size * cell)
        plan = plan_memory(budget, target, draft, page_size, cap)
        for g, priced in ((target, plan.target_cell), (draft, plan.draft_cell)):
            if g is None:
                assert priced == 0
                continue
            heads = max(1, g.num_kv_heads // state.attn_tp_size)
            assert priced == heads * (g.head_dim + g.v_head_dim) * g.num_layers * g.itemsize
        mem = build_kv_memory(plan, target, draft, max_requests=1, max_context_len=1,
                              device="cpu")  # self_check inside: priced == allocated
        assert mem.target.bytes_per_token() == plan.target_cell
        if draft is not None:
            assert mem.draft.bytes_per_token() == plan.draft_cell
            assert mem.draft.heads_local == plan.draft_kv_heads_per_rank
        allocated = sum(p.total_bytes() for p in (mem.target, mem.draft) if p is not None)
        assert allocated == plan.pool_rows * cell <= budget
        assert plan.max_total_tokens % page_size == 0
        if cap is None or cap >= plan.tokens_before_cap:
            assert plan.max_total_tokens == pages * page_size
            assert budget - allocated < page_size * cell, "more than one page left unused"
        else:
            assert plan.max_total_tokens == cap // page_size * page_size


def test_budget_too_small_names_the_smallest_workable_value() -> None:
    target = KVGeometry("target", 2, 4, 16, 16, torch.float32)
    draft = KVGeometry("draft", 1, 4, 16, 16, torch.float32)
    with override_parallel(4, 2):  # attn_tp 2: 2 heads per rank
        cell = target.cell_bytes() + draft.cell_bytes()
        assert cell == 2 * 32 * 2 * 4 + 2 * 32 * 1 * 4
        need = smallest_budget(cell, 16)
        assert need == 2 * 16 * cell
        plan_memory(need, target, draft, 16)  # exactly enough works
        with pytest.raises(ConfigError) as err:
            plan_memory(need - 1, target, draft, 16)
    msg = str(err.value)
    assert str(need) in msg and "GiB" in msg and "--kv-cache-memory" in msg
    assert "attn_tp_size=2" in msg and "page_size=16" in msg


def test_cap_rounds_down_to_pages_and_refuses_less_than_a_page() -> None:
    g = KVGeometry("target", 1, 1, 8, 8, torch.float32)
    with override_parallel(1):
        plan = plan_memory(10**6, g, None, 16, max_total_tokens_cap=40)
        assert plan.max_total_tokens == 32 and plan.tokens_before_cap > 32
        with pytest.raises(ConfigError, match="--max-total-tokens=8.*--page-size=16"):
            plan_memory(10**6, g, None, 16, max_total_tokens_cap=8)


def test_cuda_budget_is_sglangs_formula() -> None:
    # 80 GiB free before, 16 GiB of weights loaded, fraction 0.9:
    # 64 - 80 * 0.1 = 56 GiB for KV.
    assert cuda_budget(80 * GIB, 64 * GIB, 0.9) == 56 * GIB


def test_self_check_names_pool_numbers_and_terms() -> None:
    class RawTp(KVGeometry):  # the seed bug: priced at the raw tp width
        def kv_heads_per_rank(self) -> int:
            from dspark_launch.parallel import get_parallel

            return max(1, self.num_kv_heads // get_parallel().tp_size)

    target = KVGeometry("target", 2, 8, 16, 16, torch.float32)
    wrong = RawTp("draft", 1, 8, 16, 16, torch.float32)
    with override_parallel(8, 8):
        plan = plan_memory(10**6, target, wrong, 1)
        pool_t = KVPool(target, plan.pool_rows, "cpu")
        pool_d = KVPool(wrong, plan.pool_rows, "cpu")
        with pytest.raises(PoolPricingError) as err:
            self_check(plan, pool_t, pool_d)
    msg = str(err.value)
    for part in ("draft KV pool", "holds 1024 bytes/token", "priced 128 bytes/token",
                 "kv_heads_per_rank=8", "attn_tp_size=1", "tp_size=8", "head_dim=16",
                 "v_head_dim=16", "layers=1", "itemsize=4"):
        assert part in msg, (part, msg)


def test_missing_draft_pool_is_caught() -> None:
    g = KVGeometry("target", 1, 2, 8, 8, torch.float32)
    with override_parallel(1):
        plan = plan_memory(10**5, g, g, 1)
        with pytest.raises(PoolPricingError, match="no draft pool"):
            self_check(plan, KVPool(g, plan.pool_rows, "cpu"), None)


def test_geometry_from_config_reads_qwen_llama_and_draft_configs() -> None:
    qwen = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_size": 4096}
    llama = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    g = geometry_from_config("target", qwen, torch.bfloat16)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.v_head_dim) == (36, 8, 128, 128)
    g = geometry_from_config("target", llama, torch.float32)
    assert (g.num_kv_heads, g.head_dim) == (4, 16)  # defaults: all heads, hidden // heads
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        geometry_from_config("draft", {"num_attention_heads": 4}, torch.float32)
    with override_parallel(16, 2):  # attn_tp 8 > 4 heads: replicated, 1 per rank
        assert geometry_from_config("t", llama, torch.float32).kv_heads_per_rank() == 1
