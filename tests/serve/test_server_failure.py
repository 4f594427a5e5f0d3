"""A rank that dies takes the server down with the job's failure line, and nothing is left."""

from __future__ import annotations

import contextlib

import requests
from references import POOL
from server_proc import alive, launch


def test_a_dead_rank_ends_the_server_naming_it(tmp_path):
    # Rank 1 SIGKILLs itself at the start of decode step 3 (the job's fault hook).
    server = launch(["--speculative-algorithm", "NONE", "--dist-timeout", "60", *POOL],
                    nproc=2, log=tmp_path / "server.log", env={"DSPARK_FAULT": "1:3:kill"})
    pids = server.rank_pids()
    # The answer may or may not get out before the server goes down.
    with contextlib.suppress(requests.RequestException):
        requests.post(server.url + "/v1/completions", timeout=60,
                      json={"prompt": "def f(x):", "max_tokens": 32, "ignore_eos": True})
    rc = server.proc.wait(90)
    log = server.text()
    assert rc == 1, log[-3000:]
    assert "rank(s) [1] of 2 stopped answering during step 3" in log
    assert "rank 1 (local_rank 1) ended with signal SIGKILL" in log
    assert not [p for p in pids if alive(p)]
