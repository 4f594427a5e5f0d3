"""Split-K path of the extend kernel (short verify / draft blocks at long context) against
the fp32 reference, and the split-count heuristic in closed form."""

import importlib
import math

import pytest
import torch
from _kernel_cases import DEVICE, TOL, indptr, paged_rows, rand

from dspark_launch.kernels import choose_extend_splits, extend_attention, ref_extend

# A 9-row verify block after a long prefix, one after a prefix shorter than a split (empty
# splits: LSE -inf), a 32-row block (2 query blocks at GQA 4), and a 1-row block next to it
# (its second query block exits early).
Q_LENS = [9, 9, 32, 1]
KV_LENS = [1500, 20, 700, 300]


def _args(hq, hkv, d, dtype, page_size, seed):
    gen = torch.Generator().manual_seed(seed)
    kv_indptr, kv_indices, rows = paged_rows(KV_LENS, page_size, gen)
    kc, vc = rand(gen, rows, hkv, d, dtype=dtype), rand(gen, rows, hkv, d, dtype=dtype)
    q = rand(gen, sum(Q_LENS), hq, d, dtype=dtype)
    return (q, kc, vc, indptr(Q_LENS), kv_indptr, kv_indices, 1 / math.sqrt(d)), gen


@pytest.mark.parametrize("mode,splits", [("causal", 3), ("causal", 32), ("none", 5)])
def test_split_k_matches_reference(mode, splits):
    args, _ = _args(4, 1, 64, torch.float32, 16, seed=splits)
    out = extend_attention(*args, mask_mode=mode, num_splits=splits)
    torch.testing.assert_close(out, ref_extend(*args, mask_mode=mode), **TOL[torch.float32])


def test_split_k_custom_mask_bf16_d128():
    args, gen = _args(4, 1, 128, torch.bfloat16, 64, seed=5)
    masks = [torch.rand(q, k, generator=gen) < 0.3 for q, k in zip(Q_LENS, KV_LENS)]
    masks[0][4] = False  # a row that sees no key anywhere comes out as zeros
    mask = torch.cat([m.reshape(-1) for m in masks]).to(DEVICE)
    mptr = indptr([q * k for q, k in zip(Q_LENS, KV_LENS)])
    out = extend_attention(*args, "custom", mask, mptr, num_splits=4)
    assert (out[4] == 0).all() and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref_extend(*args, "custom", mask, mptr),
                               **TOL[torch.bfloat16])


def test_split_k_equals_one_split():
    # Same kernel, one split vs many: only the summation order differs.
    args, _ = _args(4, 1, 64, torch.float32, 1, seed=11)
    torch.testing.assert_close(extend_attention(*args, num_splits=5),
                               extend_attention(*args, num_splits=1), atol=2e-6, rtol=2e-6)


def test_choose_extend_splits(monkeypatch):
    lse_merge = importlib.import_module("dspark_launch.kernels.lse_merge")
    monkeypatch.setattr(lse_merge, "sm_count", lambda device: 132)  # an H200
    dev = torch.device(DEVICE)
    # Closed form: min(32, ceil(2 * 132 / (B * Hkv)), ceil(kv / 256)).
    assert choose_extend_splits(1, 8, 9, 4096, dev) == 16
    assert choose_extend_splits(1, 8, 9, 32768, dev) == 32
    assert choose_extend_splits(1, 8, 9, 300, dev) == 2
    assert choose_extend_splits(1, 8, 9, 200, dev) == 1  # short: never split
    assert choose_extend_splits(16, 8, 9, 32768, dev) == 3  # the batch fills the GPU
    assert choose_extend_splits(1, 8, 33, 32768, dev) == 1  # a prefill chunk: no split
    counts = [choose_extend_splits(1, 8, 16, kv, dev) for kv in (256, 1024, 4096, 8192)]
    assert counts == [1, 4, 16, 32]  # grows with the context
