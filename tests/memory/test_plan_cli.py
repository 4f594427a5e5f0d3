"""`python -m dspark_launch --plan` on the full-size example configs, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "examples" / "configs" / "qwen3-8b"
DRAFT = ROOT / "examples" / "configs" / "qwen3-8b-dflash-b16"
GIB = 1024**3


def plan(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the plan must not depend on a GPU
    return subprocess.run(
        [sys.executable, "-m", "dspark_launch", "--plan", *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


def plan_in_process(capsys, *flags: str) -> tuple[int, str, str]:
    """The same entry point without a fresh interpreter (torch import costs seconds here)."""
    from dspark_launch.__main__ import main

    code = main(["--plan", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def qwen_flags(tp: int, dp: int, *extra: str) -> list[str]:
    return ["--tp-size", str(tp), "--attn-dp-size", str(dp), "--model", str(TARGET),
            "--draft", str(DRAFT), "--kv-cache-memory", "8GiB", *extra]


def expected(attn_tp: int, page: int = 1) -> tuple[int, int, int]:
    """Closed form for Qwen3-8B (36 layers) + the 5-layer DFlash draft, 8 KV heads, hd 128, bf16."""
    heads = max(1, 8 // attn_tp)
    target, draft = heads * 256 * 36 * 2, heads * 256 * 5 * 2
    tokens = (8 * GIB // (target + draft) // page - 1) * page  # minus the dummy page
    return target, draft, tokens


@pytest.mark.parametrize(("tp", "dp"), [(16, 16), (16, 4), (8, 1), (8, 2), (8, 8)])
def test_plan_json_matches_closed_form(capsys, tp: int, dp: int) -> None:
    flags = qwen_flags(tp, dp, "--json", "--page-size", "16")
    code, stdout, stderr = plan_in_process(capsys, *flags)
    assert code == 0, stderr
    report = json.loads(stdout)
    target, draft, tokens = expected(tp // dp, 16)
    assert report["attn_tp_size"] == tp // dp and report["budget_bytes"] == 8 * GIB
    assert report["max_total_tokens"] == tokens
    assert len(report["ranks"]) == tp
    for rank, r in enumerate(report["ranks"]):
        assert (r["tp_rank"], r["attn_dp_rank"], r["attn_tp_rank"]) == (
            rank, rank // (tp // dp), rank % (tp // dp))
        assert (r["target_cell"], r["draft_cell"]) == (target, draft)
        assert r["draft_kv_heads_per_rank"] == max(1, 8 // (tp // dp))
        assert r["max_total_tokens"] == tokens
        assert (tokens + 16) * (target + draft) <= 8 * GIB
        assert r["target_pool_gib"] == round((tokens + 16) * target / GIB, 4)


def test_plan_tp16_attn_dp16_table_prices_all_draft_heads() -> None:
    out = plan(*qwen_flags(16, 16))
    assert out.returncode == 0, out.stderr
    target, draft, tokens = expected(1)
    assert (target, draft, tokens) == (147456, 20480, 51149)
    rows = [line.split() for line in out.stdout.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 16
    for rank, row in enumerate(rows):
        assert row[:8] == [str(rank), str(rank), "0", "8", "8", "147456", "20480", "51149"]
    assert "attn_tp=1 attn_dp=16" in out.stdout


def test_plan_tp8_json_subprocess() -> None:
    out = plan(*qwen_flags(8, 1, "--json"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert expected(8) == (18432, 2560, 409199)
    assert report["max_total_tokens"] == 409199
    assert {(r["target_cell"], r["draft_cell"]) for r in report["ranks"]} == {(18432, 2560)}


def test_plan_tp8_table(capsys) -> None:
    code, stdout, stderr = plan_in_process(capsys, *qwen_flags(8, 1))
    assert code == 0, stderr
    assert "max_total_tokens (MIN over ranks) = 409199" in stdout
    assert "attn_tp=8 attn_dp=1" in stdout


def _one_line_error(out: subprocess.CompletedProcess, *parts: str) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for part in parts:
        assert part in lines[0], (part, lines[0])


def test_plan_on_cpu_needs_kv_cache_memory() -> None:
    flags = [f for f in qwen_flags(8, 1) if f not in ("--kv-cache-memory", "8GiB")]
    _one_line_error(plan(*flags, "--device", "cpu"), "--kv-cache-memory")


def test_plan_names_a_missing_config_json(tmp_path: Path) -> None:
    flags = ["--tp-size", "2", "--model", str(TARGET), "--draft", str(tmp_path),
             "--kv-cache-memory", "1GiB"]
    _one_line_error(plan(*flags), str(tmp_path / "config.json"))


def test_plan_budget_too_small_names_the_minimum(capsys) -> None:
    code, _, stderr = plan_in_process(
        capsys, "--tp-size", "1", "--model", str(TARGET), "--draft", str(DRAFT),
        "--kv-cache-memory", "100KiB", "--device", "cpu")
    # 2 pages (one usable + the dummy) of the attn_tp=1 cells.
    assert code == 2 and len(stderr.strip().splitlines()) == 1
    assert str(2 * (147456 + 20480)) in stderr and "--kv-cache-memory" in stderr


def test_plan_defaults_to_the_embedded_tiny_model_or_says_so(capsys) -> None:
    code, stdout, stderr = plan_in_process(capsys, "--tp-size", "2", "--kv-cache-memory", "64MiB",
                                           "--device", "cpu")
    if code == 0:
        assert "assets/tiny/target" in stdout
    else:
        assert code == 2 and "--model" in stderr
