"""Our DFlash/DSpark forward vs the independent reference, plus the wiring facts of models.md §5."""

from __future__ import annotations

import json

import pytest
import torch
from _draft_reference import ref_block, ref_sample_greedy, rms, rope, run_draft, sample_block
from draft_checkpoints import tiny_target_config, write_draft
from safetensors.torch import load_file

from dspark_launch.attention import build_metadata, make_backend
from dspark_launch.memory.geometry import KVGeometry
from dspark_launch.memory.kv_pool import KVPool
from dspark_launch.models.draft_loader import load_draft
from dspark_launch.parallel import override_parallel

CTX_LENS = (3, 9, 1, 14)  # different context lengths, one of a single row


@pytest.fixture(autouse=True)
def single_rank():
    with override_parallel(1):
        yield


def _case(tmp_path, kind: str, seed: int = 0, **options):
    target = tiny_target_config()
    path = write_draft(tmp_path / kind, target, kind, seed=seed, **options)
    draft = load_draft(path, target)
    raw = json.loads((path / "config.json").read_text())
    sd = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1)
    d, b, m = target.hidden_size, draft.block_size, draft.config.num_features
    features = [torch.randn(n, m * d, generator=gen) for n in CTX_LENS]
    blocks = [torch.randn(b, d, generator=gen) for _ in CTX_LENS]
    return draft, raw, sd, features, blocks


def _reference(raw, sd, features, blocks) -> torch.Tensor:
    out = []
    for f, x in zip(features, blocks):
        n, b = f.shape[0], x.shape[0]
        out.append(ref_block(sd, raw, f, torch.arange(n), x, torch.arange(n, n + b)))
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["DFLASH", "DSPARK"])
@pytest.mark.parametrize("options", [
    {"block_size": 4, "num_layers": 2},
    {"block_size": 7, "num_layers": 3, "target_layer_ids": [0, 1, 2], "num_kv_heads": 8},
    {"block_size": 2, "num_layers": 1, "num_heads": 4, "num_kv_heads": 1, "head_dim": 8},
], ids=["b4-l2-gqa4", "b7-l3-mha", "b2-l1-mqa"])
def test_forward_block_matches_reference(tmp_path, kind, options):
    draft, raw, sd, features, blocks = _case(tmp_path, kind, **options)
    got = run_draft(draft, features, blocks)
    torch.testing.assert_close(got, _reference(raw, sd, features, blocks), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["DFLASH", "DSPARK"])
def test_a_draft_block_skips_its_context_gaps(tmp_path, kind):
    """Positions whose draft context a dormant step never wrote (Request.draft_gaps) hold a
    page's last owner's K/V. The block skips them: it equals the reference over the context
    without those positions (each kept one at its own position), whatever those rows hold.
    Read, they moved the block's output."""
    draft, raw, sd, features, blocks = _case(tmp_path, kind, block_size=4, num_layers=2)
    gaps = [[(1, 2)], [(0, 3), (5, 8)], [], [(4, 13)]]  # CTX_LENS = (3, 9, 1, 14)
    expected = []
    for f, x, ranges in zip(features, blocks, gaps):
        n, b = f.shape[0], x.shape[0]
        kept = torch.tensor([p for p in range(n) if not any(a <= p < e for a, e in ranges)])
        expected.append(ref_block(sd, raw, f[kept], kept, x, torch.arange(n, n + b)))
    got = [run_draft(draft, features, blocks, gaps=gaps, noise_seed=seed) for seed in (0, 1)]
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(got[0], torch.cat(expected), atol=1e-5, rtol=1e-5)
    read = run_draft(draft, features, blocks, gaps=gaps, skip=False)
    assert not torch.allclose(read, got[0], atol=1e-3)
    torch.testing.assert_close(read[8:12], got[0][8:12])  # request 2 has no gap


def test_dspark_greedy_block_matches_reference(tmp_path):
    draft, raw, sd, features, blocks = _case(tmp_path, "DSPARK", block_size=7, markov_rank=8)
    hidden = run_draft(draft, features, blocks).view(len(CTX_LENS), 7, -1)  # [R, B, d]
    # Base logits through "the target's" LM head (here the checkpoint's frozen copy).
    base = (hidden @ sd["lm_head.weight"].T).float()  # [R, B, V]
    anchors = torch.tensor([5, 17, 250, 0])
    tokens, q, conf = sample_block(draft, base, hidden, anchors, 0.0)
    for r in range(len(CTX_LENS)):
        ref_tokens, ref_conf = ref_sample_greedy(sd, raw, base[r], hidden[r], int(anchors[r]))
        assert tokens[r].tolist() == ref_tokens
        torch.testing.assert_close(conf[r], torch.tensor(ref_conf), atol=1e-6, rtol=1e-5)
    assert torch.equal(q, torch.nn.functional.one_hot(tokens, base.shape[-1]).float())


def test_context_rows_skip_input_layernorm(tmp_path):
    """input_layernorm never touches materialized K/V, but does change the block's output."""
    draft, _, _, features, blocks = _case(tmp_path, "DFLASH")
    pos = torch.arange(features[1].shape[0])
    rows = torch.arange(1, 1 + pos.numel())

    def materialized():
        cfg = draft.config
        pool = KVPool(KVGeometry("draft", cfg.num_hidden_layers, cfg.num_key_value_heads,
                                 cfg.head_dim, cfg.head_dim, torch.float32), 32, "cpu")
        draft.materialize(features[1], pos, rows, pool)
        return [t.clone() for t in (*pool.k, *pool.v)]

    kv_before, out_before = materialized(), run_draft(draft, features, blocks)
    for layer in draft.layers:
        layer.input_layernorm.weight.data.mul_(1.5).add_(0.3)
    kv_after, out_after = materialized(), run_draft(draft, features, blocks)
    for a, b in zip(kv_before, kv_after):
        assert torch.equal(a, b)
    assert not torch.allclose(out_before, out_after, atol=1e-3)


def test_block_is_unmasked(tmp_path):
    """Slot 0's output depends on the tokens of later slots (bidirectional block)."""
    draft, _, _, features, blocks = _case(tmp_path, "DFLASH", block_size=4)
    base = run_draft(draft, features, blocks)
    changed = [b.clone() for b in blocks]
    changed[0][3] += 1.0  # the LAST slot of request 0 only
    out = run_draft(draft, features, changed)
    assert not torch.allclose(out[0], base[0], atol=1e-4)  # slot 0 of request 0 moved
    torch.testing.assert_close(out[4:], base[4:])  # other requests are untouched


def test_one_context_projection_shared_by_layers(tmp_path):
    """K/V of every layer come from the same C = hidden_norm(fc(features))."""
    draft, raw, sd, features, _ = _case(tmp_path, "DFLASH", num_layers=3,
                                        target_layer_ids=[0, 1, 2])
    cfg = draft.config
    pool = KVPool(KVGeometry("draft", 3, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim,
                             torch.float32), 32, "cpu")
    f = features[3]
    pos = torch.arange(100, 100 + f.shape[0])  # absolute positions, not 0-based
    rows = torch.arange(2, 2 + f.shape[0])
    draft.materialize(f, pos, rows, pool)
    c = rms(f @ sd["fc.weight"].T, sd["hidden_norm.weight"], raw["rms_norm_eps"])
    for layer in range(3):
        p = f"layers.{layer}.self_attn."
        k = (c @ sd[p + "k_proj.weight"].T).view(f.shape[0], -1, cfg.head_dim)
        k = rope(rms(k, sd[p + "k_norm.weight"], raw["rms_norm_eps"]), pos, raw["rope_theta"])
        v = (c @ sd[p + "v_proj.weight"].T).view(f.shape[0], -1, cfg.head_dim)
        torch.testing.assert_close(pool.k[layer][rows], k, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(pool.v[layer][rows], v, atol=1e-6, rtol=1e-5)
        assert pool.k[layer][0].abs().sum() == 0  # nothing written outside `rows`


def test_slot_rules():
    from dspark_launch.models.dflash import DFlashDraft
    from dspark_launch.models.dspark import DSparkDraft
    assert (DFlashDraft.first_proposal_slot, DFlashDraft.predicts_next) == (1, False)
    assert (DSparkDraft.first_proposal_slot, DSparkDraft.predicts_next) == (0, True)


def test_empty_batch(tmp_path):
    """An idle attn_dp group runs the draft with no tokens: nothing breaks, nothing is written."""
    draft, _, _, _, _ = _case(tmp_path, "DSPARK")
    cfg = draft.config
    pool = KVPool(KVGeometry("draft", cfg.num_hidden_layers, cfg.num_key_value_heads,
                             cfg.head_dim, cfg.head_dim, torch.float32), 8, "cpu")
    empty = torch.zeros(0, dtype=torch.int64)
    draft.materialize(torch.zeros(0, cfg.num_features * cfg.hidden_size), empty, empty, pool)
    meta = build_metadata(torch.zeros(1, 8, dtype=torch.int64), [], [], [], mask_mode="none")
    out = draft.forward_block(torch.zeros(0, cfg.hidden_size), meta,
                              make_backend("torch", "cpu"), pool)
    assert tuple(out.shape) == (0, cfg.hidden_size)
    assert all(t.abs().sum() == 0 for t in (*pool.k, *pool.v))
