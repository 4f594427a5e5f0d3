import pytest
import torch

from dspark_launch.attention import build_metadata
from dspark_launch.attention.metadata import _device_rows, _host_rows


def test_build_metadata_csr():
    table = torch.arange(40).view(4, 10) + 100
    meta = build_metadata(table, slots=[2, 0], prefix_lens=[3, 0], q_lens=[2, 4])
    assert meta.kv_lens == [5, 4]
    assert meta.q_indptr.tolist() == [0, 2, 6]
    assert meta.kv_indptr.tolist() == [0, 5, 9]
    assert meta.kv_indices.tolist() == [120, 121, 122, 123, 124, 100, 101, 102, 103]
    assert meta.out_rows.tolist() == [123, 124, 100, 101, 102, 103]
    assert meta.positions.tolist() == [3, 4, 0, 1, 2, 3]
    assert meta.num_tokens == 6 and meta.num_requests == 2 and not meta.is_decode
    assert all(t.dtype == torch.int64 for t in (meta.q_indptr, meta.kv_indices, meta.out_rows))


def test_build_metadata_decode_and_custom():
    table = torch.arange(20).view(2, 10)
    meta = build_metadata(table, [0, 1], [4, 6], [1, 1])
    assert meta.is_decode
    masks = [torch.ones(1, 5, dtype=torch.bool), torch.zeros(1, 7, dtype=torch.bool)]
    meta = build_metadata(table, [0, 1], [4, 6], [1, 1], "custom", masks)
    assert not meta.is_decode
    assert meta.mask_indptr.tolist() == [0, 5, 12]
    assert meta.custom_mask.tolist() == [True] * 5 + [False] * 7


def test_build_metadata_empty_batch():
    meta = build_metadata(torch.zeros(4, 8, dtype=torch.int32), [], [], [])
    assert meta.num_tokens == 0 and meta.num_requests == 0 and not meta.is_decode
    assert meta.q_indptr.tolist() == [0] and meta.kv_indptr.tolist() == [0]
    assert meta.kv_indices.numel() == 0 and meta.out_rows.numel() == 0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_host_and_device_rows_match_a_loop(seed, dtype):
    """The two ways of gathering a batch's rows (numpy slices of a host table; tensor gathers
    on the table's device, run here on CPU) against a per-token Python loop."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 10**6, (8, 64), generator=gen).to(dtype)
    b = int(torch.randint(1, 9, (), generator=gen))
    slots = torch.randperm(8, generator=gen)[:b].tolist()
    q_lens = torch.randint(1, 17, (b,), generator=gen).tolist()
    prefix_lens = [int(torch.randint(0, 64 - q + 1, (), generator=gen)) for q in q_lens]
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    kv = [int(table[s, i]) for s, k in zip(slots, kv_lens) for i in range(k)]
    pos = [p + i for p, q in zip(prefix_lens, q_lens) for i in range(q)]
    out = [int(table[s, p + i]) for s, p, q in zip(slots, prefix_lens, q_lens) for i in range(q)]
    for rows in (_host_rows, _device_rows):
        got = rows(table, slots, prefix_lens, q_lens, kv_lens)
        assert [t.tolist() for t in got] == [kv, pos, out], rows.__name__
        assert all(t.dtype == torch.int64 for t in got), rows.__name__
    # Skipped positions (a draft block's gaps): random sorted disjoint ranges in each prefix,
    # some touching, some at position 0, some requests without any.
    skipped = []
    for p in prefix_lens:
        cuts = sorted(torch.randperm(p + 1, generator=gen)[:int(torch.randint(0, 5, (),
                                                                                generator=gen))]
                      .tolist())
        skipped.append([(a, b) for a, b in zip(cuts[0::2], cuts[1::2]) if a < b])
    kept = [int(table[s, i]) for s, k, gaps in zip(slots, kv_lens, skipped) for i in range(k)
            if not any(a <= i < b for a, b in gaps)]
    for rows in (_host_rows, _device_rows):
        got = rows(table, slots, prefix_lens, q_lens, kv_lens, skipped)
        assert [t.tolist() for t in got] == [kept, pos, out], rows.__name__


def test_build_metadata_skips_positions():
    table = torch.arange(40).view(4, 10) + 100
    meta = build_metadata(table, [2, 0, 1], [6, 3, 2], [2, 1, 1], "none",
                          skipped=[[(0, 2), (3, 5)], [(1, 3)], []])
    assert meta.kv_lens == [4, 2, 3] and meta.kv_indptr.tolist() == [0, 4, 6, 9]
    assert meta.kv_indices.tolist() == [122, 125, 126, 127, 100, 103, 110, 111, 112]
    assert meta.positions.tolist() == [6, 7, 3, 2]
    assert meta.out_rows.tolist() == [126, 127, 103, 112]
