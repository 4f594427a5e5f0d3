"""Paged CSR batches for the kernel tests."""

from __future__ import annotations

import torch

# Per-dtype tolerances against the fp32 reference (atol, rtol).
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=1.5e-2, rtol=1e-2),
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged_rows(kv_lens: list[int], page_size: int, gen: torch.Generator):
    """kv_indptr [B+1], kv_indices [nnz], num_rows; position p of a request lives at
    page_table[p // page_size] * page_size + p % page_size, pages shuffled, page 0 unused."""
    pages = [(k + page_size - 1) // page_size for k in kv_lens]
    total = sum(pages) + 2
    perm = (torch.randperm(total - 1, generator=gen) + 1).tolist()
    chunks = []
    for k, n in zip(kv_lens, pages):
        table, perm = torch.tensor(perm[:n], dtype=torch.int64), perm[n:]
        pos = torch.arange(k)
        chunks.append(table[pos // page_size] * page_size + pos % page_size)
    indices = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int64)
    indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int64)
    indptr[1:] = torch.tensor(kv_lens, dtype=torch.int64).cumsum(0)
    return indptr.to(DEVICE), indices.to(DEVICE), total * page_size


def rand(gen: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def indptr(lens: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int64)
    out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return out.to(DEVICE)
