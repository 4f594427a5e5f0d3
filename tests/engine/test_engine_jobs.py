"""The whole job through the real entry (issue 6): continuous batching with preemption under a
KV pool too small for the prompt set, at tp1, tp2/attn-dp2 and tp8/attn-dp8 (fork worlds) and
once under a real torchrun; idle attn_dp groups; JSONL and metrics contents.

Oracle: plain greedy decoding (NONE, tp1, each prompt alone, ample KV) — itself checked
against HF transformers in test_reference_matches_hf.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from jobs import (
    AMPLE,
    QUIET,
    Probe,
    model_args,
    read_jsonl,
    reference,
    run_job,
    topology,
    with_tokenizer,
    write_prompts,
)

MAX_NEW = 10
# 160 KV rows per rank for 64 prompts of up to 24 tokens (+10 new): requests must wait and
# running ones get preempted.
SMALL_POOL = ["--kv-cache-memory", "64MiB", "--max-total-tokens", "160",
              "--max-running-requests", "12", "--chunked-prefill-size", "48",
              "--max-new-tokens", str(MAX_NEW)]


def assert_pool_drained(job) -> None:
    for rank, probe in enumerate(job.probes):
        after = probe["after"]
        assert after["is_full"], f"rank {rank}: allocator not full after the run: {after}"
        assert after["free_pages"] == after["num_pages"]
        assert after["table_rows_held"] == 0, f"rank {rank}: request->token rows still mapped"
        assert after["slots_held"] == 0
        assert after["unfinished"] == []


def test_reference_matches_hf(tiny):
    """The oracle itself: NONE at tp1 equals HF greedy generate (first few prompts)."""
    from checkpoints import load_hf

    ref = reference(tiny, tiny.prompts64, MAX_NEW)
    rows = read_jsonl(tiny.prompts64)
    hf = load_hf(tiny.target)
    for row, out in list(zip(rows, ref))[:4]:
        n = row.get("max_new_tokens", MAX_NEW)
        ids = torch.tensor([row["input_ids"]])
        gen = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=1,
                          pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out == gen


@pytest.mark.parametrize("world,dp,algorithm", [
    (1, 1, "NONE"),
    (2, 2, "DFLASH"),
    (8, 8, "DSPARK"),
], ids=["tp1-none", "tp2-dp2-dflash", "tp8-dp8-dspark"])
def test_small_pool_every_request_completes(tiny, tmp_path, world, dp, algorithm):
    ref = reference(tiny, tiny.prompts64, MAX_NEW)
    draft = {"DFLASH": tiny.dflash(4), "DSPARK": tiny.dspark(4)}.get(algorithm)
    job = run_job(tmp_path, "e2e", [*model_args(tiny, algorithm, draft=draft),
                                    *topology(world, dp), *SMALL_POOL,
                                    "--prompts", str(tiny.prompts64)],
                  world=world, probe=Probe())
    assert job.rcs == [0] * world
    assert len(job.records) == 64
    assert [r["index"] for r in job.records] == list(range(64))
    assert all(r["finish_reason"] in ("length", "stop") for r in job.records)
    assert job.outputs == ref
    # The pool really was too small: requests were preempted and recomputed.
    assert sum(r["preemptions"] for r in job.records) > 0
    assert_pool_drained(job)
    # Each record's drafts and accepted drafts add up to what the verifies saw (one rank of
    # each attn_dp group records its group's), and the summary's rate is their ratio.
    seen = [v for p in job.probes[::world // dp] for v in p["verifies"]]
    assert sum(r["drafts"] for r in job.records) == sum(n for _, n, _ in seen)
    assert sum(r["accepted_drafts"] for r in job.records) == sum(a for _, _, a in seen)
    m = job.metrics
    assert (m["drafts"], m["accepted_drafts"]) == (sum(n for _, n, _ in seen),
                                                   sum(a for _, _, a in seen))
    assert m["acceptance_rate"] == (m["accepted_drafts"] / m["drafts"] if m["drafts"] else None)
    assert (m["drafts"] > 0) == (algorithm != "NONE")
    # Every request ran on exactly one attn_dp group (each rank of a group holds it).
    groups = [set(p["after"]["requests_here"]) for p in job.probes[::world // dp]]
    assert sorted(i for g in groups for i in g) == list(range(64))
    if dp > 1:
        assert all(groups), "least-loaded placement left a group without work"


@pytest.mark.slow
def test_torchrun_two_ranks(tiny, tmp_path):
    """One real `torchrun` (python -m torch.distributed.run), tp2 / attn-dp2, small pool."""
    ref = reference(tiny, tiny.prompts64, MAX_NEW)
    out = tmp_path / "out.jsonl"
    metrics = tmp_path / "metrics.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "-m", "dspark_launch",
           *model_args(tiny, "NGRAM"), *topology(2, 2), *SMALL_POOL,
           "--prompts", str(tiny.prompts64), "--output", str(out),
           "--metrics-json", str(metrics), *QUIET]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out)
    assert [r["output_ids"] for r in records] == ref
    assert sum(r["preemptions"] for r in records) > 0
    m = json.loads(metrics.read_text())
    assert m["topology"] == {"world_size": 2, "tp_size": 2, "attn_tp_size": 1,
                             "attn_dp_size": 2}
    assert m["requests"] == 64


@pytest.mark.parametrize("world,dp,algorithm", [(4, 4, "NONE"), (4, 2, "DSPARK")],
                         ids=["tp4-dp4-none", "tp4-dp2-dspark"])
def test_group_without_requests_finishes(tiny, tmp_path, world, dp, algorithm):
    """One prompt, several attn_dp groups: the idle groups join every collective and exit."""
    prompts = write_prompts(tmp_path / "one.jsonl", [{"input_ids": [5, 9, 33, 2]}])
    ref = reference(tiny, tiny.prompts64, MAX_NEW)  # warm the oracle's cache
    del ref
    draft = tiny.dspark(4) if algorithm == "DSPARK" else None
    job = run_job(tmp_path, "idle", [*model_args(tiny, algorithm, draft=draft),
                                     *topology(world, dp), "--prompts", str(prompts),
                                     "--max-new-tokens", "8", *AMPLE],
                  world=world, probe=Probe(), timeout=60)
    assert job.rcs == [0] * world
    alone = run_job(tmp_path, "alone", [*model_args(tiny, "NONE"), "--prompts", str(prompts),
                                        "--max-new-tokens", "8", *AMPLE])
    assert job.outputs == alone.outputs and len(job.outputs[0]) > 0
    busy = [p["after"]["requests_here"] for p in job.probes]
    assert busy.count([0]) == world // dp and busy.count([]) == world - world // dp
    assert_pool_drained(job)


def test_jsonl_and_metrics_complete(tiny, tmp_path):
    """Text and token-id prompts with a tokenizer: every field, input order, metrics JSON."""
    model = with_tokenizer(tiny)
    rows = [{"prompt": "w5 w17 w99 w3", "id": "text-a"},
            {"input_ids": [7, 8, 9], "max_new_tokens": 3},
            {"prompt": "w40", "temperature": 0.0},
            {"input_ids": [60] * 12, "id": "rep"},
            {"prompt": "w2 w3 w4 w5 w6 w7 w8"}]
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    job = run_job(tmp_path, "fields", ["--model", str(model), "--speculative-algorithm",
                                       "NGRAM", "--prompts", str(prompts),
                                       "--max-new-tokens", "6", *AMPLE])
    assert job.rcs == [0]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert [r["id"] for r in job.records] == ["text-a", "1", "2", "rep", "4"]
    for row, rec in zip(rows, job.records):
        if "prompt" in row:
            assert rec["prompt"] == row["prompt"] and "input_ids" not in rec
            ids = tok.encode(row["prompt"]).ids
        else:
            assert rec["input_ids"] == row["input_ids"] and "prompt" not in rec
            ids = row["input_ids"]
        assert rec["prompt_tokens"] == len(ids)
        assert rec["completion_tokens"] == len(rec["output_ids"]) > 0
        assert rec["text"] == tok.decode(rec["output_ids"])
        assert rec["finish_reason"] in ("length", "stop")
        if rec["finish_reason"] == "length":
            assert rec["completion_tokens"] == row.get("max_new_tokens", 6)
        # The prefill commits the first token; every later round commits accept_lens[i].
        assert 1 + sum(rec["accept_lens"]) == rec["completion_tokens"]
        assert rec["rounds"] == len(rec["accept_lens"])
        assert 0 < rec["ttft_s"] <= rec["latency_s"]
        assert rec["draft_s"] >= 0 and rec["verify_s"] > 0
    # Each text prompt decodes like its token ids would (same oracle, NONE at tp1).
    ids_rows = [{"input_ids": tok.encode(r["prompt"]).ids, **{k: v for k, v in r.items()
                 if k not in ("prompt", "id")}} if "prompt" in r else r for r in rows]
    plain = run_job(tmp_path, "plain", [*model_args(tiny, "NONE"), "--prompts",
                                        str(write_prompts(tmp_path / "ids.jsonl", ids_rows)),
                                        "--max-new-tokens", "6", *AMPLE])
    assert job.outputs == plain.outputs

    m = job.metrics
    recs = job.records
    rounds = [n for r in recs for n in r["accept_lens"]]
    assert m["requests"] == 5 and m["refused"] == 0
    assert m["prompt_tokens"] == sum(r["prompt_tokens"] for r in recs)
    assert m["output_tokens"] == sum(r["completion_tokens"] for r in recs)
    assert m["wall_s"] > 0
    assert m["output_tokens_per_s"] == pytest.approx(m["output_tokens"] / m["wall_s"])
    assert m["rounds"] == len(rounds)
    assert m["mean_tau"] == pytest.approx(sum(rounds) / len(rounds))
    assert m["tau_histogram"] == {str(k): v for k, v in sorted(Counter(rounds).items())}
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
        assert m[key] is not None and m[key] > 0
    assert m["ttft_p50_s"] <= m["ttft_p99_s"] and m["tpot_p50_s"] <= m["tpot_p99_s"]
    assert m["topology"] == {"world_size": 1, "tp_size": 1, "attn_tp_size": 1,
                             "attn_dp_size": 1}
    assert m["memory_plan"]["max_total_tokens"] == 4096
    assert m["algorithm"] == "NGRAM"


def test_per_line_sampling_fields_match_hf(tiny, tmp_path, capsys):
    """A JSONL line sets any token-level field (max_tokens, stop_token_ids, min_tokens,
    ignore_eos, top_k, top_p): each was silently ignored before. Oracle: HF greedy generate
    with the same stops; top_k=1 and a tiny top_p at T=1 sample the argmax, i.e. greedy."""
    from checkpoints import load_hf

    hf = load_hf(tiny.target)

    def greedy(ids: list[int], n: int, stops=(1,), min_new: int = 0) -> list[int]:
        x = torch.tensor([ids])
        return hf.generate(x, max_new_tokens=n, min_new_tokens=min_new, do_sample=False,
                           eos_token_id=list(stops), pad_token_id=0)[0, x.shape[1]:].tolist()

    prompts = [r["input_ids"] for r in read_jsonl(tiny.prompts64)]
    # A prompt whose greedy continuation meets EOS (1), for ignore_eos.
    eos = next(p for p in prompts if 1 in greedy(p, 8, stops=(-1,))[1:])
    p0, p1 = prompts[0], prompts[1]
    stop = greedy(p1, 8)[2]
    rows = [{"input_ids": p0, "max_tokens": 5},
            {"input_ids": p1, "stop_token_ids": [stop]},
            {"input_ids": p1, "stop_token_ids": [stop], "min_tokens": 4},
            {"input_ids": p0, "temperature": 1.0, "top_k": 1, "seed": 3},
            {"input_ids": p1, "temperature": 1.0, "top_p": 1e-30},
            {"input_ids": eos, "ignore_eos": True},
            {"input_ids": eos, "answer": 42}]
    job = run_job(tmp_path, "lines", [*model_args(tiny, "NGRAM"), "--prompts",
                                      str(write_prompts(tmp_path / "p.jsonl", rows)),
                                      "--max-new-tokens", "8", *AMPLE])
    assert job.rcs == [0]
    assert job.outputs == [greedy(p0, 5), greedy(p1, 8, (1, stop)),
                           greedy(p1, 8, (1, stop), min_new=4), greedy(p0, 8), greedy(p1, 8),
                           greedy(eos, 8, stops=(-1,)), greedy(eos, 8)]
    assert job.outputs[1][-1] == stop and stop not in job.outputs[2][:3]
    assert len(job.outputs[5]) == 8 and len(job.outputs[6]) < 8
    kept = [r["sampling"] for r in job.records]
    assert kept[1]["stop_token_ids"] == [stop] and kept[2]["min_tokens"] == 4
    assert kept[3]["top_k"] == 1 and kept[5]["ignore_eos"] is True
    # A key the job does not take is named once, with what a line takes; the line runs.
    warned = [x for x in capsys.readouterr().err.splitlines() if "ignored" in x]
    assert len(warned) == 1 and "'answer' (1 line from line 7)" in warned[0]
    assert "stop_token_ids" in warned[0]


def test_stdout_without_output_file(tiny, tmp_path, capsys):
    from dspark_launch.__main__ import main

    prompts = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [4, 5]}, {"input_ids": [6]}])
    rc = main([*model_args(tiny, "NONE"), "--prompts", str(prompts), "--max-new-tokens", "3",
               *AMPLE, *QUIET])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()
             if x.startswith("{")]
    assert sorted(x["id"] for x in lines) == ["0", "1"]
    assert all(len(x["output_ids"]) == 3 or x["output_ids"][-1] == 1 for x in lines)

