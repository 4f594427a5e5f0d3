import math

import pytest
import torch
from _kernel_cases import DEVICE, TOL, paged_rows, rand

from dspark_launch.kernels import choose_num_splits, paged_decode_attention, ref_decode

CASES = [
    # (kv_lens, page_size, hq, hkv, d, dv, dtype)
    ([1, 17, 40], 1, 4, 4, 64, 64, torch.float32),
    ([16, 33, 5], 16, 8, 2, 48, 48, torch.float32),
    ([32, 1, 64], 16, 5, 1, 80, 80, torch.bfloat16),
    ([15, 16, 17], 16, 8, 2, 64, 64, torch.bfloat16),  # page-boundary lengths
    ([9, 3], 1, 4, 2, 64, 32, torch.float16),  # Dv != D
]


def _run(kv_lens, ps, hq, hkv, d, dv, dtype, splits, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv_indptr, kv_indices, rows = paged_rows(kv_lens, ps, gen)
    kc, vc = rand(gen, rows, hkv, d, dtype=dtype), rand(gen, rows, hkv, dv, dtype=dtype)
    q = rand(gen, len(kv_lens), hq, d, dtype=dtype)
    scale = 1 / math.sqrt(d)
    out = paged_decode_attention(q, kc, vc, kv_indptr, kv_indices, scale, splits)
    return out, ref_decode(q, kc, vc, kv_indptr, kv_indices, scale)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-ps{c[1]}-h{c[2]}/{c[3]}-d{c[4]}")
def test_decode_matches_reference(case):
    out, ref = _run(*case, splits=3)
    assert out.dtype == case[-1] and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, **TOL[case[-1]])


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 5, 6, 7, 8, None])
def test_decode_split_counts(splits):
    out, ref = _run([1, 70, 128], 16, 8, 2, 64, 64, torch.float32, splits, seed=splits or 0)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_empty_sequence_gives_zeros():
    out, ref = _run([0, 5, 0], 1, 4, 2, 64, 64, torch.float32, 4)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and (out[2] == 0).all()
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_empty_batch_and_heuristic():
    q = torch.zeros(0, 4, 64, device=DEVICE)
    kc = torch.zeros(4, 2, 64, device=DEVICE)
    ptr = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    out = paged_decode_attention(q, kc, kc, ptr, ptr[:0], 0.1)
    assert out.shape == (0, 4, 64)
    for args in [(1, 8, 32768), (256, 8, 4096), (4, 1, 10)]:
        assert 1 <= choose_num_splits(*args, torch.device(DEVICE)) <= 8
    assert choose_num_splits(4, 1, 10, torch.device(DEVICE)) == 1  # short: never split


def test_decode_large_group_and_workspace():
    # Group of 72 query heads spans two head blocks; a caller workspace may be oversized.
    gen = torch.Generator().manual_seed(9)
    kv_indptr, kv_indices, rows = paged_rows([5, 20], 1, gen)
    kc, vc = rand(gen, rows, 1, 16), rand(gen, rows, 1, 16)
    q = rand(gen, 2, 72, 16)
    ws = (torch.empty(4, 72, 8, 16, device=DEVICE), torch.empty(4, 72, 8, device=DEVICE))
    out = paged_decode_attention(q, kc, vc, kv_indptr, kv_indices, 0.3, 3, workspace=ws)
    ref = ref_decode(q, kc, vc, kv_indptr, kv_indices, 0.3)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
