"""Every topology gives tp1's greedy tokens and logits (real gloo worlds, forked).

Requests are spread over the attn_dp groups (request j -> group j % attn_dp) and start at
different steps, so some groups run idle batches (0 tokens) in some steps while the others
prefill or decode: the idle ones must still join every collective. tp1 runs the same
schedule in one group. Captured layer outputs are compared too. Tolerance: logits and
features atol/rtol 1e-4 (fp32; only reduction order differs); tokens identical.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import write_checkpoint
from model_runner import Runner
from multirank import run_world

from dspark_launch.args import resolve_config
from dspark_launch.models.loader import load_model
from dspark_launch.parallel import get_parallel, init_parallel_runtime

ATOL = RTOL = 1e-4

# (prompt, start step, new tokens)
REQUESTS = [
    ([5, 17, 99, 3, 42, 7], 0, 7),
    ([11, 12], 2, 4),
    ([60, 61, 62, 63, 64, 65, 66, 67, 68, 69], 1, 3),
]
N_STEPS = max(start + n for _, start, n in REQUESTS)
CAPTURE = (1, -1)  # the draft's target_layer_ids: layer outputs under DP attention too


def _serve(rank: int, path: str, world: int, attn_dp: int) -> dict:
    torch.set_num_threads(1)
    if world > 1:
        init_parallel_runtime(resolve_config(["--attn-dp-size", str(attn_dp)], world_size=world))
    else:
        init_parallel_runtime(resolve_config([], world_size=1))
    p = get_parallel()
    assert (p.tp_size, p.attn_dp_size) == (world, attn_dp)
    model = load_model(path, "float32")
    runner = Runner(model, max_requests=len(REQUESTS))
    mine = [j for j in range(len(REQUESTS)) if j % attn_dp == p.attn_dp_rank]
    slots = {j: runner.new_request() for j in mine}
    tokens: dict[int, list[int]] = {j: [] for j in mine}
    logits: dict[int, list[torch.Tensor]] = {j: [] for j in mine}
    idle_steps = 0
    for step in range(N_STEPS):
        batch, who = [], []
        for j in mine:
            prompt, start, n_new = REQUESTS[j]
            if step == start:
                batch.append((slots[j], prompt))
            elif start < step < start + n_new:
                batch.append((slots[j], [tokens[j][-1]]))
            else:
                continue
            who.append(j)
        idle_steps += not batch
        out = runner.step(batch, CAPTURE)  # an empty batch still runs the whole forward
        assert out.logits.shape == (sum(len(t) for _, t in batch), model.config.vocab_size)
        assert out.captured.shape == (out.logits.shape[0], 2 * model.config.hidden_size)
        for j, tok, row, feats in zip(who, out.greedy, out.last_logits, out.last_captured):
            tokens[j].append(tok)
            logits[j].append(torch.cat([row, feats]))  # logits, then captured features
    # Plain lists: tensors would travel as shared-memory handles the exiting child revokes.
    rows = {j: [r.tolist() for r in v] for j, v in logits.items()}
    return {"tokens": tokens, "logits": rows, "idle_steps": idle_steps}


def _merge(results: list[dict]) -> tuple[dict, dict, int]:
    tokens, logits = {}, {}
    for r in results:
        for j, toks in r["tokens"].items():
            assert tokens.setdefault(j, toks) == toks, f"attn_tp ranks disagree on request {j}"
            logits.setdefault(j, r["logits"][j])
    return tokens, logits, sum(r["idle_steps"] for r in results)


CKPTS = {
    # 8 q heads over 2 KV heads, I = 128 (divisible by 8), vocab 250 (padded over 4 and 8)
    "qwen3": dict(arch="qwen3", vocab_size=250, num_kv_heads=2),
    "llama-tied": dict(arch="llama", vocab_size=256, num_kv_heads=2, tied=True, seed=5),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = {}
    for name, kwargs in CKPTS.items():
        path = str(write_checkpoint(tmp_path_factory.mktemp(name), **kwargs))
        tokens, logits, _ = _merge(run_world(1, _serve, path, 1, 1))
        assert all(len(tokens[j]) == n for j, (_, _, n) in enumerate(REQUESTS))
        out[name] = (path, tokens, logits)
    return out


@pytest.mark.parametrize("ckpt,tp,attn_dp", [
    ("qwen3", 2, 1),
    ("qwen3", 4, 1),
    ("qwen3", 4, 2),
    ("qwen3", 8, 2),  # attn_tp 4 over 2 KV heads: each KV head replicated on 2 ranks
    ("qwen3", 8, 8),  # attn_tp 1: whole attention per rank, MLP over 8
    ("llama-tied", 4, 2),
    ("llama-tied", 8, 2),
])
def test_topology_matches_tp1(reference, ckpt, tp, attn_dp):
    path, want_tokens, want_logits = reference[ckpt]
    tokens, logits, idle_steps = _merge(run_world(tp, _serve, path, tp, attn_dp, timeout=300))
    if attn_dp > 1:
        assert idle_steps > 0, "the schedule must leave some attn_dp group idle"
    assert tokens == want_tokens
    for j in want_logits:
        torch.testing.assert_close(torch.tensor(logits[j]), torch.tensor(want_logits[j]),
                                   atol=ATOL, rtol=RTOL)
