"""The whole job on the triton attention backend (Triton interpreter on CPU) is lossless:
DFLASH through the triton kernels gives the plain greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jobs import model_args, read_jsonl, reference, write_prompts


def test_dflash_job_on_triton_backend_matches_plain_greedy(tiny, tmp_path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [3, 9, 4, 7, 1 + i]}
                                                    for i in range(2)])
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "dspark_launch", *model_args(tiny, "DFLASH", 4, tiny.dflash(4)),
            "--prompts", str(prompts), "--max-new-tokens", "6", "--attention-backend", "triton",
            "--kv-cache-memory", "4MiB", "--output", str(out),
            # the start-up profile would run the target's forward under the interpreter at
            # several token counts (91 s of this test's 110); the fixed policy needs none of it.
            # So would the GEMM choice, 36 forwards per kernel and count (69 s of this test's
            # 74; tests/jobs.py QUIET): the projections are not what this test checks.
            "--profile-cost-curve", "off", "--cpu-gemm", "torch"]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Triton interpreter" in proc.stderr or "interpreter" in proc.stderr
    got = [r["output_ids"] for r in read_jsonl(out)]
    assert got == reference(tiny, prompts, 6)
    assert json.loads(out.read_text().splitlines()[0])["rounds"] >= 1
