"""tp1 against HF transformers on tiny random checkpoints (fp32, eager attention).

Tolerance: logits atol 1e-4 / rtol 1e-4 (fp32; the only differences are summation order in
matmuls and SDPA). Greedy continuations must match token for token (32 new tokens).
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import load_hf, write_checkpoint
from model_runner import Runner, generate

from dspark_launch.models.loader import load_model
from dspark_launch.parallel import override_parallel

ATOL = RTOL = 1e-4
N_NEW = 32

CASES = {
    "qwen3-gqa-untied": dict(arch="qwen3", num_kv_heads=2, tied=False),
    "qwen3-mha-tied": dict(arch="qwen3", num_kv_heads=8, tied=True, vocab_size=200),
    "qwen3-sharded": dict(arch="qwen3", num_kv_heads=4, max_shard_size="40KB"),
    "qwen3-bias": dict(arch="qwen3", num_kv_heads=2, attention_bias=True, seed=3),
    "llama-gqa-untied": dict(arch="llama", num_kv_heads=2, tied=False, seed=1),
    "llama-mha-tied": dict(arch="llama", num_kv_heads=8, tied=True, seed=2),
}

PROMPTS = [[5, 17, 99, 3, 42, 7, 8], [11], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 3],
           [200 % 190, 150, 2]]


@pytest.fixture(scope="module", params=sorted(CASES))
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return write_checkpoint(path, **CASES[request.param])


def _hf_greedy(hf, prompt: list[int], n_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n_new):
            nxt = int(hf(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def test_prefill_logits_and_greedy_match_hf(ckpt):
    hf = load_hf(ckpt)
    with override_parallel(1):
        model = load_model(ckpt, "float32")
        tokens, prefill = generate(model, PROMPTS, N_NEW)
    for prompt, got_logits, got_tokens in zip(PROMPTS, prefill, tokens):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got_logits, want, atol=ATOL, rtol=RTOL)
        assert got_tokens == _hf_greedy(hf, prompt, N_NEW)


def test_captured_hidden_states_match_hf(ckpt):
    hf = load_hf(ckpt)
    prompt = PROMPTS[0]
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    with override_parallel(1):
        model = load_model(ckpt, "float32")
        runner = Runner(model, max_requests=1)
        out = runner.step([(runner.new_request(), prompt)], capture=(0, -1))
    d = model.config.hidden_size
    # HF hidden_states[id + 1]; id -1 is the embedding output. Given order is kept.
    torch.testing.assert_close(out.captured[:, :d], states[1][0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.captured[:, d:], states[0][0], atol=ATOL, rtol=RTOL)


def test_greedy_equals_argmax_of_logits(ckpt):
    with override_parallel(1):
        model = load_model(ckpt, "float32")
        hidden = torch.randn(16, model.config.hidden_size)
        assert model.greedy(hidden).tolist() == model.logits(hidden).argmax(-1).tolist()
        ids = torch.tensor([0, 5, model.config.vocab_size - 1])
        torch.testing.assert_close(model.embed(ids), model.model.embed_tokens.weight[ids])


def _prefill(model, prompt: list[int]):
    runner = Runner(model, max_requests=1)
    return runner.step([(runner.new_request(), prompt)])


def test_dtype_auto_and_override(tmp_path):
    path = write_checkpoint(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    with override_parallel(1):
        auto = load_model(path)  # "auto": the checkpoint's dtype
        assert {p.dtype for p in auto.parameters()} == {torch.bfloat16}
        assert _prefill(auto, PROMPTS[0]).hidden.dtype == torch.bfloat16
        up = load_model(path, "float32")  # --dtype override: same weights, fp32 math
        assert {p.dtype for p in up.parameters()} == {torch.float32}
        got = _prefill(up, PROMPTS[0]).logits
    with torch.no_grad():
        want = load_hf(path)(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)



def test_tensors_the_config_leaves_out_are_named_and_ignored_as_hf_does(tmp_path, caplog,
                                                                        monkeypatch):
    """A Llama checkpoint with q/k/v/o biases whose config says attention_bias=false: both
    transformers and the engine run without them (same logits), and the engine now names the
    tensors it left unloaded (it dropped them without a word)."""
    import json
    import logging

    path = write_checkpoint(tmp_path, arch="llama", attention_bias=True, seed=4)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "attention_bias": False}))
    hf = load_hf(path)
    from dspark_launch.log import logger

    # A job run earlier in this process (setup_logging) stops propagation to caplog.
    monkeypatch.setattr(logger, "propagate", True)
    with override_parallel(1), caplog.at_level(logging.WARNING, logger="dspark_launch"):
        model = load_model(path, "float32")
        _, prefill = generate(model, PROMPTS[:1], 1)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(prefill[0], want, atol=ATOL, rtol=RTOL)
    warned = [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(warned) == 1 and "8 checkpoint tensor(s)" in warned[0]
    assert "'model.layers.0.self_attn.k_proj.bias'" in warned[0]
