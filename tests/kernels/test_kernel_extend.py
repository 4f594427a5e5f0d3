import math

import pytest
import torch
from _kernel_cases import DEVICE, TOL, indptr, paged_rows, rand

from dspark_launch.kernels import extend_attention, ref_extend

CASES = [
    # (q_lens, kv_lens, page_size, hq, hkv, d, dv, dtype)
    ([1, 3, 17], [1, 20, 17], 1, 4, 4, 64, 64, torch.float32),
    ([4, 1, 16], [36, 16, 31], 16, 8, 2, 48, 48, torch.float32),
    ([2, 5], [17, 5], 16, 5, 1, 80, 80, torch.bfloat16),
    ([16, 1], [32, 15], 16, 8, 2, 64, 64, torch.bfloat16),
    ([3], [9], 1, 4, 2, 64, 32, torch.float16),  # Dv != D
]


def _setup(q_lens, kv_lens, ps, hq, hkv, d, dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv_indptr, kv_indices, rows = paged_rows(kv_lens, ps, gen)
    kc, vc = rand(gen, rows, hkv, d, dtype=dtype), rand(gen, rows, hkv, dv, dtype=dtype)
    q = rand(gen, sum(q_lens), hq, d, dtype=dtype)
    return (q, kc, vc, indptr(q_lens), kv_indptr, kv_indices, 1 / math.sqrt(d)), gen


def _custom(q_lens, kv_lens, fn):
    masks = [fn(q, k).reshape(-1) for q, k in zip(q_lens, kv_lens)]
    return torch.cat(masks).to(DEVICE), indptr([q * k for q, k in zip(q_lens, kv_lens)])


def _causal(q, k):
    return torch.arange(k)[None, :] <= (k - q) + torch.arange(q)[:, None]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}/{c[1]}-ps{c[2]}-h{c[3]}/{c[4]}")
def test_extend_causal_matches_reference(case):
    args, _ = _setup(*case)
    out = extend_attention(*args)
    assert out.dtype == case[-1] and out.shape == (sum(case[0]), case[3], case[6])
    torch.testing.assert_close(out.float(), ref_extend(*args), **TOL[case[-1]])


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=["gqa4-d48", "gqa5-d80-bf16"])
def test_extend_none_is_full_attention(case):
    args, _ = _setup(*case, seed=1)
    out = extend_attention(*args, mask_mode="none")
    ones = _custom(case[0], case[1], lambda q, k: torch.ones(q, k, dtype=torch.bool))
    torch.testing.assert_close(out.float(), ref_extend(*args, "custom", *ones), **TOL[case[-1]])


def test_extend_custom_causal_equals_causal():
    case = CASES[1]
    args, _ = _setup(*case, seed=2)
    custom = extend_attention(*args, "custom", *_custom(case[0], case[1], _causal))
    torch.testing.assert_close(custom, extend_attention(*args), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_random_custom_mask_and_fully_masked_rows(dtype):
    q_lens, kv_lens = [4, 2], [10, 34]
    args, gen = _setup(q_lens, kv_lens, 16, 8, 2, 64, 64, dtype, seed=3)
    mask, mptr = _custom(q_lens, kv_lens, lambda q, k: torch.rand(q, k, generator=gen) < 0.4)
    mask[:10] = False  # request 0, query 0: sees nothing
    mask[int(mptr[1]) + 34 :] = False  # request 1, query 1: sees nothing
    out = extend_attention(*args, "custom", mask, mptr)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and (out[5] == 0).all()
    torch.testing.assert_close(out.float(), ref_extend(*args, "custom", mask, mptr), **TOL[dtype])


def test_extend_empty_batch():
    q = torch.zeros(0, 4, 64, device=DEVICE)
    kc = torch.zeros(4, 2, 64, device=DEVICE)
    ptr = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    assert extend_attention(q, kc, kc, ptr, ptr, ptr[:0], 0.1).shape == (0, 4, 64)
