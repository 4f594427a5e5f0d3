"""A rank that dies takes the server down with the job's failure line, and nothing is left; one
stuck in its step still obeys SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import threading

import openai
import requests
from references import POOL
from server_proc import alive, launch


def test_a_dead_rank_ends_the_server_naming_it(tmp_path):
    """Rank 1 SIGKILLs itself at the start of decode step 200 (the job's fault hook), a
    second or so after two requests of 300 tokens were admitted: both open requests are
    answered with an OpenAI-style error before HTTP stops (uvicorn used to cancel them, a
    traceback each in the log) naming the rank, as the job's failure line does."""
    server = launch(["--speculative-algorithm", "NONE", "--dist-timeout", "60", *POOL],
                    nproc=2, log=tmp_path / "server.log", env={"DSPARK_FAULT": "1:200:kill"})
    pids = server.rank_pids()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    streamed: list[BaseException] = []

    def stream() -> None:  # a streamed request open at the same time, through the client
        try:
            list(client.completions.create(model="dspark-tiny", prompt="def g(y):",
                                           max_tokens=300, stream=True,
                                           extra_body={"ignore_eos": True}))
        except openai.APIError as err:
            streamed.append(err)

    reader = threading.Thread(target=stream)
    reader.start()
    answer = requests.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": "def f(x):", "max_tokens": 300, "ignore_eos": True})
    reader.join(60)
    rc = server.proc.wait(90)
    log = server.text()
    assert rc == 1, log[-3000:]
    assert len(streamed) == 1 and "the server stopped before this request finished" in str(
        streamed[0])
    assert answer.status_code == 500, answer.text
    error = answer.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "server_stopped"
    assert error["message"].startswith("the server stopped before this request finished: ")
    assert error["message"].endswith(": rank(s) [1] of 2 stopped answering during step 200")
    assert "rank(s) [1] of 2 stopped answering during step 200" in log
    assert "rank 1 (local_rank 1) ended with signal SIGKILL" in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    assert not [p for p in pids if alive(p)]


def test_a_server_stuck_in_its_step_still_stops_on_sigterm(tmp_path):
    """The engine hangs at the start of decode step 3 (the job's fault hook), so the loop never
    gets back to the exchange where SIGTERM is agreed: past the stop grace
    (failure.STOP_GRACE_S) the signal counts as a second one and the server exits 143."""
    server = launch(["--speculative-algorithm", "NONE", *POOL], nproc=None,
                    log=tmp_path / "server.log", env={"DSPARK_FAULT": "0:3:hang"})
    with contextlib.suppress(requests.RequestException):  # never answered: the step hangs
        requests.post(server.url + "/v1/completions", timeout=3,
                      json={"prompt": "def f(x):", "max_tokens": 32, "ignore_eos": True})
    rc = server.stop(signal.SIGTERM, timeout=60)
    log = server.text()
    assert rc == 143, log[-3000:]
    assert "rank 0 still in step 3" in log and "stopping now on SIGTERM" in log
