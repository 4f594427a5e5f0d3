"""`python -m dspark_launch serve` as a world of one: queue limit (503 + Retry-After) and SIGINT
with --shutdown-grace 0 (in-flight requests are aborted, exit 130)."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
import requests
from references import POOL
from server_proc import launch

pytestmark = pytest.mark.slow
LONG = {"prompt": "def f(x):", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
        "stream": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve1") / "server.log"
    srv = launch(["--max-queued-requests", "1", "--max-running-requests", "1",
                  "--shutdown-grace", "0", "--speculative-algorithm", "NONE",
                  "--chunked-prefill-size", "8", *POOL],
                 nproc=None, log=log)
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def stream_in_thread(url: str, out: list, started: threading.Event) -> threading.Thread:
    def run():
        with requests.post(url + "/v1/completions", json=LONG, stream=True, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    started.set()
                    out.append(json.loads(line[6:]))
    t = threading.Thread(target=run)
    t.start()
    return t


def test_queue_limit_answers_503_then_sigint_aborts_and_exits_130(server):
    # One test, not two sharing the server's state: xdist's worksteal may run two tests of a
    # module on different workers, each with its own module fixture.
    # A long prompt prefills in chunks of 8 over many steps: it runs, and waits nowhere (the
    # waiting gauge counted requests without a first token, so this one twice).
    gauges: list[tuple[float, float]] = []
    done = threading.Event()

    def long_prompt():
        requests.post(server.url + "/v1/completions", json={
            "prompt": "def f(x):\n    return x\n" * 200, "max_tokens": 1}, timeout=120)
        done.set()

    t = threading.Thread(target=long_prompt)
    t.start()
    deadline = time.monotonic() + 60
    while not done.is_set() and time.monotonic() < deadline:
        gauges.append((server.metric("dspark_num_requests_running"),
                       server.metric("dspark_num_requests_waiting")))
        time.sleep(0.02)
    t.join(60)
    assert (1.0, 0.0) in gauges and (1.0, 1.0) not in gauges, gauges
    running, queued = [], []
    first, second = threading.Event(), threading.Event()
    a = stream_in_thread(server.url, running, first)
    assert first.wait(60)  # A runs (its first token is out): no longer queued
    b = stream_in_thread(server.url, queued, second)  # B waits: max-running-requests 1
    time.sleep(1.0)
    assert (server.metric("dspark_num_requests_running"),
            server.metric("dspark_num_requests_waiting")) == (1.0, 1.0)
    r = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                      timeout=30)
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "too_many_requests"

    rc = server.stop(signal.SIGINT)
    a.join(30)
    b.join(30)
    assert rc == 130
    assert running[-1]["choices"][0]["finish_reason"] == "abort"
    assert "leaving with exit code 130" in server.text()
    assert "every KV page is free" in server.text()
