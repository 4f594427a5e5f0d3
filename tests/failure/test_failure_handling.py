"""A dead, failing, stuck or signalled rank never leaves a hung job (real torchrun, real signals).

Faults are injected with DSPARK_FAULT=RANK:STEP:raise|kill|hang, which makes that rank raise,
SIGKILL itself, or sleep forever at the start of that decode step.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoints import write_checkpoint

LAUNCH = [sys.executable, "-m", "dspark_launch.launch", "--nproc-per-node", "2",
          "--standalone", "-m", "dspark_launch"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("failure")
    model = write_checkpoint(root / "model", "qwen3", num_layers=2)
    rng = random.Random(0)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"input_ids": [rng.randrange(2, 256) for _ in range(rng.randint(3, 12))]}) + "\n"
        for _ in range(32)))
    flags = ["--model", str(model), "--prompts", str(prompts), "--max-new-tokens", "24",
             "--kv-cache-memory", "4MiB", "--max-running-requests", "4"]
    return {"root": root, "flags": flags}


def _pids(stderr: str) -> list[int]:
    return [json.loads(line.split("LAYOUT ", 1)[1])["pid"] for line in stderr.splitlines()
            if "LAYOUT " in line]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run(cmd: list[str], env: dict | None = None, timeout: float = 120) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or ENV)
    return proc.returncode, proc.stderr, time.monotonic() - start


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dspark_launch: error:")]


def test_sigkill_of_one_rank_ends_the_job_and_names_it(job: dict) -> None:
    out = job["root"] / "kill.jsonl"
    rc, err, wall = _run(LAUNCH + job["flags"] + ["--output", str(out), "--dist-timeout", "60"],
                         {**ENV, "DSPARK_FAULT": "1:3:kill"})
    assert rc == 1
    assert wall < 60, "the survivors must notice the dead peer long before --dist-timeout"
    assert "rank(s) [1] of 2 stopped answering during step 3" in err
    assert "dspark_launch: error: rank 1 (local_rank 1) ended with signal SIGKILL" in err
    assert not [p for p in _pids(err) if _alive(p)]


def test_exception_in_one_rank_is_reported_once_with_traceback(job: dict) -> None:
    out = job["root"] / "raise.jsonl"
    rc, err, _ = _run(LAUNCH + job["flags"] + ["--output", str(out)],
                      {**ENV, "DSPARK_FAULT": "1:3:raise"})
    assert rc == 1
    failed = [e for e in _errors(err) if "failed during" in e]
    assert failed == ["dspark_launch: error: rank 1 failed during step 3: ValueError: fault "
                      "injected by DSPARK_FAULT=1:3:raise"]
    assert "Traceback" in err and "inject_fault" in err
    assert not [p for p in _pids(err) if _alive(p)]


def test_stuck_rank_times_out_and_is_named(job: dict) -> None:
    out = job["root"] / "hang.jsonl"
    rc, err, wall = _run(LAUNCH + job["flags"] + ["--output", str(out), "--dist-timeout", "4"],
                         {**ENV, "DSPARK_FAULT": "1:3:hang"})
    assert rc == 1
    assert wall < 60
    assert "rank(s) [1] of 2 stopped answering during step 3" in err
    # The stuck rank obeys torchrun's SIGTERM past its stop grace (failure.STOP_GRACE_S):
    # torchrun no longer waits 30 s to SIGKILL it (this test took 44 s before, 13 s now).
    assert "dspark_launch: rank 1 still in step 3" in err
    assert "Unable to shutdown process" not in err
    assert not [p for p in _pids(err) if _alive(p)]


def _start(cmd: list[str], out: Path, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env or ENV)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if out.exists() and len(out.read_text().splitlines()) >= 3:
            return proc
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the job produced no output to interrupt")


def _records(path: Path) -> dict[int, list[int]]:
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    indices = [r["index"] for r in records]
    assert indices == sorted(set(indices)), "lines must be unique and in input order"
    return {r["index"]: r["output_ids"] for r in records}


@pytest.fixture(scope="module")
def reference(job: dict) -> dict[int, list[int]]:
    out = job["root"] / "reference.jsonl"
    rc, err, _ = _run([sys.executable, "-m", "dspark_launch", *job["flags"], "--output", str(out)])
    assert rc == 0, err[-2000:]
    return _records(out)


def test_sigterm_writes_completed_requests_and_exits_143(job: dict, reference: dict) -> None:
    out = job["root"] / "term.jsonl"
    proc = _start(LAUNCH + job["flags"] + ["--output", str(out)], out)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143
    done = _records(out)
    assert 3 <= len(done) < 32
    assert all(done[i] == reference[i] for i in done)
    assert "interrupted by SIGTERM" in err
    assert not [p for p in _pids(err) if _alive(p)]


def test_sigterm_to_a_stuck_job_stops_it_past_the_grace_and_keeps_what_finished(
        job: dict, reference: dict) -> None:
    """One process, stuck in step 40 (DSPARK_FAULT hangs it there, after the first requests
    finished): SIGTERM would wait for the step boundary for ever; past the stop grace the
    job stops by itself with 143, and the lines already written stand."""
    out = job["root"] / "stuck.jsonl"
    proc = _start([sys.executable, "-m", "dspark_launch", *job["flags"], "--output", str(out)],
                  out, {**ENV, "DSPARK_FAULT": "0:40:hang"})
    try:
        time.sleep(3.0)  # steps take milliseconds: step 40, a few steps on, is reached by then
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # still stuck: not left behind
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-2000:]
    assert "dspark_launch: rank 0 still in step 40" in err and "on SIGTERM" in err
    done = _records(out)
    assert 3 <= len(done) < 32
    assert all(done[i] == reference[i] for i in done)


def test_resume_after_interrupt_equals_an_uninterrupted_run(job: dict, reference: dict) -> None:
    out = job["root"] / "resume.jsonl"
    proc = _start([sys.executable, "-m", "dspark_launch", *job["flags"], "--output", str(out)],
                  out)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    partial = _records(out)
    assert 0 < len(partial) < 32
    # A resume killed between writing its temp file and renaming it: nothing finished is lost.
    rc, err, _ = _run([sys.executable, "-m", "dspark_launch", *job["flags"], "--output",
                       str(out), "--resume"], {**ENV, "DSPARK_FAULT": "0:rewrite-written:kill"})
    assert rc == -signal.SIGKILL, err[-2000:]
    assert _records(out) == partial
    rc, err, _ = _run([sys.executable, "-m", "dspark_launch", *job["flags"], "--output",
                       str(out), "--resume"])
    assert rc == 0, err[-2000:]
    assert _records(out) == reference



def test_torchrun_max_restarts_resumes_from_the_output(job: dict, reference: dict) -> None:
    """Elastic conventions: rank 1 dies, torchrun restarts the job, --resume skips what the
    first attempt completed, and the final file equals an uninterrupted run's."""
    out = job["root"] / "restart.jsonl"
    cmd = LAUNCH[:3] + ["--max-restarts", "1"] + LAUNCH[3:]
    rc, err, _ = _run(cmd + job["flags"] + ["--output", str(out), "--resume"],
                      {**ENV, "DSPARK_FAULT": "1:40:kill"})
    assert rc == 0, err[-3000:]
    assert "rank(s) [1] of 2 stopped answering during step 40" in err  # the first attempt
    assert _records(out) == reference


def test_sigterm_while_loading_exits_143_within_seconds(job: dict) -> None:
    """Rank 0 is still loading weights (DSPARK_FAULT hangs it there; rank 1 waits for it in a
    collective): SIGTERM ends the job with 143 in seconds and leaves no rank behind."""
    log = job["root"] / "load.err"
    with open(log, "w") as err_file:
        proc = subprocess.Popen(LAUNCH + job["flags"], stdout=subprocess.DEVNULL,
                                stderr=err_file, text=True,
                                env={**ENV, "DSPARK_FAULT": "0:load:hang"})
        deadline = time.monotonic() + 90
        while len(_pids(log.read_text())) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # LAYOUT lines: every rank is up and about to load
        pids = _pids(log.read_text())
        assert len(pids) == 2, log.read_text()[-2000:]
        time.sleep(1.0)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        wall = time.monotonic() - start
    err = log.read_text()
    assert proc.returncode == 143, err[-2000:]
    assert wall < 15, f"took {wall:.1f}s"
    assert "interrupted by SIGTERM; stopped during loading, before any request ran" in err
    assert "Traceback" not in err
    assert not [p for p in pids if _alive(p)]


def test_config_error_on_rank_2_of_4_reaches_the_user(job: dict) -> None:
    """A budget error on rank 2 only: its own message, once, and exit 2 for the job."""
    cmd = LAUNCH[:3] + ["--nproc-per-node", "4"] + LAUNCH[5:]
    rc, err, wall = _run(cmd + job["flags"] + ["--dist-timeout", "120"],
                         {**ENV, "DSPARK_FAULT": "2:budget:config"})
    assert rc == 2, err[-3000:]
    assert wall < 60
    assert _errors(err) == ["dspark_launch: error: on rank(s) [2]: fault injected on rank 2 by "
                            "DSPARK_FAULT=2:budget:config"]
    assert "stopped answering" not in err
    assert not [p for p in _pids(err) if _alive(p)]


def test_config_error_while_a_peer_still_works_is_not_reported_as_a_signal(job: dict) -> None:
    """Rank 2 refuses its budget while rank 0 is still busy before the next collective (as a
    rank starved on a loaded machine was): torchrun stops rank 0 with SIGTERM once rank 2
    exits, and the job still ends as rank 2's error says, not as an interrupted one."""
    cmd = LAUNCH[:3] + ["--nproc-per-node", "4"] + LAUNCH[5:]
    faults = "2:budget:config,0:budget:stall"
    rc, err, wall = _run(cmd + job["flags"] + ["--dist-timeout", "120"],
                         {**ENV, "DSPARK_FAULT": faults})
    assert rc == 2, err[-3000:]
    assert wall < 60
    assert _errors(err) == ["dspark_launch: error: on rank(s) [2]: fault injected on rank 2 by "
                            f"DSPARK_FAULT={faults}"]
    assert "interrupted" not in err
    assert not [p for p in _pids(err) if _alive(p)]


def test_sighup_is_a_stop_like_sigterm(job: dict, reference: dict) -> None:
    """torchrun's agent forwards SIGHUP (a closed terminal) to its workers: they died of it
    outright (exit 129, the output left in finish order, no line). Now the job stops as on
    SIGTERM: completed requests written in input order, one line, 128 + 1."""
    out = job["root"] / "hup.jsonl"
    proc = _start(LAUNCH + job["flags"] + ["--output", str(out)], out)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 129, err[-2000:]
    done = _records(out)  # unique and in input order
    assert 3 <= len(done) < 32 and all(done[i] == reference[i] for i in done)
    assert _errors(err) == ["dspark_launch: error: interrupted by SIGHUP; completed requests "
                            "are in the output"]
    assert not [p for p in _pids(err) if _alive(p)]


def test_a_failure_while_a_peer_still_loads_is_not_reported_as_a_signal(job: dict) -> None:
    """Rank 1 raises while rank 0 is still loading: torchrun SIGTERMs rank 0, which said
    "interrupted by SIGTERM" under rank 1's traceback. It follows rank 1 out silently."""
    rc, err, wall = _run(LAUNCH + job["flags"],
                         {**ENV, "DSPARK_FAULT": "1:load:raise,0:load:stall"})
    assert rc == 1, err[-3000:]
    assert wall < 60
    assert [e for e in _errors(err) if "rank 1 failed during" in e] == [
        "dspark_launch: error: rank 1 failed during loading: ValueError: fault injected by "
        "DSPARK_FAULT=1:load:raise,0:load:stall"]
    assert "interrupted" not in err
    assert not [p for p in _pids(err) if _alive(p)]


def test_a_rank_stopping_past_its_grace_is_not_named_as_dead(job: dict) -> None:
    """Rank 1 is stalled in step 60 when the job is told to stop: past the stop grace it
    stops at once. It left without a word in the roll call, so rank 0 named it as having
    stopped answering (5 s later); it now posts its signal first."""
    out = job["root"] / "grace.jsonl"
    proc = _start(LAUNCH + job["flags"] + ["--output", str(out)], out,
                  {**ENV, "DSPARK_FAULT": "1:60:stall"})
    time.sleep(1.0)  # steps take milliseconds: rank 1 is in its 10 s stall by then
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    assert "dspark_launch: rank 1 still in step 60" in err
    assert "stopped answering" not in err
    assert not [p for p in _pids(err) if _alive(p)]


def test_an_error_before_the_ranks_agree_is_said_once(job: dict) -> None:
    """--device cuda without a GPU is refused by every rank alike before any collective:
    each printed it (8 lines at tp8); the node's first rank says it."""
    rc, err, _ = _run(LAUNCH + job["flags"] + ["--device", "cuda"])
    assert rc == 2, err[-2000:]
    assert len([e for e in _errors(err) if "--device=cuda" in e]) == 1, err[-2000:]
