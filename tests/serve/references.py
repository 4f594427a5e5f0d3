"""The oracle of the server and API tests: the offline job's outputs, as a session fixture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

MAX_TOKENS = 24
PROMPTS = Path(__file__).resolve().parents[2] / "dspark_launch/assets/prompts/heldout.jsonl"
POOL = ["--kv-cache-memory", "64MiB"]


def heldout() -> list[str]:
    return [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line]


@pytest.fixture(scope="session")
def offline(tmp_path_factory) -> dict[str, dict]:
    """The offline JSONL job (embedded model, DSPARK, 2 ranks) on the 32 held-out prompts,
    greedy, MAX_TOKENS new tokens: prompt -> its record (output_ids, text, finish_reason)."""
    from jobs import run_job

    out = tmp_path_factory.mktemp("offline")
    job = run_job(out, "heldout", ["--prompts", str(PROMPTS), "--max-new-tokens",
                                   str(MAX_TOKENS), *POOL], world=2, timeout=300)
    assert job.rcs == [0, 0]
    prompts = heldout()
    assert len(job.records) == len(prompts) == 32
    return {prompts[r["index"]]: r for r in job.records}
