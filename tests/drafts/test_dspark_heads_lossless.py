"""DeepSpec-format gated (non-zero gate_proj.bias) and rnn drafts decode losslessly end to end:
greedy DSPARK output equals plain greedy (NONE at tp1, one prompt at a time, tests/jobs.py)
token for token, at tp1 and with the target's vocabulary sharded over tp2."""

from __future__ import annotations

import json

import pytest
from jobs import AMPLE, Probe, model_args, reference, run_job, topology
from safetensors import safe_open

MAX_NEW = 16


@pytest.mark.parametrize("head_type,world,block", [
    ("gated", 1, 4), ("rnn", 1, 7), ("gated", 2, 7), ("rnn", 2, 4)], ids=lambda v: str(v))
def test_greedy_equals_plain_greedy(tiny, tmp_path, head_type, world, block):
    draft = tiny.dspark(block, head_type=head_type, scale=3.0)
    assert json.loads((draft / "config.json").read_text())["markov_head_type"] == head_type
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        bias = {"gated": "markov_head.gate_proj.bias", "rnn": "markov_head.joint_proj.bias"}
        assert f.get_tensor(bias[head_type]).abs().min() > 0  # the real format, bias and all
    ref = reference(tiny, tiny.prompts12, MAX_NEW)
    argv = [*model_args(tiny, "DSPARK", draft=draft), *topology(world, 1),
            "--prompts", str(tiny.prompts12), "--max-new-tokens", str(MAX_NEW), *AMPLE]
    job = run_job(tmp_path, "spec", argv, world=world, probe=Probe())
    assert job.rcs == [0] * world
    assert job.outputs == ref
    for rec in job.records:
        assert 1 + sum(rec["accept_lens"]) == rec["completion_tokens"]
        assert all(1 <= n <= block + 1 for n in rec["accept_lens"])
    # Every verify carried a full DSpark block of drafts when room allowed.
    widths = {n for p in job.probes for _, n, _ in p["verifies"]}
    assert max(widths) == block
