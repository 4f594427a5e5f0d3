import torch

from dspark_launch.attention import build_metadata


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
