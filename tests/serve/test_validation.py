"""Request validation of the HTTP layer, in process: every bad request is refused with its
status and an OpenAI-style error naming the field, before anything reaches the engine (the
bridge here has no step loop behind it: a request that got through would fail with 500).
The same requests against a real torchrun server: test_server.py."""

from __future__ import annotations

import json

import pytest
from chat_assets import EMBEDDED
from fastapi.testclient import TestClient
from tokenizers import Tokenizer

from dspark_launch.serve.app import build_app
from dspark_launch.serve.bridge import RequestBridge
from dspark_launch.serve.metrics import ServerMetrics
from dspark_launch.serve.requests import ModelInfo

CONTEXT = 64
TOK = Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))


@pytest.fixture(scope="module")
def client():
    info = ModelInfo(name="tiny", tokenizer=TOK,
                     vocab_size=2048, context_limit=CONTEXT, defaults={"temperature": 0.0},
                     chat_template=None, model_dir=str(EMBEDDED))
    bridge = RequestBridge(max_queued=4)
    return TestClient(build_app(info, bridge, ServerMetrics("tiny"), lambda: True))


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "a", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "a " * CONTEXT}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [2048]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [2**63]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "logprobs": 0}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "a", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/completions", b'{"prompt": "\\ud800abc"}', 400, "prompt"),  # a lone surrogate
    ("/v1/completions", {"prompt": ["a"] * 5}, 400, "prompt"),  # more than max_queued: no
    # retry would get it through
    ("/v1/completions", {"prompt": "a", "max_tokens": CONTEXT}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[str(b)[:40] for _, b, _, _ in BAD])
def test_bad_request_is_refused_naming_the_field(client, path, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = client.post(path, headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]
    if param is not None:
        assert param.split(".")[0] in err["message"]


def test_refusals_say_what_is_accepted(client):
    def said(body: dict) -> str:
        r = client.post("/v1/completions", content=json.dumps(body),  # lone surrogates
                        headers={"content-type": "application/json"})  # escaped
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    # A float field given a string: the union's int branch said "a valid integer".
    assert said({"prompt": "a", "temperature": "0.5"}) == \
        "temperature='0.5': Input should be a valid number"
    assert said({"prompt": "a", "max_tokens": CONTEXT}).endswith(
        f"the context holds {CONTEXT} tokens (prompt + output): ask for at most "
        f"{CONTEXT - len(TOK.encode('a').ids)} new tokens, or shorten the prompt")
    assert said({"prompt": "a\ud800"}).startswith("prompt holds '\\ud800' at character 1")
    # Refused by its length in characters, before the tokenizer (a 10 MB prompt took 19 s of
    # CPU and 1.6 GiB for its tokens before its 400).
    assert said({"prompt": "x" * 10**7}) == (f"prompt is {10**7} characters, more than the "
                                              f"context of {CONTEXT} tokens can hold")


def test_chat_refusals_name_max_completion_tokens_as_sent(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3,
        "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert r.json()["error"]["message"] == ("min_tokens=5: must be an integer in [0, "
                                            "max_completion_tokens=3]")


def _info(tokenizer=TOK, context: int = CONTEXT) -> ModelInfo:
    return ModelInfo(name="tiny", tokenizer=tokenizer, vocab_size=2048, context_limit=context,
                     defaults={}, chat_template=None, model_dir=str(EMBEDDED))


def test_a_prompt_at_the_character_bound_can_fit():
    """The bound never refuses what fits: the vocabulary's longest entry over and over, to the
    bound's length, is at most CONTEXT tokens (and a BOS where the tokenizer adds one)."""
    longest = max(TOK.get_vocab(), key=len)
    text = TOK.decode([TOK.token_to_id(longest)]) * CONTEXT
    assert len(text) == _info().max_prompt_chars
    assert len(TOK.encode(text).ids) <= CONTEXT + 1


@pytest.mark.parametrize("change", [
    lambda spec: spec.update(pre_tokenizer={"type": "WhitespaceSplit"}),
    lambda spec: spec.update(normalizer={"type": "Replace", "pattern": {"Regex": " {2,}"},
                                         "content": " "}),
    lambda spec: spec["added_tokens"][0].update(rstrip=True),
], ids=["whitespace split", "replace", "rstrip"])
def test_no_character_bound_where_the_tokenizer_drops_text(change):
    """A review's counterexamples: each of these made a 20 000-space text 1-2 tokens, which a
    bound by characters refused."""
    spec = json.loads(TOK.to_str())
    change(spec)
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    text = "<|endoftext|>" + " " * 20_000 + "b"
    assert len(tokenizer.encode(text).ids) < CONTEXT < len(text)
    assert _info(tokenizer).max_prompt_chars is None


def test_other_requests_are_answered_while_a_long_prompt_tokenizes():
    """The handlers tokenized on the event loop, and the tokenizer's encode holds the GIL: an
    8 MB prompt stopped every other request and /health for 7 s before its 400. Now
    /health answers while a 2 MB prompt is still being tokenized."""
    import threading
    import time

    # A context whose bound by characters lets the prompt through to the tokenizer.
    app = build_app(_info(context=100_000), RequestBridge(), ServerMetrics("tiny"),
                    lambda: True)
    with TestClient(app) as c:  # one event loop for both requests
        answers = {}
        long = threading.Thread(target=lambda: answers.setdefault("long", c.post(
            "/v1/completions", json={"prompt": "hello world " * 170_000})))
        long.start()
        time.sleep(0.2)  # the long request is in its handler
        assert c.get("/health").status_code == 200
        assert long.is_alive()  # answered while the long prompt still tokenizes
        long.join()
    assert answers["long"].status_code == 400
    assert "prompt is" in answers["long"].json()["error"]["message"]


def test_a_stream_the_server_stops_under_ends_at_its_error():
    """The error was followed by a usage chunk and data: [DONE], a normal-looking end."""
    import threading

    from dspark_launch.serve.errors import server_stopped

    bridge = RequestBridge()
    info = ModelInfo(name="tiny", tokenizer=TOK, vocab_size=2048, context_limit=CONTEXT,
                     defaults={}, chat_template=None, model_dir=str(EMBEDDED))
    app = build_app(info, bridge, ServerMetrics("tiny"), lambda: True)
    bridge.admit = lambda _: threading.Timer(
        0.2, lambda: bridge.fail_open(server_stopped("a second stop signal"))).start()
    bridge.cancel = lambda _: None
    with TestClient(app).stream("POST", "/v1/completions", json={
            "prompt": "a", "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [line for line in r.iter_lines() if line]
    assert len(events) == 1 and '"code": "server_stopped"' in events[0], events


def test_chat_without_template_names_it(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "chat_template" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "chat_template_missing"


def test_unknown_fields_are_ignored_but_known_ones_typed(client):
    # An unknown field does not make the request fail validation (it fails later, here only
    # at the missing prompt): the error names prompt, not the unknown field.
    r = client.post("/v1/completions", json={"frobnicate": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_models_and_health(client):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == CONTEXT
    assert client.get("/v1/models/tiny").json() == models["data"][0]
    r = client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


class _BrokenTokenizer:
    """A tokenizer that fails: a fault in the server's own code, not in the request."""

    def encode_batch(self, texts, add_special_tokens=False):
        raise RuntimeError("tokenizer exploded")


def test_a_server_fault_is_a_500_with_an_openai_error_body():
    info = ModelInfo(name="tiny", tokenizer=_BrokenTokenizer(), vocab_size=2048,
                     context_limit=CONTEXT, defaults={}, chat_template=None,
                     model_dir=str(EMBEDDED))
    app = build_app(info, RequestBridge(max_queued=4), ServerMetrics("tiny"), lambda: True)
    r = TestClient(app, raise_server_exceptions=False).post("/v1/completions",
                                                            json={"prompt": "a"})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "internal server error: RuntimeError: tokenizer "
                                            "exploded", "type": "server_error", "param": None,
                                 "code": "internal_error"}
