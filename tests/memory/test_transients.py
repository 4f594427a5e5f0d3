"""The step's transients in the budget, the CPU default that fits the run, lazily zeroed pools,
and the self-check against what the models' attention layers really write."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_launch.args import resolve_config
from dspark_launch.errors import ConfigError
from dspark_launch.memory import budget as budget_mod
from dspark_launch.memory.budget import (
    PoolPricingError,
    configure_memory,
    plan_memory,
    run_need_bytes,
    self_check,
)
from dspark_launch.memory.geometry import KVGeometry
from dspark_launch.memory.kv_pool import KVPool
from dspark_launch.memory.transients import SPLITK_MAX_SPLITS, round_shape
from dspark_launch.parallel import override_parallel

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "dspark_launch" / "assets" / "tiny"
MIB = 1024**2


# ---------------------------------------------------------------- the formula's inputs


def test_round_shape_matches_the_real_proposers() -> None:
    """--plan's (max_drafts, block_rows) table against the proposer classes themselves."""
    from dspark_launch.spec.block_drafter import DFlashProposer, DSparkProposer
    from dspark_launch.spec.ngram import NgramProposer
    from dspark_launch.spec.proposer import Proposer

    # The block drafters read only these two config fields at construction.
    draft = types.SimpleNamespace(config=types.SimpleNamespace(target_layer_ids=(1,),
                                                               mask_token_id=0))
    for block in (2, 8, 16):
        real = {
            "NONE": Proposer(),
            "NGRAM": NgramProposer(block),
            "DFLASH": DFlashProposer(draft, None, None, None, None, block),
            "DSPARK": DSparkProposer(draft, None, None, None, None, block),
        }
        for name, proposer in real.items():
            assert round_shape(name, block) == (proposer.max_drafts, proposer.block_rows), name


def test_split_k_width_is_the_kernels() -> None:
    from dspark_launch.kernels.decode_attention import MAX_SPLITS

    assert SPLITK_MAX_SPLITS == MAX_SPLITS


# ---------------------------------------------------------------- transients in the budget


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(10_000, 10**8), transients=st.integers(0, 10**7),
       page=st.sampled_from([1, 4, 16]), heads=st.integers(1, 8))
def test_pools_fill_what_the_transients_leave(budget: int, transients: int, page: int,
                                              heads: int) -> None:
    g = KVGeometry("target", 2, heads, 8, 8, torch.float32)
    cell = heads * (8 + 8) * 2 * 4  # closed form: H * (hd + v_hd) * layers * fp32
    need = 2 * page * cell + transients
    with override_parallel(1):
        if budget < need:
            with pytest.raises(ConfigError, match=f"transients={transients}"):
                plan_memory(budget, g, None, page, transient_bytes=transients)
            return
        plan = plan_memory(budget, g, None, page, transient_bytes=transients)
    assert plan.target_cell == cell and plan.transient_bytes == transients
    used = plan.pool_rows * cell + transients
    assert used <= budget < used + page * cell  # fits, and one more page would not


def test_run_need_is_exactly_what_the_plan_hands_back() -> None:
    """The CPU default's budget buys max_running requests at their row limit, no more."""
    target = KVGeometry("target", 3, 4, 16, 16, torch.float32)
    draft = KVGeometry("draft", 1, 4, 16, 16, torch.float32)
    with override_parallel(2):
        cell = target.cell_bytes() + draft.cell_bytes()
        for page, rows in ((1, 100), (16, 100), (16, 96)):
            need = run_need_bytes(cell, page, 5, rows, 12345)
            plan = plan_memory(need, target, draft, page, transient_bytes=12345)
            assert plan.max_total_tokens == 5 * -(-rows // page) * page


def _cpu_cfg(*extra: str):
    return resolve_config(["--device", "cpu", "--page-size", "4", "--max-running-requests",
                           "3", *extra], world_size=1)


def test_cpu_default_fits_the_run_and_the_ram_share_caps_it(monkeypatch) -> None:
    g = KVGeometry("target", 2, 2, 8, 8, torch.float32)
    cfg = _cpu_cfg()
    with override_parallel(1):
        need = run_need_bytes(g.cell_bytes(), 4, 3, 50, 0)
        monkeypatch.setattr(budget_mod, "mem_available_bytes", lambda: 10 * need)
        plan = configure_memory(cfg, g, None, "cpu", request_rows=50)
        assert plan.budget_bytes == need and plan.max_total_tokens == 3 * 52
        assert plan.budget_rule.startswith("fit: max running requests x context")
        # A run that could use more than the RAM share gets the share, and is told so.
        monkeypatch.setattr(budget_mod, "mem_available_bytes", lambda: need)
        plan = configure_memory(cfg, g, None, "cpu", request_rows=50)
        assert plan.budget_bytes == int(need * budget_mod.CPU_RAM_SHARE)
        assert plan.budget_rule.startswith("RAM share: 30% of MemAvailable / 1 local rank")
        # An explicit flag wins over both.
        plan = configure_memory(_cpu_cfg("--kv-cache-memory", "1MiB"), g, None, "cpu",
                                request_rows=50)
        assert (plan.budget_bytes, plan.budget_rule) == (MIB, "--kv-cache-memory")


# ---------------------------------------------------------------- pools: zero, untouched


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_pool_reads_zero_and_costs_only_the_rows_written() -> None:
    g = KVGeometry("target", 4, 8, 128, 128, torch.bfloat16)  # 16 KiB per row
    before = _rss()
    with override_parallel(1):
        pool = KVPool(g, 64 * 1024, "cpu")  # 1 GiB of K/V
    assert pool.total_bytes() == 1024 * MIB
    assert _rss() - before < 64 * MIB, "building the pool touched its pages"
    # What attention may read without anyone writing it is 0, never NaN: the dummy row, a
    # page tail, and a row deep in the pool.
    for layer in (0, 3):
        for buf in (pool.k[layer], pool.v[layer]):
            assert torch.equal(buf[[0, 1, 7, 50_000, -1]], torch.zeros_like(buf[:5]))
    pool.k[2][100:104] = 1.5
    assert pool.k[2][100:104].eq(1.5).all() and pool.k[2][99].eq(0).all()
    assert pool.v[2][100:104].eq(0).all() and pool.k[1][100:104].eq(0).all()  # no aliasing
    assert _rss() - before < 64 * MIB


def test_default_embedded_job_sizes_its_pools_to_the_run(tmp_path: Path) -> None:
    """The start-up line names the rule; the job's peak RSS is a small fraction of the 7 GB
    a RAM-share pool of zero-filled pages took."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    code = ("import resource, subprocess, sys\n"
            "p = subprocess.run([sys.executable, '-m', 'dspark_launch', '--max-new-tokens', "
            "'4', '--prompt', 'hello', '--output', sys.argv[1]], capture_output=True, "
            "text=True)\n"
            "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
            "print(p.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out.jsonl")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    rc, max_rss_kib = (int(x) for x in out.stdout.split("\n", 1)[0].split())
    assert rc == 0, out.stdout
    line = next(x for x in out.stdout.splitlines() if "KV:" in x)
    # 64 requests x (2048 context + 9 rows of a DSpark round) at fp32 cells 4096 + 512.
    assert "KV: 131648 tokens/rank (cells target 4096 + draft 512 bytes)" in line
    assert "(fit: max running requests x context" in line
    transients = int(re.search(r"incl\. (\d+) bytes of step transients", line).group(1))
    budget = int(re.search(r"budget (\d+) bytes/rank", line).group(1))
    assert budget == (131648 + 1) * (4096 + 512) + transients
    assert max_rss_kib * 1024 < 1024 * MIB, max_rss_kib


# ---------------------------------------------------------------- self-check vs the model


def _tiny_target(tp: int, attn_dp: int):
    from dspark_launch.models.config import ModelConfig
    from dspark_launch.models.qwen3 import CausalLM

    with override_parallel(tp, attn_dp):
        return CausalLM(ModelConfig.from_pretrained(TINY / "target"), torch.float32, "meta")


def test_self_check_compares_pools_with_what_the_model_writes() -> None:
    cfg_heads = 2  # the tiny target: 8 layers, 2 KV heads of 32
    g = KVGeometry("target", 8, cfg_heads, 32, 32, torch.float32)
    model = _tiny_target(2, 1)  # attn_tp 2: one KV head per rank
    assert {m.qkv_proj.kv_heads for m in model.modules() if hasattr(m, "qkv_proj")} == {1}
    with override_parallel(2, 1):
        plan = plan_memory(10**6, g, None, 1)
        self_check(plan, KVPool(g, plan.pool_rows, "cpu"), None, model)  # agrees
    # A pool built at another width than the model was (attn_tp 1: both heads) is named,
    # even when its own bytes match the plan priced at that same width.
    with override_parallel(2, 2):
        plan = plan_memory(10**6, g, None, 1)
        pool = KVPool(g, plan.pool_rows, "cpu")
        with pytest.raises(PoolPricingError) as err:
            self_check(plan, pool, None, model)
    msg = str(err.value)
    assert "target KV pool does not match what the target model writes" in msg
    assert "layer 0" in msg and "(1, 32, 32)" in msg and "(2, 32, 32)" in msg


# ---------------------------------------------------------------- the start-up warm-up step


def test_warmup_step_runs_the_largest_batch_and_returns_its_rows() -> None:
    """The warm-up's batch on the embedded model (its peak is measured on CUDA only)."""
    from dspark_launch.attention import make_backend
    from dspark_launch.engine.warmup import largest_batch_step
    from dspark_launch.errors import LaunchError
    from dspark_launch.memory.build import build_kv_memory
    from dspark_launch.memory.transients import (
        check_measured,
        measure_step_peak,
        price_step,
        step_shape,
    )
    from dspark_launch.models.loader import load_model
    from dspark_launch.spec.factory import make_proposer

    cfg = _cpu_cfg("--max-running-requests", "3", "--chunked-prefill-size", "20")
    with override_parallel(1):
        target = load_model(TINY / "target", "float32", "cpu")
        parts = make_proposer(cfg, "DSPARK", str(TINY / "dspark"), target, "cpu", "float32")
        shape = step_shape(cfg, target.config, torch.float32, parts.max_drafts,
                           parts.block_rows, parts.draft)
        assert (shape.verify_rows, shape.forward_rows, shape.logit_rows) == (9, 38, 27)
        backend = make_backend("torch", "cpu")
        for tokens, fits in ((64, True), (32, False)):  # rows [9, 9, 20]: 11 pages of 4
            plan = plan_memory(10**8, KVGeometry("target", 8, 2, 32, 32, torch.float32),
                               parts.geometry, 4, tokens)
            memory = build_kv_memory(plan, KVGeometry("target", 8, 2, 32, 32, torch.float32),
                                     parts.geometry, 3, 40, "cpu", target, parts.draft)
            proposer = parts.build(memory, backend)
            assert largest_batch_step(target, proposer, memory, backend, shape) is fits
            assert memory.space.is_full()  # every row and slot handed back
        # Off CUDA nothing is measured and the step is not run twice.
        assert measure_step_peak(lambda: pytest.fail("ran off CUDA"), "cpu") is None
    priced = price_step(shape).total
    check_measured(priced, priced, shape)
    with pytest.raises(LaunchError, match=f"allocated {priced + 1} bytes beyond the pools, "
                                          f"but the budget priced {priced}"):
        check_measured(priced, priced + 1, shape)


# ---------------------------------------------------------------- price vs a real run's peak


def _torch_peak(run) -> int:
    """Peak bytes torch's CPU allocator held beyond the start while `run()` ran, from the
    profiler's allocation records (each op's own allocations at its start, frees as their
    own records), in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    timeline = sorted(
        (e.time_range.start,
         e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
        for e in prof.events())
    held = peak = 0
    for _, delta in timeline:
        held += delta
        peak = max(peak, held)
    assert held == 0, "the run kept torch memory: the timeline is incomplete"
    return peak


def _drain(engine, specs) -> None:
    """The engine API's offline use: add everything, step until no work is left."""
    for spec in specs:
        engine.add_request(spec)
    engine.step()
    while engine.has_work:
        engine.step()


@pytest.mark.parametrize("algorithm", ["NONE", "DFLASH", "DSPARK"])
def test_priced_transients_cover_a_real_runs_peak(algorithm: str) -> None:
    """The engine decoding sampled requests at full batch on the embedded model: everything
    torch allocated beyond the pools (which are allocated before) stays within the price."""
    from dspark_launch.attention import make_backend
    from dspark_launch.engine.engine import Engine, EngineLimits
    from dspark_launch.engine.inputs import build_specs
    from dspark_launch.memory.build import build_kv_memory
    from dspark_launch.memory.transients import price_step, step_shape
    from dspark_launch.models.loader import load_model
    from dspark_launch.spec.factory import make_proposer

    r, chunk = 4, 32
    cfg = _cpu_cfg("--max-running-requests", str(r), "--chunked-prefill-size", str(chunk))
    with override_parallel(1):
        target = load_model(TINY / "target", "float32", "cpu")
        draft = str(TINY / algorithm.lower()) if algorithm != "NONE" else None
        parts = make_proposer(cfg, algorithm, draft, target, "cpu", "float32")
        shape = step_shape(cfg, target.config, torch.float32, parts.max_drafts,
                           parts.block_rows, parts.draft)
        geometry = KVGeometry("target", 8, 2, 32, 32, torch.float32)
        plan = plan_memory(10**8, geometry, parts.geometry, 4, 4096)
        memory = build_kv_memory(plan, geometry, parts.geometry, r, 200, "cpu", target,
                                 parts.draft)
        backend = make_backend("torch", "cpu")
        # Twice R prompts longer than a chunk: full decode batches next to a prefill chunk.
        specs = build_specs([{"input_ids": list(range(1, 40 + i))} for i in range(2 * r)],
                            None, 6, 1.0, 150, 2048)
        engine = Engine(target, parts.build(memory, backend), memory, backend,
                        EngineLimits(max_running=r, chunk_size=chunk, context_limit=150,
                                     eos_ids=(), seed=0))
        peak = _torch_peak(lambda: _drain(engine, specs))
    priced = price_step(shape).total
    print(f"{algorithm}: measured {peak} B, priced {priced} B")
    assert 0 < peak <= priced, (peak, priced, price_step(shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_kind", ["top_p", "top_k+top_p", "greedy+top_p"])
def test_the_filters_stay_within_their_priced_chunk(dtype, rows_kind) -> None:
    """Making sampled distributions allocates at most the fp32 result and the filters'
    chunk workspace that price_step reserves (SAMPLING_CHUNK_ROWS rows at
    SAMPLING_WORKSPACE_BYTES a token): top_p and greedy rows among sampled ones were made for
    every row at once, 41 bytes a token of the vocabulary per row where 16 were priced."""
    from dspark_launch.engine.params import SamplingParams
    from dspark_launch.memory.transients import SAMPLING_CHUNK_ROWS, SAMPLING_WORKSPACE_BYTES
    from dspark_launch.spec.sampling import SamplingRows, target_probs

    n, vocab = 3 * SAMPLING_CHUNK_ROWS + 5, 8192
    kinds = {"top_p": [SamplingParams(top_p=0.9)] * n,
             "top_k+top_p": [SamplingParams(top_k=20, top_p=0.95)] * n,
             "greedy+top_p": [SamplingParams(temperature=0.0) if i % 2 else
                              SamplingParams(top_p=0.9) for i in range(n)]}
    rows = SamplingRows.build(kinds[rows_kind], list(range(n)), [0] * n, "cpu")
    logits = torch.randn(n, vocab).to(dtype)
    peak = _torch_peak(lambda: target_probs(logits, rows))
    priced = n * vocab * 4 + SAMPLING_CHUNK_ROWS * vocab * SAMPLING_WORKSPACE_BYTES
    assert 0 < peak <= priced, (peak, priced)
