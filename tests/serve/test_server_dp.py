"""The server under real torchrun with 4 ranks and --attn-dp-size 2 (two attention groups),
the embedded checkpoint (no chat template), the real `openai` client. Oracle: the offline job.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from references import MAX_TOKENS, POOL, heldout
from server_proc import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve4") / "server.log"
    srv = launch(["--attn-dp-size", "2", "--max-running-requests", "8", *POOL], nproc=4,
                 log=log)
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def test_32_concurrent_greedy_completions_equal_the_offline_job(client, offline):
    prompts = heldout()

    def ask(prompt):
        return client.completions.create(model="dspark-tiny", prompt=prompt,
                                         max_tokens=MAX_TOKENS, temperature=0)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, answer in zip(prompts, answers):
        choice = answer.choices[0]
        assert choice.model_extra["meta_info"]["output_token_ids"] == \
            offline[prompt]["output_ids"], prompt[:40]
        assert choice.text == offline[prompt]["text"]


def test_chat_without_a_template_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="dspark-tiny", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 400
    assert "chat_template" in info.value.body["message"]


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"prompt": "x", "top_p": 2}, 400, "top_p"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
])
def test_bad_requests_leave_the_server_answering(server, client, body, status, param):
    r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == status and r.json()["error"]["param"] == param
    out = client.completions.create(model="dspark-tiny", prompt="def f(x):", max_tokens=4)
    assert out.usage.completion_tokens >= 1


def test_sigterm_exits_143_on_every_rank(server):
    rc = server.stop(signal.SIGTERM)
    assert rc == 143
    log = server.text()
    assert sum("leaving with exit code 143" in line for line in log.splitlines()) == 4, log[-3000:]
