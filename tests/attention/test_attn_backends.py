"""Both backends against the fp32 reference through the public backend API."""

import importlib
import math

import pytest
import torch
from _attn_cases import DEVICE, TOL, make_batch

from dspark_launch.attention import build_metadata, make_backend
from dspark_launch.errors import ConfigError
from dspark_launch.kernels import ref_extend, ref_store

BACKENDS = ["torch", "triton"]

CASES = [
    # (prefix_lens, q_lens, page_size, hq, hkv, d, dv, dtype)
    ([0, 5, 16], [3, 1, 2], 16, 4, 4, 64, 64, torch.float32),
    ([7, 0, 1], [1, 1, 1], 1, 8, 2, 48, 48, torch.float32),  # decode batch
    ([15, 31], [1, 1], 16, 5, 1, 80, 80, torch.bfloat16),  # decode, page boundaries
    ([2, 0], [4, 16], 16, 8, 2, 64, 64, torch.bfloat16),
    ([3], [2], 1, 4, 2, 64, 32, torch.float32),  # Dv != D
    # verify blocks of one width over contexts of one length: one causal mask for the batch
    ([5, 5, 5], [3, 3, 3], 1, 8, 2, 64, 64, torch.bfloat16),
    ([4, 4], [2, 2], 16, 4, 4, 32, 32, torch.float32),
]


def _run(backend_name, meta, data, sm_scale):
    backend = make_backend(backend_name, DEVICE)
    kc, vc = data["k_cache"].clone(), data["v_cache"].clone()
    backend.prepare(meta)
    out = backend.forward(data["q"], data["k"], data["v"], kc, vc, meta, sm_scale)
    return out, kc, vc


def _reference(meta, data, sm_scale):
    kc, vc = ref_store(data["k_cache"], data["v_cache"], data["k"], data["v"], meta.out_rows)
    out = ref_extend(
        data["q"], kc, vc, meta.q_indptr, meta.kv_indptr, meta.kv_indices, sm_scale,
        meta.mask_mode, meta.custom_mask, meta.mask_indptr,
    )
    return out, kc, vc


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[1]}-ps{c[2]}-h{c[3]}/{c[4]}-d{c[5]}")
def test_backend_matches_reference(backend_name, case):
    prefix, q_lens, ps, hq, hkv, d, dv, dtype = case
    meta, data = make_batch(prefix, q_lens, ps, hq, hkv, d, dv, dtype, seed=len(prefix))
    scale = 1 / math.sqrt(d)
    out, kc, vc = _run(backend_name, meta, data, scale)
    ref, rkc, rvc = _reference(meta, data, scale)
    assert out.dtype == dtype and out.shape == (meta.num_tokens, hq, dv)
    torch.testing.assert_close(kc, rkc, atol=0, rtol=0)
    torch.testing.assert_close(vc, rvc, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("mode", ["none", "custom"])
def test_backend_mask_modes(backend_name, mode):
    prefix, q_lens = [4, 0], [3, 2]
    masks = None
    if mode == "custom":
        gen = torch.Generator().manual_seed(3)
        masks = [torch.rand(q, p + q, generator=gen) < 0.5 for p, q in zip(prefix, q_lens)]
        masks[0][1] = False  # a fully masked row must come out as zeros
    meta, data = make_batch(prefix, q_lens, 1, 4, 2, 64, 64, torch.float32, 5, mode, masks)
    out, _, _ = _run(backend_name, meta, data, 0.125)
    ref, _, _ = _reference(meta, data, 0.125)
    torch.testing.assert_close(out.float(), ref, **TOL[torch.float32])
    assert torch.isfinite(out).all()
    if mode == "custom":
        assert (out[1] == 0).all()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_backend_empty_batch(backend_name):
    meta = build_metadata(torch.zeros(2, 4, dtype=torch.int64), [], [], [], device=DEVICE)
    backend = make_backend(backend_name, DEVICE)
    backend.prepare(meta)
    kc, vc = torch.zeros(8, 2, 64, device=DEVICE), torch.zeros(8, 2, 32, device=DEVICE)
    q, k = torch.zeros(0, 4, 64, device=DEVICE), torch.zeros(0, 2, 64, device=DEVICE)
    v = torch.zeros(0, 2, 32, device=DEVICE)
    out = backend.forward(q, k, v, kc, vc, meta, 0.125)
    assert out.shape == (0, 4, 32)


@pytest.mark.parametrize("case", [
    # one long prefill next to decodes; 9-row verify blocks among 1-row ones at spread
    # contexts (GQA); a mixed step in bf16
    ([0, 3, 2, 5, 9, 1], [200, 1, 1, 1, 1, 2], 4, 2, torch.float32),
    ([40, 7, 300, 12, 150, 3, 90, 260], [1, 9, 1, 9, 4, 1, 9, 1], 8, 2, torch.float32),
    ([500, 3, 64, 64], [1, 1, 9, 128], 4, 1, torch.bfloat16),
], ids=["prefill+decodes", "verify-widths", "mixed-bf16"])
def test_torch_backend_groups_wasteful_batches(case):
    # Padding everything into one call would multiply the work: the backend pads requests
    # in groups of similar (q_len, kv_len) instead, each one SDPA call.
    prefix, q_lens, hq, hkv, dtype = case
    meta, data = make_batch(prefix, q_lens, 16, hq, hkv, 64, 64, dtype, 7)
    out, _, _ = _run("torch", meta, data, 0.125)
    groups = meta.backend_state["torch"]
    assert 1 < len(groups) < len(q_lens)
    assert sorted(t for g in groups for t in g.dest.tolist()) == list(range(meta.num_tokens))
    ref, _, _ = _reference(meta, data, 0.125)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


def test_torch_backend_per_request_path_for_custom_masks():
    # A wasteful batch with a custom mask loops per request.
    prefix, q_lens = [0, 3, 2, 5, 9, 1], [200, 1, 1, 1, 1, 2]
    gen = torch.Generator().manual_seed(1)
    masks = [torch.rand(q, p + q, generator=gen) < 0.7 for p, q in zip(prefix, q_lens)]
    meta, data = make_batch(prefix, q_lens, 16, 4, 2, 64, 64, torch.float32, 7, "custom",
                            masks)
    out, _, _ = _run("torch", meta, data, 0.125)
    assert type(meta.backend_state["torch"][0]).__name__ == "_PerRequest"
    ref, _, _ = _reference(meta, data, 0.125)
    torch.testing.assert_close(out.float(), ref, **TOL[torch.float32])


def test_make_backend_auto_and_unknown():
    assert make_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError):
        make_backend("flash", torch.device("cpu"))


def test_triton_backend_requires_interpreter_on_cpu(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):  # exit 2, one line
        make_backend("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from dspark_launch.log import logger

    # A job run earlier in this worker (setup_logging) stops propagation to caplog.
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level("WARNING", logger="dspark_launch"):
        make_backend("triton", torch.device("cpu"))
    assert sum("slow" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("mode", ["causal", "none"])  # a verify block, a draft block
def test_triton_backend_short_blocks_take_split_k(monkeypatch, mode):
    # With an H200's SM count the heuristic splits a 9-row block at ~1k context; the
    # interpreter then runs the split-K path that a GPU would, through the backend API.
    lse_merge = importlib.import_module("dspark_launch.kernels.lse_merge")
    monkeypatch.setattr(lse_merge, "sm_count", lambda device: 132)
    meta, data = make_batch([1100, 300], [9, 9], 16, 4, 1, 64, 64, torch.float32, 13, mode)
    out, kc, vc = _run("triton", meta, data, 0.125)
    assert meta.backend_state["triton"].num_splits == 5  # ceil(1109 / 256), closed form
    ref, _, _ = _reference(meta, data, 0.125)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(out, _run("torch", meta, data, 0.125)[0], **TOL[torch.float32])
