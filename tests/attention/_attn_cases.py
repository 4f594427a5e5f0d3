"""Batch builders shared by the attention backend tests (paged row assignment)."""

from __future__ import annotations

import torch

from dspark_launch.attention import ForwardMetadata, build_metadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.5e-2, rtol=1e-2)}


def make_table(
    kv_lens: list[int], page_size: int, gen: torch.Generator, extra_pages: int = 3
) -> tuple[torch.Tensor, int]:
    """req_to_token [B, max_ctx] with random non-contiguous pages; page 0 (row 0) unused."""
    pages = [(k + page_size - 1) // page_size for k in kv_lens]
    num_pages = sum(pages) + extra_pages + 1
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    max_ctx = max(kv_lens, default=1)
    table = torch.zeros(max(len(kv_lens), 1), max_ctx, dtype=torch.int64)
    for b, n in enumerate(pages):
        page_table, perm = perm[:n], perm[n:]
        pos = torch.arange(kv_lens[b])
        table[b, : kv_lens[b]] = torch.tensor(page_table)[pos // page_size] * page_size + (
            pos % page_size
        )
    return table, num_pages * page_size


def make_batch(
    prefix_lens: list[int], q_lens: list[int], page_size: int, hq: int, hkv: int, d: int,
    dv: int, dtype: torch.dtype, seed: int = 0, mask_mode: str = "causal",
    custom_masks: list[torch.Tensor] | None = None,
) -> tuple[ForwardMetadata, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    table, rows = make_table(kv_lens, page_size, gen)
    meta = build_metadata(
        table, list(range(len(q_lens))), prefix_lens, q_lens, mask_mode, custom_masks, DEVICE
    )
    t = sum(q_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    data = dict(
        q=rnd(t, hq, d), k=rnd(t, hkv, d), v=rnd(t, hkv, dv),
        k_cache=rnd(rows, hkv, d), v_cache=rnd(rows, hkv, dv),
    )
    return meta, data
