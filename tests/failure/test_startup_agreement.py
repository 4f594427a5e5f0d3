"""A checkpoint problem on some ranks only (a shard missing on one node) fails every rank at once
with one message naming those ranks, instead of leaving the others in the next collective."""

from __future__ import annotations

import contextlib
import io
import time

from checkpoints import write_checkpoint
from multirank import run_world

from dspark_launch.__main__ import main


def _rank_main(rank: int, good: str, bad_ranks: list[int]) -> tuple[int, str]:
    model = good + "-missing" if rank in bad_ranks else good
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["--model", model, "--prompts", "/nonexistent", "--kv-cache-memory", "4MiB",
                   "--dist-timeout", "120"])
    errors = [line for line in err.getvalue().splitlines() if line.startswith("dspark_launch:")]
    return rc, "\n".join(errors)


def test_config_error_on_one_rank_fails_every_rank_promptly(tmp_path) -> None:
    good = str(write_checkpoint(tmp_path / "model", "qwen3", num_layers=1))
    start = time.monotonic()
    results = run_world(4, _rank_main, good, [2], timeout=60)
    assert time.monotonic() - start < 60  # far below --dist-timeout
    assert [rc for rc, _ in results] == [2, 2, 2, 2]
    said = [text for _, text in results if text]
    assert len(said) == 1 and said[0] == results[0][1]  # rank 0 speaks, once
    assert said[0].startswith("dspark_launch: error: on rank(s) [2]: ")
    assert "-missing: no config.json" in said[0]


def test_same_error_everywhere_is_said_once_without_rank_list(tmp_path) -> None:
    results = run_world(2, _rank_main, str(tmp_path / "nothing"), [], timeout=60)
    assert [rc for rc, _ in results] == [2, 2]
    assert results[1][1] == ""
    assert results[0][1].startswith("dspark_launch: error: ")
    assert "on rank(s)" not in results[0][1] and "no config.json" in results[0][1]
