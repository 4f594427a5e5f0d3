"""`python -m dspark_launch --plan` on the full-size example configs, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


# Qwen3-8B (config.json) and the 5-layer DFlash draft, bf16, written out by hand.
V, D, I_, HQ, HKV, HD, L_T, L_D, M, B = 151936, 4096, 12288, 32, 8, 128, 36, 5, 5, 16
R, CHUNK, BF16, FP32 = 64, 512, 2, 4  # --max-running-requests / --chunked-prefill-size


def cells(attn_tp: int, itemsize: int = BF16) -> tuple[int, int]:
    heads = max(1, HKV // attn_tp)
    return heads * 2 * HD * L_T * itemsize, heads * 2 * HD * L_D * itemsize


def closed_form_weights(tp: int, attn_tp: int) -> tuple[int, int]:
    """Per-rank parameter bytes: vocab and attention split over attn_tp, the target MLP over
    tp, the draft MLP over attn_tp (it never leaves its attention group), norms and fc whole."""
    shard = -(-V // attn_tp)  # padded vocabulary shard
    attn = ((HQ // attn_tp + 2 * max(1, HKV // attn_tp)) * HD * D  # q|k|v rows
            + D * (HQ // attn_tp) * HD  # o_proj columns
            + 2 * HD)  # q_norm, k_norm
    norms = 2 * D
    target = 2 * shard * D + L_T * (attn + 3 * (I_ // tp) * D + norms) + D
    draft = M * D * D + D + L_D * (attn + 3 * (I_ // attn_tp) * D + norms) + D
    return target * BF16, draft * BF16


def closed_form_transients(tp: int, attn_tp: int) -> int:
    """The largest DFLASH step (B=16: 16 verify rows, 15 drafts) priced by hand."""
    attn_dp = tp // attn_tp
    forward_rows = max(R * B, (R - 1) * B + CHUNK)
    logit_rows, q_rows = R * B, R * (B - 1)
    shard = -(-V // attn_tp)
    greedy = shard * (BF16 + FP32)  # local shard + fp32 for the argmax
    # sampled: local shard, gathered pieces (none extra at attn_tp 1), concatenation, fp32, probs
    sampled = shard * BF16 * (1 + (attn_tp if attn_tp > 1 else 0) + attn_tp) + 2 * V * FP32
    row = max(greedy, sampled)
    mlp = attn_dp * forward_rows * ((D if attn_dp > 1 else 0) + 3 * I_ // tp + D) * BF16
    split_k = R * (HQ // attn_tp) * 8 * (HD + 1) * FP32
    features = forward_rows * M * D * BF16
    q_l, kv_l = HQ // attn_tp, max(1, HKV // attn_tp)
    attention = forward_rows * (4 * (q_l + 2 * kv_l) * HD + 4 * D) * BF16
    # the sampling filters' chunk: 64 rows of 40 bytes a token of the vocabulary
    workspace = 64 * V * 40
    verify = q_rows * V * FP32 + features + max(attention + mlp + split_k,
                                                logit_rows * row + workspace)
    # deferred draft context: up to 256 + R rows of features, position and row, twice
    deferred = 2 * (256 + R) * (M * D * BF16 + 16)
    # propose (draft logits) or verify (q kept)
    return deferred + max(q_rows * row + workspace, verify)


def expected(attn_tp: int, page: int = 1, tp: int | None = None) -> tuple[int, int, int]:
    """(target cell, draft cell, tokens) at an 8 GiB budget after the step's transients."""
    target, draft = cells(attn_tp)
    free = 8 * GIB - closed_form_transients(tp or attn_tp, attn_tp)
    tokens = (free // (target + draft) // page - 1) * page  # minus the dummy page
    return target, draft, tokens


@pytest.mark.parametrize(("tp", "dp"), [(16, 16), (16, 4), (8, 1), (8, 2), (8, 8)])
def test_plan_json_matches_closed_form(capsys, tp: int, dp: int) -> None:
    flags = qwen_flags(tp, dp, "--json", "--page-size", "16")
    code, stdout, stderr = plan_in_process(capsys, *flags)
    assert code == 0, stderr
    report = json.loads(stdout)
    attn_tp = tp // dp
    target, draft, tokens = expected(attn_tp, 16, tp)
    transients = closed_form_transients(tp, attn_tp)
    weights = closed_form_weights(tp, attn_tp)
    assert report["attn_tp_size"] == attn_tp and report["budget_bytes"] == 8 * GIB
    assert report["max_total_tokens"] == tokens
    assert len(report["ranks"]) == tp
    for rank, r in enumerate(report["ranks"]):
        assert (r["tp_rank"], r["attn_dp_rank"], r["attn_tp_rank"]) == (
            rank, rank // attn_tp, rank % attn_tp)
        assert (r["target_cell"], r["draft_cell"]) == (target, draft)
        assert r["draft_kv_heads_per_rank"] == max(1, 8 // attn_tp)
        assert r["max_total_tokens"] == tokens
        assert r["transient_bytes"] == r["transients"]["total"] == transients
        assert (r["weights"]["target"], r["weights"]["draft"]) == weights
        assert (tokens + 16) * (target + draft) + transients <= 8 * GIB
        assert r["target_pool_gib"] == round((tokens + 16) * target / GIB, 4)


def _meta_weights(tp: int, dp: int, rank: int) -> tuple[int, int]:
    """The test's own sum over the models' parameters, built as rank `rank` on meta."""
    from dspark_launch.models.config import ModelConfig
    from dspark_launch.models.dflash import DFlashDraft
    from dspark_launch.models.draft_config import DraftConfig
    from dspark_launch.models.qwen3 import CausalLM
    from dspark_launch.parallel import override_parallel

    with override_parallel(tp, dp, tp_rank=rank):
        target = CausalLM(ModelConfig.from_pretrained(TARGET), torch.bfloat16, "meta")
        draft = DFlashDraft(DraftConfig.from_pretrained(DRAFT), torch.bfloat16, "meta")
    total = [0, 0]
    for i, model in enumerate((target, draft)):
        seen = set()
        for _name, param in model.named_parameters(remove_duplicate=False):
            if id(param) not in seen:  # a tied weight is one tensor in memory
                seen.add(id(param))
                total[i] += param.numel() * param.element_size()
    return total[0], total[1]


def test_plan_tp16_attn_dp16_table_prices_all_draft_heads() -> None:
    out = plan(*qwen_flags(16, 16))
    assert out.returncode == 0, out.stderr
    target, draft, tokens = expected(1, tp=16)
    assert (target, draft, tokens) == (147456, 20480, 33714)
    rows = [line.split() for line in out.stdout.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 16
    for rank, row in enumerate(rows):
        assert row[:8] == [str(rank), str(rank), "0", "8", "8", "147456", "20480", "33714"]
    assert "attn_tp=1 attn_dp=16" in out.stdout
    # The weights line: the models' own parameters at tp16/attn-dp16, equal on every rank,
    # and equal to the hand count (the embedding, LM head and attention whole, MLP / 16).
    meta = {_meta_weights(16, 16, rank) for rank in range(16)}
    assert meta == {closed_form_weights(16, 1)} == {(6189312000, 2097252864)}
    t, d = meta.pop()
    assert (f"weights/rank: target {t} B + draft {d} B = {t + d} B (7.717 GiB) on every rank"
            in out.stdout)
    trans = closed_form_transients(16, 1)
    assert f"transients/rank (every rank): {trans} B (" in out.stdout


def test_plan_tp8_json_subprocess() -> None:
    out = plan(*qwen_flags(8, 1, "--json"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert expected(8, tp=8) == (18432, 2560, 267871)
    assert report["max_total_tokens"] == 267871
    assert {(r["target_cell"], r["draft_cell"]) for r in report["ranks"]} == {(18432, 2560)}
    assert {tuple(r["weights"].values())[:2] for r in report["ranks"]} == {
        closed_form_weights(8, 8)} == {_meta_weights(8, 1, 3)}


def test_plan_tp8_table(capsys) -> None:
    code, stdout, stderr = plan_in_process(capsys, *qwen_flags(8, 1))
    assert code == 0, stderr
    assert "max_total_tokens (MIN over ranks) = 267871" in stdout
    assert "attn_tp=8 attn_dp=1" in stdout
    assert "transients/rank (every rank): " in stdout and "weights/rank: " in stdout


def _one_line_error(out: subprocess.CompletedProcess, *parts: str) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for part in parts:
        assert part in lines[0], (part, lines[0])


def test_plan_on_cpu_without_kv_cache_memory_sizes_to_the_run(capsys) -> None:
    """No --kv-cache-memory on CPU: the budget is what the run can use, and says so; the
    cells in fp32, as a CPU launch computes a bf16 checkpoint under --dtype auto (priced in
    bf16, the plan promised 2.6x the KV tokens the embedded model's launch got)."""
    flags = [f for f in qwen_flags(8, 1) if f not in ("--kv-cache-memory", "8GiB")]
    code, stdout, stderr = plan_in_process(capsys, *flags, "--device", "cpu", "--json",
                                           "--max-running-requests", "4",
                                           "--context-length", "1000", "--page-size", "16")
    assert code == 0, stderr
    report = json.loads(stdout)
    target, draft = cells(8, FP32)
    pages_per_request = -(-(1000 + B) // 16)  # context + one verify round, whole pages
    assert report["max_total_tokens"] == 4 * pages_per_request * 16
    r = report["ranks"][0]
    assert report["budget_bytes"] == (
        (4 * pages_per_request + 1) * 16 * (target + draft) + r["transient_bytes"])
    assert report["budget_source"].startswith("fit: max running requests x context")


def test_plan_names_a_missing_config_json(tmp_path: Path) -> None:
    flags = ["--tp-size", "2", "--model", str(TARGET), "--draft", str(tmp_path),
             "--kv-cache-memory", "1GiB"]
    _one_line_error(plan(*flags), str(tmp_path / "config.json"))


def test_plan_budget_too_small_names_the_minimum(capsys) -> None:
    code, _, stderr = plan_in_process(
        capsys, "--tp-size", "1", "--model", str(TARGET), "--draft", str(DRAFT),
        "--kv-cache-memory", "100KiB")
    # 2 pages (one usable + the dummy) of the attn_tp=1 cells, plus the step's transients
    # (bf16: the checkpoint's, as a GPU launch computes it).
    assert code == 2 and len(stderr.strip().splitlines()) == 1
    need = 2 * (147456 + 20480) + closed_form_transients(1, 1)
    assert f"needs {need} bytes" in stderr and "--kv-cache-memory" in stderr


def test_plan_defaults_to_the_embedded_tiny_model_or_says_so(capsys) -> None:
    code, stdout, stderr = plan_in_process(capsys, "--tp-size", "2", "--kv-cache-memory", "64MiB",
                                           "--device", "cpu")
    if code == 0:
        assert "assets/tiny/target" in stdout
    else:
        assert code == 2 and "--model" in stderr


def test_plan_prices_the_algorithm_the_run_would_use(capsys) -> None:
    """NGRAM builds no draft pool, so none is priced; a draft of the wrong kind is refused."""
    flags = [f for f in qwen_flags(8, 1, "--json") if f not in ("--draft", str(DRAFT))]
    code, stdout, stderr = plan_in_process(capsys, *flags, "--speculative-algorithm", "NGRAM")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["draft"] is None and report["algorithm"] == "NGRAM"
    assert report["step"]["verify_rows"] == 8 and report["step"]["draft_slots"] == 0
    assert {r["draft_cell"] for r in report["ranks"]} == {0}
    assert {r["weights"]["draft"] for r in report["ranks"]} == {0}
    code, _, stderr = plan_in_process(capsys, *qwen_flags(8, 1, "--speculative-algorithm",
                                                          "DSPARK"))
    assert code == 2 and "is a DFLASH checkpoint" in stderr and str(DRAFT) in stderr


def test_readme_plan_examples_are_what_the_plan_prints(capsys) -> None:
    """Each `--plan` example in the README prints the lines the README shows (rows elided
    with "..." aside): its attention terms had drifted from the code's."""
    import re
    import shlex

    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```\n\$ (python -m dspark_launch --plan .*?)\n```", readme, re.S)
    assert len(blocks) == 2
    for block in blocks:
        command, *shown = block.replace("\\\n", " ").splitlines()
        argv = shlex.split(command)[3:]  # after `python -m dspark_launch`
        code, stdout, stderr = plan_in_process(capsys, *argv)
        assert code == 0, stderr
        printed = stdout.splitlines()
        for line in shown:
            if line.strip().startswith("..."):
                continue
            assert line in printed, (command, line)


def test_plan_reads_checkpoints_and_refuses_as_the_launch_does(capsys, tmp_path) -> None:
    """Three ways the plan and a launch disagreed: without --model, DFLASH was priced with
    the embedded DSpark draft and refused; a config with both dtype keys was priced in
    torch_dtype's (the launch reads dtype), one with neither was refused (the launch runs
    it in float32); a pool too small for one round printed a plan the launch refuses."""
    from dspark_launch.models.config import ModelConfig

    cpu = ["--device", "cpu", "--kv-cache-memory", "64MiB"]
    code, stdout, stderr = plan_in_process(capsys, *cpu, "--speculative-algorithm", "DFLASH",
                                           "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["draft"]["path"].endswith("assets/tiny/dflash")
    raw = json.loads((TARGET / "config.json").read_text())
    for keys, want in (({"dtype": "float32", "torch_dtype": "bfloat16"}, "float32"),
                       ({}, "float32")):
        model = tmp_path / f"t{len(keys)}"
        model.mkdir()
        cfg = {k: v for k, v in raw.items() if k not in ("dtype", "torch_dtype")}
        (model / "config.json").write_text(json.dumps({**cfg, **keys}))
        assert str(ModelConfig.from_pretrained(model).dtype) == f"torch.{want}"
        code, stdout, stderr = plan_in_process(capsys, "--model", str(model), "--device",
                                               "cuda", "--kv-cache-memory", "8GiB",
                                               "--speculative-algorithm", "NONE", "--json")
        assert code == 0, stderr
        assert json.loads(stdout)["target"]["dtype"] == want
    code, _, stderr = plan_in_process(capsys, *cpu, "--max-total-tokens", "8")
    assert code == 2 and "too few for one round of 9 rows" in stderr
