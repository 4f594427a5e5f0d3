"""Extend at realistic sizes: several query blocks, thousands of keys, real head dims and
page sizes, and a pool whose row offsets overflow int32."""

import math

import pytest
import torch
from _kernel_cases import DEVICE, TOL, indptr, paged_rows, rand

from dspark_launch.kernels import (
    extend_attention,
    paged_decode_attention,
    ref_decode,
    ref_extend,
    store_kv,
)

# Hq=2 / Hkv=1 is a GQA group of 2, so BLOCK_Q = 32 rows: q_len 40 and 37 span two query
# blocks, and request 2 (q_len 2) leaves the grid's second query block empty (early exit).
Q_LENS = [40, 37, 2]
KV_LENS = [40, 2037, 1000]  # a fresh prefill, a chunk after a 2000-key prefix, a short block


@pytest.mark.parametrize(
    "d,page_size,dtype",
    [(128, 1, torch.float32), (256, 16, torch.float32), (128, 64, torch.bfloat16)],
    ids=["d128-ps1", "d256-ps16", "d128-ps64-bf16"],
)
def test_extend_query_blocks_long_prefix(d, page_size, dtype):
    gen = torch.Generator().manual_seed(d + page_size)
    kv_indptr, kv_indices, rows = paged_rows(KV_LENS, page_size, gen)
    kc, vc = rand(gen, rows, 1, d, dtype=dtype), rand(gen, rows, 1, d, dtype=dtype)
    q = rand(gen, sum(Q_LENS), 2, d, dtype=dtype)
    args = (q, kc, vc, indptr(Q_LENS), kv_indptr, kv_indices, 1 / math.sqrt(d))
    out = extend_attention(*args, max_q_len=max(Q_LENS))
    torch.testing.assert_close(out.float(), ref_extend(*args), **TOL[dtype])


def test_pool_rows_past_int32_offsets():
    # K and V share one pool [rows, 2, Hkv, D], so a row's stride is 2 * 1 * 128 = 256
    # elements and rows past 2**31 / 256 have element offsets beyond int32. torch.empty
    # maps the ~4 GiB pool lazily: only the pages of the rows written below become
    # resident. Any int32 offset computation in store_kv / extend / decode would read
    # or write the wrong rows (or fault) and miss the reference.
    d, ps, dtype = 128, 16, torch.bfloat16
    stride = 2 * 1 * d
    base = math.ceil(2**31 / stride / ps) * ps  # first page whose offsets overflow int32
    q_lens, kv_lens = [9, 1], [300, 77]
    gen = torch.Generator().manual_seed(31)
    kv_indptr, kv_indices, rows = paged_rows(kv_lens, ps, gen)
    kv_indices = kv_indices + base
    pool = torch.empty(base + rows, 2, 1, d, dtype=dtype, device=DEVICE)
    assert (pool.shape[0] - 1) * pool.stride(0) > 2**31
    kc, vc = pool[:, 0], pool[:, 1]  # [rows, 1, D] views, row stride 256
    # Prefix keys written directly; the new tokens' K/V go through store_kv.
    new = torch.cat([kv_indices[int(kv_indptr[b + 1]) - q : int(kv_indptr[b + 1])]
                     for b, q in enumerate(q_lens)])
    kc[kv_indices] = rand(gen, len(kv_indices), 1, d, dtype=dtype)
    vc[kv_indices] = rand(gen, len(kv_indices), 1, d, dtype=dtype)
    k_new, v_new = rand(gen, len(new), 1, d, dtype=dtype), rand(gen, len(new), 1, d, dtype=dtype)
    store_kv(kc, vc, k_new, v_new, new)
    assert torch.equal(kc[new], k_new) and torch.equal(vc[new], v_new)

    q = rand(gen, sum(q_lens), 2, d, dtype=dtype)
    args = (q, kc, vc, indptr(q_lens), kv_indptr, kv_indices, 1 / math.sqrt(d))
    ref = ref_extend(*args)
    for splits in (1, 3):
        out = extend_attention(*args, num_splits=splits)
        torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    # Decode over the same rows: the last query of each request.
    last = indptr(q_lens)[1:] - 1
    dec = paged_decode_attention(q[last], kc, vc, kv_indptr, kv_indices, 1 / math.sqrt(d), 2)
    torch.testing.assert_close(dec.float(), ref_decode(q[last], kc, vc, kv_indptr, kv_indices,
                                                       1 / math.sqrt(d)), **TOL[dtype])
