"""Errors only some ranks see, on real gloo worlds: a budget only one rank cannot afford, a
signal while loading, a rank that commits other tokens than its group. Every rank ends with
the same exit code and exactly one rank says why, in that rank's own words, within seconds."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import threading
import time

import pytest
from checkpoints import write_checkpoint
from multirank import run_world

from dspark_launch.__main__ import main
from dspark_launch.failure import progress


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("rank_local") / "model", "qwen3",
                                num_layers=1))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(
        json.dumps({"input_ids": [rng.randrange(2, 128) for _ in range(rng.randint(3, 9))]})
        + "\n" for _ in range(6)))
    return str(path)


def _rank_main(rank: int, argv: list[str], budgets: dict[int, str], term_after: float | None
               ) -> tuple[int, list[str], float, int]:
    """main() on this rank with its own --kv-cache-memory; optionally SIGTERM to itself."""
    if term_after is not None:
        threading.Timer(term_after, os.kill, (os.getpid(), signal.SIGTERM)).start()
    err = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stderr(err):
        rc = main([*argv, "--kv-cache-memory", budgets.get(rank, "4MiB")])
    said = [x for x in err.getvalue().splitlines() if x.startswith("dspark_launch: error:")]
    return rc, said, time.monotonic() - start, progress.step


def _flags(model: str, prompts: str) -> list[str]:
    return ["--model", model, "--prompts", prompts, "--max-new-tokens", "8", "--device", "cpu",
            "--dist-timeout", "120", "--log-level", "WARNING"]


def test_budget_error_on_rank_2_of_4_is_said_with_its_message(model: str, prompts: str) -> None:
    """Rank 2 alone cannot afford one page (its own --kv-cache-memory): before, the others
    waited in the plan's all-reduce and said only that rank 2 stopped answering."""
    start = time.monotonic()
    results = run_world(4, _rank_main, _flags(model, prompts), {2: "100"}, None, timeout=90)
    assert time.monotonic() - start < 60  # far below --dist-timeout
    assert [rc for rc, *_ in results] == [2, 2, 2, 2]
    said = [line for _, lines, *_ in results for line in lines]
    assert len(said) == 1 and results[2][1] == said  # rank 2 says it, once
    assert said[0].startswith("dspark_launch: error: on rank(s) [2]: KV budget 100 bytes ")
    assert "is too small" in said[0] and "--kv-cache-memory" in said[0]


@pytest.mark.parametrize("point,phase", [("load", "loading"), ("budget", "allocating pools")])
def test_sigterm_during_startup_exits_143_on_every_rank(model: str, prompts: str, point: str,
                                                       phase: str) -> None:
    """Rank 0 is still loading or sizing its pools (DSPARK_FAULT hangs it there), rank 1 waits
    for it in a collective; both get SIGTERM, as torchrun sends it, and leave with 143 at once."""
    results = run_world(2, _rank_main, _flags(model, prompts), {}, 2.0, timeout=60,
                        env={"DSPARK_FAULT": f"0:{point}:hang"})
    assert [rc for rc, *_ in results] == [143, 143]
    said = [line for _, lines, *_ in results for line in lines]
    assert said == [f"dspark_launch: error: interrupted by SIGTERM; stopped during {phase}, "
                    "before any request ran"]
    assert all(wall < 2.0 + 10 for _, _, wall, _ in results)


def test_divergent_rank_is_named_at_the_next_step(model: str, prompts: str) -> None:
    """tp 4, attn_dp 2: groups [0, 1] and [2, 3]. Rank 3 commits one token differently at
    step 3; every rank stops at step 4's all-gather with the same named error, instead of
    waiting in mismatched collectives until --dist-timeout."""
    argv = [*_flags(model, prompts), "--attn-dp-size", "2"]
    start = time.monotonic()
    results = run_world(4, _rank_main, argv, {}, None, timeout=90,
                        env={"DSPARK_FAULT": "3:3:diverge"})
    assert time.monotonic() - start < 60
    assert [rc for rc, *_ in results] == [1, 1, 1, 1]
    assert [step for *_, step in results] == [4, 4, 4, 4]  # stopped at the very next step
    said = [line for _, lines, *_ in results for line in lines]
    assert len(said) == 1 and results[0][1] == said
    assert said[0].startswith("dspark_launch: error: ranks [2, 3] of one attn_tp group "
                              "committed different tokens at step 3: request(s) ['")
    assert "rank 2 [" in said[0] and "rank 3 [" in said[0]


def test_divergence_at_the_last_step_is_named_too(model: str, prompts: str) -> None:
    """A step's commits were compared by the next step's all-gather, and the last step has
    none: rank 1 committing another token at the job's last step went unnoticed (exit 0).
    The job's closing exchange compares them and names it."""
    argv = [*_flags(model, prompts), "--tp-size", "2"]
    clean = run_world(2, _rank_main, argv, {}, None, timeout=90)
    assert [rc for rc, *_ in clean] == [0, 0]
    last = clean[0][3]  # the last step either rank began
    results = run_world(2, _rank_main, argv, {}, None, timeout=90,
                        env={"DSPARK_FAULT": f"1:{last}:diverge"})
    assert [rc for rc, *_ in results] == [1, 1]
    said = [line for _, lines, *_ in results for line in lines]
    assert len(said) == 1 and said[0].startswith(
        f"dspark_launch: error: ranks [0, 1] of one attn_tp group committed different tokens "
        f"at step {last}: request(s) ['"), said


def _late_rank_main(rank: int, argv: list[str], late_s: float, term_after: float | None):
    """Rank 1 joins late_s seconds late (a node still starting, or one that died)."""
    if rank == 1:
        time.sleep(late_s)
        return None
    return _rank_main(rank, argv, {}, term_after)


def test_a_rank_that_never_joins_is_named_after_the_timeout(model: str, prompts: str) -> None:
    """The world's rendezvous waited inside C++ (init_process_group): past --dist-timeout a
    store traceback, and no signal was heard meanwhile. Now a Python poll names the ranks
    that did not come, in one line from the lowest rank that did."""
    argv = [*_flags(model, prompts), "--dist-timeout", "3"]
    rc, said, wall, _ = run_world(2, _late_rank_main, argv, 8.0, None, timeout=60)[0]
    assert rc == 1 and wall < 8
    assert said == ["dspark_launch: error: rank(s) [1] of 2 did not join within "
                    "--dist-timeout=3 s"]


def test_sigterm_while_waiting_for_a_rank_to_join_stops_at_once(model: str,
                                                                  prompts: str) -> None:
    """torchrun SIGTERMs the survivors of a rank that died before joining: the wait in C++
    heard it only at torchrun's SIGKILL, 30 s later."""
    rc, said, wall, _ = run_world(2, _late_rank_main, _flags(model, prompts), 10.0, 1.0,
                                  timeout=60)[0]
    assert rc == 143 and wall < 5, (rc, wall)
    assert said == ["dspark_launch: error: interrupted by SIGTERM; stopped during the "
                    "rendezvous, rank(s) [1] of 2 not there yet, before any request ran"]
