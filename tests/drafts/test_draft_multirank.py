"""The draft sharded over attn_tp (2, 4, 8; fewer KV heads than ranks) equals one rank.

Under DP attention each attn_dp group drafts DIFFERENT requests: a collective that crossed
attn_tp groups (e.g. an MLP reduced over the full tp group) would mix them and fail here.
"""

from __future__ import annotations

import faulthandler

import pytest
import torch
from _draft_reference import run_draft
from draft_checkpoints import tiny_target_config, write_draft
from multirank import run_world

from dspark_launch.args import resolve_config
from dspark_launch.models.draft_loader import load_draft
from dspark_launch.parallel import init_parallel_runtime, override_parallel

TARGET = tiny_target_config()  # 8 query heads, 2 KV heads, intermediate 128
CTX_LENS = (5, 11, 2)


def _inputs(group: int, num_features: int, block: int):
    gen = torch.Generator().manual_seed(100 + group)
    d = TARGET.hidden_size
    feats = [torch.randn(n, num_features * d, generator=gen) for n in CTX_LENS]
    blocks = [torch.randn(block, d, generator=gen) for _ in CTX_LENS]
    return feats, blocks


def _rank(rank: int, path: str, tp: int, attn_dp: int) -> list:
    # A rank stuck in a collective or the rendezvous prints where, before the harness's
    # timeout kills it silently.
    faulthandler.dump_traceback_later(60)
    state = init_parallel_runtime(resolve_config(["--attn-dp-size", str(attn_dp)],
                                                 world_size=tp))
    draft = load_draft(path, TARGET)
    feats, blocks = _inputs(state.attn_dp_rank, draft.config.num_features, draft.block_size)
    out = run_draft(draft, feats, blocks).tolist()
    faulthandler.cancel_dump_traceback_later()
    return out


@pytest.mark.parametrize("kind,tp,attn_dp", [
    ("DFLASH", 2, 1), ("DSPARK", 4, 1), ("DFLASH", 8, 1), ("DFLASH", 8, 4), ("DSPARK", 4, 2),
], ids=lambda v: str(v))
def test_sharded_block_equals_one_rank(tmp_path, kind, tp, attn_dp):
    path = write_draft(tmp_path / "d", TARGET, kind, block_size=4, num_layers=2)
    outs = run_world(tp, _rank, str(path), tp, attn_dp)
    attn_tp = tp // attn_dp
    with override_parallel(1):
        draft = load_draft(path, TARGET)
        for group in range(attn_dp):
            want = run_draft(draft, *_inputs(group, draft.config.num_features, 4))
            for rank in range(group * attn_tp, (group + 1) * attn_tp):
                torch.testing.assert_close(torch.tensor(outs[rank]), want, atol=1e-5,
                                           rtol=1e-5, msg=lambda m, r=rank: f"rank {r}: {m}")
