"""Shard layouts of the parallel layers, checked rank by rank without process groups,
plus the vocab-parallel head on a real gloo world (padding-only shard, argmax ties)."""

from __future__ import annotations

import torch
from multirank import run_world

from dspark_launch.args import resolve_config
from dspark_launch.models.layers import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from dspark_launch.parallel import get_parallel, init_parallel_runtime


def test_qkv_replicates_the_kv_head_its_queries_read():
    hd, d, hq, hkv, shards = 2, 4, 8, 2, 4
    wq, wk, wv = (torch.randn(h * hd, d) for h in (hq, hkv, hkv))
    group = hq // hkv
    for rank in range(shards):
        layer = QKVParallelLinear(d, hd, hq, hkv, bias=False, shards=shards, rank=rank,
                                  dtype=torch.float32, device="cpu")
        for sid, w in zip("qkv", (wq, wk, wv)):
            layer.weight.weight_loader(layer.weight, w, sid)
        q, k, v = layer.split(layer.weight.T)  # columns of the fused weight
        q_heads = list(range(rank * 2, rank * 2 + 2))
        kv_head = q_heads[0] // group
        assert all(h // group == kv_head for h in q_heads)
        torch.testing.assert_close(q.T, wq[q_heads[0] * hd:(q_heads[-1] + 1) * hd])
        torch.testing.assert_close(k.T, wk[kv_head * hd:(kv_head + 1) * hd])
        torch.testing.assert_close(v.T, wv[kv_head * hd:(kv_head + 1) * hd])


def test_row_parallel_partials_sum_to_full():
    w, b, x = torch.randn(6, 8), torch.randn(6), torch.randn(3, 8)
    total = torch.zeros(3, 6)
    for rank in range(4):
        layer = RowParallelLinear(8, 6, bias=True, shards=4, rank=rank, group=None,
                                  dtype=torch.float32, device="cpu")
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        total += layer(x[:, rank * 2:(rank + 1) * 2]) - b  # bias added once per rank
    torch.testing.assert_close(total + b, x @ w.T + b)


def _vocab_rank(rank: int, world: int, weight: list, hidden: list, ids: list) -> tuple:
    init_parallel_runtime(resolve_config([], world_size=world))
    w = torch.tensor(weight)
    kw = dict(shards=world, rank=rank, group=get_parallel().attn_tp_group,
              dtype=torch.float32, device="cpu")
    emb = VocabParallelEmbedding(w.shape[0], w.shape[1], **kw)
    emb.weight.weight_loader(emb.weight, w)
    head = ParallelLMHead(w.shape[0], w.shape[1], tied_to=emb, **kw)
    h = torch.tensor(hidden)
    return (emb(torch.tensor(ids)).tolist(), head.logits(h).tolist(),
            head.greedy(h).tolist(), emb.owned)


def test_vocab_parallel_padding_and_ties():
    # V=5 over 4 ranks: shard 2, ranks own 2, 2, 1, 0 rows (the last is all padding).
    g = torch.Generator().manual_seed(0)
    # Unit rows: a hidden state along weight[1] scores ids 1 and 3 strictly highest.
    weight = torch.nn.functional.normalize(torch.randn(5, 3, generator=g), dim=-1)
    weight[3] = weight[1]  # ids 1 and 3 tie everywhere: the lowest id must win
    hidden = torch.randn(6, 3, generator=g)
    hidden[0] = weight[1] * 10
    ids = [4, 0, 3, 1]
    results = run_world(4, _vocab_rank, 4, weight.tolist(), hidden.tolist(), ids)
    assert [r[3] for r in results] == [2, 2, 1, 0]
    want_logits = hidden @ weight.T
    for embedded, logits, greedy, _ in results:
        torch.testing.assert_close(torch.tensor(embedded), weight[ids])
        torch.testing.assert_close(torch.tensor(logits), want_logits)
        # The tied logits of ids 1 and 3 come from different matmuls (shards vs the full
        # reference), so they may differ in the last bit: treat values within 1e-5 of the row
        # max as tied, and expect the lowest such id.
        top = want_logits >= want_logits.max(-1, keepdim=True).values - 1e-5
        assert greedy == top.float().argmax(-1).tolist()
    assert results[0][2][0] == 1
