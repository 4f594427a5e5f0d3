"""The embedded tiny model family loads through the engine's own loaders, transformers loads the
target, and both drafters decode losslessly with real acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from jobs import run_job
from model_runner import Runner

from dspark_launch.engine.runner import ASSETS
from dspark_launch.models.draft_config import DraftConfig
from dspark_launch.models.draft_loader import load_draft
from dspark_launch.models.loader import load_model
from dspark_launch.parallel import override_parallel

PROMPTS = Path(ASSETS).parent / "prompts" / "heldout.jsonl"


def test_engine_loaders_and_transformers_agree_on_the_target() -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ASSETS / "target", dtype=torch.float32).eval()
    with override_parallel(1):
        ours = load_model(ASSETS / "target", "float32")
        for kind in ("dflash", "dspark"):
            draft = load_draft(ASSETS / kind, ours.config, "float32")
            assert draft.config.kind == kind.upper()
            assert DraftConfig.from_pretrained(ASSETS / kind).block_size >= 8
        prompt = [5, 17, 300, 42, 7, 1999, 64]
        runner = Runner(ours)
        got = runner.step([(runner.new_request(), prompt)]).logits  # [T, V]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_each_drafter_decodes_losslessly_with_real_acceptance(tmp_path) -> None:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:3]]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Fixed verify lengths: tau here measures the drafters, not the (timing-driven) policy.
    common = ["--prompts", str(prompts), "--max-new-tokens", "24", "--kv-cache-memory", "64MiB",
              "--speculative-policy", "fixed"]
    outputs, taus = {}, {}
    for algorithm in ("NONE", "DFLASH", "DSPARK"):
        job = run_job(tmp_path, algorithm, ["--speculative-algorithm", algorithm, *common])
        assert job.rcs == [0]
        outputs[algorithm] = [r["output_ids"] for r in job.records]
        taus[algorithm] = job.metrics["mean_tau"]
        assert all(r["text"] for r in job.records)  # the tokenizer ships with the target
        if algorithm != "NONE":  # "fixed" verifies every draft and still predicts (the summary)
            report = job.metrics["speculative_policy"]
            assert report["policy"] == "fixed" and report["rounds"] > 0, report
            assert report["predicted_tau"] > 1.0 and report["calibration"], report
    assert outputs["DFLASH"] == outputs["NONE"]
    assert outputs["DSPARK"] == outputs["NONE"]
    assert taus["DFLASH"] > 1.2 and taus["DSPARK"] > 1.2, taus
