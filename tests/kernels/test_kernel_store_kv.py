import pytest
import torch
from _kernel_cases import DEVICE, rand

from dspark_launch.kernels import ref_store, store_kv, store_kv_torch


@pytest.mark.parametrize("h,d,dv", [(2, 64, 64), (3, 48, 80), (1, 80, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference(h, d, dv, dtype):
    gen = torch.Generator().manual_seed(h * d)
    kc, vc = rand(gen, 40, h, d, dtype=dtype), rand(gen, 40, h, dv, dtype=dtype)
    k, v = rand(gen, 6, h, d, dtype=dtype), rand(gen, 6, h, dv, dtype=dtype)
    rows = torch.tensor([7, -1, 0, 39, 12, -5], device=DEVICE)  # skip, dummy row, last row
    rk, rv = ref_store(kc, vc, k, v, rows)
    tk, tv = kc.clone(), vc.clone()
    store_kv_torch(tk, tv, k, v, rows)
    store_kv(kc, vc, k, v, rows)
    for got in ((kc, vc), (tk, tv)):
        assert torch.equal(got[0], rk) and torch.equal(got[1], rv)


def test_store_kv_casts_and_noop():
    gen = torch.Generator().manual_seed(0)
    kc = torch.zeros(8, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    vc = kc.clone()
    k, v = rand(gen, 3, 2, 64), rand(gen, 3, 2, 64)
    rows = torch.tensor([1, 2, 3], device=DEVICE)
    store_kv(kc, vc, k, v, rows)
    # fp32 -> bf16 rounding mode may differ between the interpreter and torch: 1 bf16 ulp.
    torch.testing.assert_close(kc[1:4].float(), k, atol=0, rtol=2**-7)
    before = kc.clone()
    store_kv(kc, vc, k[:0], v[:0], rows[:0])
    assert torch.equal(kc, before)
